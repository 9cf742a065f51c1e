"""Medusa heads and EAGLE heads as versioned drafts (issue 19, step 3): the gate's evidence and smoke check
for heads, and one online cycle (buffer -> heads job -> registered candidate -> gate -> champion).

    HeadsEvidence(target, ..., kind="medusa"|"eagle").collect(champion_dir, candidate_dir) -> PairedEvidence
    heads_smoke_check(target, kind=...) -> SmokeCheck
    run_heads_cycle(registry, target, job_cfg, policy, evidence) -> (candidate version, GateVerdict)
    run_heads_schedule(registry, target, job_cfg, every_s=600, ...) -> [HeadsTick]   # `distill --kind K --every`

Each kind's versions live in their own registered model (deploy/registry.py `heads_registry`, "Draft kinds"),
so aliases, promotion, canary, rollback, pause and retention are the draft's, unchanged; replicas watch its
champion alias and hot-swap the heads (serving/service.py `check_heads`). The registry's kind picks the job,
the evidence and the smoke check.

**The gate's evidence for heads** is drawn like the draft's (deploy/gate.py): the newest held-out step
records of the buffer (read-only; `training.data.is_heldout`, so no heads job trained on them), rebuilt
into examples (training/heads_job.py `examples_from_buffer`), one teacher-forced target pass for the hidden
states, then both heads scored per request: acceptance = accepted / proposed tokens of a greedy chain of K
heads at T = 0 (mean over the request's positions of the number of leading heads that match the target's
greedy tokens, divided by K), weight = the request's positions. An EAGLE head is scored on the same
examples by its teacher-forced first-token agreement (the share of answer positions where the head's top-1,
fed the target's features and the true tokens, is the target's greedy token; training/heads.py
`eagle_agreement`): the head's deeper tokens depend on its own features, which a teacher-forced pass does
not give. `judge_evidence` then applies the same paired bootstrap, margin and per-category regression test
as for drafts.

**Fresh evidence**: besides the held-out requests, the gate scores the requests that ended after both
versions' jobs read the buffer (deploy/gate.py, "Fresh evidence": `fresh_cut`, set by `run_gate`); a heads
job keeps its cut as `data_window.sequence_cut` like a draft job, and `HeadsEvidence.heldout_requests` counts
them before a schedule runs a job the gate could not judge.

**Smoke check**: heads loaded next to the target decode a few prompts at T = 0 in mode "medusa" / "eagle"
(fp32), and the tokens must equal target-only greedy: it proves the heads load and the tree path runs
(lossless at T=0 whatever the heads).
"""
from __future__ import annotations

import collections
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.gate import (DEFAULT_SMOKE_PROMPTS, EvidenceSource, GatePolicy, GateVerdict, PairedEvidence,  # noqa: F401
                         SmokeCheck, engine_smoke_check, fresh_cut, run_gate)   # (fresh_cut: re-exported)
from deploy.registry import HEADS_KINDS, Registry, UsageError, target_fingerprint

log = logging.getLogger(__name__)


@dataclass
class HeadsEvidence:
    """Where the heads gate draws its sample (as deploy/gate.py EvidenceSource) and the target that gives the
    hidden states (loaded once per HeadsEvidence, in the dtype serving uses on this device); `kind` says
    which heads the folders hold."""

    target: str | None = None
    redis_url: str | None = None
    buffer_prefix: str = "draftsmith:buf"
    heldout_fraction: float = 0.1
    records: int = 2000
    kind: str = "medusa"
    category_floor: int = 10
    fresh_after: str | None = None     # a sequence cut: requests after it are fresh evidence (module docstring)
    _target_model: object = field(default=None, repr=False)
    _hidden_cache: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in HEADS_KINDS:
            raise ValueError(f"kind must be one of {tuple(HEADS_KINDS)}, got {self.kind!r}")
        EvidenceSource(redis_url=self.redis_url, buffer_prefix=self.buffer_prefix,        # same validation
                       heldout_fraction=self.heldout_fraction, records=self.records,
                       category_floor=self.category_floor)

    def _model(self):
        if self._target_model is None:
            from serving.models import default_dtype, load_causal_lm, resolve_model_path
            from training.hidden_cache import hidden_cache_for

            path, dtype = resolve_model_path(self.target), default_dtype("cpu")
            self._target_model = load_causal_lm(path, "cpu", dtype)
            self._hidden_cache = hidden_cache_for(path, dtype)     # the jobs' cache: the same held-out requests
        return self._target_model

    def heldout_requests(self, fresh_after: str | None = None) -> int:
        """How many requests the gate's sample would hold now (read-only, no target pass): the held-out ones,
        and with `fresh_after` those after that sequence cut; a schedule runs no job the gate could not judge."""
        from training.heads_job import read_examples

        examples, _ = read_examples(redis_url=self.redis_url, buffer_prefix=self.buffer_prefix, n=self.records,
                                    heldout=True, heldout_fraction=self.heldout_fraction,
                                    target_sha256=self.target_sha256())
        return len(examples) + len(self._fresh(fresh_after)[0])

    def target_sha256(self) -> str | None:
        """The fingerprint of the target the sample is scored on (None without a local folder): requests
        another target scored are left out of the sample (buffer/redis_store.py `ReplayBufferReader`)."""
        return target_fingerprint(self.target)          # cached per folder: a few stat() calls

    def _fresh(self, after: str | None) -> tuple[list[dict], dict]:
        from training.heads_job import fresh_examples

        if not after:
            return [], {"sequence_cut": None, "requests": 0, "steps": 0}
        return fresh_examples(redis_url=self.redis_url, buffer_prefix=self.buffer_prefix, after=after,
                              n=self.records, heldout_fraction=self.heldout_fraction,
                              target_sha256=self.target_sha256())

    def collect(self, champion_path: Path, candidate_path: Path) -> PairedEvidence:
        from training.heads_job import read_examples

        examples, window = read_examples(redis_url=self.redis_url, buffer_prefix=self.buffer_prefix,
                                         n=self.records, heldout=True, heldout_fraction=self.heldout_fraction,
                                         category_floor=self.category_floor, target_sha256=self.target_sha256())
        fresh, fresh_window = self._fresh(self.fresh_after)
        examples = examples + fresh
        target = self._model()
        hidden = None
        scores = {}
        score = score_eagle if self.kind == "eagle" else score_heads
        for name, path in (("champion", champion_path), ("candidate", candidate_path)):
            scores[name], hidden = score(target, Path(path), examples, hidden, cache=self._hidden_cache)
        ids = [e["request_id"] for e in examples if e["request_id"] in scores["champion"]]
        ch, ca = scores["champion"], scores["candidate"]
        cats = {e["request_id"]: e["source"] for e in examples}
        return PairedEvidence(ids, [cats[r] for r in ids], [ch[r]["positions"] for r in ids],
                              [ch[r]["acceptance"] for r in ids], [ca[r]["acceptance"] for r in ids],
                              [ch[r]["acceptance"] for r in ids], [ca[r]["acceptance"] for r in ids],
                              records=window["steps"] + fresh_window["steps"],
                              window={**{k: window[k] for k in ("stream", "first_id", "last_id", "heldout_fraction")},
                                      "fresh_after": fresh_window["sequence_cut"],
                                      "fresh_requests": fresh_window["requests"]})


def score_heads(target, heads_dir: Path, examples: list[dict], hidden=None, *,
                cache=None) -> tuple[dict[str, dict], list]:
    """({request id: {"acceptance", "positions"}}, the hidden rows) of the heads folder on `examples`
    (module docstring); `hidden` re-uses the rows of an earlier call on the same examples, `cache`
    (training/hidden_cache.py) the states of earlier gates and jobs."""
    import torch

    from serving.decoding.medusa import MedusaHeads
    from training.heads import HeadData, kept_index, target_hidden_rows

    heads = MedusaHeads.load(heads_dir, target).eval()
    if hidden is None:
        hidden = target_hidden_rows(target, examples, cache=cache, progress=log.debug)
    vocab_index = kept_index(target, heads.output_token_ids)
    K = heads.config.num_heads
    out = {}
    with torch.no_grad():
        for e, h in zip(examples, hidden):
            data = HeadData([e], [h], K, vocab_index)
            if len(data) == 0:
                continue
            logits = heads(data.h, data.root)                       # [K, R, V_keep]
            alive = torch.ones(len(data), dtype=torch.bool)
            accepted = torch.zeros(len(data))
            for k in range(K):
                lab = data.labels[:, k]
                ok = lab >= 0
                right = torch.zeros(len(data), dtype=torch.bool)
                right[ok] = logits[k][ok].argmax(-1) == data.hard[lab[ok]]
                alive &= right
                accepted += alive.float()
            out[e["request_id"]] = {"acceptance": float(accepted.mean()) / K, "positions": float(len(data))}
    return out, hidden


def score_eagle(target, head_dir: Path, examples: list[dict], feats=None, *,
                cache=None) -> tuple[dict[str, dict], list]:
    """({request id: {"acceptance", "positions"}}, the target's features) of the EAGLE head folder on
    `examples`: acceptance = teacher-forced first-token agreement (module docstring); `feats` re-uses the
    features of an earlier call on the same examples, `cache` as `score_heads`."""
    from serving.decoding.eagle import EagleHead
    from training.heads import eagle_agreement, kept_index, target_hidden_states

    head = EagleHead.load(head_dir, target).eval()
    if feats is None:
        feats = target_hidden_states(target, examples, cache=cache, progress=log.debug)
    vocab_index = kept_index(target, head.output_token_ids)
    out = {}
    for e, f in zip(examples, feats):
        positions = len(e["topk_ids"]) - max(0, 2 - e["prompt_len"])
        if positions < 1:
            continue
        out[e["request_id"]] = {"acceptance": eagle_agreement(head, [e], [f], vocab_index),
                                "positions": float(positions)}
    return out, feats


def heads_smoke_check(target: str | None, *, prompts: tuple[str, ...] = DEFAULT_SMOKE_PROMPTS,
                      max_tokens: int = 24, kind: str = "medusa") -> SmokeCheck:
    """Module docstring: mode `kind` ("medusa", "eagle") at T = 0 in fp32 must emit target-only greedy's
    tokens."""
    return engine_smoke_check(target, prompts=prompts, max_tokens=max_tokens, gamma=3, kind=kind)


def run_heads_cycle(registry: Registry, target: str | None, job_cfg: dict | None = None, *,
                    policy: GatePolicy | None = None, evidence: HeadsEvidence | None = None,
                    smoke_check: SmokeCheck | None = None, promote: bool = True, canary_share: float = 0.0,
                    run_job=None, progress=print) -> tuple[str, GateVerdict]:
    """One heads job from the champion heads on the buffer, registered as the heads' candidate, then gated
    (and promoted when it passes and `promote`). UsageError when the heads registry has no champion yet
    (`draftsmith register <heads folder>` then `draftsmith promote --kind medusa 1 --force`);
    training.heads_job.NotEnoughRows when the buffer is too thin. The registry's kind (medusa, eagle) picks
    the job, the evidence and the smoke check. With `canary_share` > 0 a passing candidate becomes the
    canary on that share of its mode's requests instead of the champion (`draftsmith watch --kind K` then
    promotes or drops it on live acceptance). `run_job(cfg) -> candidate folder` runs the job: by default
    in this process (training/heads_job.py `run_heads_distillation`); `draftsmith distill` hands a
    deploy/ray_jobs.py `DistillRunner`, which submits it to Ray as it does the draft's jobs."""
    from training.heads_job import run_heads_distillation

    kind = registry.heads_kind
    if kind is None:
        raise UsageError(f"{registry.name} holds drafts, not heads; use heads_registry(target, kind)")
    champion = registry.champion()
    if champion is None:
        raise UsageError(f"{registry.name} has no champion {HEADS_KINDS[kind].label} to start from: register a "
                         f"folder (`draftsmith register DIR`) and promote it (`draftsmith promote --kind {kind} V "
                         "--force`)")
    target = target or registry.target
    cfg = dict(job_cfg or {})
    ev = evidence or HeadsEvidence(target, redis_url=cfg.get("redis_url"),
                                   buffer_prefix=cfg.get("buffer_prefix", "draftsmith:buf"),
                                   heldout_fraction=cfg.get("heldout_fraction", 0.1), kind=kind)
    if ev.kind != kind:
        raise ValueError(f"the evidence scores {ev.kind} heads, the registry holds {kind}")
    t0 = time.time()
    job = {**cfg, "kind": kind, "parent_heads": str(registry.materialize(champion, verify=True)),
           "parent_version": champion, "target": target, "target_sha256": target_fingerprint(target)}
    out = Path(run_job(job)) if run_job is not None else run_heads_distillation(job, progress=progress)
    version = registry.register_heads(out, candidate=True)
    verdict = gate_heads(registry, version, target, policy=policy, evidence=ev, smoke_check=smoke_check,
                         promote=promote, canary_share=canary_share, progress=progress)
    progress(f"[heads] candidate version {version}: {'accepted' if verdict.accepted else 'rejected'} "
             f"({verdict.reason}); cycle {time.time() - t0:.0f} s")
    return version, verdict


def gate_heads(registry: Registry, version: str, target: str | None, *, policy: GatePolicy | None,
               evidence: HeadsEvidence, smoke_check: SmokeCheck | None = None, promote: bool = True,
               canary_share: float = 0.0, progress=print) -> GateVerdict:
    """The gate on a registered heads candidate (`run_heads_cycle`'s second half, and a candidate gated again
    once the held-out evidence it waited for has arrived): promoted when it passes and `promote`, or made the
    canary on `canary_share` of its mode's requests."""
    from deploy.gate import start_canary_after_gate

    target = target or registry.target
    verdict = run_gate(registry, version, smoke_check or heads_smoke_check(target, kind=registry.heads_kind),
                       policy=policy, promote=promote and not canary_share,
                       evidence=evidence)   # (fresh evidence: run_gate)
    if verdict.accepted and canary_share and promote:
        move = start_canary_after_gate(registry, verdict, canary_share)
        progress(f"[heads] {move.message}")
    return verdict


@dataclass
class HeadsTick:
    """What one scheduled heads tick did: "promoted", "canary" (passed the gate and now serves a share of its
    mode's requests), "rejected", "held" (trained and registered, but the gate's held-out sample is still too
    small to judge it: it waits for that evidence), "skipped" (nothing new, job lock held, too few records, a
    canary being judged, a candidate waiting for evidence) or "failed" (the job or the gate raised; the
    schedule goes on)."""

    status: str
    message: str
    version: str | None = None
    time: float = field(default_factory=time.time)


def run_heads_schedule(registry: Registry, target: str | None, job_cfg: dict | None = None, *, every_s: float,
                       stop=None, max_jobs: int | None = None, min_new_steps: int = 1,
                       policy: GatePolicy | None = None, evidence: HeadsEvidence | None = None,
                       smoke_check: SmokeCheck | None = None, lock=None, canary_share: float = 0.0,
                       canary=None, run_job=None, poll_s: float | None = None, drift=None,
                       evidence_wait_s: float = 0.0, job_share: float = 1.0, progress=print) -> list[HeadsTick]:
    """One heads cycle (`run_heads_cycle`) at most every `every_s` seconds, counted from the start of the last
    one as the draft's scheduler counts `--every` (the first at once), when the buffer holds at least
    `min_new_steps` step records newer than the last job's window (`data_window.last_id` of the newest
    heads version; all of them before the first job); the schedule looks every `poll_s` seconds (default
    `every_s`), and a skipped look is reported only when its reason changes. Under the machine's distillation job lock
    (deploy/scheduler.py `JobLock`, shared with the draft's jobs: one training job at a time), and, with
    `evidence`, once the gate's held-out sample holds the policy's `min_requests` (a job the gate cannot judge
    would be rejected for want of evidence, its training wasted: seen as the first job of a run). With
    `evidence_wait_s` > 0 (`distill --evidence-wait`, as the draft's scheduler) the job need not wait that
    long: it starts once the sample holds half of `min_requests`, and a candidate the gate then finds
    insufficient ("held") waits up to `evidence_wait_s` after its registration, gated again as soon as the
    sample (held-out requests and the fresh ones that ended after its job's reads: module docstring, "Fresh
    evidence") holds `min_requests` (and again whenever it grows, while the gate still finds it too small),
    with no new job meanwhile (it would train from the same champion on the same newest records). On slow
    traffic the job's minutes then overlap the wait for held-out requests, instead of following it: in the
    online experiment (docs/benchmarks.md, "The twenty-fifth session") the first job waited 8-14 minutes for
    10 held-out requests before it could start. A waiting candidate whose parent is no longer the champion
    (a rollback, an operator's promotion) is dropped, as is one whose wait runs out. A cycle that
    fails (a thin buffer, MLflow or Redis down, a failed job) is logged and the schedule goes on; a rollback
    pauses promotion, which the gate's verdict then records (`Registry.promote` refuses). With
    `canary_share` > 0 a candidate that passes the gate becomes the canary on that share of its mode's
    requests instead of the champion, as the draft's scheduler does; `canary` (deploy/scheduler.py
    `CanaryJudge` on this registry) then judges it at every tick, promoting or dropping it on live evidence,
    and no new job starts while a canary is being judged. `run_job` runs each job (as `run_heads_cycle`: on
    Ray when `draftsmith distill` hands its DistillRunner). `drift` (a deploy/scheduler.py `DriftPolicy`,
    `distill --drift`): before `every_s` has passed, a job starts early when the champion's live acceptance
    has drifted below its earlier live figure, its predecessor's or its gate figure (`drift_reason`, the
    draft's scheduler's trigger), i.e. when the traffic changed under it. `job_share` < 1 (`distill
    --job-share`, deploy/scheduler.py `rest_after_job`): after a cycle that took D seconds (job and gate) no job
    starts for D x (1/share - 1) seconds, drift or not, so jobs take at most that share of the machine's time.
    Stops when `stop` (a threading.Event) is set or after `max_jobs` cycles that ran a job; returns every tick."""
    import json
    import threading

    from deploy import scheduler
    from deploy.scheduler import JobLock
    from training.heads_job import NotEnoughRows
    from training.job import pending_records

    if not every_s > 0:
        raise ValueError(f"every_s must be > 0, got {every_s!r}")
    poll_s = every_s if poll_s is None else poll_s
    if not poll_s > 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
    stop = stop or threading.Event()
    lock = lock or JobLock()
    cfg = dict(job_cfg or {})
    ticks: collections.deque[HeadsTick] = collections.deque(maxlen=1000)     # a long-running schedule keeps the last
    jobs = 0
    last_start: float | None = None
    said = None
    need_held = (policy or GatePolicy()).min_requests
    if not evidence_wait_s >= 0:
        raise ValueError(f"evidence_wait_s must be >= 0, got {evidence_wait_s!r}")
    start_held = need_held if not evidence_wait_s else max(1, -(-need_held // 2))
    scheduler.check_job_share(job_share)
    rest_until: float | None = None                   # no job before this (job_share)
    waiting: dict | None = None      # {"version", "since" (monotonic), "gated_at" (held-out count at the last gate)}
    while not stop.is_set():
        if canary is not None:                        # judged at every look, also between jobs
            try:
                v = canary.check()
                if v.action not in ("none", "waiting", "ok"):
                    progress(f"[heads-canary] {v.action}: {v.message}")
            except Exception as e:  # noqa: BLE001 - e.g. MLflow down: no judgement this tick
                progress(f"[heads-canary] no look this time: {e}")
        if waiting is not None and evidence is not None:
            try:
                waiting, tick = _look_at_waiting(registry, target, waiting, evidence, need_held, evidence_wait_s,
                                                 policy=policy, smoke_check=smoke_check, canary_share=canary_share,
                                                 progress=progress)
            except Exception as e:  # noqa: BLE001 - MLflow or Redis down: look again next time
                log.exception("gating the waiting heads candidate failed")
                tick = HeadsTick("skipped", f"the candidate waiting for evidence was not looked at: "
                                            f"{type(e).__name__}: {e}")
            if tick is not None:
                ticks.append(tick)
                if tick.status == "skipped":
                    said = _say_skip(progress, tick.message, said)
                else:
                    said = None
                    progress(f"[heads-schedule] gated again: {tick.status}: {tick.message} (version {tick.version})")
            if waiting is not None:
                stop.wait(poll_s)
                continue
            if max_jobs is not None and jobs >= max_jobs:
                break
        if rest_until is not None and time.monotonic() < rest_until:
            left = rest_until - time.monotonic()
            ticks.append(HeadsTick("skipped", f"resting after the last job: jobs take at most {job_share:.0%} of the "
                                              "time (--job-share)"))
            said = _say_skip(progress, ticks[-1].message, said)
            stop.wait(min(poll_s, left))
            continue
        early = None
        if last_start is not None and time.monotonic() - last_start < every_s:
            if drift is not None:
                try:
                    early = scheduler.drift_reason(registry, drift, time.monotonic() - last_start)
                except Exception as e:  # noqa: BLE001 - e.g. MLflow down: the interval decides
                    log.warning("[heads-schedule] drift not judged: %s", e)
            if early is None:
                stop.wait(min(poll_s, every_s - (time.monotonic() - last_start)))
                continue
        tick = None
        try:
            running = registry.canary() if canary_share else None
            if running is not None:
                ticks.append(HeadsTick("skipped", f"canary version {running['version']} is still being judged"))
                said = _say_skip(progress, ticks[-1].message, said)
                stop.wait(poll_s)
                continue
            newest = max(registry.versions(), key=lambda i: int(i.version), default=None)
            window = json.loads((newest.tags or {}).get("draftsmith.data_window") or "{}") if newest else {}
            new = pending_records(window.get("last_id"), redis_url=cfg.get("redis_url"),
                                  buffer_prefix=cfg.get("buffer_prefix", "draftsmith:buf"))
            held = evidence.heldout_requests() if evidence is not None and new >= min_new_steps else None
            if new < min_new_steps:
                tick = HeadsTick("skipped", f"{new} new step records since the last heads job (needs {min_new_steps})")
            elif held is not None and held < start_held:
                tick = HeadsTick("skipped", f"the gate's held-out sample holds {held} requests, it needs {need_held}: "
                                            + ("no job until traffic brings them" if start_held == need_held else
                                               f"no job until it holds {start_held}"))
            elif not lock.acquire():
                tick = HeadsTick("skipped", "another distillation job holds the job lock")
            else:
                last_start = time.monotonic()
                if early:
                    progress(f"[heads-schedule] a job before the interval: {early}")
                try:
                    version, verdict = run_heads_cycle(registry, target, cfg, policy=policy, evidence=evidence,
                                                       smoke_check=smoke_check, canary_share=canary_share,
                                                       run_job=run_job, progress=progress)
                finally:
                    lock.release()
                    if job_share < 1.0:
                        took = time.monotonic() - last_start
                        rest = scheduler.rest_after_job(took, job_share)
                        rest_until = time.monotonic() + rest
                        progress(f"[heads-schedule] the cycle took {took:.0f} s: next job "
                                 f"in {rest:.0f} s at the earliest (--job-share {job_share:g})")
                jobs += 1
                if evidence_wait_s and evidence is not None and getattr(verdict, "insufficient", False):
                    waiting = {"version": str(version), "since": time.monotonic(), "gated_at": held}
                    tick = HeadsTick("held", f"waits up to {evidence_wait_s:.0f} s for held-out evidence, gated "
                                             f"again once the sample holds {need_held} requests: {verdict.reason}",
                                     version)
                else:
                    tick = _verdict_tick(registry, version, verdict, canary_share)
        except NotEnoughRows as e:
            tick = HeadsTick("skipped", str(e))
        except Exception as e:  # noqa: BLE001 - a failed cycle never ends the schedule
            log.exception("scheduled heads job failed")
            tick = HeadsTick("failed", f"{type(e).__name__}: {e}")
        ticks.append(tick)
        if tick.status == "skipped":
            said = _say_skip(progress, tick.message, said)
        else:
            said = None
            progress(f"[heads-schedule] {tick.status}: {tick.message}" + (f" (version {tick.version})" if tick.version
                                                                           else ""))
        if max_jobs is not None and jobs >= max_jobs and waiting is None:
            break
        stop.wait(poll_s)
    return list(ticks)


def _verdict_tick(registry: Registry, version, verdict: GateVerdict, canary_share: float) -> HeadsTick:
    as_canary = verdict.accepted and canary_share and str((registry.canary() or {}).get("version")) == str(version)
    return HeadsTick("promoted" if verdict.promoted else "canary" if as_canary else "rejected",
                     verdict.reason + (f" ({verdict.promotion})" if verdict.promotion else ""), version)


def _look_at_waiting(registry: Registry, target: str | None, waiting: dict, evidence: HeadsEvidence,
                     need_held: int, wait_s: float, *, policy, smoke_check, canary_share: float,
                     progress) -> tuple[dict | None, HeadsTick | None]:
    """One look at the candidate that waits for held-out evidence (`run_heads_schedule`, `evidence_wait_s`):
    (the candidate still waiting or None, the tick to report or None when nothing changed)."""
    version = waiting["version"]
    if time.monotonic() - waiting["since"] > wait_s:
        return None, HeadsTick("rejected", f"the gate's held-out sample did not reach {need_held} requests within "
                                           f"{wait_s:.0f} s; the candidate stays rejected", version)
    champion = registry.champion()
    if str(registry.get(version).parent_version) != str(champion):
        return None, HeadsTick("rejected", f"its parent is no longer the champion (version {champion} is): "
                                           "dropped without a gate", version)
    held = evidence.heldout_requests(fresh_after=fresh_cut(registry, version))
    if held < need_held or held <= waiting["gated_at"]:
        return waiting, HeadsTick("skipped", f"candidate version {version} waits for held-out evidence: the gate's "
                                             f"sample holds {held} requests, it needs {need_held}")
    verdict = gate_heads(registry, version, target, policy=policy, evidence=evidence, smoke_check=smoke_check,
                         canary_share=canary_share, progress=progress)
    if getattr(verdict, "insufficient", False):
        return {**waiting, "gated_at": held}, HeadsTick("skipped", f"candidate version {version} waits for held-out "
                                                                   f"evidence: {verdict.reason}")
    return None, _verdict_tick(registry, version, verdict, canary_share)


# `drafting_kind`: the newest requests it reads, and the answer tokens among them before the traffic decides
DRAFTING_REQUESTS = 200
MIN_SERVED_TOKENS = 500
CLEAR_SHARE = 0.75      # a share that decides before the wait ends (a choice still warming up splits about evenly)
WATCH_S = 60.0          # how often a schedule that follows the served kind looks again (at most its --every)


def kind_of_version(version: str) -> str | None:
    """The drafter kind a request's draft version names (buffer SequenceRecord.draft_version, what serving
    records): "medusa" / "eagle" for the heads ("medusa-v3", "medusa:<folder>"), None for a request served
    without a drafter ("none", ""), else "draft"."""
    if not version or version == "none":
        return None
    for kind in HEADS_KINDS:
        if version.startswith((f"{kind}-", f"{kind}:")):
            return kind
    return "draft"


def drafting_kinds(sequences) -> collections.Counter:
    """Answer tokens per drafter kind over buffer SequenceRecords (`kind_of_version` of each request's draft
    version); requests served without a drafter count for none."""
    out: collections.Counter = collections.Counter()
    for r in sequences:
        kind = kind_of_version(r.draft_version)
        if kind is not None:
            out[kind] += max(0, int(r.token_ids.shape[0]) - int(r.prompt_len))
    return out


def drafting_kind(redis_url: str | None, buffer_prefix: str = "draftsmith:buf", *, n: int = DRAFTING_REQUESTS,
                  min_tokens: int = MIN_SERVED_TOKENS, share: float = 0.0) -> tuple[str | None, collections.Counter]:
    """Which drafter served most answer tokens of the buffer's newest `n` requests: (kind, counts), kind None while
    they hold fewer than `min_tokens` or while no kind holds `share` of them (the caller's early decision waits for
    a clear majority: the drafter choice's warm-up alternates the two). Replicas that choose their drafter by
    measured speed (serving/mode_choice.py) serve what is faster on their host and traffic, so that is the kind
    whose distillation reaches the traffic (deploy/cli.py `_served_kind`). Requests, not drafted tokens: a request
    on the draft that proposed little (a cold controller, new traffic) was still routed to it. Read-only; raises
    BufferUnavailable."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader, resolve_redis_url

    reader = ReplayBufferReader(resolve_redis_url(redis_url), BufferConfig(prefix=buffer_prefix))
    try:
        counts = drafting_kinds(e.record for e in reader.newest(n, stream="sequences", max_scan=n))
    finally:
        reader.client.close()
    total = sum(counts.values())
    if total < min_tokens:
        return None, counts
    kind = max(sorted(counts), key=lambda k: counts[k])
    return (kind if counts[kind] >= share * total else None), counts


def follow_served_kind(first: str, run_schedule, look, *, look_s: float, can_switch=None, progress=print):
    """Run the schedule of the drafter kind that serves, and move to another kind when the replicas' choice moves
    (`distill --every` with no --kind, deploy/cli.py). `run_schedule(kind, stop)` runs one kind's schedule until the
    threading.Event `stop` is set and returns its exit code; `look()` -> (kind or None, counts) is `drafting_kind` on
    the buffer at CLEAR_SHARE. Every `look_s` seconds a watcher looks; once another kind drafts a clear majority of
    the newest requests, and `can_switch(current, seen)` allows it (no canary of the current kind being judged, a
    champion of the new one), it sets `stop`: the schedule ends after the job it may be running (no job is cut
    short, none overlaps the next kind's), and the new kind's schedule starts. The kind chosen once per start
    distilled a drafter the replicas stopped serving when the other one became faster (docs/benchmarks.md, "The
    fortieth session"). The CLI looks every WATCH_S (or --every where that is shorter), not once per interval: with
    --every 15m the watcher looked at 900 s, after the heads had drafted 95-99% of the newest requests from 240 s to
    780 s while the draft's schedule waited for its first job, and then saw no clear majority (docs/benchmarks.md,
    "The forty-fourth session"). The newest DRAFTING_REQUESTS requests (about three minutes at two clients) and the
    clear share keep a warm-up's swings from moving it. A look that fails (Redis down) changes nothing. Returns the
    last schedule's exit code."""
    import threading

    kind = first
    while True:
        stop = threading.Event()
        seen: list = []

        def watch(current=kind, stop=stop, seen=seen):
            while not stop.wait(look_s):
                try:
                    now, counts = look()
                    if now is None or now == current or (can_switch is not None and not can_switch(current, now)):
                        continue
                except Exception as e:  # noqa: BLE001 - the buffer or MLflow down: the schedule goes on as it is
                    log.warning("[distill] no look at which drafter serves: %s", e)
                    continue
                seen.append((now, counts))
                stop.set()
                return

        watcher = threading.Thread(target=watch, name="draftsmith-served-kind", daemon=True)
        watcher.start()
        try:
            code = run_schedule(kind, stop)
        finally:
            stop.set()
            watcher.join(timeout=60)
        if not seen:
            return code
        now, counts = seen[0]
        shares = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        progress(f"[distill] answer tokens of the buffer's newest requests by drafter: {shares}: the replicas now "
                 f"draft with {'the draft' if now == 'draft' else f'the {now} heads'}; the {kind} schedule stopped "
                 f"after its last job, distilling --kind {now} from now on")
        kind = now


def _say_skip(progress, message: str, said: str | None) -> str:
    """Report a skipped look once per reason (its numbers aside: "20 new step records" and "45 new step records"
    are one reason); returns the reason now said."""
    reason = re.sub(r"[0-9.]+", "N", message)
    if reason != said:
        progress(f"[heads-schedule] skipped: {message}")
    return reason

