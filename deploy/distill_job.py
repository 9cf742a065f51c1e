"""A distillation job as deploy runs it: training/job.py's `run_distillation`, with its MLflow run logged
through the registry's MLflow door (deploy/registry.py) and, on request, as a Ray task.

    run_job(cfg) -> Path                       # what `draftsmith distill --runner process` calls (draft or heads)
    run_in_ray(cfg, num_cpus, num_gpus) -> Path
    python -m deploy.distill_job [the flags of `python -m training.job`] [--ray [--num-cpus 2] [--num-gpus 1]]
    (scheduled jobs on Ray: deploy/ray_jobs.py submits `python -m deploy.distill_job --config-json ...`)

training/ imports neither MLflow nor deploy: the job reports its run through the `JobTracker` protocol of
training/job.py, and `MlflowJobRun` below implements it: one MLflow run in experiment `draftsmith-distill`
(params, progress metrics per optimizer step, final metrics, FINISHED / FAILED with the error), created
through `Registry.experiment_id`, the one place experiments are created. A job with `mlflow: false` logs
no run. Creating the run fails the job (MLflow unreachable: nothing trained, nothing acked); progress
logging never does (a warning instead).

A heads job (`draftsmith distill --kind medusa|eagle`: a config whose "kind" is medusa or eagle) runs
`training.heads_job.run_heads_distillation` the same ways, on Ray or here; its figures go onto the version the
scheduler registers (deploy/heads.py), so it logs no MLflow run of its own.

Ray: `--ray` runs the job as a Ray task with `num_cpus` CPUs, on the cluster of RAY_ADDRESS (set by `ray job
submit`) or on a local Ray started for it. Redis URL, tracking URI and output folder are resolved in the
driver (training.job.resolve_for_remote), so the task does not depend on its working directory.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from serving.contention import marks_busy
from training.job import (
    EXPERIMENT,
    build_parser,
    config_from_args,
    parse_config,
    resolve_for_remote,
    run_cli,
    run_distillation,
)

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
HEADS_JOB_KINDS = ("medusa", "eagle")          # training/heads_job.py KINDS (imported lazily: it needs numpy)


class MlflowJobRun:
    """One MLflow run of a distillation job (training.job.JobTracker)."""

    def __init__(self, tracking_uri: str, run_name: str, params: dict, tags: dict) -> None:
        from mlflow.entities import Param

        from deploy.registry import Registry

        reg = Registry(None, tracking_uri=tracking_uri, auto_gc=False)        # only its MLflow client and experiments
        self.client = reg.client
        self.run_id = self.client.create_run(reg.experiment_id(EXPERIMENT), run_name=run_name,
                                             tags=tags).info.run_id
        items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()
                                                        if isinstance(v, (int, float)) and not isinstance(v, bool)])
        except Exception as e:  # noqa: BLE001 - progress logging never fails the job
            log.warning("MLflow progress not logged: %s", e)

    def finish(self, status: str, tags: dict | None = None) -> None:
        for k, v in (tags or {}).items():
            self.client.set_tag(self.run_id, k, str(v)[:5000])
        self.client.set_terminated(self.run_id, status=status)


def tracker_for(cfg: dict) -> Callable[[str, dict, dict], MlflowJobRun] | None:
    """The run factory for a job config: None when the job logs no MLflow run (`mlflow: false`)."""
    job, _ = parse_config(cfg)
    if not job.mlflow:
        return None
    from buffer.paths import default_tracking_uri

    uri = job.tracking_uri or default_tracking_uri()
    return lambda run_name, params, tags: MlflowJobRun(uri, run_name, params, tags)


def is_heads_job(cfg: dict) -> bool:
    """A job config for Medusa heads or an EAGLE head (training/heads_job.py: its "kind"), not the draft."""
    return cfg.get("kind") in HEADS_JOB_KINDS


def resolve_job(cfg: dict) -> dict:
    """The job's config resolved for running elsewhere (training.job / training.heads_job `resolve_for_remote`,
    by its kind); ValueError for a bad one."""
    if is_heads_job(cfg):
        from training.heads_job import resolve_for_remote as resolve_heads

        return resolve_heads(cfg)
    return resolve_for_remote(cfg)


@marks_busy("a distillation job")
def run_job(cfg: dict, progress: Callable[[str], None] = print) -> Path:
    """One job; the candidate folder. A draft job: `training.job.run_distillation(cfg)` with its MLflow run
    (module docstring); a heads job (cfg "kind" medusa / eagle): `training.heads_job.run_heads_distillation`,
    whose figures the registry records on the version it registers (no run of its own)."""
    if is_heads_job(cfg):
        from training.heads_job import run_heads_distillation

        return run_heads_distillation(cfg, progress=progress)
    return run_distillation(cfg, progress=progress, tracker=tracker_for(cfg))


def lower_priority() -> int:
    """Lower this process's CPU priority by DRAFTSMITH_JOB_NICE (set by deploy/ray_jobs.py `job_env` from
    `draftsmith distill --job-nice`), so a job on the machine that serves takes the CPU time serving leaves;
    returns the niceness now. Called before torch starts its threads (Linux: threads inherit it)."""
    raw = os.environ.get("DRAFTSMITH_JOB_NICE", "0").strip() or "0"
    try:
        want = int(raw)
    except ValueError:
        log.warning("DRAFTSMITH_JOB_NICE=%r is not an integer; the job runs at normal priority", raw)
        return os.nice(0)
    now = os.nice(0)
    if want > now:
        now = os.nice(min(want, 19) - now)
    return now


def _ray_task(cfg: dict) -> str:
    logging.basicConfig(level=logging.INFO)
    lower_priority()
    return str(run_job(cfg))


def task_env(data: Path) -> dict:
    """The Ray task's environment: this process's settings that a job reads (deploy/ray_jobs.py `job_env`:
    DRAFTSMITH_*, MLflow, Hugging Face, REDIS_URL; never the HTTP API's keys), OMP_NUM_THREADS, and the paths.
    A Ray task's process inherits the environment of the Ray that started its worker (`draftsmith serve`'s), not
    this driver's: without these its job ran at nice 0 beside serving, while `draftsmith distill --job-nice`
    had set 10 for it (docs/benchmarks.md, "The thirty-eighth session")."""
    from deploy.ray_jobs import _ENV_PREFIXES, _ENV_SECRETS

    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _ENV_SECRETS}
    if os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["DRAFTSMITH_DATA"] = str(data)
    return env


def run_in_ray(cfg: dict, num_cpus: float = 2, num_gpus: float = 0) -> Path:
    """Run `run_job(cfg)` as a Ray task with `num_cpus` CPUs and `num_gpus` GPUs (module docstring)."""
    import ray

    from buffer.paths import data_dir

    cfg = resolve_job(cfg)                           # fail fast, in the driver
    env = task_env(data_dir())
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address or None, num_cpus=None if address else max(1, int(num_cpus)),
                 include_dashboard=False, runtime_env={"env_vars": env})
    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(_ray_task).options(
        runtime_env={"env_vars": env})
    return Path(ray.get(task.remote(cfg)))


def main(argv: list[str] | None = None) -> int:
    nice = lower_priority()
    if nice:
        print(f"[distill] this job runs at nice {nice}: serving on the same machine comes first", flush=True)
    p = build_parser("python -m deploy.distill_job")
    p.add_argument("--ray", action="store_true", help="run as a Ray task (RAY_ADDRESS or a local Ray)")
    p.add_argument("--num-cpus", type=float, default=2, help="CPUs of the Ray task (default 2)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs of the Ray task (default 0)")
    args = p.parse_args(argv)
    heads = _heads_config(p, args)
    if heads is not None:
        return _run_heads_cli(lambda: run_in_ray(heads, args.num_cpus, args.num_gpus) if args.ray else run_job(heads))
    cfg = config_from_args(p, args)
    return run_cli(lambda: run_in_ray(cfg, args.num_cpus, args.num_gpus) if args.ray else run_job(cfg))


def _heads_config(p, args) -> dict | None:
    """The heads job's config when --config-json holds one (what deploy/ray_jobs.py submits for `draftsmith
    distill --kind medusa|eagle`); None for a draft job. The draft job's flags do not apply to it."""
    import json

    try:
        cfg = json.loads(args.config_json) if args.config_json else None
    except json.JSONDecodeError:
        return None                                   # config_from_args says what is wrong
    if not isinstance(cfg, dict) or not is_heads_job(cfg):
        return None
    if args.config or args.set or args.base_draft_path or args.since_id:
        p.error("a heads job (--config-json with kind medusa|eagle) takes its whole config from --config-json")
    return cfg


def _run_heads_cli(run: Callable[[], Path]) -> int:
    """As training.job.run_cli for a heads job: the candidate folder (exit 0), or what is wrong (exit 2)."""
    from serving.models import ModelLoadError
    from training.heads_job import NotEnoughRows

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = run()
    except (ValueError, NotEnoughRows, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"candidate written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
