"""Live serving statistics: per-draft-version aggregates logged to MLflow on an interval (the StatsSink of
serving/sources.py behind the MetricsHub), read back by `Registry.live_intervals` for the watchdog and the
canary judge (deploy/scheduler.py).

    live_stats_factory(tracking_uri, target, model_name, interval_s)   what deploy/app.py hands the hub
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from deploy.registry import LIVE_EXPERIMENT, TAG, Registry

log = logging.getLogger(__name__)


@dataclass
class LiveAggregate:
    """Serving figures of one draft version over one interval.

    acceptance_rate = accepted draft tokens / proposed draft tokens; mean_accepted_length = accepted
    draft tokens per verification step; tokens_per_s = emitted tokens / request wall time;
    joules_per_token = energy / emitted tokens, or None where energy is not measurable.
    draft_tokens / accepted_tokens / steps: the counts behind the rates (None when only rates were given);
    the watchdog (deploy/scheduler.py) weighs intervals by them.
    """

    acceptance_rate: float
    mean_accepted_length: float
    tokens_per_s: float
    joules_per_token: float | None = None
    requests: int = 0
    tokens: int = 0
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    steps: int | None = None


class LiveStatsLogger:
    """Logs per-draft-version serving aggregates to MLflow on an interval, one run per version.

    Runs live in the experiment `draftsmith-live`, named `live-v<version>`; metric steps are whole
    seconds since that run started, so the MLflow UI plots acceptance over time with the versions
    side by side. Feed it either ready aggregates (`update`) or per-request
    `GenerationStats.to_dict()` dicts (`observe`), which are summed per version and turned into
    rates at flush time: acceptance_rate = sum(accepted) / sum(draft tokens),
    mean_accepted_length = sum(accepted) / sum(steps), tokens_per_s = sum(tokens) / sum(wall time),
    joules_per_token = sum(energy) / sum(tokens) (None if any request had no energy figure).
    Logging never raises into the caller (failures are logged and the figures kept for the next try).
    """

    def __init__(self, tracking_uri: str | None = None, *, interval_s: float = 30.0,
                 experiment: str = LIVE_EXPERIMENT, registry: Registry | None = None, clock=time.time) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.registry = registry or Registry(tracking_uri=tracking_uri)
        self.interval_s = float(interval_s)
        self.experiment = experiment
        self.clock = clock
        self._pending: dict[str, LiveAggregate] = {}
        self._sums: dict[str, dict[str, float]] = {}
        self._runs: dict[str, tuple[str, float]] = {}   # version -> (run id, run start seconds)
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, draft_version: str, aggregate: LiveAggregate) -> None:
        """Set the latest aggregate for a version (logged at the next flush)."""
        with self._lock:
            self._pending[str(draft_version)] = aggregate

    def observe(self, stats: dict) -> None:
        """Add one finished request's GenerationStats.to_dict() to its version's running sums."""
        v = str(stats.get("draft_version", "none"))
        with self._lock:
            s = self._sums.setdefault(v, {"requests": 0, "draft_tokens": 0, "accepted_tokens": 0, "steps": 0,
                                          "tokens": 0, "wall_time_s": 0.0, "energy_j": 0.0, "energy_missing": 0})
            s["requests"] += 1
            for k in ("draft_tokens", "accepted_tokens", "steps", "tokens", "wall_time_s"):
                s[k] += float(stats.get(k) or 0)
            if stats.get("energy_j") is None:
                s["energy_missing"] += 1
            else:
                s["energy_j"] += float(stats["energy_j"])

    def _drain(self) -> dict[str, LiveAggregate]:
        with self._lock:
            out = dict(self._pending)
            for v, s in self._sums.items():
                if s["requests"] == 0:
                    continue
                out[v] = LiveAggregate(
                    acceptance_rate=s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0,
                    mean_accepted_length=s["accepted_tokens"] / s["steps"] if s["steps"] else 0.0,
                    tokens_per_s=s["tokens"] / s["wall_time_s"] if s["wall_time_s"] > 0 else 0.0,
                    joules_per_token=(s["energy_j"] / s["tokens"]
                                      if s["energy_missing"] == 0 and s["tokens"] > 0 else None),
                    requests=int(s["requests"]), tokens=int(s["tokens"]), draft_tokens=int(s["draft_tokens"]),
                    accepted_tokens=int(s["accepted_tokens"]), steps=int(s["steps"]))
            self._pending.clear()
            self._sums.clear()
            return out

    def _run_for(self, version: str) -> tuple[str, float]:
        if version in self._runs:
            return self._runs[version]
        client = self.registry.client
        exp = self.registry.experiment_id(self.experiment)
        found = client.search_runs([exp], filter_string=f"tags.`{TAG}draft_version` = '{version}'",
                                   max_results=1, order_by=["attributes.start_time ASC"])
        if found:
            run = found[0]
        else:
            run = client.create_run(exp, run_name=f"live-v{version}", start_time=int(self.clock() * 1000),
                                    tags={TAG + "draft_version": version, TAG + "model": self.registry.name})
        self._runs[version] = (run.info.run_id, run.info.start_time / 1000.0)
        return self._runs[version]

    def flush(self) -> int:
        """Log everything gathered since the last flush now; returns the number of metric points logged."""
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> int:
        from mlflow.entities import Metric

        batch = self._drain()
        logged = 0
        for version, agg in batch.items():
            try:
                run_id, start = self._run_for(version)
                now = self.clock()
                step = max(0, int(now - start))
                values = {"acceptance_rate": agg.acceptance_rate, "mean_accepted_length": agg.mean_accepted_length,
                          "tokens_per_s": agg.tokens_per_s, "requests": agg.requests, "tokens": agg.tokens}
                if agg.joules_per_token is not None:
                    values["joules_per_token"] = agg.joules_per_token
                for k in ("draft_tokens", "accepted_tokens", "steps"):
                    if getattr(agg, k) is not None:
                        values[k] = getattr(agg, k)
                ms = int(now * 1000)
                metrics = [Metric(k, float(v), ms, step) for k, v in values.items()]
                self.registry.client.log_batch(run_id, metrics=metrics)
                logged += len(metrics)
            except Exception as e:  # noqa: BLE001 - serving must not fail because MLflow is down
                log.warning("live stats for draft %s not logged (%s); keeping them for the next flush", version, e)
                with self._lock:
                    self._pending.setdefault(version, agg)
        return logged

    def start(self) -> "LiveStatsLogger":
        """Flush every `interval_s` seconds in a daemon thread until `stop()`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="draftsmith-live-stats", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def stop(self) -> None:
        """Stop the thread and flush what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
        self.flush()


class _LiveStatsFactory:
    """A picklable factory (the hub may run as a Ray actor) of a started LiveStatsLogger."""

    def __init__(self, tracking_uri: str | None, target: str | None, model_name: str | None,
                 interval_s: float) -> None:
        self.tracking_uri, self.target, self.model_name, self.interval_s = tracking_uri, target, model_name, interval_s

    def __call__(self) -> LiveStatsLogger:
        reg = Registry(self.target, name=self.model_name, tracking_uri=self.tracking_uri)
        return LiveStatsLogger(registry=reg, interval_s=self.interval_s).start()


def live_stats_factory(tracking_uri: str | None = None, target: str | None = None, model_name: str | None = None,
                       interval_s: float = 15.0) -> _LiveStatsFactory:
    """What `MetricsHub(live=...)` calls to get its statistics sink: a LiveStatsLogger on the registry of
    `target` / `model_name` at `tracking_uri`, flushing every `interval_s` seconds."""
    return _LiveStatsFactory(tracking_uri, target, model_name, interval_s)
