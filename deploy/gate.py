"""Promotion gate: plain policy code over the registry (no MLflow import here).

The gate does not trust what a distillation job says about its own candidate. It draws its own sample,
scores both drafts on it, and decides on a paired confidence interval:

1. **Pinned to the target.** The candidate's `draftsmith.target_sha256` tag (deploy/registry.py,
   `target_fingerprint`) must equal the fingerprint of the target being served (`target_sha256`, by
   default the registry target's folder). A candidate for another target, or one that records none, is
   rejected before anything is loaded.
2. **Independent, paired evidence.** `EvidenceSource` draws the newest held-out step records from the
   replay buffer (read-only; held out = `training.data.is_heldout` of the request id, the split every
   job uses, so no job ever trained on them; use the jobs' `heldout_fraction` or a smaller one), rebuilds
   them into units (`training.data.build_units`), and scores the champion and the candidate, each as
   materialised and on its own output vocabulary, with `training.distill.offline_acceptance` (sum over
   the vocabulary of min(p, q) under each record's warp), per request, together with the fresh requests
   below. With per-request acceptances
   c_r (candidate) and h_r (champion), weights w_r = the request's scored draft positions, the gain is
   `delta = sum w_r (c_r - h_r) / sum w_r`. A paired bootstrap over requests (`bootstrap` resamples,
   seeded) gives its one-sided lower bound at `confidence`. The check passes iff there are at least
   `min_requests` held-out requests (and `min_heldout_records` steps), `delta >= margin` and the lower
   bound is > 0 (the gain is significant). The job's own before/after figures are recorded next to the
   gate's (`gate_reported_delta`) but decide nothing.
3. **No significant regression on any traffic category.** For every `source` of the sampled requests
   (a SequenceRecord's traffic label) with at least `category_min_requests` requests, the same paired
   bootstrap within the category gives an upper bound at a Bonferroni-corrected level
   (1 - (1 - confidence) / number of categories tested); an upper bound below `-category_tolerance`
   blocks promotion, whatever the overall gain.
4. **Lossless smoke decode.** `smoke_check(draft_path) -> (ok, detail)` on the materialised candidate;
   the real one (`engine_smoke_check`) decodes a few prompts at temperature 0 with lossless speculative
   sampling and with the target alone (fp32) and demands identical tokens. This only proves the draft
   loads next to the target and runs: speculative sampling is lossless whatever the draft.

With no champion yet, checks 2 and 3 are skipped ("no champion yet").

**Fresh evidence** (`fresh_cut`, `run_gate`): besides the held-out requests (every tenth), the sample holds
the requests that neither the candidate nor the champion can have trained on because their SequenceRecord
was written after both versions' jobs read the buffer. Each job (training/job.py for drafts,
training/heads_job.py for heads) keeps the buffer's sequence cursor taken after its reads as its
`data_window.sequence_cut` (buffer/redis_store.py `sequence_cursor`), and uses only steps whose request's
sequence was stored when it read. Those requests are unseen by both, as held-out ones are, and they are the
newest traffic; the next job trains on them, so each serves as evidence once. On the 2-core host a tenth of
the traffic brought the gate's minimum of requests in 8-14 minutes, and a candidate held for them blocked every
later job (docs/benchmarks.md, "The twenty-seventh session"); the requests that end while a job runs are
usually enough on their own. `run_gate` sets the cut on an evidence source that has a `fresh_after` field
left at None; a champion trained by a job that kept no cut gives none (its data cannot be placed).

**Vocabulary.** Each draft is scored on the rows its materialised folder's `draftsmith.json` lists (read
by `serving.models.read_output_token_ids`, the engine's and the trainer's reader). Before scoring, the
gate checks the candidate folder's vocabulary against the version's registered `draftsmith.vocab_sha256`
tag: a mismatch is a rejection. The size it found is recorded (`draftsmith.gate.vocabulary`).

**Live figure.** The gate also records what live acceptance it expects of the candidate, for the
watchdog (deploy/scheduler.py): `gate_expected_rate`, the expected accepted draft tokens per drafted
token under the records' own draft lengths (from the per-position rates, E[L] at gamma <= 4 over
positions), and, when the champion has live figures since it became champion (MLflow `draftsmith-live`),
`gate_predicted_live_acceptance` = champion's live acceptance x candidate's / champion's expected rate
on the gate sample (which carries the live mix of decoding modes over).

The verdict and its figures are recorded on the version either way: tags `draftsmith.gate.*` (the
evidence as JSON in `draftsmith.gate.evidence`) and metrics `gate_candidate_acceptance`,
`gate_champion_acceptance`, `gate_delta`, `gate_delta_lower`, `gate_requests`, `gate_records`,
`gate_delta.<category>`, `gate_accepted`, plus a history entry on the registered model. Promotion itself
goes through `Registry.promote`, which refuses while promotions are paused (the verdict then says so) and
fails closed when MLflow cannot be read.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from serving.contention import marks_busy
from deploy.registry import (HEADS_KINDS, TAG, ArtifactError, PromotionsPaused, Registry, VersionInfo,
                             heads_kind_of, is_heads_folder, short_hash, target_fingerprint, vocabulary_digest)

log = logging.getLogger(__name__)

SmokeCheck = Callable[[Path], "tuple[bool, str]"]

FLOAT_SLACK = 1e-9
DEFAULT_SMOKE_PROMPTS = (
    "What is 12 * 7?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
)


def _int_at_least(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclass
class GatePolicy:
    """margin: gain in held-out acceptance (gate-measured, position-weighted) the candidate needs.
    confidence: one-sided level of the paired bootstrap bounds (overall gain > 0; category regression).
    min_requests / min_heldout_records: held-out requests / steps the gate's own sample needs.
    category_min_requests: a traffic category is tested only with at least this many requests.
    category_tolerance: a category blocks only when significantly below -tolerance.
    bootstrap, seed: resamples of the paired bootstrap and its RNG seed (verdicts are reproducible).
    require_smoke: run the lossless smoke decode (only an operator's --force skips the gate)."""

    margin: float = 0.01
    min_heldout_records: int = 1
    min_requests: int = 20
    confidence: float = 0.95
    category_min_requests: int = 10
    category_tolerance: float = 0.0
    bootstrap: int = 2000
    seed: int = 0
    require_smoke: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not (0.0 <= self.margin < 1.0):
            raise ValueError(f"gate margin must be a number in [0, 1), got {self.margin!r}")
        _int_at_least("min_heldout_records", self.min_heldout_records, 0)
        _int_at_least("min_requests", self.min_requests, 2)
        _int_at_least("category_min_requests", self.category_min_requests, 2)
        _int_at_least("bootstrap", self.bootstrap, 100)
        if isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float)) \
                or not (0.5 <= self.confidence < 1.0):
            raise ValueError(f"confidence must be a number in [0.5, 1), got {self.confidence!r}")
        if isinstance(self.category_tolerance, bool) or not isinstance(self.category_tolerance, (int, float)) \
                or not (0.0 <= self.category_tolerance < 1.0):
            raise ValueError(f"category_tolerance must be a number in [0, 1), got {self.category_tolerance!r}")
        self.margin = float(self.margin)
        self.confidence = float(self.confidence)


# ---------------------------------------------------------------------------------- evidence
@dataclass
class PairedEvidence:
    """Both drafts scored on the same held-out requests (one entry per request, same order).

    acceptance: mean per-position acceptance of the request's draft positions; weight: those positions;
    rate: expected accepted draft tokens per drafted token (E[L] x steps / positions)."""

    request_ids: list[str]
    categories: list[str]
    weight: list[float]
    champion: list[float]
    candidate: list[float]
    champion_rate: list[float] = field(default_factory=list)
    candidate_rate: list[float] = field(default_factory=list)
    records: int = 0                 # held-out step records in the sample
    window: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        for name in ("categories", "weight", "champion", "candidate"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"PairedEvidence.{name} has {len(getattr(self, name))} entries for {n} requests")

    @property
    def requests(self) -> int:
        return len(self.request_ids)

    def subset(self, category: str) -> "PairedEvidence":
        idx = [i for i, c in enumerate(self.categories) if c == category]
        pick = (lambda xs: [xs[i] for i in idx] if xs else [])
        return PairedEvidence(pick(self.request_ids), pick(self.categories), pick(self.weight), pick(self.champion),
                              pick(self.candidate), pick(self.champion_rate), pick(self.candidate_rate),
                              records=0, window=self.window)


def _weighted(values, weight) -> float:
    tw = float(sum(weight))
    return float(sum(v * w for v, w in zip(values, weight)) / tw) if tw > 0 else float("nan")


def paired_bootstrap(ev: PairedEvidence, *, resamples: int, seed: int, lower_q: float | None = None,
                     upper_q: float | None = None) -> tuple[float, float | None, float | None]:
    """(delta, lower, upper): the weighted mean difference candidate - champion over requests and its
    bootstrap quantiles `lower_q` / `upper_q` (requests resampled with replacement, pairs kept together)."""
    import numpy as np

    w = np.asarray(ev.weight, dtype=np.float64)
    d = np.asarray(ev.candidate, dtype=np.float64) - np.asarray(ev.champion, dtype=np.float64)
    delta = float((w * d).sum() / w.sum())
    n = len(w)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)   # [B, n]
    tw = counts @ w
    boot = (counts @ (w * d)) / np.where(tw > 0, tw, 1.0)
    lo = float(np.quantile(boot, lower_q)) if lower_q is not None else None
    hi = float(np.quantile(boot, upper_q)) if upper_q is not None else None
    return delta, lo, hi


@dataclass
class EvidenceJudgement:
    ok: bool
    reason: str
    candidate_acceptance: float | None = None
    champion_acceptance: float | None = None
    delta: float | None = None
    delta_lower: float | None = None
    categories: dict = field(default_factory=dict)   # source -> {"requests", "delta", "upper", "tested", "blocks"}
    insufficient: bool = False     # not judged: the sample is below the policy's minimums (not a regression)


def judge_evidence(ev: PairedEvidence, policy: GatePolicy) -> EvidenceJudgement:
    """Checks 2 and 3 of the module docstring (pure)."""
    if ev.requests < policy.min_requests or ev.records < policy.min_heldout_records:
        return EvidenceJudgement(False, (f"not enough held-out evidence: {ev.requests} requests / {ev.records} steps "
                                         f"in the gate's sample, the gate needs at least {policy.min_requests} "
                                         f"requests and {policy.min_heldout_records} steps"), insufficient=True)
    alpha = 1.0 - policy.confidence
    cand, champ = _weighted(ev.candidate, ev.weight), _weighted(ev.champion, ev.weight)
    delta, lower, _ = paired_bootstrap(ev, resamples=policy.bootstrap, seed=policy.seed, lower_q=alpha)
    out = EvidenceJudgement(False, "", cand, champ, delta, lower)
    counts: dict[str, int] = {}
    for c in ev.categories:
        counts[c] = counts.get(c, 0) + 1
    tested = sorted(c for c, n in counts.items() if n >= policy.category_min_requests)
    level = 1.0 - alpha / max(1, len(tested))
    blocking = []
    for c in sorted(counts):
        entry = {"requests": counts[c], "tested": c in tested}
        sub = ev.subset(c)
        if c in tested:
            d_c, _, hi = paired_bootstrap(sub, resamples=policy.bootstrap, seed=policy.seed + 1, upper_q=level)
            entry.update(delta=d_c, upper=hi, level=level, blocks=hi < -policy.category_tolerance)
            if entry["blocks"]:
                blocking.append(f"{c} ({d_c:+.4f}, upper bound {hi:+.4f} at {level:.3f}, {counts[c]} requests)")
        else:
            entry.update(delta=_weighted(sub.candidate, sub.weight) - _weighted(sub.champion, sub.weight))
        out.categories[c] = entry
    fresh = (ev.window or {}).get("fresh_requests") or 0          # deploy/heads.py "Fresh evidence"
    head = (f"gate sample of {ev.requests} held-out requests ({f'{fresh} of them fresh, ' if fresh else ''}"
            f"{ev.records} steps): acceptance {cand:.4f} vs "
            f"champion {champ:.4f}, delta {delta:+.4f} (one-sided {policy.confidence:g} lower bound {lower:+.4f})")
    if blocking:
        out.reason = f"{head}; significant regression on traffic categor{'y' if len(blocking) == 1 else 'ies'} " \
                     + ", ".join(blocking)
    elif delta < policy.margin - FLOAT_SLACK:
        out.reason = f"{head} does not reach the margin {policy.margin:g}"
    elif not lower > 0:
        out.reason = f"{head}: the gain is not significant (lower bound <= 0)"
    else:
        out.ok, out.reason = True, f"{head} >= margin {policy.margin:g}, significant"
    return out


@dataclass
class EvidenceSource:
    """Where the gate draws its own held-out sample: the replay buffer at `redis_url` (default REDIS_URL,
    else the embedded server) under `buffer_prefix`; the newest `records` held-out steps (split
    `heldout_fraction`, the jobs' or smaller), optionally of one `source`, topped up with older held-out
    steps until every traffic source met has `category_floor` requests (training/data.py
    `stratified_heldout`; the gate's `category_min_requests`, so a category the newest traffic crowds out is
    still tested); units of at most `max_len` tokens, scored in batches of about `batch_tokens`."""

    redis_url: str | None = None
    buffer_prefix: str = "draftsmith:buf"
    heldout_fraction: float = 0.1
    records: int = 4000
    max_len: int = 1024
    batch_tokens: int = 4096
    source: str | None = None
    category_floor: int = 10
    fresh_after: str | None = None     # a sequence cut: requests after it are fresh evidence (module docstring)
    target_sha256: str | None = None   # the served target's fingerprint: requests another target scored are left out

    def __post_init__(self) -> None:
        if not (0.0 < self.heldout_fraction < 1.0):
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")
        _int_at_least("records", self.records, 1)
        _int_at_least("category_floor", self.category_floor, 0)

    @contextlib.contextmanager
    def _reader(self):
        """A reader of the buffer the sample comes from, closed after the block."""
        from buffer.redis_store import BufferConfig, ReplayBufferReader, resolve_redis_url

        reader = ReplayBufferReader(resolve_redis_url(self.redis_url), BufferConfig(prefix=self.buffer_prefix),
                                    target=self.target_sha256 or None)
        try:
            yield reader
        finally:
            reader.client.close()

    def _fresh(self, reader, after: str | None) -> tuple[list, dict]:
        """The fresh requests' steps after the sequence cut `after` (none without one), of `source` if set."""
        from training import data

        if not after:
            return [], {}
        return data.fresh_window(reader, after, self.records, heldout_fraction=self.heldout_fraction,
                                 source=self.source)

    def sample_key(self, fresh_after: str | None = None) -> tuple[int, str | None]:
        """A cheap fingerprint of the sample `collect` would draw now, read from Redis without scoring
        anything: (its requests: the held-out ones, and with `fresh_after` the fresh ones after that cut; its
        newest step id). The scheduler gates a candidate that waits for evidence again only when this changed
        and the requests reach the gate's minimum."""
        from buffer.redis_store import stream_id_key
        from training import data

        with self._reader() as reader:
            entries, _ = data.heldout_window(reader, self.records, heldout_fraction=self.heldout_fraction,
                                             source=self.source)
            entries = entries + self._fresh(reader, fresh_after)[0]
        ids = [e.stream_id for e in entries]
        return len({e.record.request_id for e in entries}), (max(ids, key=stream_id_key) if ids else None)

    def collect(self, champion_path: Path, candidate_path: Path) -> PairedEvidence:
        """Draw the sample and score both drafts on it (module docstring, check 2)."""
        from buffer.redis_store import stream_id_key
        from training import data

        with self._reader() as reader:
            units, entries = data.heldout_units(reader, self.records, heldout_fraction=self.heldout_fraction,
                                                max_len=self.max_len, source=self.source,
                                                category_floor=self.category_floor)
            fresh, fresh_seqs = self._fresh(reader, self.fresh_after)
        fresh_units, _ = data.build_units(fresh, fresh_seqs, max_len=self.max_len, rows="all")
        units = units + fresh_units
        entries = entries + fresh
        scores = {name: score_requests(path, units, batch_tokens=self.batch_tokens)
                  for name, path in (("champion", champion_path), ("candidate", candidate_path))}
        ids = sorted(set(scores["champion"]) & set(scores["candidate"]))
        cats = {u.request_id: (u.source or "unlabelled") for u in units}
        ch, ca = scores["champion"], scores["candidate"]
        sids = sorted((e.stream_id for e in entries), key=stream_id_key)
        return PairedEvidence(
            ids, [cats[r] for r in ids], [ch[r]["positions"] for r in ids], [ch[r]["acceptance"] for r in ids],
            [ca[r]["acceptance"] for r in ids], [ch[r]["rate"] for r in ids], [ca[r]["rate"] for r in ids],
            records=sum(len(u.stream_ids) for u in units if u.request_id in ch),
            window={"stream": reader.config.steps_key, "first_id": sids[0] if sids else None,
                    "last_id": sids[-1] if sids else None, "heldout_fraction": self.heldout_fraction,
                    "fresh_after": self.fresh_after,
                    "fresh_requests": len({u.request_id for u in fresh_units} & set(ids))})


def score_requests(draft_path: Path, units, *, batch_tokens: int = 4096) -> dict[str, dict]:
    """{request id: {"acceptance", "positions", "rate", "steps"}} of the draft folder on `units`, through
    training.distill.offline_acceptance (each unit relabelled with its request id, so its per-"source"
    report is per request). Requests without a scored draft position are left out."""
    from training import distill

    draft = distill.Draft(draft_path, lora_r=None)
    keyed = [replace(u, source=u.request_id) for u in units]
    report = distill.offline_acceptance(draft, keyed, batch_tokens=batch_tokens)
    out = {}
    for rid, r in report.by_source.items():
        if r["positions"] and r["acceptance"] is not None:
            eal = r["expected_accepted_length"] or 0.0
            out[rid] = {"acceptance": r["acceptance"], "positions": r["positions"], "steps": r["steps"],
                        "rate": eal * r["steps"] / r["positions"]}
    return out


Evidence = Callable[[Path, Path], PairedEvidence]


# ---------------------------------------------------------------------------------- the verdict
@dataclass
class GateVerdict:
    accepted: bool
    reason: str
    candidate_version: str
    champion_version: str | None
    candidate_acceptance: float | None
    champion_acceptance: float | None
    margin: float
    smoke_ok: bool | None = None        # None: not run (an earlier check failed, or no smoke required)
    smoke_detail: str = ""
    promoted: bool = False
    vocabulary: str = ""                # output vocabulary of the materialised candidate ("N rows" / "full")
    delta_lower: float | None = None
    requests: int = 0
    records: int = 0
    categories: dict = field(default_factory=dict)
    reported_delta: float | None = None  # what the job claimed (offline_acceptance_after - _before)
    target_sha256: str | None = None
    candidate_expected_rate: float | None = None
    champion_expected_rate: float | None = None
    predicted_live_acceptance: float | None = None
    window: dict = field(default_factory=dict)
    promotion: str = ""                 # "", "paused: ..." when accepted but promotions are paused
    insufficient: bool = False          # rejected only because the held-out sample is still too small

    @property
    def delta(self) -> float | None:
        if self.candidate_acceptance is None or self.champion_acceptance is None:
            return None
        return self.candidate_acceptance - self.champion_acceptance

    def tags(self) -> dict[str, str]:
        evidence = {"requests": self.requests, "records": self.records, "delta_lower": self.delta_lower,
                    "categories": self.categories, "window": self.window, "reported_delta": self.reported_delta}
        return {
            "draftsmith.gate.verdict": "accepted" if self.accepted else "rejected",
            "draftsmith.gate.reason": self.reason,
            "draftsmith.gate.insufficient": "1" if self.insufficient and not self.accepted else "0",
            "draftsmith.gate.champion_version": self.champion_version or "none",
            "draftsmith.gate.margin": f"{self.margin:g}",
            "draftsmith.gate.smoke": {None: "not run", True: "passed", False: "failed"}[self.smoke_ok],
            "draftsmith.gate.smoke_detail": self.smoke_detail or "-",
            "draftsmith.gate.vocabulary": self.vocabulary or "not read",
            "draftsmith.gate.target_sha256": self.target_sha256 or "unknown",
            "draftsmith.gate.evidence": json.dumps(evidence, default=_json_float)[:5000],
            "draftsmith.gate.promotion": self.promotion or "-",
            "draftsmith.gate.time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def metrics(self) -> dict[str, float]:
        out = {"gate_accepted": 1.0 if self.accepted else 0.0, "gate_margin": self.margin}
        for key, value in (("gate_candidate_acceptance", self.candidate_acceptance),
                           ("gate_champion_acceptance", self.champion_acceptance), ("gate_delta", self.delta),
                           ("gate_delta_lower", self.delta_lower), ("gate_reported_delta", self.reported_delta),
                           ("gate_expected_rate", self.candidate_expected_rate),
                           ("gate_champion_expected_rate", self.champion_expected_rate),
                           ("gate_predicted_live_acceptance", self.predicted_live_acceptance)):
            if value is not None and math.isfinite(value):
                out[key] = float(value)
        if self.requests:
            out["gate_requests"], out["gate_records"] = float(self.requests), float(self.records)
        for cat, entry in self.categories.items():
            if entry.get("delta") is not None and math.isfinite(entry["delta"]):
                out[f"gate_delta.{cat}"] = float(entry["delta"])
        if self.smoke_ok is not None:
            out["gate_smoke_ok"] = 1.0 if self.smoke_ok else 0.0
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "delta": self.delta}


def _json_float(x):
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def judge_acceptance(candidate: VersionInfo, champion_version: str | None,
                     policy: GatePolicy) -> tuple[bool, str, float | None, float | None]:
    """What the distillation job CLAIMS about its candidate, judged by the margin (pure): (ok, reason,
    candidate_acc, champion_acc) from candidate.json's `offline_acceptance_after` / `_before`. This no
    longer decides anything: `run_gate` records the claim (`gate_reported_delta`) next to its own
    measurement. It remains the one place that names the job's metrics for the gate."""
    m = candidate.metrics
    cand = m.get("offline_acceptance_after")
    if not candidate.distilled:                  # a base, unless a candidate squashed into one
        return False, f"version {candidate.version} is a {candidate.kind} draft: no job figures", None, None
    if cand is None:
        return False, "the candidate has no offline_acceptance_after metric (candidate.json metrics)", None, None
    heldout = m.get("heldout_records")
    if policy.min_heldout_records and (heldout is None or heldout < policy.min_heldout_records):
        return False, (f"held-out set too small: {0 if heldout is None else int(heldout)} records, "
                       f"the gate needs at least {policy.min_heldout_records}"), cand, None
    if champion_version is None:
        return True, "no champion yet", cand, None
    if candidate.parent_version != champion_version:
        return False, (f"stale candidate: trained from version {candidate.parent_version}, but the champion is "
                       f"version {champion_version}"), cand, None
    champ = m.get("offline_acceptance_before")
    if champ is None:
        return False, "the candidate has no offline_acceptance_before metric (the champion's figure)", cand, None
    delta = cand - champ
    if delta > 0 and delta >= policy.margin - FLOAT_SLACK:
        return True, f"claimed {cand:.4f} vs {champ:.4f} (+{delta:.4f} >= margin {policy.margin:g})", cand, champ
    return False, f"claimed {cand:.4f} vs {champ:.4f}: delta {delta:+.4f} below the margin {policy.margin:g}", \
        cand, champ


def check_target(info: VersionInfo, expected: str | None, target: str) -> str | None:
    """None when the version is pinned to the expected target fingerprint, else the rejection reason."""
    if expected is None:
        return (f"cannot fingerprint the target {target!r} (no local model folder), so the gate cannot check "
                f"which target version {info.version} was built for; pass the target folder (--target)")
    got = info.target_sha256
    if got is None:
        return (f"version {info.version} records no target fingerprint (draftsmith.target_sha256), so it is not "
                f"known to be built for this target ({short_hash(expected)}); distill it again")
    if got != expected:
        return (f"version {info.version} was built for another target (fingerprint {short_hash(got)}); this "
                f"target {target!r} is {short_hash(expected)}")
    return None


def live_acceptance(registry: Registry, version: str, *, since_ms: int | None = None,
                    until_ms: int | None = None) -> tuple[float | None, float]:
    """(accepted / drafted tokens, drafted tokens) over a version's live intervals in the window."""
    acc = drafted = 0.0
    for it in registry.live_intervals(version, since_ms=since_ms, until_ms=until_ms):
        d = it.get("draft_tokens")
        if d is None:
            continue
        drafted += d
        acc += it.get("accepted_tokens", it["acceptance_rate"] * d)
    return (acc / drafted if drafted > 0 else None), drafted


def fresh_cut(registry: Registry, version: str) -> str | None:
    """The sequence cut after which requests are fresh evidence on candidate `version` against the champion
    (module docstring): the later of the two versions' `data_window.sequence_cut`, so that neither trained on
    a request after it. None when the candidate has no cut (a folder registered by hand, a job from before
    the cut was kept), or when the champion was trained by a job that kept none (its data cannot be placed)."""
    from buffer.redis_store import stream_id_key

    def window(v) -> dict:
        try:
            return json.loads((registry.get(v).tags or {}).get("draftsmith.data_window") or "{}")
        except json.JSONDecodeError:
            return {}

    cut = window(version).get("sequence_cut")
    champion = registry.champion()
    if not cut or champion is None or str(champion) == str(version):
        return cut or None
    theirs = window(champion)
    if theirs.get("sequence_cut"):
        return max(cut, theirs["sequence_cut"], key=stream_id_key)
    return None if theirs.get("steps") else cut         # a champion from the buffer, with no cut kept


@marks_busy("the gate's scoring pass")
def run_gate(registry: Registry, version: str, smoke_check: SmokeCheck | None, *,
             policy: GatePolicy | None = None, promote: bool = True, evidence: "EvidenceSource | Evidence | None" = None,
             target_sha256: str | None = None, min_live_tokens: int = 500) -> GateVerdict:
    """Judge `version` against the champion (module docstring), record the verdict on it, and (when
    accepted and `promote`) make it champion.

    `evidence`: an EvidenceSource (or any callable (champion folder, candidate folder) -> PairedEvidence);
    without one a candidate can only pass when there is no champion yet. `target_sha256`: the served
    target's fingerprint (default: `target_fingerprint(registry.target)`). MLflow errors propagate
    (RegistryUnavailable): no verdict, no promotion. Artifacts are verified and both drafts materialised
    before scoring; an ArtifactError becomes a rejection (recorded).
    """
    policy = policy or GatePolicy()
    info = registry.get(version)
    champion = registry.champion()
    if info.version == champion:
        return GateVerdict(True, f"version {info.version} is already the champion", info.version, champion,
                           info.metrics.get("gate_candidate_acceptance"), None, policy.margin)
    expected = target_sha256 or target_fingerprint(registry.target)
    _, _, claimed_after, claimed_before = judge_acceptance(info, info.parent_version, policy)
    reported = None if claimed_after is None or claimed_before is None else claimed_after - claimed_before
    verdict = GateVerdict(False, "", info.version, champion, None, None, policy.margin, reported_delta=reported,
                          target_sha256=info.target_sha256)
    verdict.reason = check_target(info, expected, registry.target) or ""
    if not verdict.reason:
        try:
            cand_path = registry.materialize(info.version, verify=True)
            verdict.vocabulary = check_vocabulary(info, cand_path)
            if champion is None:
                verdict.accepted, verdict.reason = True, "no champion yet"
            elif evidence is None:
                verdict.reason = "no evidence source configured: the gate scores both drafts on its own sample"
            else:
                collect = evidence.collect if hasattr(evidence, "collect") else evidence
                with _fresh_evidence(evidence, registry, info.version):
                    ev = collect(registry.materialize(champion), cand_path)
                j = judge_evidence(ev, policy)
                verdict.accepted, verdict.reason, verdict.insufficient = j.ok, j.reason, j.insufficient
                verdict.candidate_acceptance, verdict.champion_acceptance = j.candidate_acceptance, j.champion_acceptance
                verdict.delta_lower, verdict.categories = j.delta_lower, j.categories
                verdict.requests, verdict.records, verdict.window = ev.requests, ev.records, ev.window
                if ev.candidate_rate and ev.requests:
                    verdict.candidate_expected_rate = _weighted(ev.candidate_rate, ev.weight)
                    verdict.champion_expected_rate = _weighted(ev.champion_rate, ev.weight)
                    since = registry.champion_since_ms(registry.get(champion))
                    live, drafted = live_acceptance(registry, champion, since_ms=since)
                    if live is not None and drafted >= min_live_tokens and verdict.champion_expected_rate > 0:
                        verdict.predicted_live_acceptance = min(
                            1.0, live * verdict.candidate_expected_rate / verdict.champion_expected_rate)
        except ArtifactError as e:
            verdict.accepted, verdict.reason = False, f"artifacts unusable: {e}"
    if verdict.accepted and policy.require_smoke:
        if smoke_check is None:
            verdict.accepted, verdict.reason = False, "no smoke check configured (the gate requires one)"
        else:
            try:
                s_ok, detail = smoke_check(registry.materialize(info.version))
            except Exception as e:  # noqa: BLE001 - a crashing check is a failed check
                s_ok, detail = False, f"smoke check raised {type(e).__name__}: {e}"
            verdict.smoke_ok, verdict.smoke_detail = bool(s_ok), str(detail)
            if not s_ok:
                verdict.accepted = False
                verdict.reason = f"smoke decode failed: {detail}"
    record_verdict(registry, verdict)
    if verdict.accepted and promote:
        try:
            registry.promote(info.version, reason=f"gate: {verdict.reason}",
                             gate={k: v for k, v in verdict.to_dict().items()
                                   if k in ("reason", "candidate_acceptance", "champion_acceptance", "delta",
                                            "delta_lower", "requests", "records", "champion_version")})
            verdict.promoted = True
        except PromotionsPaused as e:
            verdict.promotion = f"paused: {e}"
            registry.set_version_tags(info.version, {"draftsmith.gate.promotion": verdict.promotion})
    log.info("gate %s version %s: %s", "accepted" if verdict.accepted else "rejected", info.version, verdict.reason)
    return verdict


@contextlib.contextmanager
def _fresh_evidence(evidence, registry: Registry, version: str):
    """Within the block, an evidence source with a `fresh_after` field left at None also scores the requests
    after `fresh_cut(registry, version)` (module docstring, "Fresh evidence"); one given a cut keeps it."""
    if getattr(evidence, "fresh_after", "") is not None:
        yield
        return
    evidence.fresh_after = fresh_cut(registry, version)
    try:
        yield
    finally:
        evidence.fresh_after = None


def check_vocabulary(info: VersionInfo, path: Path) -> str:
    """The materialised folder's output vocabulary, read through `serving.models.read_output_token_ids`
    (the engine's and the trainer's reader), checked against the version's `draftsmith.vocab_sha256` tag
    when it has one; returns "N rows" or "full"; ArtifactError when it is unreadable or differs."""
    from serving.models import ModelLoadError, read_output_token_ids

    try:
        ids = _heads_vocabulary(Path(path)) if is_heads_folder(path) else read_output_token_ids(Path(path))
    except ModelLoadError as e:
        raise ArtifactError(f"version {info.version}: materialised vocabulary unreadable: {e}") from None
    want = info.tags.get(TAG + "vocab_sha256")
    if want and vocabulary_digest(ids) != want:
        raise ArtifactError(f"version {info.version}: the materialised folder {path} has a different output "
                            f"vocabulary ({'full' if ids is None else len(ids)} rows) from the registered one "
                            f"({info.tags.get(TAG + 'vocab_size', '?')} rows)")
    return "full" if ids is None else f"{len(ids)} rows"


def _heads_vocabulary(path: Path) -> list[int] | None:
    """The kept vocabulary of a heads folder (its config's `output_token_ids`: `medusa_heads.json`,
    `eagle_head.json`)."""
    from serving.models import ModelLoadError

    cfg = path / HEADS_KINDS[heads_kind_of(path) or "medusa"].files[0]
    try:
        doc = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg} is not valid JSON: {e}") from None
    ids = doc.get("output_token_ids") if isinstance(doc, dict) else None
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ModelLoadError(f"{cfg}: output_token_ids must be a list of token ids")
    return ids or None


def record_verdict(registry: Registry, verdict: GateVerdict) -> None:
    """Tags + metrics on the version and an entry in the registered model's history."""
    registry.set_version_tags(verdict.candidate_version, verdict.tags())
    registry.log_version_metrics(verdict.candidate_version, verdict.metrics())
    registry.record_event({"action": "gate", "version": verdict.candidate_version,
                           "verdict": "accepted" if verdict.accepted else "rejected", "reason": verdict.reason})


def force_promote(registry: Registry, version: str, *, reason: str = "operator --force", ignore_pause: bool = False):
    """Promote without the gate (artifacts are still verified first; the pause still applies unless
    `ignore_pause`); recorded as such on the version."""
    move = registry.promote(version, reason=reason, ignore_pause=ignore_pause)
    if move.changed:
        registry.set_version_tags(move.champion, {"draftsmith.gate.verdict": "skipped (--force)",
                                                  "draftsmith.gate.reason": reason})
    return move


def start_canary_after_gate(registry: Registry, verdict: GateVerdict, share: float, *, ignore_pause: bool = False):
    """Start the canary (`Registry.start_canary`) for a version that passed the gate (`run_gate(...,
    promote=False)`), carrying the gate's figures; the scheduler's path, and `draftsmith promote
    --canary-share`. PromotionsPaused / ArtifactError / UsageError as `start_canary`."""
    return registry.start_canary(
        verdict.candidate_version, share, reason=f"gate: {verdict.reason}", ignore_pause=ignore_pause,
        gate={k: v for k, v in verdict.to_dict().items()
              if k in ("candidate_acceptance", "champion_acceptance", "delta", "delta_lower", "requests")})


def engine_smoke_check(target: str | None, *, prompts: tuple[str, ...] = DEFAULT_SMOKE_PROMPTS,
                       max_tokens: int = 24, gamma: int = 4, device: str = "cpu", kind: str = "draft") -> SmokeCheck:
    """The real smoke check: for each prompt, greedy (temperature 0) decoding with lossless
    speculative sampling (kind "draft": the folder is a draft), mode medusa (kind "medusa": Medusa heads) or
    mode eagle (kind "eagle": an EAGLE head; deploy/heads.py) must emit exactly the target-only greedy
    tokens. fp32, so rounding differences between one-token and (gamma+1)-token target passes cannot flip an
    argmax in practice.
    """
    if max_tokens < 1 or not prompts:
        raise ValueError("the smoke check needs at least one prompt and max_tokens >= 1")
    if kind not in ("draft", *HEADS_KINDS):
        raise ValueError(f"kind must be one of {('draft', *HEADS_KINDS)}, got {kind!r}")
    mode, what = (kind, HEADS_KINDS[kind].label) if kind in HEADS_KINDS else ("speculative", "the draft")

    def check(path: Path) -> tuple[bool, str]:
        import torch

        from serving.config import SamplingParams, SpecParams
        from serving.engine import Engine
        from serving.models import ModelLoadError

        try:
            engine = (Engine.from_paths(target, None, device=device, dtype=torch.float32, **{
                          "heads" if kind == "medusa" else "eagle": str(path)})
                      if kind in HEADS_KINDS else
                      Engine.from_paths(target, str(path), device=device, dtype=torch.float32, draft_version="smoke"))
        except ModelLoadError as e:
            return False, f"{what}: does not load next to the target: {e}"
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        accepted = drafted = 0
        for i, text in enumerate(prompts):
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = [int(t) for t in ids]
            spec = engine.generate_all(ids, sampling, SpecParams(mode=mode, gamma=gamma), log_mode="none")
            ref = engine.generate_all(ids, sampling, SpecParams(mode="target"), log_mode="none")
            if spec.token_ids != ref.token_ids:
                pos = next((j for j, (a, b) in enumerate(zip(spec.token_ids, ref.token_ids)) if a != b),
                           min(len(spec.token_ids), len(ref.token_ids)))
                return False, (f"prompt {i} ({text!r}): {mode} output differs from target greedy at token "
                               f"{pos} ({spec.token_ids[pos:pos + 3]} vs {ref.token_ids[pos:pos + 3]})")
            accepted += spec.stats.accepted_tokens
            drafted += spec.stats.draft_tokens
        rate = accepted / drafted if drafted else 0.0
        rows = {"draft": lambda: engine.draft.output_token_ids, "medusa": lambda: engine.heads.output_token_ids,
                "eagle": lambda: engine.eagle.output_token_ids}[kind]()
        return True, (f"{len(prompts)} prompts x <= {max_tokens} tokens identical to target greedy; "
                      f"greedy acceptance {rate:.3f}; {what} output vocabulary "
                      f"{'full' if rows is None else f'{len(rows)} rows'}")

    return check
