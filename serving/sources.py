"""What a replica needs from outside serving/, stated as small protocols that other packages implement.

serving/ imports nothing from deploy/: the deployment (deploy/app.py) builds the objects below and hands
them to `Service` and `MetricsHub`. Each protocol names only what serving calls.

    DraftSource   where drafts come from (the champion and canary aliases, verified local folders, the
                  target a version was built for, an operator's rollback): deploy.registry.Registry.
    StatsSink     where a finished request's per-version statistics go (live acceptance charts):
                  deploy.live_stats.LiveStatsLogger.
    RecordSink    where verification steps go (the replay buffer): buffer.records.RecordSink, implemented
                  by buffer.redis_store.ReplayBufferWriter.

Errors a DraftSource raises: `DraftSourceError` for a fault or a refused operation (MLflow down, an alias
that cannot move), and a `ValueError` (which may also be a DraftSourceError) when the request itself is
wrong (an unknown version). `Service` turns them into its own domain errors (serving/service.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from buffer.records import RecordSink  # noqa: F401 (re-exported: the third protocol serving states)


class DraftSourceError(RuntimeError):
    """A draft source could not do what was asked (unreachable, refused); the message says why."""


@runtime_checkable
class DraftSource(Protocol):
    def champion(self) -> str | None:
        """The version replicas should serve (None: no champion yet). Raises when it cannot be read."""

    def canary(self) -> dict | None:
        """{"version": str, "share": float} of the canary being tried, or None."""

    def get(self, version: str) -> Any:
        """A version's description; serving reads its `target_sha256` (None when not pinned)."""

    def materialize(self, version: str, *, verify: bool = True) -> Path:
        """A local model folder of `version`, verified against what was registered."""

    def target_fingerprint(self, target: str | Path | None) -> str | None:
        """The fingerprint versions are pinned to for a target folder (None: no local folder)."""

    def rollback(self, to: str | None = None, *, reason: str = "") -> Any:
        """Move the champion back; the result has `changed`, `champion`, `old_champion`, `message`."""


@runtime_checkable
class StatsSink(Protocol):
    def observe(self, stats: dict) -> None:
        """One finished request's statistics for one draft version (never blocks on I/O)."""

    def flush(self) -> int:
        """Write what was observed now; returns how many entries were written."""

    def stop(self) -> None:
        """Flush and stop any background work."""


StatsSinkFactory = Callable[[], StatsSink]
