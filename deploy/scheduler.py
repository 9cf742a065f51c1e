"""Scheduled distillation: run a job on an interval and/or when enough new records arrived,
never two at once, and promote the result through the gate.

One job = (1) take the job lock (non-blocking: if another job holds it, this one is skipped);
(2) materialise the champion (the parent the adapter will be trained on); (3) call the injected
`distill(JobRequest) -> candidate dir` (the real one wraps training.job.run_distillation);
(4) register the candidate; (5) run the gate, which promotes it if it passes; (6) release the lock.
A job that raises, or a process killed mid-job, registers nothing and moves no alias: the champion
is untouched and the buffer cursor (the data window's `last_id` of the newest registered candidate)
does not advance, so its records stay pending for the next job. The lock is an `fcntl.flock` on a
file under the data dir, so the kernel releases it when the holding process dies.

Triggers (`ScheduleConfig`):
- `every_s` only: a job each `every_s` seconds (the first one `every_s` after start);
- `min_records` only: a job as soon as `pending_records(cursor) >= min_records` (polled every `poll_s`);
- both: once `every_s` has passed since the last job, a job as soon as enough records are pending.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from deploy.gate import GatePolicy, GateVerdict, SmokeCheck, run_gate
from deploy.registry import Registry, RegistryError, data_dir

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


DistillFn = Callable[[JobRequest], "str | os.PathLike"]
PendingFn = Callable[["str | None"], int]


@dataclass
class JobOutcome:
    status: str                      # "promoted" | "rejected" | "failed" | "skipped"
    message: str
    version: str | None = None       # registered candidate version (None if none was registered)
    parent_version: str | None = None
    verdict: dict | None = None
    started: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ScheduleConfig:
    every_s: float | None = None
    min_records: int | None = None
    poll_s: float = 10.0

    def __post_init__(self) -> None:
        if self.every_s is None and self.min_records is None:
            raise ValueError("a schedule needs --every and/or --min-records")
        if self.every_s is not None and not (self.every_s > 0):
            raise ValueError(f"--every must be a positive duration, got {self.every_s!r}")
        if self.min_records is not None and (isinstance(self.min_records, bool) or not isinstance(self.min_records, int)
                                             or self.min_records < 1):
            raise ValueError(f"--min-records must be an integer >= 1, got {self.min_records!r}")
        if not (self.poll_s > 0):
            raise ValueError(f"poll interval must be > 0, got {self.poll_s!r}")


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
    """Runs distillation jobs (see the module docstring). All collaborators are injected."""

    def __init__(self, registry: Registry, distill: DistillFn, *, smoke_check: SmokeCheck | None,
                 policy: GatePolicy | None = None, lock: JobLock | None = None,
                 schedule: ScheduleConfig | None = None, pending_records: PendingFn | None = None,
                 status_path: str | os.PathLike | None = None, clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[str], None] = print) -> None:
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
        self.clock = clock
        self.progress = progress
        self._started = clock()
        self._last_job: float | None = None

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
        out.seconds = round(time.time() - t0, 3)
        self._write_status(out)
        self.progress(f"[distill] {out.status}: {out.message}")
        return out

    def _job(self, t0: float) -> JobOutcome:
        champion = self.registry.champion()
        if champion is None:
            return JobOutcome("failed", "no champion draft to distill from: run `draftsmith bootstrap` first",
                              started=t0)
        try:
            parent_path = self.registry.materialize(champion)
            request = JobRequest(champion, parent_path, self.registry.target, self.cursor())
            self.progress(f"[distill] job started from champion version {champion} "
                          f"(records after {request.since_id or 'the start'})")
            cand_dir = Path(self.distill(request))
        except Exception as e:  # noqa: BLE001 - a failed job must leave everything as it was
            log.error("distillation job failed:\n%s", traceback.format_exc())
            return JobOutcome("failed", f"distillation failed ({type(e).__name__}: {e}); champion {champion} "
                                        "untouched, records left pending", parent_version=champion, started=t0)
        try:
            version = self.registry.register_candidate(cand_dir)
        except Exception as e:  # noqa: BLE001
            return JobOutcome("failed", f"could not register candidate {cand_dir} ({e}); champion {champion} "
                                        "untouched, records left pending", parent_version=champion, started=t0)
        try:
            verdict: GateVerdict = run_gate(self.registry, version, self.smoke_check, policy=self.policy)
        except Exception as e:  # noqa: BLE001 - e.g. promotion found corrupt artifacts
            return JobOutcome("failed", f"gate/promotion of version {version} failed ({e}); champion "
                                        f"{self.registry.champion()}", version=version, parent_version=champion,
                              started=t0)
        status = "promoted" if verdict.promoted else "rejected"
        msg = (f"version {version} " + ("promoted to champion" if verdict.promoted else "not promoted")
               + f": {verdict.reason}")
        return JobOutcome(status, msg, version=version, parent_version=champion, verdict=verdict.to_dict(), started=t0)

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
        """Whether a job should start now, and why (or why not)."""
        if self.schedule is None:
            return True, "no schedule: run now"
        paused = self.registry.promotions_paused()
        if paused:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(paused.get("time", 0)))
            return False, f"paused since {when} ({paused.get('reason')}); `draftsmith resume` to continue"
        now = self.clock()
        sch = self.schedule
        if sch.every_s is not None:
            since = now - (self._last_job if self._last_job is not None else self._started)
            if since < sch.every_s:
                return False, f"next interval in {sch.every_s - since:.0f} s"
        if sch.min_records is not None:
            n = int(self.pending_records(self.cursor()))
            if n < sch.min_records:
                return False, f"{n} new records, waiting for {sch.min_records}"
            return True, f"{n} new records >= {sch.min_records}"
        return True, "interval elapsed"

    def run_forever(self, stop: threading.Event | None = None, *, max_jobs: int | None = None) -> list[JobOutcome]:
        """Check `due()` every `poll_s` (or sooner when an interval ends) until `stop` is set or
        `max_jobs` jobs have run; returns the outcomes."""
        if self.schedule is None:
            raise ValueError("run_forever needs a ScheduleConfig")
        stop = stop or threading.Event()
        outcomes: list[JobOutcome] = []
        while not stop.is_set():
            try:
                ok, why = self.due()
            except Exception as e:  # noqa: BLE001 - e.g. Redis briefly unreachable
                ok, why = False, f"cannot check the trigger ({e})"
                log.warning("[distill] %s", why)
            if ok:
                self.progress(f"[distill] due: {why}")
                outcomes.append(self.run_job())
                if max_jobs is not None and len(outcomes) >= max_jobs:
                    break
            wait = self.schedule.poll_s
            if self.schedule.every_s is not None and self.schedule.min_records is None:
                ref = self._last_job if self._last_job is not None else self._started
                wait = max(0.01, min(wait, ref + self.schedule.every_s - self.clock()))
            stop.wait(wait)
        return outcomes


def read_status(path: str | os.PathLike | None = None) -> dict | None:
    """The last job outcome written by a scheduler (None if no job ran yet)."""
    p = Path(path) if path else data_dir() / "distill-status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
