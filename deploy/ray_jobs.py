"""Scheduled distillation jobs on Ray: `draftsmith distill --every/--min-records` submits each job to the
Ray cluster that serving uses (or the one at RAY_ADDRESS), so training runs wherever the cluster has room
(another node, a GPU node) while serving goes on; the job's state, log tail and failure come back to the
scheduler (deploy/scheduler.py) and to `draftsmith status`.

**Which cluster** (`find_cluster`, asked again before every job, so a restarted `draftsmith serve` is found):
1. `RAY_ADDRESS`: `http(s)://head:8265` (a dashboard, as `ray job submit` takes it), `host:port` (a GCS
   address) or `ray://host:10001` (Ray Client: Ray-task submission only). Set but unreachable: the job
   fails (records stay pending); the scheduler never falls back to training beside serving behind the
   operator's back.
2. The Ray that `draftsmith serve` started or joined on this machine: `serve_forever` writes its GCS and
   dashboard address to `<data dir>/ray-cluster.json` (`publish_cluster`) and removes it when it stops;
   the file counts only while its process lives and the GCS answers.
3. The cluster of the last `ray start --head` on this machine (`/tmp/ray/ray_current_cluster`).
Liveness is a TCP connect to the GCS first (a GcsClient on a dead address takes 40 s to give up), then the
GCS itself, which also gives the dashboard address (its KV) and the nodes' resources; the job API counts
only when it answers there (a Ray started without the dashboard still records an address).

**How a job is submitted** (`submit`: "auto" picks the first that the cluster offers):
- "job": Ray's job submission API (`JobSubmissionClient`, HTTP to the dashboard): entrypoint
  `python -m deploy.distill_job --config-json <cfg>` with `entrypoint_num_cpus` / `entrypoint_num_gpus` (Ray
  places it on a node with those free), the job's environment in `runtime_env.env_vars`, and, for a cluster
  on another machine, this checkout as `runtime_env.working_dir`. Polled every `poll_s`; state from
  `get_job_info`, logs from `get_job_logs` (tail kept); stopped with `stop_job` when the scheduler is
  interrupted. Needs the dashboard, which `ray start --head` runs by default. A submission the API refuses with
  "no available agent, try again later" is retried; under "auto" it goes the "task" way after
  AUTO_SUBMIT_RETRY_S (the job record's runner says "ray-task" and its `fallback` why), under "job" it fails
  after SUBMIT_RETRY_S.
- "task": for a cluster without a dashboard, which is what `draftsmith serve` starts (measured on this
  2-core machine: Ray's start takes 9.0 s with the dashboard against 6.6 s without, and the dashboard is
  one more ~130 MB process beside serving; the job API itself then answers a trivial job in 2.3 s).
  A child process `python -m deploy.distill_job --ray --num-cpus N --num-gpus G --config-json <cfg>` with
  RAY_ADDRESS = the cluster's GCS connects as a Ray driver and runs the job as a Ray task with those
  resource requests (deploy/distill_job.py `run_in_ray`); Ray forwards the task's output to it, so its output is the
  job's log and its exit status the result. The driver is a child, not the scheduler itself: Ray ends a
  driver whose cluster goes away, and the scheduler must outlive the cluster.

**Outcome.** Success: the candidate folder (`out_dir`, fixed here before submission) must be readable
here; otherwise the job counts as failed. Failure (entrypoint exit status, runtime env, stop, a pending
job that no node can take within `pending_timeout_s`) raises `RayJobError`; a job lost with its node or
cluster (supervisor / worker / node died, the cluster unreachable for `lost_after_s`) raises `RayJobLost`.
Either way the scheduler records a failed job and nothing is acked: the job runs with `ack: registered`,
so every record it read stays pending in the consumer group until a candidate is registered. A job counted
lost because its cluster stopped answering may still be running somewhere (a partition; or, seen in tests,
an entrypoint orphaned when the whole local Ray was SIGKILLed, which Ray's fate-sharing watcher did not
stop): it acks nothing, its candidate is never registered, and the next job re-claims its records once
they have been idle `claim_idle_ms`. A scheduler stopped while a job runs stops it (Ctrl-C: `stop_job`, or
the driver child; a killed scheduler's driver child gets SIGTERM from the kernel), except a job-API job
whose scheduler was killed outright: that one finishes on the cluster, unregistered, its records pending.

**Data.** The job's config is resolved here (deploy/distill_job.py `resolve_job`: training.job's or, for a heads
job, training.heads_job's `resolve_for_remote`): Redis URL, MLflow tracking
URI, the materialised parent folder and the output folder. On one machine they are shared with the job.
A cluster of several machines needs the data dir ($DRAFTSMITH_DATA) and draft cache ($DRAFTSMITH_CACHE)
on a shared file system mounted at the same path, Redis and MLflow at addresses every node reaches
(REDIS_URL, MLFLOW_TRACKING_URI: an `mlflow server`), and the project's dependencies on every node.

Job state (`job_info`) is a dict: runner ("ray-job" | "ray-task" | "process"), id, cluster, source, state
(submitted | pending | running | succeeded | failed | stopped | lost), submitted/started/ended (epoch s),
seconds, resources, message, log_tail (last lines), candidate. The runner reports it through `on_state`
on every change; the scheduler writes it to `<data dir>/distill-job.json` (`draftsmith status`).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from buffer.paths import pid_alive

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_FILE = "ray-cluster.json"
RUNNERS = ("auto", "ray", "process")
SUBMIT_MODES = ("auto", "job", "task")
# environment a job needs from the scheduler's (not secrets of the HTTP API: DRAFTSMITH_*_KEY stay here)
_ENV_PREFIXES = ("DRAFTSMITH_", "MLFLOW_", "HF_", "TRANSFORMERS_", "REDIS_URL", "TOKENIZERS_PARALLELISM")
_ENV_SECRETS = ("DRAFTSMITH_API_KEY", "DRAFTSMITH_ADMIN_KEY")
# Ray's job API answers 500 "No available agent to submit job, please try again later" while the node's job agent
# is still starting, or while it re-registers (seen on a busy 2-core CI host right after the cluster came up, and once
# for over 60 s late in a clean-clone run of the suite, once for over 180 s, the agent gone for good): a submission it
# refuses so is retried for up to SUBMIT_RETRY_S seconds before the job counts as failed. Under submit "auto" the job
# goes to the Ray-task path instead once AUTO_SUBMIT_RETRY_S have passed (the cluster's GCS still takes tasks)
SUBMIT_RETRY_S = 180.0
AUTO_SUBMIT_RETRY_S = 60.0
_RETRY_LATER = ("No available agent", "try again later")
_WORKING_DIR_EXCLUDES = [".venv", ".git", "data", "docs", "tests", "scripts", "**/__pycache__", "*.egg-info"]
_LOST_MARKERS = ("NodeDiedError", "WorkerCrashedError", "OwnerDiedError", "ObjectLostError", "LocalRayletDiedError",
                 "RaySystemError", "ActorDiedError", "GCS may have", "Failed to connect to GCS",
                 "Timed out while waiting for GCS", "node was terminated", "node died")
_LOST_ERROR_TYPES = ("JOB_SUPERVISOR_ACTOR_DIED",)


class _JobApiBusy(RuntimeError):
    """The job API still asked to try again later when the submission's retries ran out: nothing was submitted."""


class RayJobError(RuntimeError):
    """A distillation job on Ray did not produce a candidate (failed, stopped, could not be scheduled)."""

    def __init__(self, message: str, info: dict | None = None) -> None:
        super().__init__(message)
        self.info = info or {}

    @property
    def log_tail(self) -> list[str]:
        return list(self.info.get("log_tail") or [])


class RayJobLost(RayJobError):
    """The job was lost with its node or with the cluster (it may not have failed by itself)."""


class RayUnavailable(RuntimeError):
    """No Ray cluster could be used (RAY_ADDRESS unreachable, or `--runner ray` and none running)."""


# ---------------------------------------------------------------------------------- the cluster
@dataclass
class RayCluster:
    address: str | None             # GCS "ip:port" or "ray://..." (Ray-task submission); None: dashboard only
    dashboard_url: str | None       # "http://host:port" (job submission API); None: no dashboard
    source: str                     # where it was found (RAY_ADDRESS, draftsmith serve, ray start)
    local: bool                     # its head runs on this machine (code and data dir are shared)
    cpus: float = 0.0
    gpus: float = 0.0

    def describe(self) -> str:
        where = self.address or self.dashboard_url
        return (f"Ray at {where} ({self.source}; {self.cpus:g} CPUs, {self.gpus:g} GPUs; "
                f"{'job API' if self.dashboard_url else 'no dashboard: Ray tasks'})")


def _data_dir() -> Path:
    from buffer.paths import data_dir

    return data_dir()


def _split_host_port(address: str) -> tuple[str, int] | None:
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    hp = _split_host_port(address)
    if hp is None:
        return False
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except OSError:
        return False


def _is_local_host(host: str) -> bool:
    """True when `host` is an address of this machine (binding to it succeeds)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()):
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _enable_auth() -> None:
    """Ray >= 2.5x clusters started by `ray.init` require a token (~/.ray/auth_token) from every client;
    `ray.init` loads it for a driver, a GcsClient or JobSubmissionClient in this process needs this."""
    try:
        from ray._private.authentication.authentication_token_setup import \
            maybe_enable_token_auth_if_token_available
    except ImportError:                                  # a Ray without token authentication
        return
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception as e:  # noqa: BLE001 - then the cluster says what is missing
        log.warning("Ray token authentication not set up: %s", e)


def _probe_gcs(address: str, timeout_s: float = 5.0) -> tuple[str | None, float, float]:
    """(dashboard URL or None, CPUs, GPUs of the alive nodes) from the GCS at `address`."""
    from ray._raylet import GcsClient

    _enable_auth()
    client = GcsClient(address=address)
    url = client.internal_kv_get(b"dashboard", namespace=b"dashboard", timeout=timeout_s)
    cpus = gpus = 0.0
    try:
        for node in client.get_all_node_info(timeout=timeout_s).values():
            if node.state == 0:                      # ALIVE
                cpus += float(node.resources_total.get("CPU", 0.0))
                gpus += float(node.resources_total.get("GPU", 0.0))
    except Exception as e:  # noqa: BLE001 - resources are informative (GPU auto-request); the cluster answered
        log.warning("could not read the Ray nodes' resources from %s: %s", address, e)
    return (f"http://{url.decode()}" if url else None), cpus, gpus


def _probe_dashboard(url: str, timeout_s: float = 5.0) -> tuple[float, float]:
    """CPUs and GPUs of the alive nodes, through the dashboard's state API."""
    from ray.util.state import list_nodes

    _enable_auth()
    cpus = gpus = 0.0
    for node in list_nodes(address=url, timeout=int(max(1, timeout_s)), raise_on_missing_output=False):
        if str(getattr(node, "state", "")).upper() == "ALIVE":
            res = getattr(node, "resources_total", None) or {}
            cpus += float(res.get("CPU", 0.0))
            gpus += float(res.get("GPU", 0.0))
    return cpus, gpus


def _job_api_answers(url: str) -> bool:
    """True when Ray's job submission API answers at `url`. (A Ray started with include_dashboard=False
    still records a dashboard address in its GCS, where nothing listens, or only a minimal head without
    the job module: the address alone does not tell.)"""
    if not _reachable(url):
        return False
    try:
        from ray.job_submission import JobSubmissionClient

        _enable_auth()
        JobSubmissionClient(url)                         # checks the API's version over HTTP
        return True
    except Exception as e:  # noqa: BLE001
        log.info("no Ray job API at %s: %s", url, e)
        return False


def _cluster_at(address: str, source: str, local: bool | None = None) -> RayCluster:
    """The cluster at a RAY_ADDRESS-style address; RayUnavailable when it does not answer."""
    if not _reachable(address):
        raise RayUnavailable(f"no Ray cluster answers at {address} ({source})")
    hp = _split_host_port(address)
    is_local = local if local is not None else bool(hp and _is_local_host(hp[0]))
    try:
        if address.startswith(("http://", "https://")):
            if not _job_api_answers(address):
                raise RayUnavailable(f"Ray's job submission API does not answer at {address} ({source})")
            cpus, gpus = 0.0, 0.0
            try:
                cpus, gpus = _probe_dashboard(address)
            except Exception as e:  # noqa: BLE001
                log.warning("could not read the Ray nodes' resources from %s: %s", address, e)
            return RayCluster(None, address.rstrip("/"), source, is_local, cpus, gpus)
        if address.startswith("ray://"):
            return RayCluster(address, os.environ.get("RAY_API_SERVER_ADDRESS") or None, source, is_local)
        dashboard, cpus, gpus = _probe_gcs(address)
        if dashboard and not _job_api_answers(dashboard):
            dashboard = None
    except RayUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. RpcError: the port is open but it is no GCS (any more)
        raise RayUnavailable(f"the Ray cluster at {address} ({source}) does not answer: {e}") from e
    return RayCluster(address, dashboard, source, is_local, cpus, gpus)


def find_cluster(data_dir: str | os.PathLike | None = None) -> RayCluster | None:
    """The Ray cluster scheduled jobs go to (module docstring), or None when none is configured or running.
    RayUnavailable when RAY_ADDRESS is set but does not answer."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return _cluster_at(env, "RAY_ADDRESS")
    path = Path(data_dir) if data_dir else _data_dir()
    info = read_published_cluster(path)
    if info and info.get("gcs_address"):
        if info.get("host") == socket.gethostname() and not pid_alive(info.get("pid")):
            log.info("ignoring %s: the serve process %s is gone", path / CLUSTER_FILE, info.get("pid"))
        else:
            try:
                return _cluster_at(info["gcs_address"], f"draftsmith serve, pid {info.get('pid')}",
                                   local=info.get("host") == socket.gethostname())
            except RayUnavailable as e:
                log.info("ignoring %s: %s", path / CLUSTER_FILE, e)
    try:
        from ray._private.utils import read_ray_address

        started = read_ray_address()
    except Exception:  # noqa: BLE001 - no Ray installed, unreadable temp dir
        started = None
    if started:
        try:
            return _cluster_at(started, "ray start --head", local=True)
        except RayUnavailable as e:
            log.info("ignoring the last `ray start` cluster: %s", e)
    return None


def publish_cluster(data_dir: str | os.PathLike | None = None) -> Path | None:
    """Called by `draftsmith serve` after ray.init: write the GCS and dashboard address of the Ray it uses
    to `<data dir>/ray-cluster.json`, so a scheduler on this machine finds it. Never raises."""
    try:
        import ray

        gcs = ray.get_runtime_context().gcs_address
        node = getattr(ray._private.worker.global_worker, "node", None)
        webui = (getattr(node, "address_info", None) or {}).get("webui_url") if node is not None else None
        doc = {"gcs_address": gcs, "dashboard_url": f"http://{webui}" if webui else None, "pid": os.getpid(),
               "host": socket.gethostname(), "time": time.time(),
               "joined": bool(os.environ.get("RAY_ADDRESS"))}
        path = (Path(data_dir) if data_dir else _data_dir()) / CLUSTER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CLUSTER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return path
    except Exception as e:  # noqa: BLE001 - serving never fails for this
        log.warning("could not publish the Ray address for scheduled jobs: %s", e)
        return None


def unpublish_cluster(data_dir: str | os.PathLike | None = None) -> None:
    """Remove `ray-cluster.json` if this process wrote it (serve's shutdown). Never raises."""
    path = (Path(data_dir) if data_dir else _data_dir()) / CLUSTER_FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def serving_here(data_dir: str | os.PathLike | None = None) -> bool:
    """Whether a `draftsmith serve` that published its Ray (`publish_cluster`) runs on this machine now."""
    info = read_published_cluster(data_dir) or {}
    return info.get("host") == socket.gethostname() and pid_alive(info.get("pid"))


def read_published_cluster(data_dir: str | os.PathLike | None = None) -> dict | None:
    path = (Path(data_dir) if data_dir else _data_dir()) / CLUSTER_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------------- one job on Ray
@dataclass
class RaySettings:
    """submit: "auto" | "job" | "task" (module docstring); num_cpus / num_gpus: the job's resource request
    (num_gpus "auto": one GPU when the cluster has one, so the job lands on a GPU node; 0 otherwise);
    pending_timeout_s: a job no node takes within this is stopped and failed; lost_after_s: a cluster that
    does not answer this long while a job runs counts as lost; python: the entrypoint's interpreter
    (default: this one for a cluster on this machine, `python` on another); log_lines: log tail kept."""

    submit: str = "auto"
    num_cpus: float = 1.0
    num_gpus: float | str = "auto"
    poll_s: float = 1.0
    pending_timeout_s: float = 900.0
    lost_after_s: float = 60.0
    python: str | None = None
    log_lines: int = 40
    nice: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not (0 <= self.nice <= 19):
            raise ValueError(f"the job's nice value must be an integer in 0..19, got {self.nice!r}")
        if self.submit not in SUBMIT_MODES:
            raise ValueError(f"submit must be one of {', '.join(SUBMIT_MODES)}, got {self.submit!r}")
        if not (isinstance(self.num_cpus, (int, float)) and self.num_cpus > 0):
            raise ValueError(f"the job's CPUs must be a number > 0, got {self.num_cpus!r}")
        if self.num_gpus != "auto" and not (isinstance(self.num_gpus, (int, float)) and self.num_gpus >= 0):
            raise ValueError(f"the job's GPUs must be 'auto' or a number >= 0, got {self.num_gpus!r}")
        for name in ("poll_s", "pending_timeout_s", "lost_after_s"):
            if not (getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def gpus_for(self, cluster: RayCluster) -> float:
        if self.num_gpus == "auto":
            return 1.0 if cluster.gpus >= 1 else 0.0
        return float(self.num_gpus)


def job_env(num_cpus: float, local: bool, nice: int = 0) -> dict:
    """The job's environment: the settings it shares with the scheduler (data dir, caches, MLflow, hub),
    never the HTTP API's keys; torch's threads matched to the CPUs it asked for; the CPU priority it lowers
    itself to (`DRAFTSMITH_JOB_NICE`, applied by deploy/distill_job.py before torch starts a thread)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _ENV_SECRETS}
    env["DRAFTSMITH_DATA"] = str(_data_dir())
    env["OMP_NUM_THREADS"] = str(max(1, int(num_cpus)))
    env["DRAFTSMITH_JOB_NICE"] = str(int(nice))
    env["PYTHONUNBUFFERED"] = "1"
    if local:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def _now() -> float:
    return round(time.time(), 3)


class _Job:
    """The running job's info dict and its reporting."""

    def __init__(self, info: dict, on_state: Callable[[dict], None] | None, log_lines: int) -> None:
        self.info = info
        self.on_state = on_state
        self.tail: collections.deque[str] = collections.deque(maxlen=log_lines)

    def set(self, state: str | None = None, **kw) -> None:
        changed = state is not None and state != self.info.get("state")
        if state is not None:
            self.info["state"] = state
            if state == "running" and not self.info.get("started"):
                self.info["started"] = _now()
            if state in ("succeeded", "failed", "stopped", "lost"):
                self.info["ended"] = _now()
                self.info["seconds"] = round(self.info["ended"] - self.info["submitted"], 3)
        self.info.update(kw)
        self.info["log_tail"] = list(self.tail)
        if changed or kw:
            self.report()

    def report(self) -> None:
        if self.on_state is not None:
            try:
                self.on_state(dict(self.info))
            except Exception as e:  # noqa: BLE001 - reporting never fails a job
                log.warning("job state not recorded: %s", e)

    def fail(self, state: str, message: str) -> RayJobError:
        self.set(state, message=message)
        cls = RayJobLost if state == "lost" else RayJobError
        last = next((ln for ln in reversed(self.tail) if ln.strip()), None)
        text = (f"Ray job {self.info['id']} {'was lost' if state == 'lost' else state} after "
                f"{self.info.get('seconds', 0):.0f} s: {message}" + (f"; last log line: {last.strip()}" if last else ""))
        return cls(text, dict(self.info))


def run_on_ray(cfg: dict, cluster: RayCluster, settings: RaySettings | None = None, *,
               on_state: Callable[[dict], None] | None = None, progress: Callable[[str], None] = print) -> Path:
    """Run one distillation job (`training.job` cfg) on `cluster`; return its candidate folder (module
    docstring). RayJobError / RayJobLost when it produced none."""
    from deploy.distill_job import is_heads_job, resolve_job

    st = settings or RaySettings()
    cfg = resolve_job(cfg)                        # ValueError here, before anything is submitted
    mode = st.submit
    if mode == "auto":
        mode = "job" if cluster.dashboard_url else "task"
    if mode == "job" and not cluster.dashboard_url:
        raise RayUnavailable(f"{cluster.describe()} has no dashboard: the job submission API is not available "
                             "(use submit 'task', or start the head with the dashboard)")
    if mode == "task" and not cluster.address:
        raise RayUnavailable(f"{cluster.describe()}: Ray-task submission needs a GCS or ray:// address")
    gpus = st.gpus_for(cluster)
    what = cfg["kind"] if is_heads_job(cfg) else "distill"                              # a heads job, or the draft's
    sid = f"draftsmith-{what}-v{cfg.get('parent_version') or 'none'}-{time.strftime('%Y%m%d-%H%M%S')}-" \
          f"{uuid.uuid4().hex[:6]}"
    job = _Job({"runner": f"ray-{mode}", "id": sid, "cluster": cluster.address or cluster.dashboard_url,
                "dashboard": cluster.dashboard_url, "source": cluster.source, "state": "submitted",
                "submitted": _now(), "resources": {"CPU": st.num_cpus, "GPU": gpus},
                "candidate": cfg["out_dir"]}, on_state, st.log_lines)
    progress(f"[distill] submitting job {sid} to {cluster.describe()} as a Ray {'job' if mode == 'job' else 'task'} "
             f"({st.num_cpus:g} CPU, {gpus:g} GPU)")
    job.report()
    try:
        if mode == "job":
            python = st.python or os.environ.get("DRAFTSMITH_RAY_PYTHON") or (sys.executable if cluster.local
                                                                               else "python")
            fallback = st.submit == "auto" and bool(cluster.address)
            try:
                _submit_job(cfg, cluster, st, job, python, gpus,
                            retry_s=AUTO_SUBMIT_RETRY_S if fallback else SUBMIT_RETRY_S)
            except _JobApiBusy as e:
                if not fallback:
                    raise job.fail("failed", f"the job API refused the job ({e})") from e
                log.warning("the Ray job API at %s still refuses jobs after %.0f s (%s): job %s goes to the "
                            "cluster as a Ray task instead", cluster.dashboard_url, AUTO_SUBMIT_RETRY_S, e, sid)
                progress(f"[distill] the job API has no agent after {AUTO_SUBMIT_RETRY_S:.0f} s; job {sid} runs as "
                         "a Ray task instead")
                job.info.update(runner="ray-task", fallback=f"job API refused: {e}")
                _submit_task(cfg, cluster, st, job, gpus)
        else:
            _submit_task(cfg, cluster, st, job, gpus)
    except RayJobError:
        raise
    except BaseException as e:                       # Ctrl-C, or a fault here: the job was stopped on the way out
        job.set("stopped", message=f"the scheduler stopped ({type(e).__name__}: {e}); the job was stopped")
        raise
    out = Path(cfg["out_dir"])
    if not (out / "candidate.json").is_file():
        raise job.fail("failed", f"the job succeeded but its candidate folder {out} is not readable here (a "
                                 "cluster of several machines needs DRAFTSMITH_DATA on a shared file system)")
    job.set("succeeded")
    progress(f"[distill] Ray job {sid} succeeded in {job.info.get('seconds', 0):.0f} s: {out}")
    return out


def submit_with_retry(submit: Callable[[], object], within_s: float | None = None, pause_s: float = 2.0,
                      sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
    """`submit()`, retried while Ray's job API says to try again later (its job agent still starting), for up to
    `within_s` seconds (SUBMIT_RETRY_S); any other refusal, or one past the deadline, is raised."""
    deadline = clock() + (SUBMIT_RETRY_S if within_s is None else within_s)
    while True:
        try:
            return submit()
        except Exception as e:  # noqa: BLE001 - the job API's errors are RuntimeErrors with the HTTP message
            if not any(m in str(e) for m in _RETRY_LATER) or clock() + pause_s > deadline:
                raise
            log.warning("the Ray job API asks to try again later (%s); retrying in %.0f s", e, pause_s)
            sleep(pause_s)


def _submit_job(cfg: dict, cluster: RayCluster, st: RaySettings, job: _Job, python: str, gpus: float,
                retry_s: float = SUBMIT_RETRY_S) -> None:
    """Submit through Ray's job API and follow the job to its end; `_JobApiBusy` when the API still asks to try
    again later after `retry_s` (nothing was submitted), RayJobError / RayJobLost for anything else."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    sid = job.info["id"]
    _enable_auth()
    try:
        client = JobSubmissionClient(cluster.dashboard_url)
    except Exception as e:  # noqa: BLE001 - dashboard down or not a dashboard
        raise job.fail("failed", f"the job API at {cluster.dashboard_url} does not answer ({e})") from e
    runtime_env: dict = {"env_vars": job_env(st.num_cpus, cluster.local, st.nice)}
    if not cluster.local:
        runtime_env.update(working_dir=str(ROOT), excludes=_WORKING_DIR_EXCLUDES)
    entrypoint = shlex.join([python, "-m", "deploy.distill_job", "--config-json", json.dumps(cfg, default=str)])
    try:
        submit_with_retry(lambda: client.submit_job(
            entrypoint=entrypoint, submission_id=sid, runtime_env=runtime_env, entrypoint_num_cpus=st.num_cpus,
            entrypoint_num_gpus=gpus or None, metadata={"draftsmith": "distill", "kind": str(cfg.get("kind", "draft")),
                                                        "parent_version": str(cfg.get("parent_version"))}),
            within_s=retry_s)
    except Exception as e:  # noqa: BLE001
        if any(m in str(e) for m in _RETRY_LATER):
            raise _JobApiBusy(str(e)) from e
        raise job.fail("failed", f"the job API refused the job ({e})") from e
    states = {JobStatus.PENDING: "pending", JobStatus.RUNNING: "running", JobStatus.SUCCEEDED: "succeeded",
              JobStatus.FAILED: "failed", JobStatus.STOPPED: "stopped"}
    last_ok = time.monotonic()
    t0 = time.monotonic()
    info = None
    try:
        while True:
            try:
                info = client.get_job_info(sid)
                last_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the dashboard (the head) does not answer
                if time.monotonic() - last_ok > st.lost_after_s:
                    raise job.fail("lost", f"the Ray cluster at {cluster.dashboard_url} has not answered for "
                                           f"{st.lost_after_s:.0f} s ({type(e).__name__})") from e
                time.sleep(st.poll_s)
                continue
            state = states.get(info.status, str(info.status).lower())
            if state in ("succeeded", "failed", "stopped"):
                break
            if state != job.info["state"]:
                job.set(state, message=info.message or "")
            if state == "pending" and time.monotonic() - t0 > st.pending_timeout_s:
                _quiet(lambda: client.stop_job(sid))
                raise job.fail("failed", f"no node took the job within {st.pending_timeout_s:.0f} s (it asks for "
                                         f"{st.num_cpus:g} CPU and {gpus:g} GPU; {info.message or 'pending'})")
            time.sleep(st.poll_s)
    except BaseException:
        if info is None or not info.status.is_terminal():
            _quiet(lambda: client.stop_job(sid))          # interrupted: leave no job running behind
        raise
    try:
        job.tail.extend(client.get_job_logs(sid).splitlines()[-st.log_lines:])
    except Exception as e:  # noqa: BLE001
        job.tail.append(f"(logs not available: {e})")
    if state == "succeeded":
        return
    error_type = str(getattr(info, "error_type", None) or "")
    if state == "failed" and any(t in error_type for t in _LOST_ERROR_TYPES):
        state = "lost"
    raise job.fail(state, info.message or f"the job ended {state}")


def _submit_task(cfg: dict, cluster: RayCluster, st: RaySettings, job: _Job, gpus: float) -> None:
    logdir = _data_dir() / "ray-jobs"
    logdir.mkdir(parents=True, exist_ok=True)
    logfile = logdir / f"{job.info['id']}.log"
    job.info["log_file"] = str(logfile)
    # the driver runs here, beside the scheduler (its task runs wherever Ray places it): this interpreter
    cmd = [sys.executable, "-m", "deploy.distill_job", "--ray", "--num-cpus", f"{st.num_cpus:g}", "--num-gpus", f"{gpus:g}",
           "--config-json", json.dumps(cfg, default=str)]
    env = {**os.environ, **job_env(st.num_cpus, True, st.nice), "RAY_ADDRESS": cluster.address}
    for k in _ENV_SECRETS:
        env.pop(k, None)
    started = threading.Event()
    with open(logfile, "w", buffering=1) as fh:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
                                preexec_fn=_death_signal())
        job.info["driver_pid"] = proc.pid

        def pump() -> None:
            for line in proc.stdout:
                fh.write(line)
                job.tail.append(line.rstrip("\n"))
                if "(_ray_task" in line:                 # Ray forwards the task's own output: it runs
                    started.set()

        reader = threading.Thread(target=pump, name=f"ray-task-log-{proc.pid}", daemon=True)
        reader.start()
        t0 = time.monotonic()
        try:
            while proc.poll() is None:
                if started.is_set() and job.info["state"] != "running":
                    job.set("running")
                if not started.is_set() and time.monotonic() - t0 > st.pending_timeout_s:
                    _stop_group(proc)
                    raise job.fail("failed", f"the task did not start within {st.pending_timeout_s:.0f} s (it asks "
                                             f"for {st.num_cpus:g} CPU and {gpus:g} GPU)")
                time.sleep(min(st.poll_s, 0.5))
        except BaseException:
            _stop_group(proc)                             # the driver's end cancels its task
            raise
        finally:
            reader.join(10)
    if proc.returncode == 0:
        return
    text = "\n".join(job.tail)
    lost = any(m in text for m in _LOST_MARKERS)
    raise job.fail("lost" if lost else "failed", f"the Ray driver exited with status {proc.returncode}"
                   + (" (the task's worker, node or the cluster went away)" if lost else ""))


def _death_signal():
    """A preexec_fn for the driver child (Linux): the kernel sends it SIGTERM when the scheduler (the thread
    that started and waits for it) dies, even by SIGKILL; its own session keeps it out of the scheduler's
    Ctrl-C, which the scheduler handles by stopping it. Resolved here, in the parent: the child only calls
    it. None where prctl is not available."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)          # PR_SET_PDEATHSIG


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def _quiet(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.warning("%s", e)


# ---------------------------------------------------------------------------------- the scheduler's runner
class DistillRunner:
    """The scheduler's `distill` callable (JobRequest -> candidate folder): builds the job's cfg with
    `make_cfg(request)` and runs it by `runner`:
    - "auto" (default): on Ray when `find_cluster()` finds one, else in this process (said once per change);
    - "ray": on Ray; no cluster -> RayUnavailable (a failed job, records pending);
    - "process": `in_process(cfg)` (deploy/distill_job.py `run_job`, with its MLflow run) in this process.
    `on_state(info)` receives the job state on every change; `last_job` is the last job's final state."""

    def __init__(self, make_cfg: Callable, runner: str = "auto", settings: RaySettings | None = None, *,
                 in_process: Callable[[dict], "str | os.PathLike"] | None = None,
                 on_state: Callable[[dict], None] | None = None, progress: Callable[[str], None] = print,
                 find: Callable[[], RayCluster | None] = find_cluster) -> None:
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
        self.make_cfg = make_cfg
        self.runner = runner
        self.settings = settings or RaySettings()
        self.in_process = in_process
        self.on_state = on_state
        self.progress = progress
        self.find = find
        self.last_job: dict | None = None
        self._said: str | None = None

    def _say_once(self, text: str) -> None:
        if text != self._said:
            self._said = text
            self.progress(text)

    def _record(self, info: dict) -> None:
        self.last_job = info
        if self.on_state is not None:
            self.on_state(info)

    def _cluster(self) -> RayCluster | None:
        """The cluster the next job goes to (None: this process), said when it changes."""
        if self.runner == "process":
            self._say_once("[distill] jobs run in this process (--runner process)")
            return None
        cluster = self.find()                         # RayUnavailable: RAY_ADDRESS set but dead -> job fails
        if cluster is None:
            if self.runner == "ray":
                raise RayUnavailable("no Ray cluster: RAY_ADDRESS is not set, no `draftsmith serve` Ray runs "
                                     "on this machine and no `ray start --head` cluster answers")
            self._say_once("[distill] no Ray cluster found (RAY_ADDRESS unset, no `draftsmith serve` Ray on "
                           "this machine): jobs run in this process")
        else:
            self._say_once(f"[distill] jobs run on {cluster.describe()}")
        return cluster

    def announce(self) -> None:
        """Say where jobs will run (the scheduler's start); never raises."""
        try:
            self._cluster()
        except Exception as e:  # noqa: BLE001 - e.g. RAY_ADDRESS unreachable now: each job tries again
            self.progress(f"[distill] {e}; each job looks for the cluster again")

    def __call__(self, request) -> Path:
        cfg = self.make_cfg(request)
        self.last_job = None
        cluster = self._cluster()
        if cluster is None:
            return self._run_here(cfg)
        return run_on_ray(cfg, cluster, self.settings, on_state=self._record, progress=self.progress)

    def _run_here(self, cfg: dict) -> Path:
        run = self.in_process
        if run is None:
            from deploy.distill_job import run_job as run
        info = {"runner": "process", "id": f"pid-{os.getpid()}", "state": "running", "submitted": _now(),
                "started": _now(), "candidate": cfg.get("out_dir")}
        self._record(dict(info))
        try:
            out = Path(run(cfg))
        except BaseException as e:
            ended = _now()
            self._record({**info, "state": "failed", "ended": ended, "seconds": round(ended - info["submitted"], 3),
                          "message": f"{type(e).__name__}: {e}"})
            raise
        ended = _now()
        self._record({**info, "state": "succeeded", "ended": ended, "seconds": round(ended - info["submitted"], 3),
                      "candidate": str(out)})
        return out
