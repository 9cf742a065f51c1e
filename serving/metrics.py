"""Serving telemetry: per-replica counters and histograms, merged across replicas, rendered in the
Prometheus text format with vLLM-shaped names, plus the hub that merges them and logs live acceptance
per draft version to MLflow.

Each replica owns a `Telemetry`; it publishes a JSON-able `snapshot()` to the `MetricsHub` (a named Ray
actor in the Ray Serve app, a plain object in-process) about once a second and at every /metrics call.
`GET /metrics` on any replica answers `render(hub.merged())`, so the figures cover every replica, not only
the one that answered. Counters and histograms are summed over replicas (a replica that went away keeps
its last counts, so totals never go backwards); gauges are summed over replicas seen in the last
STALE_S seconds; `draftsmith:draft_version_info` has one sample per live replica.

Names (prefix `draftsmith:`; vLLM's spec-decode counters are `vllm:spec_decode_*`):
    spec_decode_num_drafts_total                 verification steps that checked draft tokens
    spec_decode_num_draft_tokens_total           draft tokens proposed
    spec_decode_num_accepted_tokens_total        draft tokens accepted
    spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at draft position i (0-based)
    prompt_tokens_total / generation_tokens_total
    request_success_total{finished_reason} / request_errors_total{code}
    e2e_request_latency_seconds / time_to_first_token_seconds (histograms)
    num_requests_running / num_requests_waiting (queue depth) (gauges)
    buffer_records_written_total / buffer_records_dropped_total (replay buffer writer)
    draft_swaps_total{result} / draft_version_info{replica, version}
    heads_swaps_total{kind,result}               Medusa / EAGLE head hot-swaps from their registries
"""
from __future__ import annotations

import math
import threading
import time

PREFIX = "draftsmith:"
STALE_S = 30.0
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HISTOGRAMS = {"e2e_request_latency_seconds": LATENCY_BUCKETS, "time_to_first_token_seconds": TTFT_BUCKETS}
LABELLED = {"spec_decode_num_accepted_tokens_per_pos_total", "request_success_total", "request_errors_total",
            "draft_swaps_total", "draft_version_info", "heads_swaps_total"}
HELP = {
    "spec_decode_num_drafts_total": ("counter", "Verification steps that checked draft tokens."),
    "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted by verification."),
    "spec_decode_num_accepted_tokens_per_pos_total": ("counter", "Accepted draft tokens per draft position."),
    "prompt_tokens_total": ("counter", "Prompt tokens processed."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "request_success_total": ("counter", "Requests finished, by finish reason."),
    "request_errors_total": ("counter", "Requests answered with an error, by error code."),
    "buffer_records_written_total": ("counter", "Replay-buffer records written to Redis."),
    "buffer_records_dropped_total": ("counter", "Replay-buffer records dropped (Redis down, queue full, ...)."),
    "draft_swaps_total": ("counter", "Draft hot-swaps, by result."),
    "heads_swaps_total": ("counter", "Medusa / EAGLE head hot-swaps, by kind and result."),
    "e2e_request_latency_seconds": ("histogram", "Request latency from arrival to last token."),
    "time_to_first_token_seconds": ("histogram", "Time from arrival to the first token."),
    "num_requests_running": ("gauge", "Requests decoding now."),
    "num_requests_waiting": ("gauge", "Requests waiting for a decoding slot (queue depth)."),
    "draft_version_info": ("gauge", "The draft version each replica serves (value 1)."),
}


def _key(name: str, labels: dict | None) -> str:
    """A sample key `name{a="x",b="y"}` (labels sorted, values escaped)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_esc(str(v))}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Telemetry:
    """One replica's counters (monotonic), histograms and gauges. Thread-safe."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.hist: dict[str, dict] = {n: {"buckets": [0] * (len(b) + 1), "sum": 0.0, "count": 0}
                                      for n, b in HISTOGRAMS.items()}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        k = _key(name, labels)
        with self._lock:
            self.counters[k] = self.counters.get(k, 0.0) + value

    def set_counter(self, name: str, value: float, **labels) -> None:
        """For counters kept elsewhere (the buffer writer's): publish their current total."""
        with self._lock:
            self.counters[_key(name, labels)] = float(value)

    def set_gauge(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self.gauges[_key(name, labels)] = float(value)

    def clear_gauge(self, name: str) -> None:
        with self._lock:
            for k in [k for k in self.gauges if k == name or k.startswith(name + "{")]:
                del self.gauges[k]

    def observe(self, name: str, value: float) -> None:
        bounds = HISTOGRAMS[name]
        with self._lock:
            h = self.hist[name]
            i = next((j for j, b in enumerate(bounds) if value <= b), len(bounds))
            h["buckets"][i] += 1
            h["sum"] += float(value)
            h["count"] += 1

    def record_request(self, stats: dict, prompt_tokens: int, finish_reason: str) -> None:
        """Fold one finished request's GenerationStats.to_dict() into the counters."""
        with self._lock:
            c = self.counters

            def add(name, v, **labels):
                k = _key(name, labels)
                c[k] = c.get(k, 0.0) + float(v)

            if stats.get("draft_tokens"):
                add("spec_decode_num_drafts_total", stats.get("steps", 0))
                add("spec_decode_num_draft_tokens_total", stats.get("draft_tokens", 0))
                add("spec_decode_num_accepted_tokens_total", stats.get("accepted_tokens", 0))
                for pos, n in enumerate(stats.get("accepted_per_position") or []):
                    add("spec_decode_num_accepted_tokens_per_pos_total", n, position=str(pos))
            add("prompt_tokens_total", prompt_tokens)
            add("generation_tokens_total", stats.get("tokens", 0))
            add("request_success_total", 1, finished_reason=finish_reason)

    def snapshot(self) -> dict:
        with self._lock:
            return {"replica": self.replica_id, "time": time.time(), "counters": dict(self.counters),
                    "gauges": dict(self.gauges),
                    "hist": {n: {"buckets": list(h["buckets"]), "sum": h["sum"], "count": h["count"]}
                             for n, h in self.hist.items()}}


def merge(snapshots: list[dict], now: float | None = None) -> dict:
    """Sum counters and histograms over all snapshots, gauges over the fresh ones."""
    now = time.time() if now is None else now
    out = {"counters": {}, "gauges": {}, "hist": {n: {"buckets": [0] * (len(b) + 1), "sum": 0.0, "count": 0}
                                                   for n, b in HISTOGRAMS.items()}, "replicas": 0}
    for snap in snapshots:
        for k, v in snap.get("counters", {}).items():
            out["counters"][k] = out["counters"].get(k, 0.0) + v
        if now - snap.get("time", 0) <= STALE_S:
            out["replicas"] += 1
            for k, v in snap.get("gauges", {}).items():
                out["gauges"][k] = out["gauges"].get(k, 0.0) + v
        for n, h in snap.get("hist", {}).items():
            if n not in out["hist"] or len(h["buckets"]) != len(out["hist"][n]["buckets"]):
                continue
            m = out["hist"][n]
            m["buckets"] = [a + b for a, b in zip(m["buckets"], h["buckets"])]
            m["sum"] += h["sum"]
            m["count"] += h["count"]
    return out


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def render(merged: dict) -> str:
    """Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []
    by_name: dict[str, list[tuple[str, float]]] = {}
    for k, v in list(merged["counters"].items()) + list(merged["gauges"].items()):
        by_name.setdefault(k.split("{", 1)[0], []).append((k, v))
    for name in sorted(set(by_name) | set(n for n in HELP if HELP[n][0] != "histogram")):
        kind, text = HELP.get(name, ("untyped", name))
        lines.append(f"# HELP {PREFIX}{name} {text}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        samples = by_name.get(name) or ([] if name in LABELLED else [(name, 0.0)])
        for k, v in sorted(samples):
            lines.append(f"{PREFIX}{k} {_fmt(v)}")
    for name, bounds in HISTOGRAMS.items():
        h = merged["hist"][name]
        lines.append(f"# HELP {PREFIX}{name} {HELP[name][1]}")
        lines.append(f"# TYPE {PREFIX}{name} histogram")
        acc = 0
        for b, n in zip(list(bounds) + [math.inf], h["buckets"]):
            acc += n
            lines.append(f'{PREFIX}{name}_bucket{{le="{_fmt(b) if not math.isinf(b) else "+Inf"}"}} {acc}')
        lines.append(f"{PREFIX}{name}_sum {_fmt(h['sum'])}")
        lines.append(f"{PREFIX}{name}_count {h['count']}")
    return "\n".join(lines) + "\n"


def split_by_version(stats: dict) -> list[dict]:
    """One finished request's stats as one dict per draft version that proposed its steps, so live
    per-version acceptance is exact when a hot-swap lands mid-request: each part carries that version's
    steps, draft and accepted tokens (GenerationStats.draft_versions), and the request's tokens and wall
    time in proportion to its steps. Steps that drafted nothing (version "none") count under the version
    that drafted for the request, or "none" when no draft did."""
    per = {v: c for v, c in (stats.get("draft_versions") or {}).items() if v != "none"}
    if len(per) <= 1:
        return [stats]
    total = sum(c["steps"] for c in per.values()) or 1
    parts = []
    for v, c in per.items():
        share = c["steps"] / total
        part = dict(stats, draft_version=v, steps=c["steps"], draft_tokens=c["draft_tokens"],
                    accepted_tokens=c["accepted_tokens"], tokens=(stats.get("tokens") or 0) * share,
                    wall_time_s=(stats.get("wall_time_s") or 0.0) * share)
        if stats.get("energy_j") is not None:
            part["energy_j"] = stats["energy_j"] * share
        parts.append(part)
    return parts


class MetricsHub:
    """Merges replica snapshots and hands each finished request's per-version statistics to a live
    statistics sink (serving/sources.py `StatsSink`; deploy/live_stats.py logs them to MLflow).

    In the Ray Serve app this class runs as the named actor HUB_NAME; in-process it is used directly.
    `live`: a StatsSink, or a factory called here (in the actor's process) that returns a started one;
    None: no live statistics. `observe` never raises: a failing sink costs the live charts, never a request.
    """

    def __init__(self, live=None, *, live_stats: bool = True) -> None:
        self.snapshots: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.live = None
        if live is not None and live_stats:
            try:
                self.live = live() if callable(live) and not hasattr(live, "observe") else live
            except Exception as e:  # noqa: BLE001 - live charts are optional
                import logging

                logging.getLogger(__name__).warning("live acceptance statistics are off: %s", e)

    def push(self, snapshot: dict) -> None:
        with self._lock:
            self.snapshots[str(snapshot.get("replica"))] = snapshot

    def observe(self, stats: dict) -> None:
        if self.live is not None:
            try:
                for part in split_by_version(stats):
                    self.live.observe(part)
            except Exception:  # noqa: BLE001
                pass

    def merged(self) -> dict:
        with self._lock:
            return merge(list(self.snapshots.values()))

    def render(self) -> str:
        return render(self.merged())

    def flush_live(self) -> int:
        return self.live.flush() if self.live is not None else 0

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


HUB_NAME = "draftsmith-metrics-hub"
HUB_NAMESPACE = "draftsmith"
