"""The distillation job: buffer window -> LoRA training -> candidate folder.

    run_distillation(cfg: dict, tracker=None) -> Path   # deploy/distill_job.py runs it with its MLflow run
    pending_records(since_id) -> int                    # step records after the scheduler's cursor
    python -m training.job --parent-version 3 --base-draft-path DIR [--since-id ID] [--config cfg.yaml]
                           [--config-json '{...}'] [--set loss=reverse_kl --set steps=200]
    (the same flags, plus --ray and an MLflow run: `python -m deploy.distill_job`, which is what
    `draftsmith distill` and deploy/ray_jobs.py run)

One job:
1. consume up to `max_records` step records from the consumer group `group` (default "distill";
   created at `since_id` when it does not exist yet, afterwards its own delivery state decides what
   is new); held-out requests are never trained on; steps of requests still in flight stay pending;
   with `replay_ratio` r > 0, also read (not consume) the newest r x (new records) older training
   records and train on both, so that adapting to new traffic does not erase the old;
2. read the newest `eval_records` held-out steps (read-only, optionally of one `eval_source`);
3. pack both into units (training/data.py), measure offline acceptance of the parent draft on the
   parent's output vocabulary (as it is served: "before");
4. re-choose the output vocabulary from the training units (below), train LoRA on it
   (training/distill.py; with `acceptance_weight` s > 0 each request's rows weigh more the more often the
   parent misses them, replay included: training/distill.py "Acceptance weighting"), measure again on the
   new vocabulary ("after");
5. write `<out_dir>/adapter/` (peft, safetensors) + `vocabulary.json` + `candidate.json`
   (docs/architecture.md, "Candidate folder"); `data_window.last_id` is the newest stream id trained
   on (the cursor), `data_window.sequence_cut` the buffer's sequence cursor taken after the job's reads
   (the gate's fresh evidence is the requests after it: deploy/gate.py).

**Acks** (`ack`). "registered" (what the scheduler, `draftsmith distill`, asks for): the job acks no
record it trained on; it writes their stream ids to `<out_dir>/records.json` and they stay pending in the
consumer group until the candidate is registered, when the scheduler (or `draftsmith register`) acks them
with `ack_candidate_records`. A job that fails, or a candidate that never gets registered, leaves every
trained record pending: a later job re-claims it after `claim_idle_ms`. "step" (the default for direct
calls): each record is acked right after the optimizer step that used it (a crash before that leaves it
pending). In both modes records deliberately dropped are acked at once: steps of held-out requests
(never trained on) and steps that cannot be rebuilt into training units.

**Vocabulary.** The draft computes only the rows `output_token_ids` of its frozen, tied output layer
(training/vocab.py). A job re-chooses them from the step records it trains on: the target's stored
top-k probability mass per token (`token_mass` over every scored row of the training units, replay
included, held-out never), then `choose_vocabulary(mass, size, always=<tokenizer special ids>,
prior=<parent's ids>, prior_weight=vocab_prior_weight)`, so tokens the window uses heavily enter and
parent tokens it never uses may leave. `size` = `vocab_size`: None (default) = the parent's size,
0 = keep the parent's vocabulary unchanged, n = n rows (>= the full vocabulary: full). A parent on
the full vocabulary stays full unless `vocab_size` asks for a cut. The counts of tokens that entered
and left are metrics of the job's MLflow run (`vocab_entered`, `vocab_left`, `vocab_size`).

Too few usable records or held-out records -> NotEnoughRecords (nothing acked that was not used);
the scheduler then leaves the champion as it is.

**Tracking.** The job reports its run (params, progress metrics per optimizer step, final metrics,
FINISHED / FAILED) through a `JobTracker` it is given; training/ has no MLflow client of its own: the
MLflow one is deploy/distill_job.py's `MlflowJobRun`, through the registry's door. No tracker (or
`mlflow: false`): no run is logged. Ray tasks are deploy's too (deploy/distill_job.py `run_in_ray`).

Importing this module does not import torch, peft, MLflow or Ray.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol

log = logging.getLogger(__name__)

EXPERIMENT = "draftsmith-distill"      # the MLflow experiment of job runs (deploy/distill_job.py)


VOCABULARY_FILE = "vocabulary.json"      # deploy/registry.py reads it under the same name
RECORDS_FILE = "records.json"            # "registered" acks: the trained stream ids, acked after registration
ACK_MODES = ("step", "registered")


class NotEnoughRecords(RuntimeError):
    """The buffer holds too few usable (or held-out) records for a job; nothing was trained."""


@dataclass
class JobConfig:
    """Everything but the training hyper-parameters (those are training.distill.TrainConfig's keys)."""

    base_draft_path: str
    parent_version: str | None = None
    target: str | None = None
    since_id: str | None = None
    max_records: int = 20_000
    min_records: int = 16
    heldout_fraction: float = 0.1
    # 1.0: three chained jobs on a served buffer gained +0.080 with it against +0.054 without (bench_weighting.py
    # --chain 3), and the earlier category lost 0.011 online; the first job after a start has nothing older to read
    replay_ratio: float = 1.0
    eval_records: int = 1000
    min_heldout: int = 1
    eval_source: str | None = None
    max_len: int = 1024
    rows: str = "all"
    redis_url: str | None = None
    buffer_prefix: str = "draftsmith:buf"
    group: str = "distill"
    consumer: str | None = None
    claim_idle_ms: int = 60_000
    out_dir: str | None = None
    mlflow: bool = True
    tracking_uri: str | None = None
    vocab_size: int | None = None          # None: the parent's size; 0: keep the parent's vocabulary
    vocab_prior_weight: float = 0.5        # choose_vocabulary's lean towards the parent's vocabulary
    ack: str = "step"                      # "step" | "registered" (module docstring, "Acks")
    target_sha256: str | None = None       # fingerprint of the served target (deploy.registry.target_fingerprint)

    def __post_init__(self) -> None:
        if not self.base_draft_path:
            raise ValueError("base_draft_path is required (the parent draft's model folder)")
        if not (Path(self.base_draft_path) / "config.json").is_file():
            raise ValueError(f"base_draft_path {self.base_draft_path!r} is not a model folder (no config.json)")
        if self.since_id is not None:
            from buffer.redis_store import stream_id_key

            stream_id_key(self.since_id)
        for name in ("max_records", "min_records", "eval_records", "max_len", "min_heldout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.claim_idle_ms, bool) or not isinstance(self.claim_idle_ms, int) or self.claim_idle_ms < 0:
            raise ValueError(f"claim_idle_ms must be an integer >= 0, got {self.claim_idle_ms!r}")
        if isinstance(self.replay_ratio, bool) or not isinstance(self.replay_ratio, (int, float)) \
                or not (0.0 <= self.replay_ratio <= 10.0):
            raise ValueError(f"replay_ratio must be a number in [0, 10], got {self.replay_ratio!r}")
        if not (0.0 < self.heldout_fraction < 1.0):
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")
        if self.rows not in ("all", "accepted"):
            raise ValueError(f"rows must be 'all' or 'accepted', got {self.rows!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 0):
            raise ValueError(f"vocab_size must be an integer >= 0 (0: keep the parent's vocabulary) or None "
                             f"(the parent's size), got {self.vocab_size!r}")
        if self.ack not in ACK_MODES:
            raise ValueError(f"ack must be one of {', '.join(ACK_MODES)}, got {self.ack!r}")
        if isinstance(self.vocab_prior_weight, bool) or not isinstance(self.vocab_prior_weight, (int, float)) \
                or not (0.0 <= self.vocab_prior_weight < float("inf")):
            raise ValueError(f"vocab_prior_weight must be a number >= 0, got {self.vocab_prior_weight!r}")


def parse_config(cfg: dict):
    """A flat dict (CLI/YAML/scheduler keys) -> (JobConfig, TrainConfig); unknown keys are an error."""
    from training.distill import TrainConfig

    if not isinstance(cfg, dict):
        raise ValueError(f"the job config must be a mapping, got {type(cfg).__name__}")
    job_keys = {f.name for f in dataclasses.fields(JobConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(cfg) - job_keys - train_keys)
    if unknown:
        raise ValueError(f"unknown distillation setting(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(job_keys | train_keys))}")
    job = JobConfig(**{k: v for k, v in cfg.items() if k in job_keys})
    return job, TrainConfig(**{k: v for k, v in cfg.items() if k in train_keys})


# ----------------------------------------------------------------------------- buffer helpers
def _redis_url(url: str | None) -> str:
    from buffer.redis_store import resolve_redis_url

    return resolve_redis_url(url)


def pending_records(since_id: str | None = None, *, redis_url: str | None = None,
                    buffer_prefix: str = "draftsmith:buf", page: int = 10_000) -> int:
    """Number of step records with a stream id after `since_id` (all of them when None).

    Counted inside Redis (`buffer.redis_store.count_after`), so no record is transferred.
    """
    from buffer.redis_store import BufferConfig, count_after

    return count_after(_redis_url(redis_url), BufferConfig(prefix=buffer_prefix).steps_key, since_id, page=page)


# ----------------------------------------------------------------------------- tracking
class JobTracker(Protocol):
    """One logged run of a job (deploy/distill_job.py `MlflowJobRun` is the MLflow one)."""

    run_id: str

    def log(self, step: int, metrics: dict) -> None: ...

    def finish(self, status: str, tags: dict | None = None) -> None: ...


# (run name, params, tags) -> a started run; raising fails the job before anything is consumed
TrackerFactory = Callable[[str, dict, dict], JobTracker]


def _flat(prefix: str, obj, out: dict) -> dict:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj if isinstance(obj, str) else json.dumps(obj)
    return out


# ----------------------------------------------------------------------------- the vocabulary
@dataclass
class VocabularyChoice:
    """A job's output vocabulary (module docstring, "Vocabulary"). `ids` None = the full vocabulary."""

    ids: list[int] | None
    parent_ids: list[int] | None
    full_size: int                  # ids the draft could emit at all
    how: str                        # "window" (re-chosen), "parent" (kept: vocab_size 0), "full"
    entered: list[int]              # in ids, not in the parent's vocabulary (ascending)
    left: list[int]                 # in the parent's vocabulary, not in ids (ascending)
    scored_rows: int = 0            # target top-k rows the mass was summed over
    prior_weight: float | None = None

    @property
    def size(self) -> int:
        return self.full_size if self.ids is None else len(self.ids)

    @property
    def parent_size(self) -> int:
        return self.full_size if self.parent_ids is None else len(self.parent_ids)

    def describe(self) -> str:
        return (f"{self.size} of {self.full_size} rows ({self.how}; parent {self.parent_size}); "
                f"{len(self.entered)} tokens entered, {len(self.left)} left")

    def summary(self) -> dict:
        """candidate.json `vocabulary` (counts only; the ids are in vocabulary.json)."""
        return {"size": self.size, "parent_size": self.parent_size, "full_size": self.full_size,
                "chosen_by": self.how, "entered": len(self.entered), "left": len(self.left),
                "scored_rows": self.scored_rows, "prior_weight": self.prior_weight, "file": VOCABULARY_FILE}

    def to_file(self, parent_version: str | None) -> dict:
        """vocabulary.json: `output_token_ids` (null: the full vocabulary) and what changed."""
        return {"output_token_ids": self.ids, "parent_version": parent_version, "chosen_by": self.how,
                "full_size": self.full_size, "entered": self.entered, "left": self.left}


def choose_job_vocabulary(draft, units, *, vocab_size: int | None, prior_weight: float = 0.5) -> VocabularyChoice:
    """The candidate's output vocabulary from the training `units` (module docstring, "Vocabulary").
    `draft` is the parent as loaded (its rows are the parent's vocabulary, as served)."""
    import numpy as np

    from serving.models import read_output_token_ids
    from training.vocab import choose_vocabulary, token_mass

    parent = read_output_token_ids(draft.folder)             # the one reader, as the engine and Draft use it
    full = int(draft.full_vocab_size)
    size = len(parent) if vocab_size is None and parent is not None else vocab_size
    rows = sum(int(u.target_ids.shape[0]) for u in units)
    if vocab_size == 0 or (vocab_size is None and parent is None):
        ids, how = parent, ("parent" if vocab_size == 0 else "full")
    elif size >= full:
        ids, how = None, "full"
    else:
        mass = np.zeros(full)
        for u in units:
            mass += token_mass(u.target_ids, u.target_logprobs, full)
        specials = [i for i in draft.tokenizer.all_special_ids if 0 <= i < full]
        ids = choose_vocabulary(mass, size, always=specials, prior=parent, prior_weight=prior_weight)
        how = "window"
        if parent is not None and set(ids) == set(parent):
            ids = parent                                      # unchanged: keep the parent's rows as they are
    old = set(range(full)) if parent is None else set(parent)
    new = set(range(full)) if ids is None else set(ids)
    return VocabularyChoice(ids, parent, full, how, sorted(new - old), sorted(old - new), rows,
                            prior_weight if how == "window" else None)


# ----------------------------------------------------------------------------- the job
def _default_out_dir(parent_version: str | None) -> Path:
    from buffer.paths import data_dir

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return data_dir() / "candidates" / f"{stamp}-from-v{parent_version or 'none'}-{uuid.uuid4().hex[:6]}"


def run_distillation(cfg: dict, progress: Callable[[str], None] = print,
                     tracker: TrackerFactory | None = None) -> Path:
    """One distillation job (module docstring); returns the candidate folder. `tracker` starts the job's
    logged run (module docstring, "Tracking"); None or `mlflow: false` logs none."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader
    from training import data, distill

    job, tcfg = parse_config(cfg)
    url = _redis_url(job.redis_url)
    bcfg = BufferConfig(prefix=job.buffer_prefix)
    reader = ReplayBufferReader(url, bcfg, group=job.group, consumer=job.consumer, min_idle_ms=job.claim_idle_ms,
                                start_id=job.since_id or "0", target=job.target_sha256 or None)
    tracking = None
    if job.mlflow and tracker is not None:
        params = _flat("", {**{k: v for k, v in asdict(job).items() if k != "redis_url"}, **asdict(tcfg)}, {})
        tracking = tracker(f"distill-from-v{job.parent_version}", params,
                           {"draftsmith.parent_version": str(job.parent_version), "draftsmith.target": str(job.target)})
    window = None
    try:
        t0 = time.time()
        window = data.read_training_window(reader, max_records=job.max_records,
                                           heldout_fraction=job.heldout_fraction)
        units, skipped = data.build_units(window.entries, window.sequences, max_len=job.max_len, rows=job.rows)
        in_units = {sid for u in units for sid in u.stream_ids}
        unusable = [e.stream_id for e in window.entries if e.stream_id not in in_units]
        progress(f"[distill] read {len(window.entries)} training steps from {len(window.sequences)} requests "
                 f"({window.skipped or 'none skipped'}; unusable: {skipped or 'none'})")
        if len(in_units) < job.min_records:
            raise NotEnoughRecords(
                f"only {len(in_units)} usable step records in {bcfg.steps_key} for group {job.group!r} "
                f"(after {job.since_id or 'the start'}); a job needs at least {job.min_records}")
        held, held_seqs = data.heldout_window(reader, job.eval_records, heldout_fraction=job.heldout_fraction,
                                              source=job.eval_source)
        eval_units, _ = data.build_units(held, held_seqs, max_len=job.max_len, rows="all")
        n_held = sum(len(u.stream_ids) for u in eval_units)
        if n_held < job.min_heldout:
            raise NotEnoughRecords(
                f"only {n_held} held-out step records (heldout_fraction {job.heldout_fraction}"
                + (f", source {job.eval_source!r}" if job.eval_source else "") + f"); need {job.min_heldout}")
        reader.ack(unusable)
        replay = data.TrainingWindow([], {}, {}, [])
        n_replay = int(round(job.replay_ratio * len(in_units)))
        if n_replay:
            first = min(in_units, key=data.stream_id_key)
            rep, rep_seqs = data.replay_window(reader, n_replay, before_id=first, heldout_fraction=job.heldout_fraction)
            replay = data.TrainingWindow(rep, rep_seqs, {}, [])
            rep_units, _ = data.build_units(rep, rep_seqs, max_len=job.max_len, rows=job.rows)
            units += rep_units
            progress(f"[distill] replaying {len(rep)} older training steps from {len(rep_seqs)} requests "
                     f"(before {first})")
        # after every read: each request this job trains on has its sequence at or before the cut, so the
        # requests whose sequence comes after it are unseen (deploy/gate.py, "Fresh evidence")
        cut = reader.sequence_cursor()

        draft = distill.Draft(job.base_draft_path, lora_r=tcfg.lora_r, lora_alpha=tcfg.lora_alpha,
                              lora_targets=tcfg.lora_targets)  # parent's rows
        before = distill.offline_acceptance(draft, eval_units, batch_tokens=tcfg.batch_tokens)
        if before.acceptance is None:
            raise NotEnoughRecords(f"the {n_held} held-out steps hold no drafted token to measure offline acceptance "
                                   "on (serving drafted nothing on them); nothing was trained, the records stay "
                                   "for a later job")
        progress(f"[distill] held-out: {n_held} steps from {len(held_seqs)} requests; offline acceptance "
                 f"before {before.acceptance:.4f}, E[L] {before.expected_accepted_length:.3f}")
        vocab = choose_job_vocabulary(draft, units, vocab_size=job.vocab_size, prior_weight=job.vocab_prior_weight)
        draft.set_output_token_ids(vocab.ids)                       # train and measure "after" on the new rows
        progress(f"[distill] output vocabulary: {vocab.describe()}")
        acked: set[str] = set()          # "step": acked after their optimizer step; "registered": trained on

        def ack_used(used_units) -> None:
            ids = [sid for u in used_units for sid in u.stream_ids if sid in in_units and sid not in acked]
            if job.ack == "step":
                reader.ack(ids)
            acked.update(ids)

        report = distill.train(draft, units, tcfg, on_step=ack_used,
                               log_metrics=tracking.log if tracking else None, progress=progress)
        reader.release([sid for sid in in_units if sid not in acked or job.ack == "registered"])
        after = distill.offline_acceptance(draft, eval_units, batch_tokens=tcfg.batch_tokens)
        progress(f"[distill] offline acceptance {before.acceptance:.4f} -> {after.acceptance:.4f}, "
                 f"E[L] {before.expected_accepted_length:.3f} -> {after.expected_accepted_length:.3f}")

        used = [e for e in window.entries if e.stream_id in acked]
        used_window = data.TrainingWindow(used, {e.record.request_id: window.sequences[e.record.request_id]
                                                 for e in used}, window.skipped, window.left_pending)
        metrics = {
            "offline_acceptance_before": before.acceptance, "offline_acceptance_after": after.acceptance,
            "expected_accepted_length_before": before.expected_accepted_length,
            "expected_accepted_length_after": after.expected_accepted_length,
            "heldout_records": n_held, "heldout_positions": after.positions,
            "train_tokens_per_s": report.tokens_per_s, "train_rows_per_s": report.rows_per_s,
            "train_steps": report.steps, "train_tokens": report.tokens, "train_seconds": report.seconds,
            "loss_first": report.loss_first, "loss_final": report.loss_final,
            "peak_rss_mb": distill.peak_rss_mb(), "job_seconds": time.time() - t0,
            "vocab_size": vocab.size, "vocab_parent_size": vocab.parent_size,
            "vocab_entered": len(vocab.entered), "vocab_left": len(vocab.left),
        }
        if report.weighting:
            metrics["weighting_seconds"] = report.weighting["seconds"]
            metrics["weighting_mean_miss"] = report.weighting["mean_miss"]
        for src, b in before.by_source.items():
            metrics[f"offline_acceptance_before.{src}"] = b["acceptance"]
            metrics[f"offline_acceptance_after.{src}"] = after.by_source[src]["acceptance"]
        meta = {
            "parent_version": job.parent_version,
            "base_draft_path": str(Path(job.base_draft_path).resolve()),
            "target": job.target,
            "target_sha256": job.target_sha256,
            "loss": tcfg.loss,
            "train_config": {**asdict(tcfg), "lora_alpha": tcfg.lora_alpha or 2 * tcfg.lora_r,
                             "lora_targets": distill.lora_target_modules(tcfg.lora_targets), "rows": job.rows,
                             "max_len": job.max_len, "heldout_fraction": job.heldout_fraction},
            "data_window": {**used_window.summary(bcfg.steps_key), "group": job.group, "since_id": job.since_id,
                            "sequence_cut": cut,
                            "replay": {k: v for k, v in replay.summary(bcfg.steps_key).items()
                                       if k in ("first_id", "last_id", "steps", "requests", "sources")},
                            "heldout": {"records": n_held, "requests": len(held_seqs), "source": job.eval_source,
                                        "by_source": {s: v["steps"] for s, v in after.by_source.items()}}},
            "metrics": metrics,
            "eval": {"before": before.to_dict(), "after": after.to_dict()},
            "vocabulary": vocab.summary(),
            "weighting": report.weighting,
            "mlflow_run_id": tracking.run_id if tracking else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        out = Path(job.out_dir) if job.out_dir else _default_out_dir(job.parent_version)
        records = None
        if job.ack == "registered":
            records = {"stream": bcfg.steps_key, "group": job.group,
                       "ids": sorted(acked, key=data.stream_id_key)}
        _write_candidate(out, draft, meta, vocab.to_file(job.parent_version), records)
        progress(f"[distill] candidate written to {out}"
                 + (f"; its {len(acked)} records stay pending until it is registered" if records else ""))
        if tracking:
            tracking.log(report.steps, {k: v for k, v in metrics.items() if v is not None})
            tracking.finish("FINISHED", {"draftsmith.candidate_dir": out})
        return out
    except BaseException as e:
        if window is not None:   # whatever was not acked stays pending for a later job
            reader.release([en.stream_id for en in window.entries])
        if tracking:
            tracking.finish("FAILED", {"draftsmith.error": f"{type(e).__name__}: {e}"})
        raise


def _write_candidate(out: Path, draft, meta: dict, vocabulary: dict, records: dict | None = None) -> None:
    """adapter/ + vocabulary.json + candidate.json (+ records.json), staged in a sibling folder and
    renamed into place."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"candidate folder {out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:6]}"
    try:
        draft.save_adapter(staging / "adapter")
        (staging / VOCABULARY_FILE).write_text(json.dumps(vocabulary))
        (staging / "candidate.json").write_text(json.dumps(meta, indent=1, default=str))
        if records is not None:
            (staging / RECORDS_FILE).write_text(json.dumps(records))
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ack_candidate_records(candidate_dir: str | os.PathLike, *, redis_url: str | None = None) -> int:
    """Ack the records a "registered"-mode job trained on (its `records.json`), once its candidate is
    registered; returns how many Redis acknowledged, 0 when the folder has no records.json. The file is
    renamed to `records.acked.json` afterwards, so acking twice is a no-op. BufferUnavailable when Redis
    cannot be reached (the records then stay pending and a later job re-claims them)."""
    from buffer.redis_store import ack_entries

    path = Path(candidate_dir) / RECORDS_FILE
    if not path.is_file():
        return 0
    doc = json.loads(path.read_text())
    n = ack_entries(_redis_url(redis_url), doc["stream"], doc["group"], doc.get("ids") or [])
    try:
        os.replace(path, path.with_name("records.acked.json"))
    except OSError as e:
        log.warning("could not mark %s as acked: %s", path, e)
    return n


# ----------------------------------------------------------------------------- remote runs
def resolve_for_remote(cfg: dict) -> dict:
    """`cfg` validated (ValueError early, in the driver) with what a job running elsewhere (a Ray task, a
    Ray job's entrypoint) must not resolve on its own: the Redis URL, absolute parent and output folders,
    and the MLflow tracking URI (when the job logs to MLflow)."""
    job, _ = parse_config(cfg)
    cfg = {**cfg, "redis_url": _redis_url(job.redis_url),
           "base_draft_path": str(Path(job.base_draft_path).resolve()),
           "out_dir": str(Path(job.out_dir).resolve() if job.out_dir else _default_out_dir(job.parent_version))}
    if job.mlflow:
        from buffer.paths import default_tracking_uri

        cfg["tracking_uri"] = job.tracking_uri or default_tracking_uri()
    return cfg


# ----------------------------------------------------------------------------- CLI
def _parse_value(text: str):
    import yaml

    return yaml.safe_load(text)


def build_parser(prog: str = "python -m training.job") -> argparse.ArgumentParser:
    """The job's command line (also deploy/distill_job.py's, which adds --ray)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--base-draft-path", default=None, help="parent draft model folder (required unless the "
                   "config sets base_draft_path)")
    p.add_argument("--parent-version", default=None, help="registry version of the parent draft")
    p.add_argument("--target", default=None, help="target model name/folder (default: the config's, else "
                   "$DRAFTSMITH_TARGET)")
    p.add_argument("--since-id", default=None, help="buffer cursor: records after this stream id")
    p.add_argument("--config", type=Path, default=None, help="YAML mapping of distillation settings")
    p.add_argument("--config-json", default=None, metavar="JSON",
                   help="distillation settings as one JSON object (what a scheduled Ray job is given); "
                        "--config, then --config-json, then --set and the flags above override one another")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting (YAML value), e.g. --set loss=reverse_kl --set steps=200")
    return p


def config_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The job cfg the parsed flags describe; `p.error` (exit 2, a message that says what to fix) on bad input."""
    cfg: dict = {}
    if args.config is not None:
        import yaml

        cfg = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(cfg, dict):
            p.error(f"--config {args.config} must hold a YAML mapping")
    if args.config_json is not None:
        try:
            extra = json.loads(args.config_json)
        except json.JSONDecodeError as e:
            p.error(f"--config-json is not valid JSON: {e}")
        if not isinstance(extra, dict):
            p.error("--config-json must hold a JSON object")
        cfg.update(extra)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--set needs KEY=VALUE, got {item!r}")
        cfg[key.strip()] = _parse_value(value)
    cfg.update({k: v for k, v in {"base_draft_path": args.base_draft_path, "parent_version": args.parent_version,
                                  "target": args.target, "since_id": args.since_id}.items() if v is not None})
    if not cfg.get("base_draft_path"):
        p.error("the parent draft is required: --base-draft-path, or base_draft_path in the config")
    if cfg.get("target") is None and os.environ.get("DRAFTSMITH_TARGET"):
        cfg["target"] = os.environ["DRAFTSMITH_TARGET"]
    return cfg


def run_cli(run: Callable[[], Path]) -> int:
    """Run a job for a command line: print its candidate folder (exit 0), or a message that says what is wrong
    (exit 2) when the config is bad or the buffer holds too few records."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = run()
    except (ValueError, NotEnoughRecords) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    cfg = config_from_args(p, p.parse_args(argv))

    def run() -> Path:
        if parse_config(cfg)[0].mlflow:
            print("note: no MLflow run is logged by `python -m training.job` (training/ has no MLflow client); "
                  "`python -m deploy.distill_job` takes the same flags and logs one", file=sys.stderr)
        return run_distillation(cfg)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
