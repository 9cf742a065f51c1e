"""One serving replica's core, independent of Ray and HTTP: the engine, the replay-buffer writer, the
draft watcher (hot-swap), admission control, telemetry, and an async token stream per request.

Scheduling: every admitted request (at most `max_running` at once) is handed to the engine's batch
scheduler (serving/scheduler.py), which decodes all running requests together: one draft forward per
drafted position and one target forward per step for the whole batch (continuous batching: requests join
and leave between steps; the KV budget `max_batch_tokens` bounds what they may reserve together).
Requests beyond `max_running` wait in a queue of at most `max_waiting`; beyond that the answer is 429 with
Retry-After. A request that is not finished within `request_timeout_s` (queueing included) is cancelled and
answered 408 (or an error event mid-stream).

Hot-swap: a watcher thread polls the registry's `champion` alias every `watch_interval_s` seconds; when it
names another version, the replica materialises it (verified against its manifest), loads it, and swaps
it in between two decoding steps (`Engine.swap_draft` takes the engine lock). Requests in flight finish
with the draft they started with for the steps already run; every response names the draft version that
produced its tokens (each step is credited to the version that proposed it). A failed load keeps the old
draft; the reason is in /health and in `draft_swaps_total{result="failed"}`, and the same version is
retried with exponential backoff while the alias names it; a draft pinned to another target is refused
(`result="refused"`) and never loaded. Champion reads retry with backoff; during an MLflow outage the
current draft keeps serving.
With an explicit `draft` folder the replica serves that folder as version "local" and does not watch.

Canary (issue 17): the watcher also follows the registry's `canary` alias (`check_canary`): it loads that
version beside the champion (same target check, materialisation and verification) and the engine routes
`draftsmith.canary_share` of new requests to it by a hash of the request id (serving/engine.py); when the
alias goes away the canary is unloaded (its requests continue on the champion draft), and when it becomes
the champion the loaded canary model takes over without a second load. /health shows the canary. Medusa
heads and the EAGLE head have canaries the same way, from their own registries' `canary` aliases
(`check_canary(kind=...)`, the engine's `set_heads_canary`; /health `heads_canary`).

Faults: Redis down -> the writer drops and counts records (buffer_records_dropped_total), requests are
unaffected; MLflow down -> no hot-swap and no live charts until it is back, requests are unaffected.
Decoding faults: see serving/scheduler.py (a failed batched forward fails that step's requests only).

Errors: the service raises its own domain errors (`ServiceError`: InvalidRequest, UnknownModel, Busy,
TimedOut, Conflict), never HTTP ones; serving/api.py maps them to status codes and error bodies. Every
limit on a request is checked here, once: the model name, the prompt and the context (`prepare`), the KV
budget (`check_fits`) and the queue (`stream`).

Outside systems come in through the protocols of serving/sources.py: the draft source (the registry,
built by deploy/app.py and passed as `registry`), the record sink (the replay-buffer writer) and the live
statistics sink behind the MetricsHub.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from serving.config import AUTO_MODE, DEFAULT_MODE, DEPLOYMENT_MODES, SamplingParams, served_mode
from serving.mode_choice import ModeChooser
from serving.metrics import MetricsHub, Telemetry

log = logging.getLogger(__name__)

# draft kinds served from the target's hidden states, each with its own registry (deploy/registry.py
# "Draft kinds"): the engine's loader, its live-version attribute, the Service's error attribute (/health),
# what to call it, and the key of the live version in an admin rollback's answer
HEADS_KINDS = {"medusa": ("load_heads", "heads_version", "heads_error", "Medusa heads", "replica_medusa_heads"),
               "eagle": ("load_eagle", "eagle_version", "eagle_error", "EAGLE head", "replica_eagle_head")}


class ServiceError(Exception):
    """A request the service refuses or cannot finish; `param` names the offending field, `code` the reason."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidRequest(ServiceError):
    """The request itself is wrong or over a limit (prompt, context, max_tokens, KV budget, rollback target)."""


class UnknownModel(ServiceError):
    """The request names a model this replica does not serve."""


class Busy(ServiceError):
    """The queue is full; retry after `retry_after_s` seconds."""

    retry_after_s = 1


class TimedOut(ServiceError):
    """The request did not finish (or start) within its deadline."""


class Conflict(ServiceError):
    """The operation does not apply in this replica's state (no registry, a draft that failed to load, a
    rollback the registry refused)."""


@dataclass
class ServiceSettings:
    """How a replica runs (the Ray Serve app passes these as a plain dict)."""

    target: str | None = None               # model id or local HF folder (default: SmolLM2-135M-Instruct)
    draft: str | None = None                # explicit draft folder: served as version "local", no watching
    medusa_heads: str | None = None         # Medusa heads folder for mode "medusa" (python -m training.heads)
    eagle_head: str | None = None           # EAGLE-style head folder for mode "eagle" (training.heads --kind eagle)
    # teacher data whose answers seed each replica's suffix store (serving/decoding/suffix.py); settings_from_env:
    # $DRAFTSMITH_SUFFIX_SEED ("none": no seed), default the bootstrap's <data>/bootstrap/teacher.safetensors where
    # it exists
    suffix_seed: str | None = None
    # how often the replica adds to its suffix store the answers the replay buffer holds from the other replicas
    # (and, once at start, the newest ones from before a restart): serving/decoding/suffix.py `BufferFollower`;
    # 0: never ($DRAFTSMITH_SUFFIX_FOLLOW_S)
    suffix_follow_s: float = 5.0
    served_model_name: str | None = None    # the `model` clients send (default: the target's name)
    registry_model: str | None = None       # registered model name (default draftsmith-<target>-draft)
    tracking_uri: str | None = None         # MLflow (default MLFLOW_TRACKING_URI or the local SQLite store)
    redis_url: str | None = None            # replay buffer (default REDIS_URL or the embedded server)
    buffer: bool = True                     # log verification steps to the replay buffer
    buffer_prefix: str = "draftsmith:buf"
    api_key: str | None = None              # when set: Bearer auth on /v1/* inference routes (not admin)
    admin_api_key: str | None = None        # when set: Bearer auth on /v1/admin/*; unset: loopback callers only
    device: str | None = None               # cpu / cuda (default: cuda when available)
    max_running: int = 16                   # requests decoding at once (batched together)
    max_waiting: int = 32                   # queue bound; beyond it 429
    max_batch_tokens: int = 65536           # KV tokens the running requests may reserve together (beams count)
    request_timeout_s: float = 300.0
    max_tokens_limit: int = 2048
    max_body_bytes: int = 1 << 20
    watch_interval_s: float = 2.0
    torch_threads: int | None = None
    prefill_threads: int | None = None      # torch threads for prompt prefill (None: torch_threads)
    wide_threads: int | None = None         # torch threads for a step that drafts (None: torch_threads)
    # run on fewer threads while distillation jobs or the gate beside serving hold cores (serving/contention.py)
    yield_to_jobs: bool = True
    # measure the seeded requests' cost profile (Engine.calibrate) at start and after a swap to a draft of
    # another shape, in the background; off: the first seeded sampled request measures it
    calibrate: bool = True
    # where the measured profile is kept, so that restarts and the other replicas of this machine plan seeded
    # requests alike (Engine.profile_dir; settings_from_env: $DRAFTSMITH_PROFILE_DIR, default
    # <cache dir>/cost-profiles); None: each replica measures its own
    profile_dir: str | None = None
    live_interval_s: float = 15.0
    # the mode of a request that names none (`Service.default_mode`, config.served_mode): "auto", the product's
    # default, drafts with the Medusa heads where the replica has them, else MJSD with the draft; a deployment
    # may pin a mode instead
    default_mode: str = AUTO_MODE
    # "auto" on a replica with both the Medusa heads and the draft: route each unseeded request that names no mode to
    # the one measured faster on this replica's traffic (serving/mode_choice.py `ModeChooser`); off: the heads
    # always ($DRAFTSMITH_AUTO_CHOICE=0)
    auto_choice: bool = True
    # move what the replica built at start (modules, models, tokenizer) to Python's permanent GC generation, as
    # vLLM does: a replica tracks about 560,000 objects and each full collection walked them all, a 0.5-s pause
    # of every thread on a 2-core CPU ($DRAFTSMITH_GC_FREEZE=0 turns it off; `freeze_startup_heap`)
    gc_freeze: bool = True
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __post_init__(self) -> None:
        for name in ("max_running", "max_waiting", "max_tokens_limit", "max_body_bytes", "max_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "max_waiting" else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.suffix_follow_s >= 0:
            raise ValueError(f"suffix_follow_s must be >= 0, got {self.suffix_follow_s!r}")
        for name in ("request_timeout_s", "watch_interval_s", "live_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.default_mode not in DEPLOYMENT_MODES:
            raise ValueError(f"default_mode must be one of {', '.join(DEPLOYMENT_MODES)}; got {self.default_mode!r}")


class _LocalHub:
    """Hub access for an in-process MetricsHub (tests, single process)."""

    def __init__(self, hub: MetricsHub) -> None:
        self.hub = hub

    def push(self, snapshot: dict) -> None:
        self.hub.push(snapshot)

    def observe(self, stats: dict) -> None:
        self.hub.observe(stats)

    async def render(self) -> str:
        return self.hub.render()


class _RayHub:
    """Hub access through the named Ray actor; pushes are fire-and-forget and never raise."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def push(self, snapshot: dict) -> None:
        try:
            self.handle.push.remote(snapshot)
        except Exception:  # noqa: BLE001
            pass

    def observe(self, stats: dict) -> None:
        try:
            self.handle.observe.remote(stats)
        except Exception:  # noqa: BLE001
            pass

    async def render(self) -> str:
        return await asyncio.wait_for(asyncio.wrap_future(self.handle.render.remote().future()), timeout=5.0)


def _next(gen):
    return next(gen, None)


class Service:
    """A replica. Pass `engine`, `sink` or `hub` to inject them (tests); else they are built from `settings`.
    `hub` may be a MetricsHub or a Ray actor handle of one. `registry` is the draft source
    (serving/sources.py `DraftSource`, deploy.registry.Registry in a deployment): without one and without an
    explicit `draft` folder the replica serves the target alone."""

    def __init__(self, settings: ServiceSettings | None = None, *, engine=None, registry=None, sink=None,
                 hub=None, heads_source=None, eagle_source=None) -> None:
        self.s = settings or ServiceSettings()
        if self.s.torch_threads:
            import torch

            torch.set_num_threads(self.s.torch_threads)
        self.telemetry = Telemetry(self.s.replica_id)
        # the served default's measured choice between the heads and the draft (mode "auto" only)
        self.chooser = (ModeChooser(("medusa", DEFAULT_MODE), discard_cold=True) if self.s.default_mode == AUTO_MODE
                        and self.s.auto_choice else None)
        if hub is None:
            hub = MetricsHub()                 # this replica's figures only; deploy/app.py passes the shared hub
        self.hub = _LocalHub(hub) if isinstance(hub, MetricsHub) else _RayHub(hub)
        self.registry = registry
        # where registered Medusa heads / EAGLE heads come from (deploy.registry.heads_registry; None: the
        # configured folder or none): their champions are hot-swapped in by check_heads, as the draft's is by
        # check_champion
        self.heads_source = heads_source if not self.s.medusa_heads else None
        self.eagle_source = eagle_source if not self.s.eagle_head else None
        self.sink = sink if sink is not None else self._make_sink()
        self.swap_error: str | None = None
        self.heads_error: str | None = None     # why the configured Medusa heads did not load
        self.eagle_error: str | None = None     # why the configured EAGLE head did not load
        self._failed_version: str | None = None
        self._swap_lock = threading.Lock()
        self.engine = engine if engine is not None else self._make_engine()
        self._name_target()
        if getattr(self.engine, "scheduler", None) is not None:
            if self.s.prefill_threads:
                self.engine.scheduler.prefill_threads = self.s.prefill_threads
            if self.s.wide_threads:
                self.engine.scheduler.wide_threads = self.s.wide_threads
            if self.s.yield_to_jobs:
                from serving.contention import ContentionWatch

                self.engine.scheduler.contention = ContentionWatch()
        if self.s.profile_dir and hasattr(self.engine, "profile_dir"):
            self.engine.profile_dir = self.s.profile_dir
        if self.s.gc_freeze:
            freeze_startup_heap()
        self.model_name = self.s.served_model_name or self._default_model_name()
        self._pool = cf.ThreadPoolExecutor(max_workers=self.s.max_running + 1, thread_name_prefix="decode")
        self._slots: asyncio.Semaphore | None = None
        self.running = 0
        self.waiting = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._publish_loop, name="telemetry", daemon=True)]
        if self.s.calibrate and hasattr(self.engine, "calibrate"):
            self._threads.append(threading.Thread(target=self._calibrate, name="calibration", daemon=True))
        if ((self.registry is not None and self.s.draft is None) or self.heads_source is not None
                or self.eagle_source is not None):
            self._threads.append(threading.Thread(target=self._watch_loop, name="draft-watcher", daemon=True))
        self.suffix_follower = self._make_follower()
        if self.suffix_follower is not None:
            learning = lambda: getattr(self.engine, "suffix_learn", True)  # noqa: E731
            self._threads.append(threading.Thread(target=self.suffix_follower.run, name="suffix-follower",
                                                  args=(self._stop, self.s.suffix_follow_s),
                                                  kwargs={"enabled": learning}, daemon=True))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ construction
    def _default_model_name(self) -> str:
        from buffer.paths import DEFAULT_TARGET, is_default_target

        t = self.s.target
        return DEFAULT_TARGET if is_default_target(t) else Path(str(t)).name

    def _make_sink(self):
        if not self.s.buffer:
            return None
        try:
            from buffer.redis_store import BufferConfig, ReplayBufferWriter

            return ReplayBufferWriter(self.s.redis_url, BufferConfig(prefix=self.s.buffer_prefix))
        except Exception as e:  # noqa: BLE001 - no buffer is a degraded service, not a dead one
            log.warning("replay buffer unavailable (%s); serving without logging verification steps", e)
            self.telemetry.set_gauge("buffer_available", 0)
            return None

    def _make_follower(self):
        """The thread that fills the suffix store from the replay buffer (None: no store, no Redis buffer, or
        following off)."""
        from buffer.redis_store import ReplayBufferReader, ReplayBufferWriter
        from serving.decoding.suffix import BufferFollower

        store = getattr(self.engine, "suffix_store", None)
        if store is None or not self.s.suffix_follow_s or not isinstance(self.sink, ReplayBufferWriter):
            return None
        reader = ReplayBufferReader(self.sink.client, self.sink.config, stream="sequences")
        return BufferFollower(store, reader, vocab_size=getattr(self.engine, "vocab_size", None))

    def _name_target(self) -> None:
        """Name this replica's target in the SequenceRecords it writes (`engine.target_sha256`, buffer/records.py
        `target`): a job then learns only the opinions of the target it distils for, however long the buffer
        outlives a change of target. Computed once per target folder (cached on disk, buffer/fingerprint.py);
        a target without a local folder, or a failure, leaves the records' target unknown ("")."""
        from buffer.fingerprint import target_fingerprint

        path = getattr(getattr(self.engine, "target", None), "path", None)
        if self.sink is None or path is None or getattr(self.engine, "target_sha256", None):
            return
        try:
            self.engine.target_sha256 = target_fingerprint(path)
        except Exception as e:  # noqa: BLE001 - the buffer still takes records, of unknown target
            log.warning("target fingerprint for the replay buffer: %s", e)

    def _make_engine(self):
        import torch

        from serving.engine import Engine

        device = self.s.device or ("cuda" if torch.cuda.is_available() else "cpu")
        engine = Engine.from_paths(self.s.target, None, device=device, sink=self.sink,
                                   max_batch_tokens=self.s.max_batch_tokens)
        if self.s.medusa_heads:
            try:
                engine.load_heads(self.s.medusa_heads)
            except Exception as e:  # noqa: BLE001 - bad heads cost mode "medusa" only, never the endpoint
                log.error("serving without Medusa heads: %s", e)
                self.heads_error = str(e)
        if self.s.eagle_head:
            try:
                engine.load_eagle(self.s.eagle_head)
            except Exception as e:  # noqa: BLE001 - a bad head costs mode "eagle" only, never the endpoint
                log.error("serving without an EAGLE head: %s", e)
                self.eagle_error = str(e)
        if self.s.suffix_seed:
            engine.seed_suffix_store(self.s.suffix_seed)
        if self.s.draft is not None:
            engine.swap_draft(self.s.draft, "local")
        else:
            self.check_champion(engine)
            self.check_canary(engine)
        for kind in HEADS_KINDS:
            self.check_heads(engine, kind=kind)
            self.check_canary(engine, kind=kind)
        return engine

    # ------------------------------------------------------------------ hot-swap
    def check_champion(self, engine=None, *, due_only: bool = False) -> str:
        """Load the registry's champion if it is not the live draft. Returns the live version.

        Faults (issue 17): the champion alias is read with a few quick retries; when MLflow still cannot
        be read the replica keeps serving what it has, says so in `swap_error` (/health) and the watcher
        backs off (`_watch_delay`). A swap that fails (MLflow error, corrupt artifacts, a draft that does not
        load) is retried with exponential backoff for as long as the alias names that version
        (`due_only`: the watcher's calls wait for the retry time; other callers, e.g. the admin reload
        route, try at once). A version built for another target (its `draftsmith.target_sha256` differs
        from this replica's target) is refused, loudly: an error in the log, `swap_error` in /health,
        `draft_swaps_total{result="refused"}`; the replica serves without it meanwhile (its current draft,
        or the target alone)."""
        engine = engine or self.engine
        if self.registry is None:
            return engine.draft_version
        with self._swap_lock:
            st = self._watch_state()
            try:
                version = self._read_champion()
            except Exception as e:  # noqa: BLE001 - MLflow down: keep serving what we have
                st["read_failures"] += 1
                st["error"] = "read"
                self.swap_error = (f"cannot read the champion alias ({e}); still serving draft version "
                                   f"{engine.draft_version}; retrying in {self._watch_delay():.0f} s")
                log.warning("draft watcher: %s", self.swap_error)
                self.telemetry.inc("draft_watch_errors_total")
                return engine.draft_version
            st["read_failures"] = 0
            if st.get("error") == "read":
                st["error"], self.swap_error = None, None
            if version is None or version == engine.draft_version:
                st["retry"] = {}
                if version is not None and st.get("error") in ("swap", "refused"):
                    st["error"], self.swap_error = None, None
                return engine.draft_version
            retry = st["retry"] if st["retry"].get("version") == version else {}
            now = time.monotonic()
            if due_only and retry and now < retry["next"]:
                return engine.draft_version
            t0 = time.perf_counter()
            refusal = None
            try:
                refusal = self._target_refusal(engine, version)
                if refusal is None:
                    path = self.registry.materialize(version, verify=True)
                    engine.swap_draft(path, version)
            except Exception as e:  # noqa: BLE001 - a failed load keeps the old draft; retried with backoff
                failure = f"{type(e).__name__}: {e}"
            else:
                failure = None
            if refusal is not None or failure is not None:
                attempts = retry.get("attempts", 0) + 1
                delay = min(300.0, max(1.0, self.s.watch_interval_s) * 2 ** (attempts - 1))
                st["retry"] = {"version": version, "attempts": attempts, "next": now + delay}
                self._failed_version = version
                serving = (f"version {engine.draft_version}" if engine.draft_version not in (None, "none")
                           else "the target alone (no draft)")
                if refusal is not None:
                    st["error"] = "refused"
                    self.swap_error = f"REFUSED draft version {version}: {refusal}; serving {serving} meanwhile"
                    log.error("replica %s: %s", self.s.replica_id, self.swap_error)
                    self.telemetry.inc("draft_swaps_total", result="refused")
                else:
                    st["error"] = "swap"
                    self.swap_error = (f"draft version {version} failed to load ({failure}); still serving {serving}; "
                                       f"retry {attempts} in {delay:.0f} s")
                    log.error(self.swap_error)
                    self.telemetry.inc("draft_swaps_total", result="failed")
                return engine.draft_version
            st["retry"], st["error"] = {}, None
            self._failed_version = None
            self.swap_error = None
            self.telemetry.inc("draft_swaps_total", result="ok")
            log.info("replica %s now serves draft version %s (swap took %.1f s)", self.s.replica_id, version,
                     time.perf_counter() - t0)
            if self.chooser is not None:        # the served default's choice measures the new draft afresh
                self.chooser.forget(DEFAULT_MODE)
            return version

    def _watch_state(self) -> dict:
        """The draft watcher's own state (created on first use): consecutive failed alias reads, the retry
        schedule of the version that failed to swap, the kind of the error in swap_error, and this
        replica's target fingerprint (computed once)."""
        st = self.__dict__.get("_draft_watch")
        if st is None:
            st = self.__dict__.setdefault("_draft_watch", {"read_failures": 0, "retry": {}, "error": None,
                                                           "target_sha256": None, "target_known": False})
        return st

    def _read_champion(self, attempts: int = 3, backoff_s: float = 0.2) -> str | None:
        """registry.champion() with `attempts` tries, backing off between them; the last error is raised
        (an outage raises: deploy.registry.RegistryUnavailable, never "no champion")."""
        for i in range(attempts):
            try:
                return self.registry.champion()
            except Exception:  # noqa: BLE001
                if i == attempts - 1 or self._stop.is_set():
                    raise
                time.sleep(backoff_s * 2 ** i)
        return None

    def _watch_delay(self) -> float:
        """Seconds until the watcher's next look: watch_interval_s, doubled per consecutive failed alias
        read, at most 60 s."""
        n = self._watch_state()["read_failures"]
        return self.s.watch_interval_s if n == 0 else min(60.0, self.s.watch_interval_s * 2 ** min(n, 10))

    def _target_refusal(self, engine, version: str, source=None) -> str | None:
        """Why `version` (of `source`, default the draft registry) must not be loaded next to this replica's
        target (None: it may). Versions that record no target fingerprint (registered before drafts were
        pinned) are loaded with a warning."""
        source = source if source is not None else self.registry
        st = self._watch_state()
        if not st["target_known"]:
            path = getattr(getattr(engine, "target", None), "path", None)
            st["target_sha256"] = source.target_fingerprint(path) if path is not None else None
            st["target_known"] = True
        mine = st["target_sha256"]
        theirs = source.get(version).target_sha256
        if theirs is None or mine is None:
            log.warning("draft version %s: %s; loading it without the target check", version,
                        "it records no target fingerprint" if theirs is None else "this replica's target has no "
                        "local folder to fingerprint")
            return None
        if theirs != mine:
            return (f"it was built for another target (fingerprint {theirs[:12]}), this replica serves "
                    f"{self.s.target or 'the default target'} ({mine[:12]})")
        return None

    def _calibrate(self) -> None:
        """The seeded requests' cost profile (Engine.calibrate; a no-op while the draft keeps its shape)."""
        try:
            self.engine.calibrate(cancel=self._stop)
        except Exception as e:  # noqa: BLE001 - without a profile seeded requests plan from prior costs
            log.warning("cost calibration: %s", e)

    def _watch_loop(self) -> None:
        while not self._stop.wait(self._watch_delay()):
            if self.registry is not None and self.s.draft is None:
                try:
                    self.check_champion(due_only=True)
                except Exception as e:  # noqa: BLE001 - the watcher must not die
                    log.warning("draft watcher: %s", e)
                if self.s.calibrate and hasattr(self.engine, "calibrate"):
                    self._calibrate()
                try:
                    self.check_canary()
                except Exception as e:  # noqa: BLE001
                    log.warning("draft watcher (canary): %s", e)
            for kind in HEADS_KINDS:
                try:
                    self.check_heads(due_only=True, kind=kind)
                    self.check_canary(kind=kind)
                except Exception as e:  # noqa: BLE001
                    log.warning("draft watcher (%s): %s", kind, e)

    def check_heads(self, engine=None, *, due_only: bool = False, kind: str = "medusa") -> str:
        """Load the champion of the `kind` heads registry (`heads_source` for "medusa", `eagle_source` for
        "eagle") if it is not the live one; returns the live version ("medusa-v<N>", "medusa:<folder>",
        "eagle-v<N>", ... or "none"). As `check_champion`: an unreadable registry keeps the current heads; a
        version that fails to load, or was built for another target, is not served (the old heads, or none,
        stay: that mode answers 400 without them, every other mode is untouched), the reason is in /health
        `heads_error` / `eagle_error`, and the load is retried with back-off."""
        engine = engine or self.engine
        load, version_attr, error_attr, label, _ = HEADS_KINDS[kind]
        src = self.heads_source if kind == "medusa" else self.eagle_source
        if src is None or not hasattr(engine, load):
            return getattr(engine, version_attr, "none")
        live = lambda: getattr(engine, version_attr)  # noqa: E731
        st = self._watch_state().setdefault(kind, {"version": None, "attempts": 0, "next": 0.0})
        with self._swap_lock:
            try:
                v = src.champion()
            except Exception as e:  # noqa: BLE001 - MLflow down: keep what we have
                setattr(self, error_attr, f"cannot read the {label}' champion alias ({type(e).__name__}: {e}); "
                                          f"still serving {live()}")
                return live()
            if v is None:
                return live()
            name = f"{kind}-v{v}"
            if name == live():
                st.update(version=None, attempts=0, next=0.0)
                setattr(self, error_attr, None)
                return name
            now = time.monotonic()
            if due_only and st["version"] == v and now < st["next"]:
                return live()
            try:
                theirs = src.get(v).target_sha256
                path = getattr(getattr(engine, "target", None), "path", None)
                mine = src.target_fingerprint(path) if path is not None else None
                if theirs and mine and theirs != mine:
                    raise ValueError(f"it was built for another target (fingerprint {theirs[:12]}), this "
                                     f"replica serves {mine[:12]}")
                getattr(engine, load)(src.materialize(v, verify=True), version=name)
            except Exception as e:  # noqa: BLE001 - bad heads cost their mode only, never the endpoint
                attempts = st["attempts"] + 1 if st["version"] == v else 1
                delay = min(300.0, max(1.0, self.s.watch_interval_s) * 2 ** (attempts - 1))
                st.update(version=v, attempts=attempts, next=now + delay)
                setattr(self, error_attr, f"{label} version {v} not loaded ({type(e).__name__}: {e}); serving "
                                          f"{live()}; retry {attempts} in {delay:.0f} s")
                log.error("replica %s: %s", self.s.replica_id, getattr(self, error_attr))
                self.telemetry.inc("heads_swaps_total", kind=kind, result="failed")
                return live()
            st.update(version=None, attempts=0, next=0.0)
            setattr(self, error_attr, None)
            self.telemetry.inc("heads_swaps_total", kind=kind, result="ok")
            log.info("replica %s now serves %s version %s", self.s.replica_id, label, v)
            if self.chooser is not None:        # the served default's choice measures the new heads afresh
                self.chooser.forget(kind)       # (at the first load: nothing measured yet, nothing dropped)
            return name

    def check_canary(self, engine=None, *, kind: str = "draft") -> str:
        """Follow the `canary` alias of the draft registry, or of the `kind` heads registry ("medusa",
        "eagle"; module docstring, "Canary"); returns the canary version this replica serves ("none"
        without one; heads: "<kind>-v<N>"). An unreadable registry keeps the current state; a canary that
        fails to load or was built for another target is not served (its share stays on the champion), the
        reason is in /health `canary.error` (`heads_canary.<kind>.error`), and the load is retried after a
        back-off."""
        engine = engine or self.engine
        heads = kind in HEADS_KINDS
        source = (self.heads_source if kind == "medusa" else self.eagle_source) if heads else self.registry
        if source is None or not hasattr(engine, "set_heads_canary" if heads else "set_canary"):
            return "none"
        name = (lambda v: f"{kind}-v{v}") if heads else str

        def live() -> tuple[str, float, object]:     # (canary version name, share, loaded path) on the engine
            if heads:
                c = engine.heads_canary.get(kind)
                return (c[1], c[2], c[3]) if c else ("none", 0.0, None)
            return engine.canary_version, engine.canary_share, getattr(engine.canary, "path", None)

        def serve(path, version: str, share: float) -> None:
            if heads:
                engine.set_heads_canary(kind, path, version, share)
            else:
                engine.set_canary(path, version, share)

        key = "canary" if not heads else f"canary-{kind}"
        st = self._watch_state().setdefault(key, {"error": None, "version": None, "next": 0.0, "attempts": 0})
        with self._swap_lock:
            try:
                c = source.canary()
            except Exception as e:  # noqa: BLE001 - MLflow down: keep what we have
                st["error"] = f"cannot read the canary alias ({type(e).__name__}: {e})"
                return live()[0]
            champion_name = engine.version_of(kind) if heads else engine.draft_version
            if c is None or c["share"] <= 0 or name(c["version"]) == champion_name:
                if live()[0] != "none":
                    log.info("replica %s: canary %s version %s ended", self.s.replica_id, kind, live()[0])
                    serve(None, "none", 0.0)
                st.update(error=None, version=None, attempts=0)
                return "none"
            version, share = name(c["version"]), c["share"]
            current, current_share, current_path = live()
            if version == current:
                if share != current_share:                            # loaded: only the share changes
                    serve(current_path, version, share)
                return version
            now = time.monotonic()
            if st["version"] == version and st["error"] and now < st["next"]:
                return current
            try:
                refusal = self._target_refusal(engine, c["version"], source)
                if refusal is not None:
                    raise RuntimeError(f"REFUSED: {refusal}")
                serve(source.materialize(c["version"], verify=True), version, share)
            except Exception as e:  # noqa: BLE001 - the champion keeps all traffic meanwhile
                st["attempts"] = st["attempts"] + 1 if st["version"] == version else 1
                delay = min(300.0, max(1.0, self.s.watch_interval_s) * 2 ** (st["attempts"] - 1))
                st.update(version=version, next=now + delay,
                          error=f"canary version {version} not served ({type(e).__name__}: {e}); retry in {delay:.0f} s")
                log.error("replica %s: %s", self.s.replica_id, st["error"])
                self.telemetry.inc("heads_swaps_total" if heads else "draft_swaps_total",
                                   **({"kind": kind} if heads else {}), result="canary_failed")
                return current
            st.update(error=None, version=version, attempts=0)
            self.telemetry.inc("heads_swaps_total" if heads else "draft_swaps_total",
                               **({"kind": kind} if heads else {}), result="canary")
            log.info("replica %s serves canary %s version %s to %.0f%% of new requests", self.s.replica_id, kind,
                     version, 100 * share)
            return version

    def _heads_canary_health(self, kind: str) -> dict:
        c = getattr(self.engine, "heads_canary", {}).get(kind)
        return {"version": c[1] if c else "none", "share": c[2] if c else 0.0,
                "error": self._watch_state().get(f"canary-{kind}", {}).get("error")}

    # ------------------------------------------------------------------ telemetry
    def publish(self) -> dict:
        t = self.telemetry
        t.set_gauge("num_requests_running", self.running)
        t.set_gauge("num_requests_waiting", self.waiting)
        t.clear_gauge("draft_version_info")
        t.set_gauge("draft_version_info", 1, replica=self.s.replica_id, version=self.engine.draft_version)
        if self.sink is not None and hasattr(self.sink, "stats"):
            st = self.sink.stats()
            t.set_counter("buffer_records_written_total", st.get("written", 0))
            t.set_counter("buffer_records_dropped_total", st.get("dropped", 0))
        snap = t.snapshot()
        self.hub.push(snap)
        return snap

    def _publish_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.publish()
            except Exception as e:  # noqa: BLE001
                log.debug("telemetry publish failed: %s", e)

    async def metrics_text(self) -> str:
        self.publish()
        try:
            return await self.hub.render()
        except Exception as e:  # noqa: BLE001 - the hub is gone: this replica's own figures
            from serving.metrics import merge, render

            log.warning("metrics hub unavailable (%s); /metrics shows this replica only", e)
            return render(merge([self.telemetry.snapshot()]))

    def health(self) -> tuple[bool, dict]:
        ok, why = self.engine.healthy()
        info = {"status": "ok" if ok else "unhealthy", "reason": why, "replica": self.s.replica_id,
                "draft_version": self.engine.draft_version, "draft_loaded": self.engine.draft is not None,
                "default_mode": self.default_mode,
                "auto_choice": None if self.chooser is None else self.chooser.snapshot(),
                "medusa_heads": getattr(self.engine, "heads_version", "none"), "heads_error": self.heads_error,
                "eagle_head": getattr(self.engine, "eagle_version", "none"), "eagle_error": self.eagle_error,
                "swap_error": self.swap_error, "running": self.running, "waiting": self.waiting,
                "canary": {"version": getattr(self.engine, "canary_version", "none"),
                           "share": getattr(self.engine, "canary_share", 0.0),
                           "error": self._watch_state().get("canary", {}).get("error")},
                "heads_canary": {k: self._heads_canary_health(k) for k in HEADS_KINDS},
                "buffer": None if self.sink is None else {k: v for k, v in self.sink.stats().items()
                                                          if k in ("written", "dropped", "queued")},
                "suffix_store": self._suffix_health(),
                "gc": {"frozen": gc.get_freeze_count(), "collections": [g["collections"] for g in gc.get_stats()]},
                "threads": self._threads_health()}
        return ok, info

    def _threads_health(self) -> dict:
        """torch threads of the replica's plain decoding steps, prompt prefills and steps that draft, and the
        processes beside serving it yields cores to meanwhile (None: it does not watch for them)."""
        sched = getattr(self.engine, "scheduler", None)
        decode = self.s.torch_threads       # None: torch's own default (not set by the replica)
        watch = getattr(sched, "contention", None)
        return {"decode": decode, "prefill": getattr(sched, "prefill_threads", None) or decode,
                "drafting": getattr(sched, "wide_threads", None) or decode,
                "jobs_beside": None if watch is None else watch.markers()}

    def _suffix_health(self) -> dict | None:
        """The replica's suffix store (serving/decoding/suffix.py): answers and tokens held; None when off."""
        store = getattr(self.engine, "suffix_store", None)
        if store is None:
            return None
        f = getattr(self, "suffix_follower", None)
        return {"answers": store.answers, "tokens": len(store), "capacity": store.capacity,
                "seed": self.s.suffix_seed, "from_buffer": None if f is None else f.added,
                "buffer_error": None if f is None else f.error}

    # ------------------------------------------------------------------ what callers may read
    @property
    def settings(self) -> ServiceSettings:
        return self.s

    @property
    def draft_version(self) -> str:
        """The champion draft version this replica serves ("none": the target alone, "local": --draft)."""
        return self.engine.draft_version

    @property
    def has_draft(self) -> bool:
        return self.engine.draft is not None

    @property
    def default_mode(self) -> str:
        """The mode of a request that names none: the deployment's `default_mode` while what it needs is
        loaded (the draft model, the Medusa heads, the EAGLE head), else mjsd with a draft, else the target
        alone. A request is never refused for what the deployment chose; it decodes the next best way, and
        its response's metrics name the mode that ran."""
        return served_mode(self.s.default_mode, has_draft=self.has_draft,
                           has_heads=getattr(self.engine, "heads", None) is not None,
                           has_eagle=getattr(self.engine, "eagle", None) is not None)

    def request_mode(self, named: bool, sampling: SamplingParams, label: str = "") -> tuple[str, dict | None]:
        """(mode, routing) for a request: `named` (it has a `speculative` field) or seeded requests at T > 0 (whose
        text reproduces on one mode only; at T = 0 every mode emits the target's greedy text), and replicas without
        both the heads and the draft, get `default_mode`; the others the chooser's pick, with the routing that
        `record` counts its speed under (serving/mode_choice.py)."""
        mode, t = self.default_mode, sampling.temperature
        seeded = sampling.seed is not None and t > 0
        if self.chooser is None or named or seeded or mode != "medusa" or not self.has_draft:
            return mode, None
        mode, why = self.chooser.choose(t, label, busy=self._beside_jobs())
        return mode, {"temperature": t, "label": label, "why": why}

    def _beside_jobs(self) -> bool:
        """Whether jobs beside serving hold cores now (serving/contention.py; False where the replica does not
        watch for them)."""
        watch = getattr(getattr(self.engine, "scheduler", None), "contention", None)
        return watch is not None and watch.busy_cores() > 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def count_error(self, code: str | int) -> None:
        """Count a request that ended in an error (`request_errors_total{code}`)."""
        self.telemetry.inc("request_errors_total", code=str(code))

    # ------------------------------------------------------------------ request limits (each checked once, here)
    def prepare(self, *, model: str | None, prompt: str | list[int] | None = None,
                messages: list[dict] | None = None, max_tokens: int | None = None) -> tuple[list[int], int]:
        """Check a request against this replica and tokenise it: the model name (UnknownModel), the prompt
        (text, token ids, or chat `messages` through the chat template), the context and `max_tokens_limit`
        (InvalidRequest). `max_tokens` None: the rest of the context up to the limit for a chat, 16 for a
        completion. Returns (prompt token ids, max_tokens)."""
        if model not in (None, self.model_name, self.s.target):
            raise UnknownModel(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                               param="model", code="model_not_found")
        chat = messages is not None
        ids = self._prompt_ids(prompt, messages)
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenisation", param="prompt")
        ctx = self.engine.max_context
        if len(ids) >= ctx:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {ctx} tokens",
                                 param="messages" if chat else "prompt", code="context_length_exceeded")
        limit = self.s.max_tokens_limit
        if max_tokens is None:
            max_tokens = min(limit, ctx - len(ids)) if chat else 16
        if max_tokens > limit:
            raise InvalidRequest(f"max_tokens is {max_tokens}; this server allows at most {limit}", param="max_tokens")
        if len(ids) + max_tokens > ctx:
            raise InvalidRequest(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this "
                                 f"model's context of {ctx} tokens; lower max_tokens", param="max_tokens",
                                 code="context_length_exceeded")
        return ids, max_tokens

    def _prompt_ids(self, prompt, messages) -> list[int]:
        tok = self.engine.tokenizer
        if messages is not None:
            if not getattr(tok, "chat_template", None):
                raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            return [int(i) for i in ids]
        if isinstance(prompt, str):
            return [int(i) for i in tok(prompt, add_special_tokens=False)["input_ids"]]
        ids = list(prompt or [])
        bad = [i for i in ids if not 0 <= i < self.engine.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside [0, {self.engine.vocab_size})", param="prompt")
        return ids

    def check_fits(self, prompt_len: int, sampling, spec) -> None:
        """InvalidRequest when the request could never fit this replica's KV budget, or asks for mode "medusa"
        ("eagle") on a replica without heads (an EAGLE head): the engine would refuse it inside decoding, where
        the client would only see an internal error."""
        if spec.mode == "medusa" and self.engine.heads is None:
            from serving.engine import MEDUSA_NEEDS_HEADS

            why = f" (loading them failed: {self.heads_error})" if self.heads_error else ""
            raise InvalidRequest(MEDUSA_NEEDS_HEADS + why, param="speculative.mode", code="medusa_heads_unavailable")
        if spec.mode == "eagle" and getattr(self.engine, "eagle", None) is None:
            from serving.engine import EAGLE_NEEDS_HEAD

            why = f" (loading it failed: {self.eagle_error})" if self.eagle_error else ""
            raise InvalidRequest(EAGLE_NEEDS_HEAD + why, param="speculative.mode", code="eagle_head_unavailable")
        footprint, budget = self.engine.footprint(prompt_len, sampling, spec), self.engine.max_batch_tokens
        if footprint > budget:
            raise InvalidRequest(f"this request may hold {footprint} KV tokens (prompt + max_tokens + gamma, times "
                                 f"beams or drafts), more than this server's budget of {budget}; lower max_tokens, "
                                 "speculative.beams or speculative.params.num_drafts", param="max_tokens",
                                 code="kv_budget_exceeded")

    # ------------------------------------------------------------------ admin operations
    def draft_status(self) -> dict:
        """This replica's draft and the registry's champion (read now; a failed read is said as such)."""
        champion = None
        if self.registry is not None:
            try:
                champion = self.registry.champion()
            except Exception:  # noqa: BLE001
                log.warning("admin: cannot read the champion alias", exc_info=True)
                champion = "unknown (the registry could not be read; the replica log has the cause)"
        return {"replica": self.s.replica_id, "draft_version": self.engine.draft_version, "champion": champion,
                "swap_error": self.swap_error}

    def reload(self) -> dict:
        """Load the champion now (Conflict without a registry or when the load fails)."""
        if self.registry is None:
            raise Conflict("this server serves an explicit draft folder (--draft); there is no registry "
                           "to reload from", code="no_registry")
        version = self.check_champion()
        if self.swap_error:
            raise Conflict(self.swap_error, code="draft_load_failed")
        return {"replica": self.s.replica_id, "draft_version": version,
                "note": "other replicas load the champion within their watch interval"}

    def rollback(self, to: str | None = None, *, reason: str | None = None, kind: str = "draft") -> dict:
        """Move the registry's champion back (as `draftsmith rollback`) and load it here; `kind` "medusa" /
        "eagle": that heads registry's (as `draftsmith rollback --kind medusa|eagle`). InvalidRequest for a wrong `to` (the
        source's ValueError), Conflict when there is no registry or it refuses."""
        from serving.sources import DraftSourceError

        if kind in HEADS_KINDS:
            source = self.heads_source if kind == "medusa" else self.eagle_source
            reload, loaded = (lambda: self.check_heads(kind=kind)), HEADS_KINDS[kind][4]
            if source is None:
                raise Conflict(f"this server serves a fixed {HEADS_KINDS[kind][3]} folder or none; there is no "
                               f"{kind} registry to roll back", code="no_registry")
        else:
            source, reload, loaded = self.registry, self.check_champion, "replica_draft_version"
            if source is None:
                raise Conflict("this server serves an explicit draft folder (--draft); nothing to roll back",
                               code="no_registry")
        try:
            move = source.rollback(to, reason=reason or "http admin")
        except ValueError as e:
            raise InvalidRequest(str(e), param="to") from None
        except DraftSourceError as e:
            raise Conflict(str(e), code="rollback_failed") from None
        return {"changed": move.changed, "champion": move.champion, "old_champion": move.old_champion,
                "message": move.message, loaded: reload()}

    # ------------------------------------------------------------------ decoding
    def stream(self, prompt_ids: list[int], sampling, spec, *, request_id: str, log_mode: str = "full",
               deadline: float, cancel: threading.Event | None = None, source: str = "") -> AsyncIterator:
        """Admit the request (Busy when the queue is full: checked here, before anything is sent), then return
        an async iterator of StepOutput objects as the engine produces them.

        The iterator raises TimedOut (deadline passed, queued or decoding). The caller stops the stream
        (disconnect, stop string) by closing the iterator or setting `cancel`; the engine's generator is
        then closed in the decode pool after its current step.
        """
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.s.max_running)
        if self.waiting >= self.s.max_waiting and self._slots.locked():
            raise Busy(f"the server is busy ({self.running} requests decoding, {self.waiting} queued); "
                       "retry shortly", code="queue_full")
        return self._decode(prompt_ids, sampling, spec, request_id=request_id, log_mode=log_mode, deadline=deadline,
                            cancel=cancel, source=source)

    async def _decode(self, prompt_ids: list[int], sampling, spec, *, request_id: str, log_mode: str,
                      deadline: float, cancel: threading.Event | None, source: str = "") -> AsyncIterator:
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TimedOut("the request timed out waiting for a decoding slot", code="request_timeout") from None
        finally:
            self.waiting -= 1
        self.running += 1
        cancel = cancel or threading.Event()
        gen = self.engine.generate(prompt_ids, sampling, spec, request_id=request_id, cancel=cancel,
                                   log_mode=log_mode, source=source)
        pending: cf.Future | None = None
        try:
            while True:
                pending = self._pool.submit(_next, gen)
                left = deadline - time.monotonic()
                try:
                    out = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending)), timeout=max(0.0, left))
                except asyncio.TimeoutError:
                    raise TimedOut(f"the request did not finish within {self.s.request_timeout_s:g} s",
                                   code="request_timeout") from None
                pending = None
                if out is None:
                    return
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            cancel.set()
            self._close_later(gen, pending)
            self.running -= 1
            self._slots.release()

    def _close_later(self, gen, pending: cf.Future | None) -> None:
        """Close the engine generator in the pool once its in-flight step (if any) is done."""
        def close(_=None):
            try:
                self._pool.submit(gen.close)
            except RuntimeError:  # pool shut down
                pass
        if pending is None or pending.done():
            close()
        else:
            pending.add_done_callback(close)

    def record(self, stats: dict, prompt_tokens: int, reason: str, latency_s: float, ttft_s: float | None,
               routing: dict | None = None) -> None:
        """Count a finished request: telemetry, the metrics hub, and (`routing` from `request_mode`) the chooser."""
        self.telemetry.record_request(stats, prompt_tokens, reason)
        if routing is not None and self.chooser is not None and stats:
            wall = float(stats.get("wall_time_s") or 0.0)
            own = wall - float(stats.get("other_steps_s") or 0.0)
            busy = float(stats.get("beside_jobs_s") or 0.0) > 0.5 * wall    # mostly beside a job: kept apart
            # the steps it took in its kind's batch, and their time; the rest of its own time outside any pass
            # (its prefill, admission) goes to each company in proportion to steps (mode_choice.py, "company")
            steps = int(stats.get("steps") or 0)
            share = min(1.0, int(stats.get("shared_steps") or 0) / steps) if steps else 0.0
            outside = max(0.0, own - float(stats.get("own_steps_s") or 0.0))
            self.chooser.observe(stats.get("mode", ""), routing["temperature"], routing["label"],   # mode_choice.py
                                 int(stats.get("tokens") or 0), own, busy=busy, shared_share=share,
                                 shared_s=float(stats.get("shared_steps_s") or 0.0) + share * outside)
        self.telemetry.observe("e2e_request_latency_seconds", latency_s)
        if ttft_s is not None:
            self.telemetry.observe("time_to_first_token_seconds", ttft_s)
        self.hub.observe(stats)

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            if t.name == "calibration":      # cancelled by _stop: gone within a decoding step
                t.join(timeout=10.0)
        if self.sink is not None and hasattr(self.sink, "close"):
            self.sink.close(timeout_s=2.0)


_heap_frozen = 0                                         # objects frozen at start; 0 until then


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now into the permanent generation (gc.freeze), once per process;
    returns how many objects it froze then (the permanent generation shrinks later as frozen objects die). A
    replica's startup heap (torch, transformers, Ray, MLflow, the models) lives as long as the process, and without
    this each full collection walks all of it: 0.5-0.6 s on a 2-core AVX2 host (docs/benchmarks.md, "The
    thirty-fifth session"). Later objects are collected as usual; what the frozen heap drops is freed by reference
    counting, its cycles are not (a process builds one replica)."""
    global _heap_frozen
    if not _heap_frozen:
        gc.collect()
        gc.freeze()
        _heap_frozen = gc.get_freeze_count()
    return _heap_frozen


def _switch(value: str) -> bool:
    """An on/off environment value: off for 0 / false / no / off, on otherwise."""
    return value.strip().lower() not in ("0", "false", "no", "off")


def settings_from_env(**overrides) -> ServiceSettings:
    """ServiceSettings from DRAFTSMITH_* environment variables, then `overrides` (None values ignored)."""
    env = os.environ
    kw: dict = {}
    if env.get("DRAFTSMITH_MEDUSA_HEADS"):
        kw["medusa_heads"] = env["DRAFTSMITH_MEDUSA_HEADS"]
    if env.get("DRAFTSMITH_EAGLE_HEAD"):
        kw["eagle_head"] = env["DRAFTSMITH_EAGLE_HEAD"]
    for name, conv in (("max_running", int), ("max_waiting", int), ("max_batch_tokens", int), ("request_timeout_s", float),
                       ("max_tokens_limit", int), ("watch_interval_s", float), ("torch_threads", int),
                       ("prefill_threads", int), ("wide_threads", int), ("yield_to_jobs", _switch),
                       ("calibrate", _switch), ("live_interval_s", float),
                       ("default_mode", str), ("suffix_follow_s", float), ("gc_freeze", _switch),
                       ("auto_choice", _switch)):
        v = env.get(f"DRAFTSMITH_{name.upper()}")
        if v:
            kw[name] = conv(v)
    if env.get("DRAFTSMITH_ADMIN_KEY"):
        kw["admin_api_key"] = env["DRAFTSMITH_ADMIN_KEY"]
    from buffer.paths import cache_dir
    from serving.decoding.suffix import resolve_seed

    kw["profile_dir"] = env.get("DRAFTSMITH_PROFILE_DIR") or str(cache_dir() / "cost-profiles")
    kw["suffix_seed"] = resolve_seed(env.get("DRAFTSMITH_SUFFIX_SEED"))
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ServiceSettings(**kw)
