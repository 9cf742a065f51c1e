"""Scheduled distillation: run a job on an interval and/or when enough new records arrived,
never two at once, and promote the result through the gate.

One job = (1) take the job lock (non-blocking: if another job holds it, this one is skipped);
(2) materialise the champion (the parent the adapter will be trained on); (3) call the injected
`distill(JobRequest) -> candidate dir` (the real one wraps training.job.run_distillation with
`ack="registered"`: the job acks nothing it trained on); (4) register the candidate; (5) ack its
records (`ack_records(candidate dir)`, training.job.ack_candidate_records); (6) run the gate
(deploy/gate.py, on its own held-out sample), which promotes it if it passes; (7) release the lock.
Where step (3) runs is the callable's business: `draftsmith distill` hands in a deploy.ray_jobs.DistillRunner,
which submits the job to Ray (the cluster serving uses, or RAY_ADDRESS) or runs it in this process. A
callable with `on_state` / `last_job` attributes (DistillRunner) has its job's state (runner, Ray job id,
state, log tail, duration) written to `distill-job.json` beside the status file on every change, and the
final one into the job's outcome (`draftsmith status` shows both).
A job that raises, a candidate that cannot be registered, or a process killed before step 5 acks
nothing and moves no alias: the champion is untouched, the buffer cursor (the data window's `last_id`
of the newest registered candidate) does not advance, and every record stays pending in the consumer
group for the next job (which re-claims them after `claim_idle_ms`). The lock is an `fcntl.flock` on a
file under the data dir, so the kernel releases it when the holding process dies.

Faults (issue 17). MLflow unreadable: the trigger check fails (`due` raises, nothing starts), a job
fails before registration (records pending), and promotion fails closed (`Registry.promote` raises).
A candidate registered by a job whose gate could not finish (MLflow or Redis failing mid-gate), or
whose accepted verdict met a pause, carries `draftsmith.gate_pending`; every tick gates it again
(`gate_pending`) once MLflow answers and promotions are not paused, so promotion resumes by itself. A
candidate short of held-out evidence is gated again only once the gate's sample has changed and holds
the gate's minimum of requests (`EvidenceSource.sample_key`: held-out requests and fresh ones, those that
ended after the candidate's job read the buffer), not on every tick.

**Watchdog** (`LiveWatchdog`, every tick before anything else): the champion's live acceptance over the
newest `window_s` of its logged intervals since it became champion (MLflow `draftsmith-live`: accepted /
drafted tokens per interval, a ratio estimate with its standard error over intervals, at least the
binomial one; a recent window, so a draft that breaks late is not averaged away) is compared with (a) its
gate figure (`gate_predicted_live_acceptance`, else `gate_expected_rate`, deploy/gate.py) and (b) the
previous version's live acceptance over the last `previous_window_s` of its own tenure. When the difference
to the previous version is significantly below -tolerance x its figure, or, where the previous version has
too little live evidence for (b), the one-sided upper bound at `confidence` is below (1 - tolerance) x the
gate figure, the champion is rolled back to `previous` exactly as `draftsmith rollback` does (promotions
paused), with the reason and figures recorded on the version (`draftsmith.rollback_reason`,
`draftsmith.rollback_details`), in the history and in `draftsmith status`. Before `min_draft_tokens` drafted
tokens over `min_intervals` intervals it waits. With no `previous` it records the finding on the version and
does nothing else. The gate figure is a prediction: the champion's live rate scaled by the gate's expected
rates, which assume the records' own draft lengths. The adaptive controller drafts longer chains for a better
draft, so its accepted / drafted rises less than that: in the forty-first session's online run version 2 of the
draft, +0.118 over version 1 at the gate, ran at a live 0.449 against version 1's 0.420 before it, but below
the predicted 0.631, and was rolled back minutes after its promotion, which paused learning
(docs/results/online-2026-12-01-fortyfirst-rollback/). So a champion that is not worse than the version it
replaced, measured the same way, stays.

**Canary** (issue 17; `canary_share` > 0, the CLI's default 0.25): a candidate that passes the gate is not
made champion at once; it becomes the `canary` (`Registry.start_canary`), which every replica loads beside
the champion and serves to that share of new requests (chosen by a hash of the request id, so both arms
see the same traffic mix in the same batches: serving/scheduler.py). Every tick the `CanaryJudge` compares
the two arms' live figures over the same window (both since the canary started, or since the champion
did if later), from MLflow `draftsmith-live` where each step is credited to the draft that proposed it:
acceptance (accepted / drafted tokens) and tokens/s (tokens / request wall time). Once both arms have
`min_draft_tokens` drafted tokens and `min_requests` requests and the canary has run `min_duration_s`, it
is promoted (`Registry.end_canary(promote=True)`: champion -> previous) unless it is significantly worse
(one-sided, `confidence`) than the champion less a tolerance (`tolerance` for acceptance,
`tps_tolerance` for tokens/s); a significantly worse canary is dropped as soon as the evidence minimum is
met, without waiting for `min_duration_s`. A canary that has not gathered enough evidence by `timeout_s`
is dropped (a canary is promoted only on evidence; the reason says which arm lacked it). While promotion
is paused a passing canary is held (it keeps its share) and dropped at the timeout. No distillation job
starts while a canary runs, unless the schedule pipelines (below). Reasons and figures go on the version (`draftsmith.canary_*` tags, `canary_*`
metrics), into the history, `canary-status.json` and `draftsmith status`.

**Pipelining** (`ScheduleConfig.pipeline`, `draftsmith distill --pipeline`; issue 15's job latency): a job
that is due while a canary runs starts at once, trained from the canary (its parent) on the records after
the canary's window, while the scheduler goes on judging the canary every `poll_s` in its own thread. When
the job ends, the candidate waits for the canary's decision: promoted (the parent is now the champion)
-> the candidate is registered, acked and gated as usual; dropped -> the candidate is discarded unregistered
(outcome "discarded"), its records stay pending for the next job, which trains from the champion. A
learning loop then runs a job and a canary at once instead of one after the other.

Triggers (`ScheduleConfig`):
- `every_s` only: a job each `every_s` seconds (the first one `every_s` after start);
- `min_records` only: a job as soon as `pending_records(cursor) >= min_records` (polled every `poll_s`);
- both: once `every_s` has passed since the last job, a job as soon as enough records are pending.
- `drift` (a `DriftPolicy`, `draftsmith distill --drift`; with `every_s`): a job may start before the interval
  ends when the champion's live acceptance over its newest `window_s` of logged intervals (MLflow
  `draftsmith-live`, the watchdog's `live_figure`) is significantly below its reference, less `tolerance`
  (`drift_reference`, the first with the evidence): its own live figure over its earlier tenure; else the
  previous version's over the last `previous_window_s` of its tenure; else its gate figure
  (`gate_predicted_live_acceptance`, else `gate_expected_rate`). Both standard errors count where the
  reference is live. The gate figure comes last for the reason the watchdog gives (below): it assumes the
  records' draft lengths, the controller drafts further for a better draft, so a champion runs below it
  without any drift. Traffic that the champion serves worse than it did, or than its predecessor did, is
  new traffic to learn from, so it is learnt from sooner; the watchdog (below), which judges the same
  figure at a far stricter level and checks offline before acting, is not replaced by it. Still needed:
  `min_records` pending records when set, at least `min_gap_s` since the last job, `min_draft_tokens` drafted
  tokens over `min_intervals` intervals in the window. The champion's live figure is per version, over all
  traffic: a category that drifts shows there in proportion to its share (serving has no category label).
- `job_share` (`draftsmith distill --job-share`, by default 0.5 beside a local `draftsmith serve`, else 1): after
  a job that took D seconds with its gate, no job starts for D x (1/share - 1) seconds, whatever the other
  triggers say (`rest_after_job`), so jobs take at most that share of the machine's time. The heads' schedule
  (deploy/heads.py) rests the same way.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import shutil
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Callable

from buffer.paths import data_dir
from deploy.gate import GatePolicy, GateVerdict, SmokeCheck, fresh_cut, run_gate, start_canary_after_gate
from deploy.registry import CANDIDATE, PREVIOUS, TAG, PromotionsPaused, Registry, RegistryError

GATE_PENDING_TAG = TAG + "gate_pending"

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- the lock
class JobLock:
    """An exclusive, non-blocking lock on `path` (fcntl.flock): one distillation job at a time across
    threads and processes on this machine. The file also holds the holder's pid/host/start time."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path else data_dir() / "distill.lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """True if taken now, False if another holder has it."""
        if self._fd is not None:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> dict | None:
        """{"pid", "host", "since"} of the current holder, or None when nobody holds the lock."""
        if self._fd is not None:
            return {"pid": os.getpid(), "host": socket.gethostname(), "since": None, "self": True}
        if not self.path.exists():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                try:
                    return json.loads(os.pread(fd, 4096, 0) or b"{}")
                except json.JSONDecodeError:
                    return {}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def __enter__(self) -> "JobLock":
        if not self.acquire():
            raise RegistryError(f"another distillation job holds {self.path} ({self.holder()})")
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------- job + schedule
@dataclass
class JobRequest:
    """What a distillation job is asked to do: train an adapter on `parent_path` (registry version
    `parent_version`, the champion) from buffer records after `since_id` (None: from the start)."""

    parent_version: str
    parent_path: Path
    target: str
    since_id: str | None = None
    target_sha256: str | None = None      # the served target's fingerprint, written into candidate.json


DistillFn = Callable[[JobRequest], "str | os.PathLike"]
PendingFn = Callable[["str | None"], int]
AckFn = Callable[[Path], int]


@dataclass
class JobOutcome:
    status: str    # "promoted" | "canary" | "rejected" | "held" (accepted, paused) | "failed" | "skipped" | "discarded"
    message: str
    version: str | None = None       # registered candidate version (None if none was registered)
    parent_version: str | None = None
    verdict: dict | None = None
    started: float = 0.0
    seconds: float = 0.0
    job: dict | None = None          # where and how the job ran (runner, Ray job id, state, log tail): ray_jobs.py

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DriftPolicy:
    """When live acceptance has drifted far enough to start a job early (module docstring, "Triggers")."""

    window_s: float = 300.0
    tolerance: float = 0.05
    confidence: float = 0.9
    min_draft_tokens: int = 500
    min_intervals: int = 2
    min_gap_s: float = 60.0
    previous_window_s: float = 3600.0

    def __post_init__(self) -> None:
        if not (self.window_s > 0) or not (self.min_gap_s >= 0) or not (self.previous_window_s > 0):
            raise ValueError(f"drift window and previous window must be > 0 and min gap >= 0, got "
                             f"{self.window_s!r}, {self.previous_window_s!r}, {self.min_gap_s!r}")
        if not (0.0 <= self.tolerance < 1.0):
            raise ValueError(f"drift tolerance must be in [0, 1), got {self.tolerance!r}")
        if not (0.5 <= self.confidence < 1.0):
            raise ValueError(f"drift confidence must be in [0.5, 1), got {self.confidence!r}")
        if self.min_draft_tokens < 1 or self.min_intervals < 1:
            raise ValueError("drift min_draft_tokens and min_intervals must be >= 1")


@dataclass
class ScheduleConfig:
    every_s: float | None = None
    min_records: int | None = None
    poll_s: float = 10.0
    drift: DriftPolicy | None = None
    pipeline: bool = False     # a job may start while a canary runs, trained from it (module docstring, "Pipelining")
    job_share: float = 1.0     # the largest share of wall-clock time jobs may take (`rest_after_job`)

    def __post_init__(self) -> None:
        if self.every_s is None and self.min_records is None:
            raise ValueError("a schedule needs --every and/or --min-records")
        check_job_share(self.job_share)
        if self.every_s is not None and not (self.every_s > 0):
            raise ValueError(f"--every must be a positive duration, got {self.every_s!r}")
        if self.min_records is not None and (isinstance(self.min_records, bool) or not isinstance(self.min_records, int)
                                             or self.min_records < 1):
            raise ValueError(f"--min-records must be an integer >= 1, got {self.min_records!r}")
        if not (self.poll_s > 0):
            raise ValueError(f"poll interval must be > 0, got {self.poll_s!r}")
        if self.drift is not None and self.every_s is None:
            raise ValueError("--drift brings an interval's job forward: it needs --every")


def check_job_share(share: float) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0.0 < share <= 1.0):
        raise ValueError(f"--job-share must be a fraction in (0, 1], got {share!r}")
    return float(share)


def rest_after_job(seconds: float, share: float) -> float:
    """How long a schedule rests after a job (with its gate) that took `seconds`, so that jobs take at most `share`
    of the wall-clock time (`draftsmith distill --job-share`): seconds x (1/share - 1), 0 at share 1. Beside serving
    on the same CPUs a job slows every request while it runs (docs/benchmarks.md, "The twenty-sixth session": SQL
    steps 131 -> 203 ms once jobs ran back to back), so the rest is what keeps the speed the jobs bought. It is
    counted from the job's end, so it follows the job's real length; `every_s` still counts from its start."""
    check_job_share(share)
    return max(0.0, float(seconds)) * (1.0 / share - 1.0)


def drift_reason(registry, pol: DriftPolicy, since_last_job_s: float) -> str | None:
    """Why `registry`'s champion's live acceptance has drifted (module docstring, "Triggers"), or None: the
    draft's scheduler (`DistillScheduler.drift`) and the heads' (deploy/heads.py `run_heads_schedule`) start
    a job early on it."""
    if since_last_job_s < pol.min_gap_s:
        return None
    reg = registry
    champ = reg.champion()
    if champ is None:
        return None
    info = reg.get(champ)
    since = reg.champion_since_ms(info)
    intervals = [it for it in reg.live_intervals(champ, since_ms=since) if it.get("draft_tokens")]
    recent = live_figure(intervals, pol.window_s)
    if not recent.enough(pol):         # the watchdog's evidence rule, on the drift policy's minimums
        return None
    ref = drift_reference(reg, champ, info, since, intervals, pol)
    if ref is None:
        return None
    what, value, se = ref
    z = NormalDist().inv_cdf(pol.confidence)
    if recent.rate - value * (1 - pol.tolerance) + z * math.hypot(recent.se, se) >= 0:
        return None
    return (f"drift: version {champ}'s live acceptance {recent.rate:.3f} +- {recent.se:.3f} over the last "
            f"{pol.window_s:.0f} s is significantly below {what} less {pol.tolerance:.0%}")


def drift_reference(reg, champ: str, info, since_ms: int | None, intervals: list[dict],
                    pol: DriftPolicy) -> tuple[str, float, float] | None:
    """What the champion's recent live acceptance is held against (module docstring, "Triggers"): (words,
    figure, its standard error), the first of these that has the evidence: the champion's own live figure
    before the recent window; the previous version's over the last `previous_window_s` of its tenure; the
    champion's gate figure (a prediction: standard error 0). None when none has."""
    newest = max(it["time_ms"] for it in intervals)
    base = live_figure([it for it in intervals if it["time_ms"] < newest - pol.window_s * 1000])
    if base.rate is not None and base.drafted >= pol.min_draft_tokens:
        return f"its own earlier live figure {base.rate:.3f}", base.rate, base.se
    prev = reg.alias(PREVIOUS)
    if prev is not None and prev != champ and since_ms is not None:
        pf = previous_live_figure(reg, prev, since_ms, pol.previous_window_s)
        if pf.enough(pol):
            return f"version {prev}'s live figure {pf.rate:.3f} before it was replaced", pf.rate, pf.se
    ref = info.metrics.get("gate_predicted_live_acceptance", info.metrics.get("gate_expected_rate"))
    if ref is not None:
        return f"its gate figure {ref:.3f}", float(ref), 0.0
    return None


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '1.5h' -> seconds; ValueError with the accepted forms otherwise."""
    s = str(text).strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    mult = 1.0
    if s and s[-1] in units:
        mult, s = units[s[-1]], s[:-1]
    try:
        val = float(s) * mult
    except ValueError:
        raise ValueError(f"cannot read duration {text!r}; use e.g. 90s, 10m or 2h") from None
    if not (val > 0):
        raise ValueError(f"duration must be positive, got {text!r}")
    return val


class DistillScheduler:
    """Runs distillation jobs (see the module docstring). All collaborators are injected.

    evidence: the gate's EvidenceSource (deploy/gate.py); target_sha256: the served target's fingerprint
    (candidates are pinned to it; default: the registry target's); ack_records: acks a registered
    candidate's records (None: the job acked them itself); watchdog: a LiveWatchdog run every tick."""

    def __init__(self, registry: Registry, distill: DistillFn, *, smoke_check: SmokeCheck | None,
                 policy: GatePolicy | None = None, lock: JobLock | None = None,
                 schedule: ScheduleConfig | None = None, pending_records: PendingFn | None = None,
                 status_path: str | os.PathLike | None = None, clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[str], None] = print, evidence=None, target_sha256: str | None = None,
                 ack_records: AckFn | None = None, watchdog: "LiveWatchdog | None" = None,
                 canary_share: float = 0.0, canary: "CanaryJudge | None" = None,
                 evidence_wait_s: float = 1800.0) -> None:
        if schedule is not None and schedule.min_records is not None and pending_records is None:
            raise ValueError("--min-records needs a way to count pending records (pending_records)")
        self.registry = registry
        self.distill = distill
        self.smoke_check = smoke_check
        self.policy = policy or GatePolicy()
        self.lock = lock or JobLock()
        self.schedule = schedule
        self.pending_records = pending_records
        self.status_path = Path(status_path) if status_path else self.lock.path.with_name("distill-status.json")
        self.job_status_path = self.status_path.with_name("distill-job.json")
        if getattr(distill, "on_state", False) is None:
            distill.on_state = self.record_job        # a DistillRunner reports its job's state changes here
        self.clock = clock
        self.progress = progress
        self.evidence = evidence
        self.target_sha256 = target_sha256
        self.ack_records = ack_records
        self.watchdog = watchdog
        if not (0.0 <= canary_share < 1.0):
            raise ValueError(f"canary share must be in [0, 1), got {canary_share!r} (0: promote directly)")
        self.canary_share = float(canary_share)
        self.canary = canary if canary is not None or not canary_share else CanaryJudge(registry, progress=progress)
        if evidence_wait_s < 0:
            raise ValueError(f"evidence_wait_s must be >= 0, got {evidence_wait_s!r}")
        self.evidence_wait_s = float(evidence_wait_s)
        self._started = clock()
        self._last_job: float | None = None
        self._rest_until: float | None = None           # no job before this (ScheduleConfig.job_share)
        self._evidence_keys: dict[str, tuple] = {}      # waiting candidate -> its last gate's sample_key()

    # ------------------------------------------------------------------ one job
    def cursor(self) -> str | None:
        window = self.registry.last_data_window()
        last = (window or {}).get("last_id")
        return None if last in (None, "") else str(last)

    def run_job(self) -> JobOutcome:
        """One distillation job now (skipped if another job holds the lock); never raises for job errors."""
        t0 = time.time()
        if not self.lock.acquire():
            out = JobOutcome("skipped", f"another distillation job is running ({self.lock.holder()})", started=t0)
            self.progress(f"[distill] {out.message}")
            return out
        self._last_job = self.clock()
        try:
            out = self._job(t0)
        finally:
            self.lock.release()
            if self.schedule is not None and self.schedule.job_share < 1.0:
                rest = rest_after_job(self.clock() - self._last_job, self.schedule.job_share)
                self._rest_until = self.clock() + rest
        out.seconds = round(time.time() - t0, 3)
        self._write_status(out)
        self.progress(f"[distill] {out.status}: {out.message}")
        return out

    def _gate(self, version: str) -> GateVerdict:
        """The gate; a pass is promoted directly (canary_share 0, or no champion yet) or starts a canary
        (module docstring, "Canary"; a pause holds it like a promotion: gated again after resume)."""
        canary = self.canary_share > 0 and self.registry.champion() is not None
        verdict = run_gate(self.registry, version, self.smoke_check, policy=self.policy, evidence=self.evidence,
                           target_sha256=self.target_sha256, promote=not canary)
        if canary and verdict.accepted and verdict.candidate_version != verdict.champion_version:
            try:
                move = start_canary_after_gate(self.registry, verdict, self.canary_share)
                verdict.promotion = f"canary: {move.message}"
            except PromotionsPaused as e:
                verdict.promotion = f"paused: {e}"
            self.registry.set_version_tags(version, {"draftsmith.gate.promotion": verdict.promotion})
        return verdict

    @staticmethod
    def _verdict_outcome(verdict: GateVerdict, version: str, parent: str | None, t0: float,
                         note: str = "") -> JobOutcome:
        status = "promoted" if verdict.promoted else ("held" if verdict.accepted else "rejected")
        if status == "held" and verdict.promotion.startswith("canary"):
            status = "canary"
        waiting = status == "rejected" and verdict.insufficient
        if waiting:
            status = "held"
        msg = (f"version {version} " + ("waits for held-out evidence, gated again on later ticks" if waiting else
               {"promoted": "promoted to champion", "held": "passed the gate but was not "
               "promoted", "rejected": "not promoted", "canary": "passed the gate and serves as the canary"}[status])
               + f": {verdict.reason}"
               + (f" ({verdict.promotion})" if verdict.promotion else "") + note)
        return JobOutcome(status, msg, version=version, parent_version=parent, verdict=verdict.to_dict(), started=t0)

    def _job(self, t0: float) -> JobOutcome:
        try:
            champion = self.registry.champion()
        except Exception as e:  # noqa: BLE001 - MLflow unreadable: fail closed, start nothing
            return JobOutcome("failed", f"cannot read the champion ({e}); no job started, records left pending",
                              started=t0)
        if champion is None:
            return JobOutcome("failed", "no champion draft to distill from: run `draftsmith bootstrap` first",
                              started=t0)
        called, canary = False, None
        try:
            canary = self._pipelined_canary()
            parent = canary or champion
            parent_path = self.registry.materialize(parent)
            request = JobRequest(parent, parent_path, self.registry.target, self.cursor(), self.target_sha256)
            self.progress(f"[distill] job started from {'canary' if canary else 'champion'} version {parent} "
                          f"(records after {request.since_id or 'the start'})")
            called = True
            cand_dir = Path(self._judging_while(lambda: self.distill(request)) if canary else self.distill(request))
        except Exception as e:  # noqa: BLE001 - a failed job must leave everything as it was
            log.error("distillation job failed:\n%s", traceback.format_exc())
            return JobOutcome("failed", f"distillation failed ({type(e).__name__}: {e}); champion {champion} "
                                        "untouched, records left pending", parent_version=canary or champion,
                              started=t0, job=self._job_state() if called else None)
        job = self._job_state()
        if canary is not None:
            fate = self._await_canary(canary)
            if fate != "promoted":
                return JobOutcome("discarded", f"this job trained from canary version {canary}, which was {fate}; "
                                               f"its candidate {cand_dir} is {self._discard(cand_dir)} and its "
                                               "records stay pending for the next job", parent_version=canary,
                                  started=t0, job=job)
        try:
            version = self.registry.register_candidate(cand_dir, target_sha256=self.target_sha256,
                                                       tags={GATE_PENDING_TAG: "scheduler"})
        except Exception as e:  # noqa: BLE001
            return JobOutcome("failed", f"could not register candidate {cand_dir} ({e}); champion {champion} "
                                        "untouched, records left pending", parent_version=champion, started=t0,
                              job=job)
        note = self._ack(cand_dir, version)
        try:
            verdict = self._gate(version)
        except Exception as e:  # noqa: BLE001 - e.g. MLflow or Redis down mid-gate: gated again later
            log.error("gate of version %s failed:\n%s", version, traceback.format_exc())
            return JobOutcome("failed", f"gate/promotion of version {version} could not run ({type(e).__name__}: "
                                        f"{e}); champion unchanged, the gate runs again on a later tick" + note,
                              version=version, parent_version=champion, started=t0, job=job)
        out = self._verdict_outcome(verdict, version, champion, t0, note)
        out.job = job
        return out

    # ------------------------------------------------------------------ pipelining
    def _judge_canary(self) -> None:
        """The watchdog, then the canary's judge: every tick, and every poll while a pipelined job runs or
        its candidate awaits its parent's decision (a bad champion is rolled back meanwhile too)."""
        if self.watchdog is not None:
            try:
                self.watchdog.check()
            except Exception as e:  # noqa: BLE001 - e.g. MLflow down: no action
                log.warning("[watchdog] %s", e)
        if self.canary is not None:
            try:
                self.canary.check()
            except Exception as e:  # noqa: BLE001 - e.g. MLflow down: no decision
                log.warning("[canary] %s", e)

    def _pipelined_canary(self) -> str | None:
        """The running canary's version when a pipelined job is to train from it (module docstring)."""
        if self.schedule is None or not self.schedule.pipeline or self.canary is None:
            return None
        c = self.registry.canary()
        return None if c is None else str(c["version"])

    def _judging_while(self, fn: Callable[[], "str | os.PathLike"]) -> "str | os.PathLike":
        """fn() (a job) in a worker thread while this thread goes on judging the canary every poll_s."""
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the scheduler's thread
                box["error"] = e

        worker = threading.Thread(target=run, name="distill-job", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(self.schedule.poll_s)
            if worker.is_alive():
                self._judge_canary()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _discard(self, cand_dir: Path) -> str:
        """Delete a discarded candidate's folder (never registered, so retention would keep it forever);
        only a folder under the registry's candidates root. Says what became of it."""
        try:
            inside = cand_dir.resolve().is_relative_to(self.registry.candidates_root.resolve())
        except OSError:
            inside = False
        if not inside:
            return "not registered (left in place: not under the candidates folder)"
        shutil.rmtree(cand_dir, ignore_errors=True)
        return "deleted unregistered" if not cand_dir.exists() else "not registered (could not be deleted)"

    def _await_canary(self, version: str) -> str:
        """Judge canary `version` every poll_s until it is decided (the judge's own timeout bounds this; a
        registry that stays unreadable for as long gives up); "promoted" or what became of it otherwise."""
        limit = time.monotonic() + (self.canary.policy.timeout_s if self.canary is not None else 0) + 600
        announced = False
        while True:
            try:
                c = self.registry.canary()
                if c is None or str(c["version"]) != version:
                    return "promoted" if self.registry.champion() == version else "not promoted (dropped)"
            except Exception as e:  # noqa: BLE001 - MLflow down: wait for it, within the limit
                log.warning("[distill] cannot read the canary (%s)", e)
            if time.monotonic() > limit:
                return "still undecided when the wait ran out"
            if not announced:
                self.progress(f"[distill] the job is done; its parent, canary version {version}, is still being "
                              "judged: the candidate waits for that decision")
                announced = True
            self._judge_canary()
            time.sleep(self.schedule.poll_s)

    def record_job(self, info: dict) -> None:
        """Write a running job's state (deploy/ray_jobs.py `job_info`) to `distill-job.json`."""
        write_job_status(info, self.job_status_path)

    def _job_state(self) -> dict | None:
        """The distill callable's final job state (None for a callable that keeps none)."""
        info = getattr(self.distill, "last_job", None)
        return dict(info) if isinstance(info, dict) else None

    def _ack(self, cand_dir: Path, version: str) -> str:
        """Ack a registered candidate's records; a note for the outcome message."""
        if self.ack_records is None:
            return ""
        try:
            n = self.ack_records(cand_dir)
        except Exception as e:  # noqa: BLE001 - Redis down: they stay pending, a later job re-claims them
            log.warning("records of candidate %s not acked (%s); a later job re-claims them", version, e)
            return f"; its records could not be acked ({e}) and stay pending"
        return f"; {n} records acked"

    def gate_pending(self) -> JobOutcome | None:
        """Gate again the `candidate` version a scheduled job registered whose gate never finished, or which
        passed while promotions were paused (module docstring, "Faults"); None when there is none, while
        paused, or while a job holds the lock."""
        cand = self.registry.alias(CANDIDATE)
        if cand is None:
            return None
        info = self.registry.get(cand)
        verdict = info.tags.get("draftsmith.gate.verdict")
        held = verdict == "accepted" and info.tags.get("draftsmith.gate.promotion", "-").startswith("paused")
        waiting = self._awaits_evidence(info)
        if info.tags.get(GATE_PENDING_TAG) != "scheduler" or not (verdict is None or held or waiting):
            return None
        if self.registry.promotions_paused():
            return None
        if waiting and not self._evidence_changed(cand):
            return None
        if not self.lock.acquire():
            return None
        t0 = time.time()
        try:
            self.progress(f"[distill] gating version {cand} again "
                          + ("(it waits for held-out evidence)" if waiting else "(its gate did not finish before)"))
            out = self._verdict_outcome(self._gate(cand), cand, info.parent_version, t0)
        finally:
            self.lock.release()
        out.seconds = round(time.time() - t0, 3)
        self._write_status(out)
        self.progress(f"[distill] {out.status}: {out.message}")
        return out

    def _evidence_changed(self, version: str) -> bool:
        """Whether the gate's sample (held-out requests, and the fresh ones after `version`'s cut: deploy/gate.py
        "Fresh evidence") changed since candidate `version` was last gated again short of it, and now holds the
        gate's minimum of requests (`EvidenceSource.sample_key`); gating it on the same sample, or on one still
        too small, would score both drafts again, on the cores serving uses, for the same verdict. True when
        the evidence source cannot tell."""
        key_fn = getattr(self.evidence, "sample_key", None)
        if key_fn is None:
            return True
        try:
            key = key_fn(fresh_after=fresh_cut(self.registry, version))
        except Exception as e:  # noqa: BLE001 - e.g. Redis down: let the gate run and report it
            log.warning("[distill] cannot read the gate's sample size: %s", e)
            return True
        if self._evidence_keys.get(version) == key or key[0] < self.policy.min_requests:
            return False            # the same sample, or one still too small to judge: no scoring
        self._evidence_keys[version] = key
        return True

    def _awaits_evidence(self, info) -> bool:
        """A candidate rejected only because the gate's held-out sample was too small (not because it was
        worse), trained from the current champion, registered less than `evidence_wait_s` ago: it is gated
        again every tick as held-out traffic arrives, and no new job starts meanwhile (a new job would
        train from the champion again on newer records only, so what this one learnt would be lost)."""
        if info.tags.get("draftsmith.gate.verdict") != "rejected" or info.tags.get("draftsmith.gate.insufficient") != "1":
            return False
        if info.parent_version != self.registry.champion():
            return False
        return time.time() - info.created_ms / 1000.0 < self.evidence_wait_s

    def waiting_candidate(self) -> str | None:
        """The `candidate` version that waits for held-out evidence (see `_awaits_evidence`), if any."""
        cand = self.registry.alias(CANDIDATE)
        if cand is None:
            return None
        info = self.registry.get(cand)
        return cand if info.tags.get(GATE_PENDING_TAG) == "scheduler" and self._awaits_evidence(info) else None

    def _write_status(self, out: JobOutcome) -> None:
        try:
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"time": time.time(), **out.to_dict()}, default=str, indent=1))
            os.replace(tmp, self.status_path)
        except OSError as e:
            log.warning("could not write %s: %s", self.status_path, e)

    # ------------------------------------------------------------------ the schedule
    def due(self) -> tuple[bool, str]:
        """Whether a job should start now, and why (or why not). Raises when MLflow cannot be read
        (RegistryUnavailable): an unreadable pause is not "not paused"."""
        if self.schedule is None:
            return True, "no schedule: run now"
        paused = self.registry.promotions_paused()
        if paused:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(paused.get("time", 0)))
            return False, f"paused since {when} ({paused.get('reason')}); `draftsmith resume` to continue"
        canary = self.registry.canary() if self.canary is not None else None
        if canary is not None and not self.schedule.pipeline:
            return False, f"canary version {canary['version']} is being judged; the next job waits for its decision"
        waiting = self.waiting_candidate()
        if waiting is not None:
            return False, (f"candidate version {waiting} waits for held-out evidence (at most "
                           f"{self.evidence_wait_s:.0f} s after registration); the next job waits for its verdict")
        now = self.clock()
        sch = self.schedule
        if self._rest_until is not None and now < self._rest_until:
            return False, (f"resting {self._rest_until - now:.0f} s more after the last job: jobs take at most "
                           f"{sch.job_share:.0%} of the time (--job-share)")
        early = None
        if sch.every_s is not None:
            since = now - (self._last_job if self._last_job is not None else self._started)
            if since < sch.every_s:
                early = self.drift(since) if sch.drift is not None else None
                if early is None:
                    return False, f"next interval in {sch.every_s - since:.0f} s"
        if sch.min_records is not None:
            n = int(self.pending_records(self.cursor()))
            if n < sch.min_records:
                return False, f"{n} new records, waiting for {sch.min_records}" + (f" ({early})" if early else "")
            return True, f"{n} new records >= {sch.min_records}" + (f"; {early}" if early else "")
        return True, early or "interval elapsed"

    def drift(self, since_last_job_s: float) -> str | None:
        """Why the champion's live acceptance has drifted (module docstring, "Triggers"), or None."""
        return drift_reason(self.registry, self.schedule.drift, since_last_job_s)

    def tick(self) -> JobOutcome | None:
        """One pass of the schedule: the watchdog, a pending gate, then a job when due; returns the job's
        outcome (None when no job ran). Never raises."""
        self._judge_canary()
        try:
            self.gate_pending()
        except Exception as e:  # noqa: BLE001
            log.warning("[distill] pending gate not run: %s", e)
        try:
            ok, why = self.due()
        except Exception as e:  # noqa: BLE001 - e.g. Redis or MLflow briefly unreachable
            ok, why = False, f"cannot check the trigger ({e})"
            log.warning("[distill] %s", why)
        if not ok:
            return None
        self.progress(f"[distill] due: {why}")
        return self.run_job()

    def run_forever(self, stop: threading.Event | None = None, *, max_jobs: int | None = None) -> list[JobOutcome]:
        """`tick()` every `poll_s` (or sooner when an interval ends) until `stop` is set or `max_jobs`
        jobs have run; returns the job outcomes."""
        if self.schedule is None:
            raise ValueError("run_forever needs a ScheduleConfig")
        stop = stop or threading.Event()
        outcomes: list[JobOutcome] = []
        while not stop.is_set():
            out = self.tick()
            if out is not None:
                outcomes.append(out)
                if max_jobs is not None and len(outcomes) >= max_jobs:
                    break
            wait = self.schedule.poll_s
            if self.schedule.every_s is not None and self.schedule.min_records is None:
                ref = self._last_job if self._last_job is not None else self._started
                wait = max(0.01, min(wait, max(ref + self.schedule.every_s, self._rest_until or 0.0) - self.clock()))
            stop.wait(wait)
        return outcomes


# ---------------------------------------------------------------------------------- the watchdog
@dataclass
class WatchdogPolicy:
    """confidence: one-sided level of the tests; tolerance: relative drop below a baseline that is
    tolerated (traffic drifts); min_draft_tokens / min_intervals: live evidence needed before judging;
    window_s: the champion is judged on its newest intervals within this many seconds of the last one;
    previous_window_s: how much of the previous version's tenure (its last seconds) is its baseline."""

    confidence: float = 0.99
    tolerance: float = 0.10
    min_draft_tokens: int = 2000
    min_intervals: int = 3
    window_s: float = 900.0
    previous_window_s: float = 3600.0
    compare_gate: bool = True
    compare_previous: bool = True

    def __post_init__(self) -> None:
        if not (0.5 <= self.confidence < 1.0):
            raise ValueError(f"watchdog confidence must be in [0.5, 1), got {self.confidence!r}")
        if not (0.0 <= self.tolerance < 1.0):
            raise ValueError(f"watchdog tolerance must be in [0, 1), got {self.tolerance!r}")
        if self.min_draft_tokens < 1 or self.min_intervals < 1 or not (self.previous_window_s > 0) \
                or not (self.window_s > 0):
            raise ValueError("min_draft_tokens and min_intervals must be >= 1, window_s and previous_window_s > 0")


@dataclass
class LiveFigure:
    rate: float | None
    se: float
    drafted: float
    intervals: int

    def enough(self, policy: "WatchdogPolicy | DriftPolicy") -> bool:
        return self.rate is not None and self.drafted >= policy.min_draft_tokens \
            and self.intervals >= policy.min_intervals


def live_figure(intervals: list[dict], window_s: float | None = None) -> LiveFigure:
    """Ratio estimate accepted / drafted over logged intervals (only those within `window_s` of the newest,
    when given), with its standard error: the larger of the between-interval (cluster) estimate and the
    binomial one. Intervals without draft_tokens are skipped."""
    intervals = [it for it in intervals if it.get("draft_tokens")]
    if window_s is not None and intervals:
        newest = max(it["time_ms"] for it in intervals)
        intervals = [it for it in intervals if it["time_ms"] >= newest - window_s * 1000]
    pts = [(it.get("accepted_tokens", it["acceptance_rate"] * it["draft_tokens"]), it["draft_tokens"])
           for it in intervals]
    D = sum(d for _, d in pts)
    if not pts or D <= 0:
        return LiveFigure(None, math.inf, 0.0, 0)
    A = sum(a for a, _ in pts)
    r = A / D
    n = len(pts)
    se_cluster = math.sqrt(n / (n - 1) * sum((a - r * d) ** 2 for a, d in pts)) / D if n > 1 else math.inf
    se_binom = math.sqrt(max(r * (1 - r), 1e-12) / D)
    return LiveFigure(r, max(se_cluster, se_binom) if n > 1 else se_binom, D, n)


def previous_live_figure(reg, prev: str, since_ms: int, window_s: float) -> "LiveFigure":
    """The previous version `prev`'s live figure over the last `window_s` of its tenure, which ended when the
    champion took over at `since_ms`: the baseline of the watchdog and of the drift trigger."""
    return live_figure(reg.live_intervals(prev, since_ms=since_ms - int(window_s * 1000), until_ms=since_ms))


@dataclass
class WatchdogVerdict:
    action: str                        # "none" | "waiting" | "ok" | "rolled back" | "degraded"
    message: str
    version: str | None = None
    live: float | None = None
    live_se: float | None = None
    drafted: float = 0.0
    gate_figure: float | None = None
    previous_version: str | None = None
    previous_live: float | None = None
    rolled_back_to: str | None = None
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


class LiveWatchdog:
    """Rolls back a champion whose live acceptance falls significantly below its gate figure or below the
    previous version's (module docstring, "Watchdog")."""

    def __init__(self, registry: Registry, policy: WatchdogPolicy | None = None, *,
                 status_path: str | os.PathLike | None = None, progress: Callable[[str], None] = print,
                 evidence=None, recheck_s: float = 300.0, min_requests: int = 20) -> None:
        self.registry = registry
        self.policy = policy or WatchdogPolicy()
        self.status_path = Path(status_path) if status_path else data_dir() / "watchdog-status.json"
        self.progress = progress
        self._flagged: set[str] = set()
        # the offline check before a rollback (`_offline_check`): the gate's evidence source (or any
        # callable (previous folder, champion folder) -> PairedEvidence), how long a "the traffic, not
        # the draft" finding stands before it is checked again, and the sample it needs
        self.evidence = evidence
        self.recheck_s = float(recheck_s)
        self.min_requests = int(min_requests)
        self._traffic_until: dict[str, float] = {}

    def check(self) -> WatchdogVerdict:
        """One look at the champion; MLflow errors propagate (no action is taken on an unreadable state)."""
        v = self._check()
        try:
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(v.to_dict(), default=str, indent=1))
            os.replace(tmp, self.status_path)
        except OSError as e:
            log.warning("could not write %s: %s", self.status_path, e)
        if v.action in ("rolled back", "degraded"):
            self.progress(f"[watchdog] {v.action}: {v.message}")
        return v

    def _check(self) -> WatchdogVerdict:
        reg, pol = self.registry, self.policy
        champ = reg.champion()
        if champ is None:
            return WatchdogVerdict("none", "no champion")
        info = reg.get(champ)
        since = reg.champion_since_ms(info)
        live = live_figure(reg.live_intervals(champ, since_ms=since), pol.window_s)
        out = WatchdogVerdict("waiting", "", champ, live.rate, live.se if math.isfinite(live.se) else None,
                              live.drafted)
        if not live.enough(pol):
            out.message = (f"version {champ}: {live.drafted:.0f} drafted tokens over {live.intervals} live intervals "
                           f"since it became champion; judging from {pol.min_draft_tokens} over {pol.min_intervals}")
            return out
        z = NormalDist().inv_cdf(pol.confidence)
        upper = live.rate + z * live.se
        reasons = []
        details = {"live_acceptance": live.rate, "live_se": live.se, "drafted_tokens": live.drafted,
                   "intervals": live.intervals, "confidence": pol.confidence, "tolerance": pol.tolerance}
        prev = reg.alias(PREVIOUS)
        out.previous_version = prev
        compared = False                 # the like-for-like comparison with the previous version could be made
        if pol.compare_previous and prev is not None and since is not None:
            pf = previous_live_figure(reg, prev, since, pol.previous_window_s)
            out.previous_live = pf.rate
            if pf.enough(pol):
                compared = True
                details.update(previous_version=prev, previous_live_acceptance=pf.rate, previous_se=pf.se)
                diff = live.rate - pf.rate * (1 - pol.tolerance)
                if diff + z * math.hypot(live.se, pf.se) < 0:
                    reasons.append(f"live acceptance {live.rate:.3f} is significantly below version {prev}'s "
                                   f"{pf.rate:.3f} (less {pol.tolerance:.0%}) before it was replaced")
        if pol.compare_gate:
            fig = info.metrics.get("gate_predicted_live_acceptance", info.metrics.get("gate_expected_rate"))
            out.gate_figure = fig
            if fig is not None:
                details["gate_figure"] = fig
                bar = fig * (1 - pol.tolerance)
                # a prediction, not a like-for-like figure: it decides only where the previous version's live
                # figure cannot (module docstring, "Watchdog")
                if upper < bar and not compared:
                    reasons.append(f"live acceptance {live.rate:.3f} (upper bound {upper:.3f} at {pol.confidence:g}) "
                                   f"is significantly below its gate figure {fig:.3f} less {pol.tolerance:.0%}")
        if not reasons:
            out.action = "ok"
            out.message = f"version {champ}: live acceptance {live.rate:.3f} +- {live.se:.3f} is not significantly low"
            return out
        reason = "; ".join(reasons)
        if prev is not None and self.evidence is not None:
            if time.time() < self._traffic_until.get(champ, 0.0):
                out.action = "ok"
                out.message = (f"version {champ}: {reason}; attributed to the traffic by the last offline check "
                               "(checked again later)")
                return out
            verdict, note, figures = self._offline_check(champ, prev)
            details["offline_check"] = figures
            if verdict == "traffic":
                self._traffic_until[champ] = time.time() + self.recheck_s
                out.action = "ok"
                out.message = f"version {champ}: {reason}; but {note}: the traffic changed, not the draft; no rollback"
                reg.record_event({"action": "watchdog", "version": champ, "reason": out.message, "details": details})
                self.progress(f"[watchdog] {out.message}")
                return out
            reason = f"{reason}; {note}"
        if prev is None:
            out.action = "degraded"
            out.message = f"version {champ}: {reason}; no previous version to roll back to"
            if champ not in self._flagged:
                reg.set_version_tags(champ, {TAG + "watchdog": out.message})
                reg.record_event({"action": "watchdog", "version": champ, "reason": out.message, "details": details})
                self._flagged.add(champ)
            log.error("[watchdog] %s", out.message)
            return out
        move = reg.rollback(reason=f"automatic rollback by the watchdog: {reason}", pause=True, details=details)
        reg.set_version_tags(champ, {TAG + "auto_rollback": "1"})
        out.action, out.rolled_back_to = "rolled back", move.champion
        out.message = f"version {champ} rolled back to {move.champion}: {reason}"
        log.error("[watchdog] %s", out.message)
        return out


    def _offline_check(self, champ: str, prev: str) -> tuple[str, str, dict]:
        """Is the champion worse than the previous version on the traffic of NOW? A live figure can fall
        because the traffic changed (a new kind of request both drafts know less about), which a rollback
        would not cure (and it would pause learning from the new traffic). Both drafts are scored on the
        newest held-out records of the replay buffer, paired by request, as the gate scores them
        (deploy/gate.py): ("worse", note, figures) when the champion is significantly below the previous
        version there (one-sided upper bound of the paired difference below -tolerance x its figure),
        ("traffic", ...) when it is not, ("unknown", ...) when the sample is too small or cannot be drawn
        (then the live evidence alone decides, as without the check)."""
        from deploy.gate import paired_bootstrap

        pol = self.policy
        try:
            collect = getattr(self.evidence, "collect", self.evidence)
            ev = collect(self.registry.materialize(prev), self.registry.materialize(champ))
        except Exception as e:  # noqa: BLE001 - Redis down, artifacts unreadable: decide on live evidence
            log.warning("[watchdog] offline check not possible: %s", e)
            return "unknown", f"offline check not possible ({type(e).__name__}: {e})", {"error": str(e)}
        if ev.requests < self.min_requests:
            return "unknown", (f"offline check: {ev.requests} held-out requests, fewer than "
                               f"{self.min_requests}"), {"requests": ev.requests}
        delta, _, upper = paired_bootstrap(ev, resamples=2000, seed=0, upper_q=pol.confidence)
        w = sum(ev.weight)
        prev_fig = sum(a * b for a, b in zip(ev.champion, ev.weight)) / w if w else 0.0
        champ_fig = sum(a * b for a, b in zip(ev.candidate, ev.weight)) / w if w else 0.0
        figures = {"requests": ev.requests, "records": ev.records, "previous": prev_fig, "champion": champ_fig,
                   "delta": delta, "delta_upper": upper}
        worse = upper is not None and upper < -pol.tolerance * prev_fig
        note = (f"on the newest {ev.requests} held-out requests version {champ} scores {champ_fig:.3f} offline vs "
                f"version {prev}'s {prev_fig:.3f} (paired difference {delta:+.3f}, upper bound {upper:+.3f} at "
                f"{pol.confidence:g})")
        return ("worse" if worse else "traffic"), note, figures


# ---------------------------------------------------------------------------------- the canary judge
@dataclass
class CanaryPolicy:
    """Evidence a canary needs and how much worse it may be (module docstring, "Canary"): per arm at least
    `min_draft_tokens` drafted tokens and `min_requests` requests, and `min_duration_s` of canary time
    before a promotion; `timeout_s` without that evidence drops it; `tolerance` / `tps_tolerance`: the
    relative drop of acceptance / tokens/s below the champion's that is not held against it; `confidence`:
    one-sided level of the "significantly worse" tests."""

    min_draft_tokens: int = 2000
    min_requests: int = 20
    min_duration_s: float = 600.0
    timeout_s: float = 7200.0
    tolerance: float = 0.05
    tps_tolerance: float = 0.10
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.min_draft_tokens < 1 or self.min_requests < 1:
            raise ValueError("canary min_draft_tokens and min_requests must be >= 1")
        if not (self.min_duration_s >= 0) or not (self.timeout_s > 0) or self.timeout_s < self.min_duration_s:
            raise ValueError(f"canary timeout ({self.timeout_s!r} s) must be > 0 and >= its minimum duration "
                             f"({self.min_duration_s!r} s)")
        if not (0.0 <= self.tolerance < 1.0) or not (0.0 <= self.tps_tolerance < 1.0):
            raise ValueError("canary tolerances must be in [0, 1)")
        if not (0.5 <= self.confidence < 1.0):
            raise ValueError(f"canary confidence must be in [0.5, 1), got {self.confidence!r}")


@dataclass
class ArmFigures:
    """One arm's live figures over the comparison window: acceptance (accepted / drafted tokens, with the
    standard error of `live_figure`), tokens/s (tokens / request wall time over the window, intervals as
    clusters), requests."""

    acceptance: float | None
    acceptance_se: float
    drafted: float
    requests: int
    tokens_per_s: float | None
    tokens_per_s_se: float
    intervals: int

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def arm_figures(intervals: list[dict]) -> ArmFigures:
    acc = live_figure(intervals)
    pts = [(it.get("tokens") or 0.0, (it.get("tokens") or 0.0) / it["tokens_per_s"]) for it in intervals
           if it.get("tokens_per_s") and it.get("tokens")]
    T, W = sum(t for t, _ in pts), sum(w for _, w in pts)
    tps, tps_se = (T / W, math.inf) if W > 0 else (None, math.inf)
    if tps is not None and len(pts) > 1:
        n = len(pts)
        tps_se = math.sqrt(n / (n - 1) * sum((t - tps * w) ** 2 for t, w in pts)) / W
    return ArmFigures(acc.rate, acc.se, acc.drafted, int(sum(it.get("requests") or 0 for it in intervals)),
                      tps, tps_se, len(intervals))


@dataclass
class CanaryVerdict:
    action: str                        # "none" | "waiting" | "held" | "promoted" | "dropped"
    message: str
    version: str | None = None
    champion: str | None = None
    share: float | None = None
    since_ms: int | None = None
    elapsed_s: float = 0.0
    canary_figures: dict = field(default_factory=dict)
    champion_figures: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


class CanaryJudge:
    """Promotes or drops the running canary on live evidence (module docstring, "Canary")."""

    def __init__(self, registry: Registry, policy: CanaryPolicy | None = None, *,
                 status_path: str | os.PathLike | None = None, progress: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.policy = policy or CanaryPolicy()
        self.status_path = Path(status_path) if status_path else data_dir() / "canary-status.json"
        self.progress = progress
        self.clock = clock

    def assess(self) -> tuple[CanaryVerdict, str | None, dict]:
        """Read-only: (verdict with the figures so far, decision "promote" | "drop" | None, details)."""
        reg, pol = self.registry, self.policy
        c = reg.canary()
        if c is None:
            return CanaryVerdict("none", "no canary"), None, {}
        champ = reg.champion()
        now_ms = int(self.clock() * 1000)
        started = c["since_ms"] or now_ms
        since = started
        if champ is not None:
            since = max(since, reg.champion_since_ms(reg.get(champ)) or 0)
        ca = arm_figures(reg.live_intervals(c["version"], since_ms=since))
        ha = arm_figures(reg.live_intervals(champ, since_ms=since)) if champ else arm_figures([])
        elapsed = max(0.0, (now_ms - started) / 1000.0)
        v = CanaryVerdict("waiting", "", c["version"], champ, c["share"], started, round(elapsed, 1),
                          ca.to_dict(), ha.to_dict())
        details = {"share": c["share"], "elapsed_s": round(elapsed, 1), "window_since_ms": since,
                   "live_acceptance": ca.acceptance, "champion_live_acceptance": ha.acceptance,
                   "tokens_per_s": ca.tokens_per_s, "champion_tokens_per_s": ha.tokens_per_s,
                   "drafted_tokens": ca.drafted, "champion_drafted_tokens": ha.drafted,
                   "requests": ca.requests, "champion_requests": ha.requests, "champion_version": champ}
        lacking = [f"{name}: {a.drafted:.0f}/{pol.min_draft_tokens} drafted tokens, {a.requests}/{pol.min_requests} "
                   "requests" for name, a in ((f"canary {c['version']}", ca), (f"champion {champ}", ha))
                   if a.acceptance is None or a.drafted < pol.min_draft_tokens or a.requests < pol.min_requests]
        figures = (f"canary {c['version']} acceptance {_f(ca.acceptance)}, {_f(ca.tokens_per_s, 1)} tokens/s vs "
                   f"champion {champ} {_f(ha.acceptance)}, {_f(ha.tokens_per_s, 1)} tokens/s")
        if lacking:
            if elapsed >= pol.timeout_s:
                v.message = (f"no decision on live evidence within {pol.timeout_s:g} s ({'; '.join(lacking)}); "
                             "a canary is promoted only on evidence")
                return v, "drop", details
            v.message = f"{figures}; waiting for evidence ({'; '.join(lacking)})"
            return v, None, details
        z = NormalDist().inv_cdf(pol.confidence)
        worse = []
        if ca.acceptance + z * math.hypot(ca.acceptance_se, ha.acceptance_se) < ha.acceptance * (1 - pol.tolerance):
            worse.append(f"live acceptance {ca.acceptance:.3f} is significantly below the champion's "
                         f"{ha.acceptance:.3f} less {pol.tolerance:.0%}")
        if ca.tokens_per_s is not None and ha.tokens_per_s is not None and math.isfinite(ca.tokens_per_s_se) \
                and math.isfinite(ha.tokens_per_s_se) and ca.tokens_per_s + z * math.hypot(
                    ca.tokens_per_s_se, ha.tokens_per_s_se) < ha.tokens_per_s * (1 - pol.tps_tolerance):
            worse.append(f"{ca.tokens_per_s:.1f} tokens/s is significantly below the champion's "
                         f"{ha.tokens_per_s:.1f} less {pol.tps_tolerance:.0%}")
        details.update(confidence=pol.confidence, tolerance=pol.tolerance, tps_tolerance=pol.tps_tolerance)
        if worse:
            v.message = f"{'; '.join(worse)} (same window, {figures})"
            return v, "drop", details
        if elapsed < pol.min_duration_s:
            v.message = f"{figures}; not worse so far, judging after {pol.min_duration_s:g} s ({elapsed:.0f} s)"
            return v, None, details
        v.message = f"not significantly worse than the champion on the same window: {figures}"
        return v, "promote", details

    def check(self) -> CanaryVerdict:
        """One look: assess, then promote / drop through the registry (alias lock, pause respected); the
        verdict goes to `canary-status.json`. MLflow errors propagate (no decision)."""
        v, decision, details = self.assess()
        if decision == "promote":
            try:
                move = self.registry.end_canary(v.version, promote=True, reason=v.message, details=details)
                v.action = "promoted" if move.changed else "none"
            except PromotionsPaused as e:
                if v.elapsed_s >= self.policy.timeout_s:
                    decision = "drop"
                    v.message = f"passed but promotions stayed paused until the timeout ({e}); {v.message}"
                else:
                    v.action, v.message = "held", f"passed, held while promotions are paused: {v.message}"
        if decision == "drop":
            move = self.registry.end_canary(v.version, promote=False, reason=v.message, details=details)
            v.action = "dropped" if move.changed else "none"
        if v.action in ("promoted", "dropped"):
            self.progress(f"[canary] version {v.version} {v.action}: {v.message}")
            log.info("[canary] version %s %s: %s", v.version, v.action, v.message)
        try:
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(v.to_dict(), default=str, indent=1))
            os.replace(tmp, self.status_path)
        except OSError as e:
            log.warning("could not write %s: %s", self.status_path, e)
        return v


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def read_canary_status(path: str | os.PathLike | None = None) -> dict | None:
    """The canary judge's last verdict (None if it never ran)."""
    p = Path(path) if path else data_dir() / "canary-status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_watchdog_status(path: str | os.PathLike | None = None) -> dict | None:
    """The watchdog's last verdict (None if it never ran)."""
    p = Path(path) if path else data_dir() / "watchdog-status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_status(path: str | os.PathLike | None = None) -> dict | None:
    """The last job outcome written by a scheduler (None if no job ran yet)."""
    p = Path(path) if path else data_dir() / "distill-status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_job_status(info: dict, path: str | os.PathLike | None = None) -> None:
    """Write a job's state (deploy/ray_jobs.py `job_info`; a heads job's carries its "kind") to
    `distill-job.json`, atomically; a failed write is a warning (the job goes on)."""
    p = Path(path) if path else data_dir() / "distill-job.json"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"time": time.time(), **info}, default=str, indent=1))
        os.replace(tmp, p)
    except OSError as e:
        log.warning("could not write %s: %s", p, e)


def read_job_status(path: str | os.PathLike | None = None) -> dict | None:
    """The state of the current (or last) job as its runner reported it: `distill-job.json` (None if none)."""
    p = Path(path) if path else data_dir() / "distill-job.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
