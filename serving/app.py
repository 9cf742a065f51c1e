"""The Ray Serve application: N replicas of the FastAPI app (serving/api.py) over a Service each, plus
one named MetricsHub actor that merges their metrics and logs live acceptance to MLflow.

    draftsmith serve [--port 8000] [--replicas 1] [--draft DIR] [--api-key KEY]    -> serve_forever(...)
    serve run serving.app:app_builder target=... replicas=2                       (an existing Ray)
    serve deploy deploy/serve_config.yaml                                          (a running cluster)

`serve_forever` starts (or joins, with RAY_ADDRESS) Ray, resolves the Redis URL once (REDIS_URL or the
embedded server under ./data, shared by every replica) and the MLflow tracking URI, starts the hub, and
runs the app on host:port until interrupted. CPU budget: each replica asks Ray for `num_cpus` (default
2 / replicas on a 2-core machine, so that one or two replicas fit beside the proxy) and sets torch's
thread count to match.
"""
from __future__ import annotations

import logging
import os
import time

from ray import serve

from serving.metrics import HUB_NAME, HUB_NAMESPACE, MetricsHub
from serving.service import Service, ServiceSettings, settings_from_env

log = logging.getLogger(__name__)
APP_NAME = "draftsmith"


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
        self.service = Service(s, hub=hub if hub is not None else MetricsHub(live_stats=False))

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


def start_hub(settings: ServiceSettings):
    """The named, detached MetricsHub actor (created once; later calls return the existing one)."""
    import ray

    Hub = ray.remote(num_cpus=0)(MetricsHub)
    return Hub.options(name=HUB_NAME, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached").remote(
        settings.tracking_uri, settings.target, settings.registry_model, settings.live_interval_s,
        settings.draft is None)


def build(settings: ServiceSettings, replicas: int = 1, num_cpus: float | None = None):
    """The bound application for serve.run: `replicas` replicas with `num_cpus` CPUs each."""
    cpus = float(num_cpus if num_cpus is not None else max(0.25, min(1.0, (os.cpu_count() or 2) / (2 * replicas))))
    if settings.torch_threads is None:
        # one core is left to the Serve proxy and HTTP: on 2 cores, 1 torch thread gave 37 tok/s at one
        # streaming client against 31 tok/s with 2 threads (docs/benchmarks.md)
        settings.torch_threads = max(1, ((os.cpu_count() or 2) - 1) // replicas)
    opts = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus}}
    fields = {k: getattr(settings, k) for k in settings.__dataclass_fields__ if k != "replica_id"}
    return DraftsmithDeployment.options(**opts).bind(fields)


def app_builder(args: dict):
    """Entry point for `serve run serving.app:app_builder key=value ...` and serve_config.yaml.

    args: any ServiceSettings field, plus `replicas` and `num_cpus`. The hub is started here, so the
    app has merged metrics and live MLflow charts however it was deployed."""
    args = dict(args or {})
    replicas = int(args.pop("replicas", 1))
    num_cpus = args.pop("num_cpus", None)
    conv = {"max_running": int, "max_waiting": int, "max_tokens_limit": int, "max_body_bytes": int,
            "request_timeout_s": float, "watch_interval_s": float, "live_interval_s": float, "torch_threads": int}
    for k, f in conv.items():
        if k in args and args[k] is not None:
            args[k] = f(args[k])
    if "buffer" in args and isinstance(args["buffer"], str):
        args["buffer"] = args["buffer"].lower() not in ("0", "false", "no", "off")
    settings = ServiceSettings(**args)
    if settings.redis_url is None and settings.buffer and not os.environ.get("REDIS_URL"):
        from buffer.embedded import ensure_embedded

        settings.redis_url = ensure_embedded()
    start_hub(settings)
    return build(settings, replicas, float(num_cpus) if num_cpus is not None else None)


def serve_forever(host: str = "127.0.0.1", port: int = 8000, target: str | None = None, draft: str | None = None,
                  replicas: int = 1, api_key: str | None = None, **settings) -> None:
    """Start Ray (or join RAY_ADDRESS), the embedded Redis when needed, the hub and the app; block until ^C."""
    import ray

    from deploy.registry import default_tracking_uri

    s = settings_from_env(target=target, draft=draft, api_key=api_key, **settings)
    s.tracking_uri = s.tracking_uri or default_tracking_uri()
    if s.buffer and s.redis_url is None and not os.environ.get("REDIS_URL"):
        from buffer.embedded import ensure_embedded

        s.redis_url = ensure_embedded()
    s.redis_url = s.redis_url or os.environ.get("REDIS_URL")
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, namespace=HUB_NAMESPACE, ignore_reinit_error=True,
             include_dashboard=False, log_to_driver=True)
    hub = start_hub(s)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(build(s, replicas), name=APP_NAME, route_prefix="/")
    print(f"[serve] Draftsmith is up: http://{host}:{port}/v1 (model {target or 'smollm2-135m-instruct'}, "
          f"{replicas} replica(s), buffer {'on' if s.buffer else 'off'}, MLflow {s.tracking_uri}); Ctrl-C stops it",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("[serve] shutting down", flush=True)
    finally:
        try:
            ray.get(hub.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        serve.shutdown()
        ray.kill(hub)
