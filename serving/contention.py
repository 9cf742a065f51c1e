"""Jobs that share this machine's cores with serving, and how a replica learns of them.

A replica decodes on its share of the cores (deploy/app.py), and a step that drafts borrows more
(serving/scheduler.py `wide_threads`). Beside a distillation job that holds one of those cores, a parallel
region of two torch threads waits at its barrier for the thread the job displaced: on a 2-core host a 1-thread
trainer at nice 10 cost 2-thread serving 19% and was left 13% of a core, where 1-thread serving beside it lost
nothing and the trainer ran at full speed (docs/results/job-contention-2026-11-26/); in a 30-minute online run
with 2-thread serving, requests took 13-33 s while a job ran against about 4 s between jobs (docs/benchmarks.md,
"The thirty-eighth session"). So a process that computes beside serving (a job, the gate's scoring pass) says so
with `busy()`: a small JSON file under `$DRAFTSMITH_CACHE/busy/` for as long as it computes. A replica's
`ContentionWatch` counts the cores those files claim (files of processes that are gone are removed), and its
scheduler runs on that many fewer threads meanwhile, never fewer than one.

No pickle, no network: a file per marker, read as JSON, on this machine only.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from buffer.paths import cache_dir, pid_alive, write_json_atomic

log = logging.getLogger(__name__)


def busy_dir() -> Path:
    """Where the markers live: `$DRAFTSMITH_BUSY_DIR`, else `<cache>/busy` (buffer/paths.py cache_dir)."""
    if os.environ.get("DRAFTSMITH_BUSY_DIR"):
        return Path(os.environ["DRAFTSMITH_BUSY_DIR"]).expanduser()
    return cache_dir() / "busy"


@contextlib.contextmanager
def busy(what: str, cores: int = 1, directory: Path | None = None):
    """Mark this process as holding `cores` cores of this machine for `what` inside the block. Writing the marker
    may fail (a read-only cache): the work runs anyway, unmarked."""
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
        raise ValueError(f"cores must be an integer >= 1, got {cores!r}")
    folder = Path(directory) if directory is not None else busy_dir()
    path = folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    try:
        write_json_atomic(path, {"pid": os.getpid(), "what": str(what), "cores": cores, "since": time.time()})
    except OSError as exc:
        log.warning("could not mark %s as busy beside serving (%s); serving will not yield to it", what, exc)
        path = None
    try:
        yield path
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def busy_beside_serving(what: str, cores: int = 1):
    """`busy(what, cores)` when this process runs beside serving, which the distillation machinery signals by
    lowering its priority (deploy/distill_job.py `lower_priority`, deploy/cli.py `_distill_priority`: nice > 0);
    elsewhere (a job on its own machine) nothing is marked."""
    if os.nice(0) > 0:
        with busy(what, cores):
            yield
    else:
        yield


def marks_busy(what: str):
    """A decorator: the function runs inside `busy_beside_serving(what)`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with busy_beside_serving(what):
                return fn(*args, **kwargs)
        return inner
    return wrap


def read_busy(directory: Path | None = None) -> list[dict]:
    """The live markers of `directory` (default `busy_dir()`); markers of processes that are gone are removed,
    unreadable ones skipped."""
    folder = Path(directory) if directory is not None else busy_dir()
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return out
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        try:
            m = json.loads(Path(entry.path).read_text())
            pid, cores = int(m["pid"]), int(m["cores"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
            continue
        out.append({"pid": pid, "what": str(m.get("what", "")), "cores": max(1, cores)})
    return out


class ContentionWatch:
    """The cores that processes beside serving hold now (`busy_cores`), read from the markers at most every
    `interval_s` seconds; thread-safe."""

    def __init__(self, directory: Path | None = None, interval_s: float = 1.0) -> None:
        self.directory = Path(directory) if directory is not None else busy_dir()
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._markers: list[dict] = []

    def markers(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.interval_s:
                self._markers, self._at = read_busy(self.directory), now
            return list(self._markers)

    def busy_cores(self) -> int:
        return sum(m["cores"] for m in self.markers())
