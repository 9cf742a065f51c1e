"""The Ray Serve application: N replicas of the FastAPI app (serving/api.py) over a Service each, plus
one named MetricsHub actor that merges their metrics and logs live acceptance to MLflow.

It lives in deploy/ because it wires serving to the outside systems: each replica's Service gets the
registry (deploy/registry.py) as its draft source and the hub gets the live statistics logger
(deploy/live_stats.py) as its statistics sink (the protocols of serving/sources.py); serving/ itself
imports nothing from deploy/.

    draftsmith serve [--port 8000] [--replicas 1] [--draft DIR] [--api-key KEY] [--admin-key KEY]
                                                                                 -> serve_forever(...)
    serve run deploy.app:app_builder target=... replicas=2                        (an existing Ray)
    serve deploy deploy/serve_config.yaml                                          (a running cluster)

`serve_forever` starts (or joins, with RAY_ADDRESS) Ray and writes its address to
`<data dir>/ray-cluster.json` (removed at shutdown; scheduled distillation jobs are submitted to that Ray,
deploy/ray_jobs.py), resolves the Redis URL once (REDIS_URL or the
embedded server under ./data, shared by every replica) and the MLflow tracking URI, starts the hub, and
runs the app on host:port until SIGINT or SIGTERM. Then, in order, it stops the hub, Serve, Ray
(`ray.shutdown`, which stops the raylet and with it Ray's agents), the embedded Redis, and finally every
process still running below it. (Before, Ray's own SIGTERM handler exited the driver and Ray went down by
fate-sharing: its DashboardAgent and RuntimeEnvAgent, orphaned, kept running for minutes.) For that
last sweep `serve_forever` makes its process a child subreaper (Linux), so whatever Ray orphans on the
way is re-parented to it instead of to init and is still found. A second signal, or a shutdown longer
than SHUTDOWN_TIMEOUT_S, stops everything below at once with SIGKILL.

Keys: `app_builder` (serve run / serve deploy) takes `api_key` and `admin_api_key` from its args, else
from DRAFTSMITH_API_KEY / DRAFTSMITH_ADMIN_KEY in the environment of the process that builds the app,
so deploy/serve_config.yaml holds no key. CPU budget: each replica asks Ray for `num_cpus` (default
2 / replicas on a 2-core machine, so that one or two replicas fit beside the proxy) and sets torch's
thread count to match. Priority: a Ray that `serve_forever` starts runs its workers at niceness 0
(`RAY_worker_niceness`, unless set already), not Ray's default of 15, under which a load generator or any
other process at normal priority took the replica's core first (docs/benchmarks.md); a cluster joined
through RAY_ADDRESS keeps its own setting.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from ray import serve

from serving.metrics import HUB_NAME, HUB_NAMESPACE, MetricsHub
from serving.service import Service, ServiceSettings, settings_from_env

log = logging.getLogger(__name__)
APP_NAME = "draftsmith"
SHUTDOWN_TIMEOUT_S = 60.0     # graceful stop (replicas finish in-flight requests: up to 20 s); then SIGKILL
RAY_WORKER_NICENESS = "RAY_worker_niceness"   # read by the raylet when it starts (Ray's default: 15)


@serve.deployment(name="Draftsmith", max_ongoing_requests=64, health_check_period_s=10,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=20)
@serve.ingress()
class DraftsmithDeployment:
    def __init__(self, settings: dict) -> None:
        import ray

        logging.basicConfig(level=logging.INFO)
        hub = None
        try:
            hub = ray.get_actor(HUB_NAME, namespace=HUB_NAMESPACE)
        except ValueError:
            log.warning("metrics hub %s not found; this replica keeps its own metrics", HUB_NAME)
        s = ServiceSettings(**settings)
        self.service = Service(s, registry=draft_source(s), hub=hub if hub is not None else MetricsHub(),
                               heads_source=heads_source(s), eagle_source=heads_source(s, "eagle"))

    def __serve_build_asgi_app__(self):
        from serving.api import build_app

        return build_app(self.service)

    def check_health(self) -> None:
        ok, info = self.service.health()
        if not ok:
            raise RuntimeError(f"engine unhealthy: {info.get('reason')}")

    def __del__(self):
        try:
            self.service.close()
        except Exception:  # noqa: BLE001
            pass


def draft_source(settings: ServiceSettings):
    """The replica's draft source: the registry of its target, or None with an explicit `draft` folder."""
    if settings.draft is not None:
        return None
    from deploy.registry import Registry

    return Registry(settings.target, name=settings.registry_model, tracking_uri=settings.tracking_uri)


def heads_source(settings: ServiceSettings, kind: str = "medusa"):
    """The replica's source of `kind` heads: that heads registry of its target (deploy/registry.py "Draft
    kinds"), or None when an explicit folder is configured (`--medusa-heads`, `--eagle-head`)."""
    if settings.medusa_heads if kind == "medusa" else settings.eagle_head:
        return None
    from deploy.registry import heads_registry

    return heads_registry(settings.target, kind, name=settings.registry_model, tracking_uri=settings.tracking_uri)


def start_hub(settings: ServiceSettings):
    """The named, detached MetricsHub actor (created once; later calls return the existing one), logging
    live statistics to MLflow (deploy/live_stats.py) unless the replicas serve an explicit draft folder."""
    import ray

    from deploy.live_stats import live_stats_factory

    live = None
    if settings.draft is None:
        live = live_stats_factory(settings.tracking_uri, settings.target, settings.registry_model,
                                  settings.live_interval_s)
    Hub = ray.remote(num_cpus=0)(MetricsHub)
    return Hub.options(name=HUB_NAME, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached").remote(live)


def build(settings: ServiceSettings, replicas: int = 1, num_cpus: float | None = None):
    """The bound application for serve.run: `replicas` replicas with `num_cpus` CPUs each."""
    cpus = float(num_cpus if num_cpus is not None else max(0.25, min(1.0, (os.cpu_count() or 2) / (2 * replicas))))
    share = max(1, (os.cpu_count() or 2) // replicas)
    if settings.torch_threads is None:
        # each replica decodes on its share of the cores. An early session left one core to the Serve proxy (37 vs
        # 31 tok/s at one streaming client, measured while idle OpenMP workers slept and had to be woken every
        # pass, since fixed: serving/models.py release_openmp_threads); on a 2-core host one replica on 2
        # threads then served the traffic mix's target-only requests 17% faster and 4 streaming clients 12%
        # faster than 1 thread (docs/benchmarks.md, "The thirty-eighth session": an AMD bf16 host); on an Intel fp32
        # host, target-only 33% and the served default 19% faster ("The thirty-ninth session")
        settings.torch_threads = share
    if settings.prefill_threads is None:
        # a prompt's prefill is one compute-bound forward: where decoding leaves cores idle it borrows them
        # (150-token prompt on a 2-core AMD host: 0.78-0.86 s on one thread, 0.47-0.60 s on two)
        settings.prefill_threads = max(settings.torch_threads, share)
    if settings.wide_threads is None:
        # so does a step that drafts: its verification pass over k + 1 tokens (a tree's nodes) is compute-bound
        settings.wide_threads = max(settings.torch_threads, share)
    opts = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus}}
    fields = {k: getattr(settings, k) for k in settings.__dataclass_fields__ if k != "replica_id"}
    return DraftsmithDeployment.options(**opts).bind(fields)


def settings_from_args(args: dict) -> tuple[ServiceSettings, int, float | None]:
    """`app_builder`'s args -> (settings, replicas, num_cpus). Values arrive as strings from `serve run`;
    `api_key` / `admin_api_key` not given (or empty) come from DRAFTSMITH_API_KEY / DRAFTSMITH_ADMIN_KEY."""
    args = dict(args or {})
    replicas = int(args.pop("replicas", 1))
    num_cpus = args.pop("num_cpus", None)
    for field_name, env_name in (("api_key", "DRAFTSMITH_API_KEY"), ("admin_api_key", "DRAFTSMITH_ADMIN_KEY")):
        if not args.get(field_name):
            args[field_name] = os.environ.get(env_name) or None
    conv = {"max_running": int, "max_waiting": int, "max_batch_tokens": int, "max_tokens_limit": int, "max_body_bytes": int,
            "request_timeout_s": float, "watch_interval_s": float, "live_interval_s": float, "torch_threads": int,
            "prefill_threads": int, "wide_threads": int,
            "default_mode": str}
    for k, f in conv.items():
        if k in args and args[k] is not None:
            args[k] = f(args[k])
    for switch in ("buffer", "yield_to_jobs"):        # on/off values from a YAML or `serve run` string
        if switch in args and isinstance(args[switch], str):
            args[switch] = args[switch].strip().lower() not in ("0", "false", "no", "off")
    settings = ServiceSettings(**args)
    check_keys(settings)
    return settings, replicas, float(num_cpus) if num_cpus is not None else None


def check_keys(settings: ServiceSettings) -> None:
    """ValueError when the admin key equals the inference key (every inference client would hold it)."""
    if settings.admin_api_key and settings.admin_api_key == settings.api_key:
        raise ValueError("admin_api_key (DRAFTSMITH_ADMIN_KEY) must differ from api_key (DRAFTSMITH_API_KEY)")


def app_builder(args: dict):
    """Entry point for `serve run deploy.app:app_builder key=value ...` and serve_config.yaml.

    args: any ServiceSettings field, plus `replicas` and `num_cpus` (see settings_from_args). The hub is
    started here, so the app has merged metrics and live MLflow charts however it was deployed."""
    settings, replicas, num_cpus = settings_from_args(args)
    if settings.redis_url is None and settings.buffer and not os.environ.get("REDIS_URL"):
        from buffer.embedded import ensure_embedded

        settings.redis_url = ensure_embedded()
    start_hub(settings)
    return build(settings, replicas, num_cpus)


# ---------------------------------------------------------------------------------- process lifecycle
class _Stop(BaseException):
    """Raised in the main thread by the SIGTERM / SIGINT handler (a BaseException, like KeyboardInterrupt,
    so no `except Exception` on the way swallows it)."""


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): orphaned descendants are
    re-parented to it, not to init, so they stay findable below it. False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0        # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        return False


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) of every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()       # the command name may hold spaces and parentheses
        if len(rest) >= 2:
            out[int(entry)] = (int(rest[1]), rest[0])
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Live (not zombie) processes below `pid` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (pp, _) in table.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], list(children.get(root, ()))
    while todo:
        p = todo.pop()
        if table.get(p, (0, "Z"))[1] not in ("Z", "X"):
            out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _reap_children() -> None:
    """Collect exit statuses of this process's finished children (adopted orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_descendants(grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process below this one, SIGKILL what is left after `grace_s`; return the pids
    that were still running when called."""
    found = pids = descendants()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            _reap_children()
            if not descendants():
                break
            time.sleep(0.1)
        left = descendants()
        if not left:
            break
        pids = left
    _reap_children()
    return found


def _hard_stop(code: int) -> None:
    """A second signal or a hung shutdown: kill everything below at once and exit."""
    try:
        print("[serve] stopping every remaining process now (SIGKILL)", file=sys.stderr, flush=True)
        stop_descendants(grace_s=0.0)
    finally:
        os._exit(code)


def _install_stop_handlers() -> None:
    def first(signum, _frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, first)


def serve_forever(host: str = "127.0.0.1", port: int = 8000, target: str | None = None, draft: str | None = None,
                  replicas: int = 1, api_key: str | None = None, admin_api_key: str | None = None,
                  **settings) -> None:
    """Start Ray (or join RAY_ADDRESS), the embedded Redis when needed, the hub and the app; block until
    SIGINT or SIGTERM, then stop everything this process started (see the module docstring)."""
    import ray

    from buffer.paths import DEFAULT_TARGET, default_tracking_uri

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        become_subreaper()
        _install_stop_handlers()
    hub = None
    why = "stopped"
    try:
        s = settings_from_env(target=target, draft=draft, api_key=api_key, admin_api_key=admin_api_key, **settings)
        check_keys(s)
        s.tracking_uri = s.tracking_uri or default_tracking_uri()
        if s.buffer and s.redis_url is None and not os.environ.get("REDIS_URL"):
            from buffer.embedded import ensure_embedded

            s.redis_url = ensure_embedded()
        s.redis_url = s.redis_url or os.environ.get("REDIS_URL")
        if not os.environ.get("RAY_ADDRESS"):
            # a Ray started here runs its workers (the replicas, the proxy) at normal priority: Ray's default
            # niceness of 15 let any other busy process on the machine take the replicas' cores first
            os.environ.setdefault(RAY_WORKER_NICENESS, "0")
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, namespace=HUB_NAMESPACE, ignore_reinit_error=True,
                 include_dashboard=False, log_to_driver=True)
        if main_thread:
            _install_stop_handlers()            # ray.init installs its own SIGTERM handler (sys.exit)
        from deploy.ray_jobs import publish_cluster

        publish_cluster()                       # scheduled distillation jobs find this Ray (deploy/ray_jobs.py)
        hub = start_hub(s)
        serve.start(http_options={"host": host, "port": int(port)})
        serve.run(build(s, replicas), name=APP_NAME, route_prefix="/")
        admin = "admin key set" if s.admin_api_key else "admin endpoints: loopback callers only"
        print(f"[serve] Draftsmith is up: http://{host}:{port}/v1 (model {target or DEFAULT_TARGET}, "
              f"{replicas} replica(s), buffer {'on' if s.buffer else 'off'}, MLflow {s.tracking_uri}, {admin}); "
              "Ctrl-C or SIGTERM stops it", flush=True)
        while True:
            # Orphans re-parented here while serving stay zombies until the shutdown reaps them: reaping
            # now (waitpid(-1)) could take the exit status of a child that Ray's own code waits for.
            time.sleep(3600)
    except (_Stop, KeyboardInterrupt) as e:
        signum = e.args[0] if isinstance(e, _Stop) and e.args else signal.SIGINT
        why = f"{signal.Signals(signum).name} received"
    finally:
        _shutdown(hub, why, main_thread)


def _shutdown(hub, why: str, main_thread: bool) -> None:
    import ray

    if main_thread:
        # from here on a second SIGINT / SIGTERM (an impatient operator) kills everything at once
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _f: _hard_stop(128 + signum))
    watchdog = threading.Timer(SHUTDOWN_TIMEOUT_S, _hard_stop, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    print(f"[serve] {why}: shutting down", flush=True)
    steps = []
    if ray.is_initialized():                   # (serve.shutdown would start Ray to look for Serve)
        if hub is not None:
            steps.append(("metrics hub", lambda: ray.get(hub.stop.remote(), timeout=10)))
        steps.append(("Serve", serve.shutdown))
        if hub is not None:
            steps.append(("hub actor", lambda: ray.kill(hub)))
        steps.append(("Ray", ray.shutdown))

    def ray_address_file():
        from deploy.ray_jobs import unpublish_cluster

        unpublish_cluster()

    steps.append(("Ray address file", ray_address_file))

    def embedded_redis():
        from buffer.embedded import stop_embedded

        stop_embedded()

    steps.append(("embedded Redis", embedded_redis))
    for name, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - every later step must still run
            log.warning("shutdown: stopping the %s failed: %s", name, e)
    left = stop_descendants() if main_thread else []
    watchdog.cancel()
    if left:
        print(f"[serve] stopped {len(left)} process(es) left behind by Ray's shutdown", flush=True)
    print("[serve] stopped", flush=True)
