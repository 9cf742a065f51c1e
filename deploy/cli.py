"""`draftsmith` command line (console script `draftsmith = deploy.cli:main`).

    draftsmith serve [--host H] [--port P] [--target T] [--draft D] [--replicas N] [--api-key K] [--admin-key K]
    draftsmith bootstrap [--out DIR] [--budget 14m] [--force]
    draftsmith distill [--every 10m] [--min-records N] [--drift] [--pipeline] [--margin 0.01] [--no-watchdog]
                       [--canary-share 0.25]
    draftsmith watch [--poll 10s] [--once]         (the watchdog and the canary judge alone, no distillation)
    draftsmith register CANDIDATE_DIR            (or a full model folder: a new base draft)
    draftsmith promote VERSION [--force] [--ignore-pause]
    draftsmith rollback [--to VERSION] [--no-pause]   (pauses scheduled distillation by default)
    draftsmith resume                              (lets scheduled distillation promote again)
    draftsmith versions                            (job-reported and gate-measured acceptance side by side)
    draftsmith status                              (aliases, pause, last job, watchdog, rollback reasons)
    draftsmith gc [--keep-last N] [--dry-run]       (delete cached drafts and candidate folders not retained)

Common options: --target (default $DRAFTSMITH_TARGET or the default SmolLM2 target) picks the
registered model `draftsmith-<target>-draft`; --tracking-uri (default $MLFLOW_TRACKING_URI or
sqlite under $DRAFTSMITH_DATA). Exit codes: 0 ok, 1 the operation failed (gate rejected, corrupt
artifacts, job failed, MLflow unavailable, promotions paused), 2 bad input (the message says what to fix).

The gate (`distill`, `promote`) scores champion and candidate itself on held-out records of the replay
buffer: the Redis of `redis_url` in --config (else $REDIS_URL, else the embedded server), under
`buffer_prefix`, split by `heldout_fraction` (the distillation config's keys). Heavy modules (MLflow, torch,
Ray) are imported only by the subcommand that needs them. DRAFTSMITH_DEBUG=1 shows tracebacks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from buffer.paths import DEFAULT_TARGET
from serving.config import AUTO_MODE, DEFAULT_MODE, DEPLOYMENT_MODES, HEADS_MODES

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
HEADS = HEADS_MODES                          # the kinds served from the target's hidden states
KINDS = ("draft", *HEADS)                    # draft kinds with a registry (deploy/registry.py "Draft kinds")
KIND_HELP = ("which draft kind: 'draft' (the standalone draft model, default), 'medusa' (Medusa heads) or 'eagle' "
             "(the EAGLE head); each heads kind has its own registered model, <name>-medusa / <name>-eagle")


class CommandFailed(Exception):
    """The operation ran but did not succeed (exit code 1)."""


class BadInput(Exception):
    """The user must change the command (exit code 2)."""


# ---------------------------------------------------------------------------------- argument types
def _duration(text: str) -> float:
    from deploy.scheduler import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration_or_off(text: str) -> float:
    """A duration, or 0 (also "0s", "0m", "off"): the step is skipped."""
    if text.strip().lower() in ("0", "0s", "0m", "off", "none"):
        return 0.0
    return _duration(text)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 10], got {text!r}") from None
    if not (0.0 <= v <= 10.0):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 10], got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number in 1..65535, got {text!r}") from None
    if not (1 <= v <= 65535):
        raise argparse.ArgumentTypeError(f"port must be a number in 1..65535, got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not (0.0 <= v < 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return v


def _share(text: str) -> float:
    from deploy.scheduler import check_job_share

    try:
        return check_job_share(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None


def _version(text: str) -> str:
    s = text.strip()
    s = s[1:] if s.lower().startswith("v") else s
    if not s.isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"a version is a registry version number such as 3 (or v3), got {text!r}")
    return str(int(s))


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (v > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _gpus(text: str):
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number >= 0, got {text!r}") from None
    if not (v >= 0):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number >= 0, got {text!r}")
    return v


def _existing_dir(text: str) -> Path:
    p = Path(text).expanduser()
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not an existing folder")
    return p


# ---------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=os.environ.get("DRAFTSMITH_TARGET"),
                        help=f"target model id or folder (default: $DRAFTSMITH_TARGET or {DEFAULT_TARGET})")
    common.add_argument("--model-name", default=None, help="registered model name (default draftsmith-<target>-draft)")
    common.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///$DRAFTSMITH_DATA/mlflow.db)")

    p = argparse.ArgumentParser(prog="draftsmith", description="Online speculative decoding with continual draft "
                                "distillation: serve, distill, and manage draft versions.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("serve", parents=[common], help="start the HTTP service (Ray Serve)")
    s.add_argument("--host", default=os.environ.get("DRAFTSMITH_HOST", "127.0.0.1"))
    s.add_argument("--port", type=_port, default=int(os.environ.get("DRAFTSMITH_PORT", "8000")))
    s.add_argument("--draft", default=None, help="draft folder or registry version (default: the champion)")
    s.add_argument("--medusa-heads", default=os.environ.get("DRAFTSMITH_MEDUSA_HEADS"), metavar="PATH",
                   help="Medusa heads folder (built by `python -m training.heads`) for requests with "
                        "speculative.mode 'medusa' (default $DRAFTSMITH_MEDUSA_HEADS; none: the heads registry's "
                        "champion, hot-swapped as it changes; none there either: that mode answers 400)")
    s.add_argument("--eagle-head", default=os.environ.get("DRAFTSMITH_EAGLE_HEAD"), metavar="PATH",
                   help="EAGLE-style head folder (built by `python -m training.heads --kind eagle`) for requests "
                        "with speculative.mode 'eagle' (default $DRAFTSMITH_EAGLE_HEAD; none: the eagle registry's "
                        "champion, hot-swapped as it changes; none there either: that mode answers 400)")
    s.add_argument("--default-mode", default=os.environ.get("DRAFTSMITH_DEFAULT_MODE", AUTO_MODE),
                   choices=DEPLOYMENT_MODES, metavar="MODE",
                   help="the decoding mode of requests that name none (default $DRAFTSMITH_DEFAULT_MODE or "
                        f"'{AUTO_MODE}': the Medusa heads' tree, its depth chosen per step, where the replica has "
                        f"heads, else {DEFAULT_MODE} with the draft). While what a named mode needs is not loaded, "
                        "such requests decode with mjsd (or the target alone)")
    s.add_argument("--replicas", type=_positive_int, default=1)
    s.add_argument("--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"),
                   help="require this bearer token on the inference routes (default $DRAFTSMITH_API_KEY; "
                        "none = open); it does not open the admin routes")
    s.add_argument("--admin-key", default=None,
                   help="require this bearer token on /v1/admin/* from any address (default "
                        "$DRAFTSMITH_ADMIN_KEY; none = admin routes answer loopback callers only)")
    s.add_argument("--no-bootstrap", action="store_true",
                   help="with no registered draft, serve target-only instead of building the default draft "
                        "in the background")

    b = sub.add_parser("bootstrap", parents=[common], help="build the first draft, register it as champion")
    b.add_argument("--out", type=Path, default=None, help="output folder (default $DRAFTSMITH_DATA/bootstrap-draft)")
    b.add_argument("--budget", type=_duration, default=840.0,
                   help="time budget, e.g. 14m (default 14m: 13.5 min wall on 2 cores, registration included)")
    b.add_argument("--force", action="store_true", help="register a new base draft even if versions exist")
    b.add_argument("--heads-budget", type=_duration_or_off, default=180.0,
                   help="then train Medusa heads on the same teacher data (its hidden states, kept while the "
                        "teacher generated; an older cache without them pays a target pass inside this budget) "
                        "and make them the heads' champion, which the default mode drafts with where they pay "
                        "(default 3m; 0: no heads)")

    d = sub.add_parser("distill", parents=[common], help="run one distillation job now, or on a schedule")
    d.add_argument("--every", type=_duration, default=None, help="run a job every DURATION (e.g. 10m)")
    d.add_argument("--kind", choices=("auto", *KINDS), default="auto",
                   help="'auto' (default): the kind the served default drafts with: the Medusa heads when their "
                        "registry has a champion (what `draftsmith bootstrap` leaves), else the draft; 'draft': "
                        "distill the draft model; 'medusa' / 'eagle': an online job for the Medusa heads / the "
                        "EAGLE head (training/heads_job.py) from the champion, registered and gated "
                        "(deploy/heads.py); now, or with --every on a schedule")
    d.add_argument("--heads-budget", type=_duration, default=120.0,
                   help="training time of a --kind medusa|eagle job (default 2m; the hidden-state pass comes on "
                        "top)")
    d.add_argument("--heads-replay", type=_ratio, default=None,
                   help="a --kind medusa|eagle job also trains on RATIO x its window of OLDER buffer steps, against "
                        "forgetting earlier traffic after a shift (default: the job's, 1; 0: none)")
    d.add_argument("--min-records", type=_positive_int, default=None,
                   help="run when at least N new records are in the buffer")
    d.add_argument("--drift", action="store_true",
                   help="with --every: start a job before the interval ends when the champion's live acceptance "
                        "over the last --drift-window is significantly below its own earlier live figure, else the "
                        "previous version's, else its gate figure (deploy/scheduler.py, 'Triggers')")
    d.add_argument("--drift-window", type=_duration, default=300.0,
                   help="live intervals the drift trigger judges (default 5m)")
    d.add_argument("--drift-tolerance", type=_fraction, default=0.05,
                   help="relative drop below the reference figure that is not yet drift (default 0.05)")
    d.add_argument("--pipeline", action="store_true",
                   help="with a canary: a job due while the canary is judged starts at once, trained from the canary; "
                        "its candidate is registered once the canary is promoted, discarded if it is dropped "
                        "(deploy/scheduler.py, 'Pipelining')")
    d.add_argument("--poll", type=_duration, default=10.0, help="how often the schedule is checked (default 10s)")
    d.add_argument("--max-jobs", type=_positive_int, default=None, help="stop the scheduler after N jobs")
    _gate_options(d)
    d.add_argument("--config", type=Path, default=None, help="distillation config YAML (training.job); its "
                   "redis_url / buffer_prefix / heldout_fraction also tell the gate where to draw its sample")
    d.add_argument("--evidence-wait", type=_age_or_zero, default=1800.0,
                   help="a candidate the gate could not judge yet (held-out sample below its minimum) is gated "
                        "again as held-out traffic arrives, for this long, while no new job starts (default 30m; "
                        "0 = reject it). A heads schedule then starts a job once the sample holds half the "
                        "minimum instead of all of it")
    d.add_argument("--job-share", type=_share, default=None, metavar="FRACTION",
                   help="the largest share of wall-clock time scheduled jobs may take: after a job (with its gate) of "
                        "D seconds the next waits D x (1/FRACTION - 1) after its end (default 0.5 when `draftsmith "
                        "serve` runs on this machine, where a job slows serving while it runs; 1 elsewhere)")
    d.add_argument("--no-watchdog", action="store_true",
                   help="do not watch the champion's live acceptance (no automatic rollback)")
    d.add_argument("--runner", choices=("auto", "ray", "process"),
                   default=os.environ.get("DRAFTSMITH_DISTILL_RUNNER", "auto"),
                   help="where jobs run: 'auto' (default) submits each job to Ray when a cluster is reachable "
                        "($RAY_ADDRESS, else the Ray `draftsmith serve` runs on this machine, else the last `ray "
                        "start --head`) and runs it in this process otherwise; 'ray' always on Ray (a job fails "
                        "when none answers); 'process' always here")
    d.add_argument("--ray-submit", choices=("auto", "job", "task"), default="auto",
                   help="how a job goes to Ray: the job submission API ('job', needs the dashboard), a Ray task "
                        "('task'), or 'auto' (default): the job API when the cluster has a dashboard")
    d.add_argument("--job-nice", type=int, choices=range(0, 20), default=None, metavar="0..19",
                   help="CPU priority a job lowers itself by (nice; a Ray job or task, not --runner process): "
                        "on a machine that also serves, a higher value leaves serving the CPU, and this process "
                        "(the gate) lowers its own priority as well (default: 10 when `draftsmith serve` runs on "
                        "this machine, else 0)")
    d.add_argument("--ray-cpus", type=_positive_float, default=1.0,
                   help="CPUs a Ray job asks for (default 1; torch uses as many threads)")
    d.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads of this process, which scores the gate's sample (and runs jobs with --runner "
                        "process); default: --ray-cpus when `draftsmith serve` runs on this machine, so the "
                        "distillation side never takes more of the cores than a job asks for, else torch's default")
    d.add_argument("--ray-gpus", type=_gpus, default="auto",
                   help="GPUs a Ray job asks for: a number, or 'auto' (default): 1 when the cluster has a GPU, "
                        "so the job lands on a GPU node")
    d.add_argument("--rollback-tolerance", type=_fraction, default=0.10,
                   help="relative drop of live acceptance below the gate figure / the previous version's that "
                        "the watchdog tolerates before a significant drop rolls back (default 0.10)")
    _watch_options(d)

    r = sub.add_parser("register", parents=[common], help="register a candidate folder, a full model folder or a "
                       "Medusa heads folder (registered in the heads' own model)")
    r.add_argument("path", type=_existing_dir, metavar="CANDIDATE_DIR")

    pr = sub.add_parser("promote", parents=[common], help="promote a version through the gate")
    pr.add_argument("version", type=_version, metavar="VERSION")
    pr.add_argument("--force", action="store_true", help="skip the gate (artifacts are still verified)")
    pr.add_argument("--kind", choices=KINDS, default="draft",
                    help=KIND_HELP)
    pr.add_argument("--ignore-pause", action="store_true",
                    help="promote although promotions are paused after a rollback (default: refuse)")
    pr.add_argument("--canary-share", type=_canary_fraction, default=0.0, metavar="S",
                    help="instead of promoting at once, make the version the canary on this share of requests "
                         "(0 < S < 1) once it passes the gate (or at once with --force); `draftsmith watch` or a "
                         "running `draftsmith distill --every` judges it on live acceptance (default 0: promote)")
    _gate_options(pr)
    pr.add_argument("--config", type=Path, default=None,
                    help="distillation config YAML: redis_url / buffer_prefix / heldout_fraction of the gate sample")

    rb = sub.add_parser("rollback", parents=[common], help="move the champion back to the previous version")
    rb.add_argument("--to", type=_version, default=None, metavar="VERSION")
    rb.add_argument("--reason", default="operator rollback")
    rb.add_argument("--kind", choices=KINDS, default="draft",
                    help=KIND_HELP)
    rb.add_argument("--no-pause", action="store_true",
                    help="do not pause scheduled distillation (by default a rollback pauses it until "
                         "`draftsmith resume`)")
    rs = sub.add_parser("resume", parents=[common], help="let scheduled distillation promote again after a rollback")
    rs.add_argument("--kind", choices=KINDS, default="draft",
                    help=KIND_HELP)

    vs = sub.add_parser("versions", parents=[common], help="list draft versions with aliases and metrics")
    vs.add_argument("--kind", choices=KINDS, default="draft",
                    help=KIND_HELP)

    sub.add_parser("status", parents=[common], help="champion, aliases, scheduler state")
    _watch_parser(sub, common)
    _gc_parser(sub, common)
    return p


def _gate_options(sub) -> None:
    sub.add_argument("--margin", type=_fraction, default=0.01,
                     help="held-out acceptance gain (measured by the gate) the candidate needs over the champion "
                          "(default 0.01)")
    sub.add_argument("--confidence", type=float, default=0.95,
                     help="one-sided level of the gate's paired bootstrap bounds (default 0.95)")
    sub.add_argument("--min-requests", type=int, default=20,
                     help="held-out requests the gate's own sample needs (default 20)")
    sub.add_argument("--min-heldout", type=int, default=1, help="held-out steps the gate's sample needs (default 1)")
    sub.add_argument("--category-min-requests", type=int, default=10,
                     help="a traffic category is tested for regression from this many requests; the gate's sample "
                          "reaches back for older held-out requests of a category below it (default 10)")
    sub.add_argument("--gate-records", type=_positive_int, default=4000,
                     help="newest held-out step records the gate draws (default 4000)")


# ---------------------------------------------------------------------------------- commands
def _registry(args, kind: str | None = None):
    """The registry of `kind` (default: the command's --kind, else the draft's)."""
    from deploy.registry import Registry, heads_registry

    kind = kind or getattr(args, "kind", "draft")
    if kind in HEADS:
        return heads_registry(args.target, kind, name=args.model_name, tracking_uri=args.tracking_uri)
    return Registry(args.target, name=args.model_name, tracking_uri=args.tracking_uri)


def _gate_policy(args):
    from deploy.gate import GatePolicy

    try:
        return GatePolicy(margin=args.margin, min_heldout_records=args.min_heldout, min_requests=args.min_requests,
                          confidence=args.confidence, category_min_requests=args.category_min_requests)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _evidence(args, overrides: dict):
    """The gate's EvidenceSource: the buffer the distillation jobs read (their config's keys)."""
    from deploy.gate import EvidenceSource

    try:
        return EvidenceSource(redis_url=overrides.get("redis_url"),
                              buffer_prefix=overrides.get("buffer_prefix", "draftsmith:buf"),
                              heldout_fraction=overrides.get("heldout_fraction", 0.1), records=args.gate_records,
                              max_len=overrides.get("max_len", 1024),
                              category_floor=getattr(args, "category_min_requests", 10),
                              target_sha256=_target_sha(args))
    except ValueError as e:
        raise BadInput(f"gate sample: {e}") from None


def _target_sha(args, *, convert: bool = True) -> str | None:
    """Fingerprint of the served target (deploy.registry.target_fingerprint). With `convert`, the default
    target is converted first if it never was (what serving does on first start)."""
    from deploy.registry import resolve_target_folder, target_fingerprint

    if convert and resolve_target_folder(args.target) is None:
        try:
            from serving.models import ModelLoadError, resolve_model_path
        except ImportError:
            return None
        try:
            return target_fingerprint(resolve_model_path(args.target))
        except (ModelLoadError, OSError) as e:
            raise BadInput(f"cannot find the target {args.target or 'default'} to pin drafts to: {e}") from None
    return target_fingerprint(args.target)


def cmd_serve(args) -> int:
    """Serve until SIGINT or SIGTERM; serve_forever then stops every process below this one: Ray's, the
    embedded Redis, and a background bootstrap started here (the next start begins it again; a finished
    teacher-data cache is re-used)."""
    try:
        from deploy.app import serve_forever
    except ImportError as e:
        raise CommandFailed(f"the serving application is not available ({e})") from None
    if args.admin_key is not None and not args.admin_key.strip():
        raise BadInput("--admin-key is empty; pass a secret, or leave it out to keep admin routes loopback-only")
    admin = args.admin_key or os.environ.get("DRAFTSMITH_ADMIN_KEY")
    if admin and args.api_key and admin == args.api_key:
        raise BadInput("the admin key (--admin-key / $DRAFTSMITH_ADMIN_KEY) must differ from the API key "
                       "(--api-key / $DRAFTSMITH_API_KEY): every inference client would hold the admin key")
    if args.default_mode not in DEPLOYMENT_MODES:   # argparse checks --default-mode, not a default from the env
        raise BadInput(f"$DRAFTSMITH_DEFAULT_MODE is {args.default_mode!r}; use one of {', '.join(DEPLOYMENT_MODES)}")
    if args.draft is None and not args.no_bootstrap:
        _bootstrap_in_background(args)
    keys = {"admin_api_key": args.admin_key} if args.admin_key else {}   # else serve_forever reads the env
    if args.medusa_heads:
        keys["medusa_heads"] = str(Path(args.medusa_heads).resolve())
    if args.eagle_head:
        keys["eagle_head"] = str(Path(args.eagle_head).resolve())
    serve_forever(host=args.host, port=args.port, target=args.target, draft=args.draft,
                  replicas=args.replicas, api_key=args.api_key, default_mode=args.default_mode, **keys)
    return EXIT_OK


def _bootstrap_in_background(args) -> None:
    """First start on a fresh machine: no draft is registered yet. Serving starts at once (target-only)
    while `draftsmith bootstrap` builds the default draft, then the Medusa heads, in a child process (about
    14 + 3 minutes on 2 cores); it registers and promotes each, and the replicas, which watch the champion
    aliases, hot-swap them in (the default mode drafts with the heads from then on). The service gets
    faster without a restart, which is the product's point."""
    import subprocess

    from buffer.paths import data_dir
    from deploy.registry import RegistryUnavailable
    from deploy.scheduler import JobLock

    reg = _registry(args)
    try:
        if reg.champion() is not None:
            return
    except RegistryUnavailable as e:   # MLflow down: serve (target-only or what replicas can load), build nothing
        print(f"[serve] the registry is unreachable ({e}); not starting a bootstrap, serving anyway")
        return
    lock = JobLock(data_dir() / "bootstrap.lock")
    if lock.holder() is not None:
        print(f"[serve] no draft registered yet; a bootstrap is already running ({lock.holder()})")
        return
    logfile = data_dir() / "bootstrap.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deploy.cli", "bootstrap"]
    for flag, value in (("--target", args.target), ("--model-name", args.model_name),
                        ("--tracking-uri", args.tracking_uri)):
        if value:
            cmd += [flag, str(value)]
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})   # progress lines reach the log
    print(f"[serve] no draft registered yet: serving target-only while `draftsmith bootstrap` (pid {proc.pid}) "
          f"builds the default draft (~14 min, progress in {logfile}); replicas switch to it when it is promoted")


def _bootstrap_builder():
    """The bootstrap recipe: bootstrap(out_dir, target_path, budget_s=...) -> model folder."""
    from training.draft_builder import bootstrap

    return bootstrap


def cmd_bootstrap(args) -> int:
    from buffer.paths import data_dir

    reg = _registry(args)
    existing = reg.versions()
    if existing and not args.force:
        raise BadInput(f"{reg.name} already has {len(existing)} version(s) (champion: {reg.champion() or 'none'}); "
                       "pass --force to build and register another base draft")
    from deploy.scheduler import JobLock

    out = args.out or data_dir() / "bootstrap-draft"
    build = _bootstrap_builder()
    lock = JobLock(data_dir() / "bootstrap.lock")
    if not lock.acquire():
        raise CommandFailed(f"another bootstrap is running ({lock.holder()})")
    try:
        folder = Path(build(out, args.target, budget_s=args.budget,
                            teacher_cache=data_dir() / "bootstrap" / "teacher.safetensors",
                            progress=lambda m: print(m, flush=True)))
    finally:
        lock.release()
    version = reg.register_base(folder, description="bootstrap base draft", target_sha256=_target_sha(args))
    move = reg.promote(version, reason="bootstrap")
    print(f"registered {folder} as {reg.name} version {version}; {move.message}")
    if args.heads_budget > 0:
        _bootstrap_heads(args, data_dir() / "bootstrap" / "teacher.safetensors", data_dir() / "medusa-heads")
    return EXIT_OK


def _heads_builder():
    """The bootstrap's heads recipe: (target path, teacher cache, out dir, budget_s, progress) -> heads folder."""
    def build(target_path, teacher: Path, out: Path, budget_s: float, progress) -> Path:
        from serving.models import (default_dtype, ensure_default_target, load_causal_lm, load_tokenizer,
                                    resolve_model_path)
        from training.heads import build_heads
        from training.teacher import load_examples

        held = teacher.with_suffix(".heldout.safetensors")
        if not teacher.is_file() or not held.is_file():
            raise FileNotFoundError(f"no teacher data at {teacher} (and {held.name})")
        tpath = resolve_model_path(target_path) if target_path else ensure_default_target()
        target = load_causal_lm(tpath, "cpu", default_dtype("cpu"))      # the hidden states serving will see
        build_heads(target, load_tokenizer(tpath), load_examples(teacher), load_examples(held), out,
                    budget_s=budget_s, progress=progress)
        return out
    return build


def _bootstrap_heads(args, teacher: Path, out: Path) -> None:
    """After the draft: Medusa heads from the same teacher data, registered in the heads' own model and made
    its champion (replicas load it; the default mode drafts with them where their tree pays). A failure here
    leaves the registered draft as it is: the service then serves mjsd with the draft alone."""
    try:
        folder = _heads_builder()(args.target, teacher, out, args.heads_budget, lambda m: print(m, flush=True))
        reg = _registry(args, "medusa")
        version = reg.register_heads(folder)
        move = reg.promote(version, reason="bootstrap")
        print(f"registered {folder} as {reg.name} version {version}; {move.message}")
    except Exception as e:  # noqa: BLE001 - the draft is registered; heads are an addition
        print(f"[bootstrap] Medusa heads not built ({type(e).__name__}: {e}); the draft alone serves. Build them "
              "later with `python -m training.heads` and `draftsmith register PATH`", flush=True)


def _real_distill(args):
    """The injected distillation function (deploy.ray_jobs.DistillRunner, JobRequest -> candidate dir): the
    job `training.job.run_distillation(cfg)` with its MLflow run (deploy/distill_job.py) on Ray or in this
    process, as --runner says.

    cfg is a plain dict: the --config YAML's keys, overridden by the job request
    (parent_version, base_draft_path = the materialised champion, target, since_id = buffer cursor,
    target_sha256) and `ack: registered` (the scheduler acks the records once the candidate is registered).
    """
    try:
        from deploy.distill_job import run_job
    except ImportError as e:
        raise CommandFailed(f"the distillation job (training.job.run_distillation) is not available: {e}") from None
    from deploy.ray_jobs import DistillRunner

    overrides = _read_config(args.config)
    return DistillRunner(lambda request: job_config(request, args.target, overrides),
                         getattr(args, "runner", "auto"), _ray_settings(args), in_process=run_job)


def _ray_settings(args):
    from deploy.ray_jobs import RaySettings

    try:
        return RaySettings(submit=getattr(args, "ray_submit", "auto"), num_cpus=getattr(args, "ray_cpus", 1.0),
                           num_gpus=getattr(args, "ray_gpus", "auto"), nice=getattr(args, "job_nice", 0) or 0)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _heads_runner(args):
    """The heads jobs' runner: a DistillRunner (deploy/ray_jobs.py) handed each job's whole config, so a heads
    job goes to Ray, or runs here, exactly as --runner says for the draft's jobs (deploy/distill_job.py
    `run_job` runs either kind); its state goes to `distill-job.json` for `draftsmith status`."""
    from deploy.distill_job import run_job
    from deploy.ray_jobs import DistillRunner
    from deploy.scheduler import write_job_status

    return DistillRunner(lambda cfg: cfg, getattr(args, "runner", "auto"), _ray_settings(args), in_process=run_job,
                         on_state=lambda info: write_job_status({**info, "kind": args.kind}))


def job_config(request, target: str | None, overrides: dict | None = None) -> dict:
    """The cfg handed to training.job.run_distillation for one scheduler JobRequest."""
    return {**(overrides or {}), "parent_version": request.parent_version,
            "base_draft_path": str(request.parent_path), "target": target, "since_id": request.since_id,
            "target_sha256": request.target_sha256, "ack": "registered"}


def _ack_records(overrides: dict):
    """`training.job.ack_candidate_records` against the job's Redis (the scheduler's ack_records)."""
    def ack(cand_dir):
        from training.job import ack_candidate_records

        return ack_candidate_records(cand_dir, redis_url=overrides.get("redis_url"))

    return ack


def _read_config(path: Path | None) -> dict:
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise BadInput(f"cannot read --config {path}: {e}") from None
    if not isinstance(data, dict):
        raise BadInput(f"--config {path} must hold a YAML mapping of distillation settings")
    return data


def _pending_records():
    """`training.job.pending_records(since_id) -> int`: buffer records newer than the cursor."""
    try:
        from training.job import pending_records
    except ImportError as e:
        raise CommandFailed(f"--min-records needs training.job.pending_records(since_id), which is not "
                            f"available: {e}") from None
    return pending_records


def cmd_distill(args) -> int:
    policy = _gate_policy(args)
    _distill_threads(args)
    _job_nice(args)
    _distill_priority(args)
    if args.drift and args.every is None:        # the flags first: no registry read for a bad command line
        raise BadInput("--drift brings a scheduled job forward: pass --every DURATION too (e.g. --every 10m "
                       "--drift)")
    if args.kind not in HEADS:
        if args.pipeline and (not args.canary_share or (args.every is None and args.min_records is None)):
            raise BadInput("--pipeline overlaps a scheduled job with a canary: it needs --every or --min-records and "
                           "--canary-share above 0")
    chosen = args.kind == "auto"
    if chosen:
        args.kind = _served_kind(args)
        if args.every is not None and not args.pipeline and _registry(args, "medusa").champion() is not None:
            return _follow_served_kind(args, policy)
    return _distill_kind(args, policy, chosen)


def _follow_served_kind(args, policy) -> int:
    """`distill --every` with no --kind and a heads champion: the schedule of the kind that serves
    (`_served_kind`), moved to the other kind when the replicas' measured choice moves (deploy/heads.py
    `follow_served_kind`), but not while a canary of the current kind is being judged."""
    from deploy.heads import CLEAR_SHARE, WATCH_S, drafting_kind, follow_served_kind

    overrides = _read_config(args.config)

    def run(kind, stop):
        args.kind = kind
        return _distill_kind(args, policy, True, stop)

    def look():
        return drafting_kind(overrides.get("redis_url"), overrides.get("buffer_prefix", "draftsmith:buf"),
                             share=CLEAR_SHARE)

    def can_switch(current, new):
        return _registry(args, current).canary() is None and _registry(args, new).champion() is not None

    return follow_served_kind(args.kind, run, look, look_s=min(args.every, WATCH_S), can_switch=can_switch,
                              progress=lambda m: print(m, flush=True))


def _distill_kind(args, policy, chosen: bool, stop=None) -> int:
    """One job or a schedule of args.kind (`chosen`: the kind was read from what serves, and the output says so);
    a schedule runs until `stop` (a threading.Event) is set or Ctrl-C."""
    if args.kind in HEADS:
        if args.pipeline:
            why = (f"the served default drafts with the Medusa heads ({_registry(args, 'medusa').name} has a "
                   "champion), so `distill` distills them, and " if chosen else "")
            raise BadInput(f"{why}--pipeline schedules draft jobs; a --kind {args.kind} schedule runs by --every "
                           "(--min-records, --drift): drop the flag"
                           + (", or pass --kind draft to distill the draft" if chosen else ""))
        if chosen:
            print(f"[distill] the served default drafts with the Medusa heads: distilling them (--kind {args.kind}; "
                  "--kind draft distills the draft)", flush=True)
        return _distill_heads(args, policy, stop)
    if chosen and _registry(args, "medusa").champion() is not None:
        print("[distill] the served default drafts with the draft: distilling it (--kind draft; --kind medusa "
              "distills the heads)", flush=True)
    return _distill_draft(args, policy, stop)


def _distill_draft(args, policy, stop=None) -> int:
    """`draftsmith distill --kind draft`: one job now, or the scheduler (deploy/scheduler.py) until `stop`."""
    import threading

    from deploy.gate import engine_smoke_check
    from deploy.scheduler import DistillScheduler, ScheduleConfig

    schedule = None
    if args.every is not None or args.min_records is not None:
        drift = _drift_policy(args)
        try:
            schedule = ScheduleConfig(every_s=args.every, min_records=args.min_records, poll_s=args.poll, drift=drift,
                                      pipeline=args.pipeline, job_share=_job_share(args))
        except ValueError as e:
            raise BadInput(str(e)) from None
    reg = _registry(args)
    if reg.champion() is None:
        raise BadInput(f"{reg.name} has no champion draft to distill from; run `draftsmith bootstrap` first")
    overrides = _read_config(args.config)
    distill = _real_distill(args)
    watchdog = None if args.no_watchdog or schedule is None else _watchdog(args, reg, _evidence(args, overrides))
    sched = DistillScheduler(reg, distill, smoke_check=engine_smoke_check(args.target), policy=policy,
                             schedule=schedule, pending_records=_pending_records() if args.min_records else None,
                             evidence=_evidence(args, overrides), target_sha256=_target_sha(args),
                             ack_records=_ack_records(overrides), watchdog=watchdog,
                             canary_share=args.canary_share, canary=_canary_judge(args, reg),
                             evidence_wait_s=args.evidence_wait)
    if schedule is None:
        out = sched.run_job()
        return EXIT_OK if out.status in ("promoted", "rejected", "held", "canary") else EXIT_FAILED
    print(f"[distill] scheduler started: every {args.every or '-'} s, min records {args.min_records or '-'}"
          + (f", drift over {args.drift_window:.0f} s" if args.drift else "")
          + (", jobs pipelined with canaries" if args.pipeline else "")
          + (f", jobs take at most {args.job_share:.0%} of the time" if args.job_share < 1 else "") + "; Ctrl-C stops it")
    getattr(distill, "announce", lambda: None)()      # where jobs run (deploy/ray_jobs.py)
    stop = stop or threading.Event()
    try:
        sched.run_forever(stop, max_jobs=args.max_jobs)
    except KeyboardInterrupt:
        stop.set()
    return EXIT_OK


def _drift_policy(args):
    """--drift's DriftPolicy (None without --drift)."""
    from deploy.scheduler import DriftPolicy

    if not args.drift:
        return None
    try:
        return DriftPolicy(window_s=args.drift_window, tolerance=args.drift_tolerance)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _distill_threads(args) -> int | None:
    """Set this process's torch threads (--threads; by default --ray-cpus when serving runs on this machine:
    the gate's scoring pass beside a 1-thread serving replica on 2 cores otherwise takes both cores from it,
    docs/benchmarks.md); returns what was set (None: torch's default kept)."""
    n = args.threads
    if n is None:
        from deploy.ray_jobs import serving_here

        if not serving_here():
            return None
        n = max(1, int(args.ray_cpus))
        print(f"[distill] `draftsmith serve` runs on this machine: the gate scores on {n} thread{'s' * (n > 1)} "
              "(--threads to change)", flush=True)
    import torch

    torch.set_num_threads(n)
    return n


def _job_nice(args) -> int:
    """--job-nice, or by default 10 when `draftsmith serve` runs on this machine (jobs and the gate then leave
    serving the CPU: docs/benchmarks.md, the nineteenth session) and 0 elsewhere; sets args.job_nice."""
    if getattr(args, "job_nice", None) is None:
        from deploy.ray_jobs import serving_here

        args.job_nice = DEFAULT_JOB_NICE_BESIDE_SERVING if serving_here() else 0
    return args.job_nice


DEFAULT_JOB_NICE_BESIDE_SERVING = 10


def _job_share(args) -> float:
    """--job-share, or by default DEFAULT_JOB_SHARE_BESIDE_SERVING when `draftsmith serve` runs on this machine
    (a job there slows every request while it runs: docs/benchmarks.md, the twenty-sixth and twenty-seventh
    sessions) and 1 elsewhere; sets args.job_share."""
    if getattr(args, "job_share", None) is None:
        from deploy.ray_jobs import serving_here

        args.job_share = DEFAULT_JOB_SHARE_BESIDE_SERVING if serving_here() else 1.0
    return args.job_share


DEFAULT_JOB_SHARE_BESIDE_SERVING = 0.5


def _distill_priority(args) -> int:
    """With --job-nice N on the machine that serves, this process (the gate's scoring pass, registration, the
    smoke check) lowers its CPU priority by N as the jobs do, so no part of a distillation cycle takes CPU time
    from serving (docs/benchmarks.md, the nineteenth session); returns the niceness now."""
    import os

    want = int(getattr(args, "job_nice", 0) or 0)
    now = os.nice(0)
    if want <= now:
        return now
    from deploy.ray_jobs import serving_here

    if not serving_here():
        return now
    now = os.nice(want - now)
    print(f"[distill] `draftsmith serve` runs on this machine: the gate runs at nice {now}, as jobs do (--job-nice)",
          flush=True)
    return now


def _served_kind(args) -> str:
    """The kind a request that names no mode drafts with (serving/config.py `served_mode`, mode `auto`): without a
    heads champion, the draft. With one, replicas that choose their drafter by measured speed (serving/mode_choice.py,
    on by default) serve the heads or the draft, whichever is faster on their host and traffic: the kind that
    drafted most of the buffer's newest steps is the one whose distillation reaches the traffic (deploy/heads.py
    `drafting_kind`). On an fp32 host the draft won the choice and a loop that distilled the heads promoted five
    versions that served 9 of 414 requests (docs/benchmarks.md, "The thirty-ninth session"). So a schedule (--every)
    reads the buffer: it decides early where one kind served CLEAR_SHARE of enough answer tokens, else by the
    majority at the end of one interval (the choice's warm-up alternates the two kinds); the heads when the
    buffer holds too few then,
    when the buffer cannot be read, for a single job, and with --pipeline (a draft-only flag: an error follows)."""
    from buffer.redis_store import BufferUnavailable
    from deploy.heads import CLEAR_SHARE, MIN_SERVED_TOKENS, drafting_kind

    if _registry(args, "medusa").champion() is None:
        return "draft"
    if not args.every or args.pipeline:
        return "medusa"
    overrides = _read_config(args.config)
    deadline = time.monotonic() + args.every
    said = False
    while True:
        try:
            last = time.monotonic() >= deadline
            kind, counts = drafting_kind(overrides.get("redis_url"), overrides.get("buffer_prefix", "draftsmith:buf"),
                                         share=0.0 if last else CLEAR_SHARE)
        except Exception as e:  # noqa: BLE001 - Redis down or a bad URL: the static rule, the schedule still runs
            why = e if isinstance(e, BufferUnavailable) else f"{type(e).__name__}: {e}"
            print(f"[distill] cannot read the replay buffer to see which drafter serves ({why}): the Medusa heads",
                  flush=True)
            return "medusa"
        if kind is not None:
            shares = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"[distill] answer tokens of the buffer's newest requests by drafter: {shares}: the traffic is "
                  f"drafted by {'the draft' if kind == 'draft' else f'the {kind} heads'}", flush=True)
            return kind
        if last:
            print(f"[distill] the buffer's newest requests hold {sum(counts.values())} answer tokens served with a "
                  f"drafter after one interval (needs {MIN_SERVED_TOKENS}): the Medusa heads, the static default",
                  flush=True)
            return "medusa"
        if not said:
            print(f"[distill] waiting up to {args.every:.0f} s to see which drafter the replicas serve (answer tokens "
                  f"of the buffer's newest requests, {CLEAR_SHARE:.0%} of at least {MIN_SERVED_TOKENS} to decide "
                  "sooner)", flush=True)
            said = True
        time.sleep(max(0.05, min(args.poll, deadline - time.monotonic())))


def _distill_heads(args, policy, stop=None) -> int:
    """`draftsmith distill --kind medusa|eagle`: one heads cycle now (deploy/heads.py `run_heads_cycle`), or with
    --every a heads job every DURATION when the buffer has new records (`run_heads_schedule`)."""
    from deploy.heads import HeadsEvidence, run_heads_cycle
    from deploy.ray_jobs import RayJobError, RayUnavailable
    from training.heads_job import NotEnoughRows

    if args.min_records is not None and args.every is None:
        raise BadInput(f"--kind {args.kind} schedules by time: pass --every DURATION (and --min-records N for the new "
                       "step records a job needs, default 1)")
    overrides = _read_config(args.config)
    reg = _registry(args)
    job = {k: overrides[k] for k in ("redis_url", "buffer_prefix", "heldout_fraction") if k in overrides}
    job["budget_s"] = args.heads_budget
    if args.heads_replay is not None:
        job["replay_ratio"] = args.heads_replay
    runner = _heads_runner(args)
    try:
        evidence = HeadsEvidence(args.target or reg.target, redis_url=job.get("redis_url"),
                                 buffer_prefix=job.get("buffer_prefix", "draftsmith:buf"),
                                 heldout_fraction=job.get("heldout_fraction", 0.1), records=args.gate_records,
                                 kind=args.kind, category_floor=args.category_min_requests)
        if args.every is not None:
            import threading

            from deploy.heads import run_heads_schedule

            share = _job_share(args)
            print(f"[heads] schedule started: a heads job every {args.every:g} s when the buffer has new records"
                  + (f" (jobs take at most {share:.0%} of the time: --job-share)" if share < 1 else "") + "; "
                  + (f"a candidate that passes the gate serves {args.canary_share:.0%} of {args.kind} requests as the "
                     "canary until the live judge promotes or drops it; " if args.canary_share else
                     "a candidate that passes the gate becomes champion; ") + "Ctrl-C stops it")
            runner.announce()                                 # where jobs run (deploy/ray_jobs.py)
            stop = stop or threading.Event()
            try:
                ticks = run_heads_schedule(reg, args.target, job, every_s=args.every, poll_s=args.poll, stop=stop,
                                           max_jobs=args.max_jobs, min_new_steps=args.min_records or 1,
                                           policy=policy, evidence=evidence, canary_share=args.canary_share,
                                           canary=_canary_judge(args, reg) if args.canary_share else None,
                                           run_job=runner, drift=_drift_policy(args),
                                           evidence_wait_s=args.evidence_wait, job_share=_job_share(args))
            except KeyboardInterrupt:
                stop.set()
                return EXIT_OK
            return EXIT_OK if all(t.status != "failed" for t in ticks) else EXIT_FAILED
        version, verdict = run_heads_cycle(reg, args.target, job, policy=policy, evidence=evidence,
                                           canary_share=args.canary_share, run_job=runner)
    except NotEnoughRows as e:
        raise CommandFailed(f"no heads job: {e}") from None
    except (RayJobError, RayUnavailable) as e:
        tail = "\n".join(e.log_tail[-5:]) if isinstance(e, RayJobError) else ""
        raise CommandFailed(f"the heads job failed on Ray: {e}" + (f"\n{tail}" if tail else "")) from None
    except ValueError as e:
        raise BadInput(str(e)) from None
    outcome = ("promoted" if verdict.promoted else
               f"canary on {args.canary_share:.0%} of {args.kind} requests" if verdict.accepted and args.canary_share
               else "not promoted")
    print(f"heads candidate {reg.name} version {version}: {outcome} ({verdict.reason})"
          + (_canary_hint(args.kind) if "canary" in outcome else ""))
    return EXIT_OK if verdict.accepted else EXIT_FAILED


def cmd_register(args) -> int:
    """A base folder is pinned to the --target's fingerprint (when it has a local folder); a candidate to
    the one its candidate.json records, else its parent's. A candidate written with `ack: registered`
    has its records acked now that it is registered."""
    from deploy.registry import short_hash

    from deploy.registry import heads_kind_of

    kind = heads_kind_of(args.path)
    reg = _registry(args, kind or "draft")
    note = ""
    if kind is not None:
        version = reg.register_heads(args.path)
    elif (args.path / "candidate.json").exists():
        version = reg.register_candidate(args.path)
        if (args.path / "records.json").exists():
            try:
                from training.job import ack_candidate_records

                note = f"; {ack_candidate_records(args.path)} of its records acked"
            except Exception as e:  # noqa: BLE001 - Redis unreachable: they stay pending
                note = f"; its records could not be acked ({e}) and stay pending for a later job"
    else:
        version = reg.register(args.path)
    info = reg.get(version)
    print(f"registered {args.path} as {reg.name} version {version} ({info.kind}"
          + (f" on version {info.parent_version}" if info.parent_version else "")
          + (f", squashed: its chain {' -> '.join(info.squashed_chain)} "
             f"merged in, as the adapter chain would exceed {reg.max_chain_depth}" if info.squashed_from else "")
          + f"; target {short_hash(info.target_sha256)})" + note)
    return EXIT_OK


def cmd_promote(args) -> int:
    from deploy.gate import engine_smoke_check, force_promote, run_gate, start_canary_after_gate

    from deploy.registry import PromotionsPaused

    reg = _registry(args)
    canary = args.canary_share > 0
    if canary and reg.champion() is None:
        raise BadInput("--canary-share needs a champion to compare the canary with; promote the first version "
                       "without it")
    try:
        if args.force and canary:
            move = reg.start_canary(args.version, args.canary_share, reason="operator --force",
                                    ignore_pause=args.ignore_pause)
            print(move.message + _canary_hint(args.kind))
            return EXIT_OK
        if args.force:
            move = force_promote(reg, args.version, ignore_pause=args.ignore_pause)
            print(move.message + ("" if move.changed else " (nothing changed)"))
            return EXIT_OK
        if not args.ignore_pause and reg.promotions_paused():
            raise PromotionsPaused(f"promotions are paused ({reg.promotions_paused().get('reason')}); "
                                   "`draftsmith resume` first, or pass --ignore-pause")
        if args.kind in HEADS:
            from deploy.heads import HeadsEvidence, heads_smoke_check

            ov = _read_config(args.config)
            smoke = heads_smoke_check(args.target, kind=args.kind)
            evidence = HeadsEvidence(args.target or reg.target, redis_url=ov.get("redis_url"),
                                     buffer_prefix=ov.get("buffer_prefix", "draftsmith:buf"),
                                     heldout_fraction=ov.get("heldout_fraction", 0.1), records=args.gate_records,
                                     kind=args.kind, category_floor=args.category_min_requests)
        else:
            smoke, evidence = engine_smoke_check(args.target), _evidence(args, _read_config(args.config))
        # run_gate adds the requests that ended after both versions' jobs read the buffer, as in the schedule's
        # gate (deploy/gate.py, "Fresh evidence")
        verdict = run_gate(reg, args.version, smoke, policy=_gate_policy(args), evidence=evidence,
                           target_sha256=_target_sha(args), promote=not (args.ignore_pause or canary))
        if verdict.accepted and canary and verdict.candidate_version != verdict.champion_version:
            move = start_canary_after_gate(reg, verdict, args.canary_share, ignore_pause=args.ignore_pause)
            print(f"version {args.version} passed the gate ({verdict.reason}); {move.message}" + _canary_hint(args.kind))
            return EXIT_OK
        if verdict.accepted and args.ignore_pause:
            reg.promote(args.version, reason=f"gate: {verdict.reason}", ignore_pause=True)
            verdict.promoted = True
    except PromotionsPaused as e:
        raise CommandFailed(f"version {args.version} was not promoted: {e}") from None
    if not verdict.accepted:
        raise CommandFailed(f"version {args.version} was not promoted: {verdict.reason} "
                            "(the verdict is recorded on the version; `promote --force` overrides the gate)")
    if not verdict.promoted and verdict.champion_version != verdict.candidate_version:
        raise CommandFailed(f"version {args.version} passed the gate but was not promoted: {verdict.promotion}")
    print(f"version {args.version} is the champion: {verdict.reason}"
          + (f"; smoke: {verdict.smoke_detail}" if verdict.smoke_detail else ""))
    return EXIT_OK


_CANARY_HINT = ("; `draftsmith watch` (or a running `draftsmith distill --every`) promotes or drops it on live "
                "acceptance, `draftsmith status` shows it")


def _canary_hint(kind: str) -> str:
    return _CANARY_HINT if kind not in HEADS else (f"; `draftsmith watch --kind {kind}` promotes or drops it on "
                                                   "live acceptance, `draftsmith status` shows it")


def _canary_fraction(text: str) -> float:
    """--canary-share of promote: 0 (promote at once) or a share in (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"the canary share must be in [0, 1) (0 = promote at once), got {text}")
    return v


def cmd_rollback(args) -> int:
    reg = _registry(args)
    move = reg.rollback(args.to, reason=args.reason, pause=not args.no_pause)
    print(move.message + ("" if move.changed else " (nothing changed)"))
    return EXIT_OK


def cmd_resume(args) -> int:
    reg = _registry(args)
    if reg.resume_promotions():
        print(f"{reg.name}: scheduled distillation resumed; the next due job may promote through the gate")
    else:
        print(f"{reg.name}: scheduled distillation was not paused (nothing changed)")
    return EXIT_OK


def _fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def cmd_versions(args) -> int:
    reg = _registry(args)
    infos = reg.versions()
    if not infos:
        print(f"{reg.name}: no versions yet (run `draftsmith bootstrap`)  [{reg.tracking_uri}]")
        return EXIT_OK
    rows = [("VERSION", "ALIASES", "KIND", "PARENT", "ACC_BEFORE", "ACC_AFTER", "GATE", "GATE_ACC", "GATE_DELTA",
             "CREATED")]
    for i in infos:
        delta = i.metrics.get("gate_delta")
        rows.append((i.version, ",".join(i.aliases) or "-", i.kind, i.parent_version or "-",
                     _fmt(i.metrics.get("offline_acceptance_before")), _fmt(i.offline_acceptance),
                     i.tags.get("draftsmith.gate.verdict", "-"), _fmt(i.metrics.get("gate_candidate_acceptance")),
                     "-" if delta is None else f"{delta:+.3f}",
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created_ms / 1000))))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print(f"{reg.name}  [{reg.tracking_uri}]")
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return EXIT_OK


def _print_job(job: dict, tail_lines: int = 10) -> None:
    """The current (or last) job as its runner reported it (deploy/ray_jobs.py): runner, Ray job id, state,
    duration, where; the log tail when it failed or was lost."""
    state = job.get("state", "?")
    now = time.time()
    if job.get("ended"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["ended"]))
        took = f"after {job.get('seconds', 0):.0f} s (ended {when})"
    else:
        took = f"for {now - (job.get('started') or job.get('submitted') or now):.0f} s"
    where = f" on {job['cluster']} ({job.get('source')})" if job.get("cluster") else ""
    res = job.get("resources") or {}
    ask = f"; asks {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU" if res else ""
    kind = f"{job['kind']} " if job.get("kind") else ""                     # a heads job says which heads
    print(f"job:       {kind}{job.get('runner')} {job.get('id')} {state} {took}{where}{ask}"
          + (f": {job['message']}" if job.get("message") and state != "running" else ""))
    tail = [ln for ln in job.get("log_tail") or [] if ln.strip()]
    if state in ("failed", "lost", "stopped") and tail:
        print("job log:   (last lines" + (f"; full log {job['log_file']}" if job.get("log_file") else "") + ")")
        for line in tail[-tail_lines:]:
            print(f"  | {line}")


def cmd_status(args) -> int:
    """Aliases, pins, pause, scheduler and watchdog state, and the last alias moves with their reasons.
    An MLflow outage is reported as such (exit 1), never as "no champion"."""
    from deploy.registry import RegistryUnavailable, short_hash
    from deploy.scheduler import JobLock, read_job_status, read_status, read_watchdog_status

    reg = _registry(args)
    print(f"registry:  {reg.name}  [{reg.tracking_uri}]")
    try:
        aliases = reg.aliases()
        print(f"versions:  {len(reg.versions())}")
        for a in ("champion", "previous", "candidate", "canary"):
            print(f"{a + ':':<10} {aliases.get(a, '-')}")
        champ = aliases.get("champion")
        if champ:
            info = reg.get(champ)
            print(f"champion offline acceptance: {_fmt(info.offline_acceptance)}; gate-measured "
                  f"{_fmt(info.metrics.get('gate_candidate_acceptance'))}; built for target "
                  f"{short_hash(info.target_sha256)}")
            print(f"champion chain: {' -> '.join(reg.chain(champ))} (adapter depth {reg.chain_depth(champ)}, "
                  f"at most {reg.max_chain_depth})")
        paused = reg.promotions_paused()
        history = reg.history()
        _print_canary(reg, history)
        for kind in HEADS:
            heads = _registry(args, kind)
            if heads.exists():
                h = heads.aliases()
                print(f"{kind} heads: {heads.name}: champion {h.get('champion', '-')}, previous "
                      f"{h.get('previous', '-')}, candidate {h.get('candidate', '-')}, canary {h.get('canary', '-')}"
                      + ("; promotions paused" if heads.promotions_paused() else ""))
    except RegistryUnavailable as e:
        raise CommandFailed(f"{e}; replicas keep serving their current draft and nothing is promoted until "
                            "MLflow answers") from None
    if paused:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(paused.get("time", 0)))
        print(f"paused:    scheduled distillation paused since {when} ({paused.get('reason')}); "
              "`draftsmith resume` lifts it")
    holder = JobLock().holder()
    print("distill:   " + (f"a job is running (pid {holder.get('pid')} on {holder.get('host')})" if holder
                           else "no job running"))
    job = read_job_status()
    if job:
        _print_job(job)
    last = read_status()
    if last:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.get("time", 0)))
        print(f"last job:  {last.get('status')} at {when}: {last.get('message')}")
    dog = read_watchdog_status()
    if dog:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(dog.get("time", 0)))
        print(f"watchdog:  {dog.get('action')} at {when}: {dog.get('message')}")
    last_moves = [h for h in history if h.get("action") in ("promote", "rollback")][-3:]
    for h in last_moves:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("time", 0)))
        print(f"history:   {when} {h['action']} -> {h.get('version') or h.get('to')}"
              + (f" (from {h.get('from')})" if h.get("from") else "")
              + (f": {h.get('reason')}" if h.get("action") == "rollback" and h.get("reason") else ""))
    rb = next((h for h in reversed(history) if h.get("action") == "rollback"), None)
    if rb is not None:
        auto = "automatic " if "watchdog" in str(rb.get("reason")) else ""
        print(f"last rollback: {auto}version {rb.get('from')} -> {rb.get('to')}: {rb.get('reason') or '-'}")
    return EXIT_OK


COMMANDS = {"serve": cmd_serve, "bootstrap": cmd_bootstrap, "distill": cmd_distill, "register": cmd_register,
            "promote": cmd_promote, "rollback": cmd_rollback, "resume": cmd_resume, "versions": cmd_versions,
            "status": cmd_status}


# ---------------------------------------------------------------------------------- gc (retention)
def _gc_parser(sub, common) -> None:
    g = sub.add_parser("gc", parents=[common], help="delete cached merged drafts and candidate folders of "
                       "versions neither aliased nor among the newest N")
    g.add_argument("--keep-last", type=_count, default=None, metavar="N",
                   help="newest versions kept besides the aliased ones (default $DRAFTSMITH_KEEP_VERSIONS or 3)")
    g.add_argument("--grace", type=_age, default=None, metavar="DURATION",
                   help="never delete a folder written or used more recently than this (default 10m; 0 = none)")
    g.add_argument("--unregistered-older-than", type=_age, default=None, metavar="DURATION",
                   help="also delete candidate folders no version was registered from, older than this "
                        "(default: never)")
    g.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return v


def _age(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0s", "0m") else _duration(text)


def cmd_gc(args) -> int:
    """Retention (deploy.registry.Registry.gc): what was deleted, kept and left alone, and why."""
    reg = _registry(args)
    reports = reg.gc(args.keep_last, grace_s=args.grace, dry_run=args.dry_run,
                     unregistered_older_than_s=args.unregistered_older_than)
    keep = reg.retained_versions(args.keep_last)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{reg.name}: keeping versions "
          + (", ".join(f"{v} ({', '.join(why)})" for v, why in sorted(keep.items(), key=lambda kv: int(kv[0])))
             or "none (nothing registered)"))
    for r in reports.values():
        line = f"{r.what} {r.root}: "
        if not r.root.is_dir():
            print(line + "no such folder (nothing to delete)")
            continue
        line += (f"{verb} {len(r.deleted)} folder(s), {r.freed_bytes / 1e6:.1f} MB" if r.deleted
                 else "nothing to delete") + f"; kept {len(r.kept)}"
        if r.skipped:
            line += f"; left {len(r.skipped)}: " + "; ".join(f"{n} ({why})" for n, why in r.skipped[:5])
            line += " ..." if len(r.skipped) > 5 else ""
        print(line)
        for name in r.deleted:
            print(f"  {verb}: {r.root / name}")
    if any(why == "not registered" for n, why in reports["candidates"].skipped):
        print("candidate folders no version was registered from are kept: `draftsmith register` them, or pass "
              "--unregistered-older-than DURATION to delete old ones")
    return EXIT_OK


COMMANDS["gc"] = cmd_gc


# ---------------------------------------------------------------------------------- watchdog + canary (issue 17)
def _watch_options(sub, *, tolerance: bool = False) -> None:
    """The live watchdog's and the canary judge's settings (distill and watch)."""
    if tolerance:
        sub.add_argument("--rollback-tolerance", type=_fraction, default=0.10,
                         help="relative drop of the champion's live acceptance below its gate figure / the "
                              "previous version's tolerated before a significant drop rolls back (default 0.10)")
    sub.add_argument("--watch-window", type=_duration, default=900.0,
                     help="the champion is judged on its newest live intervals within this window (default 15m)")
    sub.add_argument("--watch-min-tokens", type=_positive_int, default=2000,
                     help="drafted tokens of live evidence the watchdog needs before judging (default 2000)")
    sub.add_argument("--watch-min-intervals", type=_positive_int, default=3,
                     help="live intervals (MLflow draftsmith-live points) the watchdog needs (default 3)")
    sub.add_argument("--no-offline-check", action="store_true",
                     help="roll back on live evidence alone; by default a live drop is first checked offline: "
                          "champion and previous version scored on the newest held-out records, and no rollback "
                          "when the champion is not worse there (the traffic changed, not the draft)")
    sub.add_argument("--canary-share", type=_fraction, default=0.25,
                     help="share of requests a gate-passed candidate serves as the canary before it may become "
                          "champion (default 0.25; 0 = promote directly after the gate)")
    sub.add_argument("--canary-min-tokens", type=_positive_int, default=2000,
                     help="drafted tokens each arm (canary, champion) needs before the canary is judged (default 2000)")
    sub.add_argument("--canary-min-requests", type=_positive_int, default=20,
                     help="requests each arm needs before the canary is judged (default 20)")
    sub.add_argument("--canary-min-time", type=_age_or_zero, default=600.0,
                     help="least time a canary serves before it may be promoted (default 10m; a significantly "
                          "worse one is dropped as soon as the evidence minimum is met)")
    sub.add_argument("--canary-timeout", type=_duration, default=7200.0,
                     help="a canary without enough live evidence by then is dropped (default 2h)")
    sub.add_argument("--canary-tolerance", type=_fraction, default=0.05,
                     help="relative drop of live acceptance below the champion's not held against the canary "
                          "(default 0.05; tokens/s: twice this)")


def _age_or_zero(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0s", "0m") else _duration(text)


def _status_file(reg, name: str):
    """<data>/<name>.json for the draft registry, <data>/<name>-<kind>.json for a heads registry."""
    from buffer.paths import data_dir

    return data_dir() / (f"{name}-{reg.heads_kind}.json" if reg.heads_kind else f"{name}.json")


def _watchdog(args, reg, evidence=None):
    """The live watchdog; `evidence`: the gate's evidence source for its offline check (default: the
    default buffer's, scored as `reg`'s kind), none with --no-offline-check."""
    from deploy.gate import EvidenceSource
    from deploy.heads import HeadsEvidence
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy

    default = (HeadsEvidence(args.target or reg.target, kind=reg.heads_kind) if reg.heads_kind
               else EvidenceSource())
    try:
        return LiveWatchdog(reg, WatchdogPolicy(tolerance=args.rollback_tolerance, window_s=args.watch_window,
                                                min_draft_tokens=args.watch_min_tokens,
                                                min_intervals=args.watch_min_intervals),
                            evidence=None if args.no_offline_check else (evidence or default),
                            status_path=_status_file(reg, "watchdog-status"))
    except ValueError as e:
        raise BadInput(str(e)) from None


def _canary_judge(args, reg):
    from deploy.scheduler import CanaryJudge, CanaryPolicy

    try:
        return CanaryJudge(reg, CanaryPolicy(min_draft_tokens=args.canary_min_tokens,
                                             min_requests=args.canary_min_requests,
                                             min_duration_s=args.canary_min_time, timeout_s=args.canary_timeout,
                                             tolerance=args.canary_tolerance,
                                             tps_tolerance=min(0.99, 2 * args.canary_tolerance)),
                           status_path=_status_file(reg, "canary-status"))
    except ValueError as e:
        raise BadInput(str(e)) from None


def _watch_parser(sub, common) -> None:
    w = sub.add_parser("watch", parents=[common], help="run the live watchdog (automatic rollback) and the canary "
                       "judge on a poll interval, without scheduled distillation")
    w.add_argument("--poll", type=_duration, default=10.0, help="seconds between looks (default 10s)")
    w.add_argument("--once", action="store_true", help="look once, print the verdicts and exit")
    w.add_argument("--no-canary", action="store_true", help="do not judge a running canary")
    w.add_argument("--kind", choices=KINDS, default="draft", help=KIND_HELP + "; one kind per `watch` process")
    _watch_options(w, tolerance=True)


def cmd_watch(args) -> int:
    """The watchdog and the canary judge that `distill --every/--min-records` runs every tick, alone: for a
    deployment that distills elsewhere, or promotes by hand. Ctrl-C (SIGINT) or SIGTERM stops it."""
    import signal
    import threading

    reg = _registry(args)
    dog, judge = _watchdog(args, reg), None if args.no_canary else _canary_judge(args, reg)
    stop = threading.Event()
    if not args.once and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"[watch] {reg.name}: watchdog window {args.watch_window:g} s, >= {args.watch_min_tokens} drafted tokens "
          f"over >= {args.watch_min_intervals} intervals, tolerance {args.rollback_tolerance:g}"
          + ("" if judge is None else f"; canary judge: >= {args.canary_min_tokens} tokens and "
             f"{args.canary_min_requests} requests per arm, >= {args.canary_min_time:g} s, timeout "
             f"{args.canary_timeout:g} s") + f"; every {args.poll:g} s", flush=True)
    try:
        while not stop.is_set():
            for name, part in (("watchdog", dog), ("canary", judge)):
                if part is None:
                    continue
                try:
                    v = part.check()
                except Exception as e:  # noqa: BLE001 - e.g. MLflow down: no action this time
                    print(f"[{name}] no look this time: {e}", flush=True)
                    continue
                if args.once or v.action not in ("none", "waiting", "ok"):
                    print(f"[{name}] {v.action}: {v.message}", flush=True)
            if args.once:
                break
            stop.wait(args.poll)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _print_canary(reg, history: list[dict]) -> None:
    """`status`: the running canary (version, share, since, live figures so far, the judge's last word) and
    the last canary decision."""
    from deploy.scheduler import CanaryJudge, read_canary_status

    c = reg.canary()
    if c is not None:
        since = "-" if not c.get("since_ms") else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                time.localtime(c["since_ms"] / 1000))
        print(f"canary:    version {c['version']} on {c['share']:.0%} of requests since {since}")
        v, _, _ = CanaryJudge(reg, progress=lambda m: None).assess()
        ca, ha = v.canary_figures, v.champion_figures
        print(f"canary live: acceptance {_fmt(ca.get('acceptance'))} over {ca.get('drafted', 0):.0f} drafted tokens, "
              f"{ca.get('requests', 0)} requests, {_fmt(ca.get('tokens_per_s'), 1)} tokens/s; champion "
              f"{v.champion}: {_fmt(ha.get('acceptance'))} over {ha.get('drafted', 0):.0f}, {ha.get('requests', 0)} "
              f"requests, {_fmt(ha.get('tokens_per_s'), 1)} tokens/s (same window)")
        last = read_canary_status()
        if last and str(last.get("version")) == c["version"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.get("time", 0)))
            print(f"canary judge: {last.get('action')} at {when}: {last.get('message')}")
        else:
            print("canary judge: no verdict yet (it runs in `draftsmith distill` on a schedule or `draftsmith watch`)")
    done = next((h for h in reversed(history) if str(h.get("action", "")).startswith("canary ")), None)
    if done is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(done.get("time", 0)))
        print(f"last canary: version {done.get('version')} {done['action'].split(' ', 1)[1]} at {when}: "
              f"{done.get('reason') or '-'}")


COMMANDS["watch"] = cmd_watch


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)          # argparse itself exits 2 with a usage message on bad syntax
    from deploy.registry import ArtifactError, RegistryError, UsageError, fail_fast_mlflow_client

    fail_fast_mlflow_client()               # an MLflow server that is down is reported in seconds, not minutes

    prog = f"draftsmith {args.command}"
    try:
        return COMMANDS[args.command](args)
    except (BadInput, UsageError) as e:
        return _report(prog, f"error: {e}", EXIT_USAGE)
    except (CommandFailed, ArtifactError, RegistryError) as e:
        return _report(prog, f"failed: {e}", EXIT_FAILED)
    except KeyboardInterrupt:
        return _report(prog, "interrupted", 130)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked to
        return _report(prog, f"unexpected error: {type(e).__name__}: {e} (set DRAFTSMITH_DEBUG=1 for the "
                             "traceback)", EXIT_FAILED)


def _report(prog: str, message: str, code: int) -> int:
    if os.environ.get("DRAFTSMITH_DEBUG"):
        import traceback

        traceback.print_exc()
    print(f"{prog}: {message}", file=sys.stderr)
    return code

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
