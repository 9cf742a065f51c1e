"""deploy/ray_jobs.py against a real local Ray: scheduled distillation jobs submitted to the cluster that
`draftsmith serve` publishes (here a separate process that starts Ray with the dashboard, as a serving
process would, and publishes its address the same way), through the job submission API and as a Ray task,
real jobs on tiny models over records really served into real Redis, registered in real MLflow.

A job completes and its candidate is registered (records acked only then); a failing job (a config the
buffer cannot satisfy) is a failed job with its log tail, its records left pending, shown by
`draftsmith status`; the next job re-claims them; a job lost with its node (the cluster killed mid-job)
is a failed job with its records pending (its entrypoint, orphaned when Ray is SIGKILLed under it and not
always stopped by Ray's fate-sharing watcher, is ended by the test). Finding the cluster (RAY_ADDRESS, the
serve file, stale files) and the in-process fallback are checked without Ray."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from pathlib import Path

import pytest

from deploy.ray_jobs import SUBMIT_RETRY_S
from deploy.registry import CHAMPION, Registry
from deploy.scheduler import DistillScheduler, JobLock, read_job_status, read_status
from tests.deploy_helpers import fresh_store, make_base_draft, synthetic_evidence, template_db

ROOT = Path(__file__).resolve().parents[2]
SHA = "7" * 64
HELD = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- no Ray needed
def test_a_job_lowers_its_own_cpu_priority_as_asked(monkeypatch):
    """--job-nice N reaches the job as DRAFTSMITH_JOB_NICE (job_env), which the job's process applies before
    torch starts a thread; a value it cannot read is a warning, not a failed job; 0..19 only."""
    from deploy.ray_jobs import RaySettings, job_env

    assert job_env(1, True, 7)["DRAFTSMITH_JOB_NICE"] == "7" and job_env(2, False)["DRAFTSMITH_JOB_NICE"] == "0"
    for bad in (-1, 20, 2.5, True):
        with pytest.raises(ValueError, match="nice"):
            RaySettings(nice=bad)
    code = "import os; from deploy.distill_job import lower_priority; print(lower_priority(), os.nice(0))"
    base = os.nice(0)
    for value, want in (("7", max(7, base)), ("eleven", base), ("", base)):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "DRAFTSMITH_JOB_NICE": value})
        assert out.returncode == 0 and out.stdout.split() == [str(want)] * 2, (value, out.stdout, out.stderr)
        assert ("not an integer" in out.stderr) == (value == "eleven")


def test_the_ray_task_of_a_job_gets_the_drivers_priority_threads_and_settings_but_no_keys(monkeypatch, tmp_path):
    """`python -m deploy.distill_job --ray` runs the job in a Ray task, whose process inherits the environment of
    the Ray that started its worker, not the driver's: the task's runtime env carries the driver's
    DRAFTSMITH_JOB_NICE (its job ran at nice 0 beside serving without it), OMP_NUM_THREADS and settings, never the
    HTTP API's keys; and the task lowers its priority and marks itself busy beside serving while it runs."""
    from deploy import distill_job

    monkeypatch.setenv("DRAFTSMITH_JOB_NICE", "10")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x.db")
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "secret")
    monkeypatch.setenv("DRAFTSMITH_ADMIN_KEY", "secret2")
    env = distill_job.task_env(tmp_path)
    assert (env["DRAFTSMITH_JOB_NICE"], env["OMP_NUM_THREADS"], env["MLFLOW_TRACKING_URI"]) == ("10", "1",
                                                                                              "sqlite:////tmp/x.db")
    assert env["DRAFTSMITH_DATA"] == str(tmp_path) and str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert "DRAFTSMITH_API_KEY" not in env and "DRAFTSMITH_ADMIN_KEY" not in env
    # the task's own steps, in a child process (niceness only rises): priority first, then the marked job
    code = ("import os, json; from deploy import distill_job; from serving.contention import read_busy; "
            "distill_job.run_job = distill_job.marks_busy('a distillation job')("
            "lambda cfg: json.dumps([os.nice(0), [m['what'] for m in read_busy()]])); "
            "print(distill_job._ray_task({}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DRAFTSMITH_JOB_NICE": "10", "DRAFTSMITH_BUSY_DIR": str(tmp_path / "busy")})
    assert out.returncode == 0, out.stderr
    nice, marked = json.loads(out.stdout.strip().splitlines()[-1])
    assert nice >= 10 and marked == ["a distillation job"], out.stdout


def test_a_submission_the_job_api_asks_to_retry_is_retried_until_its_deadline():
    """Ray's job API answers 500 "No available agent to submit job, please try again later" while its agent starts
    (two CI tests failed so on a busy host): such a refusal is retried within SUBMIT_RETRY_S, any other is not."""
    from deploy.ray_jobs import submit_with_retry

    later = RuntimeError("Request failed with status code 500: No available agent to submit job, please try again "
                         "later..")
    now, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    def flaky(fails: int, error: Exception):
        calls = []

        def submit():
            calls.append(1)
            if len(calls) <= fails:
                raise error
            return "sid"
        return submit, calls

    submit, calls = flaky(3, later)
    assert submit_with_retry(submit, 60, 2.0, sleep, lambda: now[0]) == "sid" and len(calls) == 4 and slept == [2.0] * 3
    submit, calls = flaky(100, later)                              # still refused at the deadline: raised
    with pytest.raises(RuntimeError, match="No available agent"):
        submit_with_retry(submit, 10, 2.0, sleep, lambda: now[0])
    assert len(calls) == 6                                         # at 0, 2, ..., 10 s
    submit, calls = flaky(1, RuntimeError("Request failed with status code 400: bad runtime_env"))
    with pytest.raises(RuntimeError, match="bad runtime_env"):    # any other refusal: at once
        submit_with_retry(submit, 60, 2.0, sleep, lambda: now[0])
    assert len(calls) == 1


def test_finding_the_cluster_and_the_in_process_fallback(tmp_path, monkeypatch):
    from deploy.ray_jobs import (CLUSTER_FILE, DistillRunner, RayUnavailable, find_cluster,
                                 read_published_cluster, unpublish_cluster)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray._private.utils.read_ray_address", lambda *a, **k: None)   # no `ray start` here
    assert find_cluster(tmp_path) is None
    # a file left by a serve process that is gone is ignored; so is one whose GCS does not answer
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / CLUSTER_FILE).write_text(json.dumps({"gcs_address": f"127.0.0.1:{_free_port()}", "pid": dead.pid,
                                                     "host": socket.gethostname()}))
    assert find_cluster(tmp_path) is None
    (tmp_path / CLUSTER_FILE).write_text(json.dumps({"gcs_address": f"127.0.0.1:{_free_port()}",
                                                     "pid": os.getpid(), "host": socket.gethostname()}))
    t0 = time.time()
    assert find_cluster(tmp_path) is None and time.time() - t0 < 10
    # serving runs here (a live local serve pid): `draftsmith distill` scores its gate on the jobs' CPUs
    import torch

    from deploy import cli
    from deploy.ray_jobs import serving_here

    assert serving_here(tmp_path)
    before = torch.get_num_threads()
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path))
    try:
        assert cli._distill_threads(types.SimpleNamespace(threads=None, ray_cpus=1.0)) == 1
        assert torch.get_num_threads() == 1
        assert cli._distill_threads(types.SimpleNamespace(threads=2, ray_cpus=1.0)) == 2   # --threads wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # ... and with --job-nice the gate lowers its own priority as the jobs do (a child process: niceness only rises)
    probe = ("import os, types; from deploy import cli; base = os.nice(0); "
             "print(cli._distill_priority(types.SimpleNamespace(job_nice=base + 7)) - base, "
             "cli._distill_priority(types.SimpleNamespace(job_nice=0)) - base)")
    env = {**os.environ, "DRAFTSMITH_DATA": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["7", "7"] and "the gate runs at nice" in out.stdout
    # no --job-nice: 10 beside a local `draftsmith serve`, 0 elsewhere (below)
    assert cli._job_nice(types.SimpleNamespace(job_nice=None)) == cli.DEFAULT_JOB_NICE_BESIDE_SERVING == 10
    assert cli._job_nice(types.SimpleNamespace(job_nice=3)) == 3
    # ... and jobs take at most half the time there (--job-share), all of it elsewhere
    assert cli._job_share(types.SimpleNamespace(job_share=None)) == cli.DEFAULT_JOB_SHARE_BESIDE_SERVING == 0.5
    assert cli._job_share(types.SimpleNamespace(job_share=0.8)) == 0.8
    unpublish_cluster(tmp_path)                                         # written by this pid: removed
    assert not serving_here(tmp_path)
    assert cli._distill_threads(types.SimpleNamespace(threads=None, ray_cpus=1.0)) is None   # torch's default kept
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["0", "0"], out.stdout + out.stderr   # nothing served here
    assert cli._job_nice(types.SimpleNamespace(job_nice=None)) == 0
    assert cli._job_share(types.SimpleNamespace(job_share=None)) == 1.0
    assert read_published_cluster(tmp_path) is None
    # RAY_ADDRESS set but dead: an error (the job fails, records pending), never a silent fallback
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port()}")
    with pytest.raises(RayUnavailable, match="no Ray cluster answers"):
        find_cluster(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS")

    said, ran, states = [], [], []
    runner = DistillRunner(lambda req: {"out_dir": str(tmp_path / f"c{req}")}, "auto",
                           in_process=lambda cfg: ran.append(cfg) or cfg["out_dir"], progress=said.append,
                           on_state=states.append, find=lambda: None)
    assert runner(1) == tmp_path / "c1" and runner(2) == tmp_path / "c2" and len(ran) == 2
    assert len(said) == 1 and "no Ray cluster found" in said[0] and "in this process" in said[0]
    assert [s["state"] for s in states] == ["running", "succeeded"] * 2 and states[-1]["runner"] == "process"
    strict = DistillRunner(lambda req: {}, "ray", in_process=ran.append, find=lambda: None)
    with pytest.raises(RayUnavailable, match="no Ray cluster"):
        strict(3)
    assert len(ran) == 2
    with pytest.raises(ValueError, match="runner must be one of"):
        DistillRunner(lambda req: {}, "kubernetes")

    # `draftsmith distill` builds its runner from the flags
    from deploy import cli

    args = cli.build_parser().parse_args(["distill", "--runner", "ray", "--ray-submit", "task", "--ray-cpus", "0.5",
                                          "--ray-gpus", "1"])
    runner = cli._real_distill(args)
    assert isinstance(runner, DistillRunner) and runner.runner == "ray"
    assert (runner.settings.submit, runner.settings.num_cpus, runner.settings.num_gpus) == ("task", 0.5, 1.0)
    default = cli._real_distill(cli.build_parser().parse_args(["distill"]))
    assert default.runner == "auto" and default.settings.num_gpus == "auto" and default.settings.submit == "auto"


# ----------------------------------------------------------------------------- a real Ray cluster
_CLUSTER = textwrap.dedent("""
    import json, signal, sys, time
    import ray
    from deploy.ray_jobs import publish_cluster
    ctx = ray.init(num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=int(sys.argv[2]),
                   log_to_driver=False)
    publish_cluster(sys.argv[1])
    node = ray._private.worker._global_node
    print(json.dumps({"session": node.get_session_dir_path()}), flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    while True:
        time.sleep(1)
""")


class Cluster:
    """A process that owns a local Ray (2 CPUs, dashboard) like `draftsmith serve` does, in its own process
    group, published in `data/ray-cluster.json`. It starts in the background (`ready()` waits), so Ray's
    start overlaps the other fixtures."""

    def __init__(self, data: Path) -> None:
        self.data = data
        data.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _CLUSTER, str(data), str(_free_port())], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""},
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        self.session = None
        self.info = None

    def ready(self) -> "Cluster":
        if self.info is None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the Ray cluster process did not start")
            self.session = json.loads(line)["session"]
            self.info = json.loads((self.data / "ray-cluster.json").read_text())
        return self

    def kill(self, pids: list[int] | None = None) -> None:
        """The node dies: every process of this Ray (the cluster process and everything below it), at once."""
        for pid in pids if pids is not None else _tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)

    def stop(self) -> None:
        below = _tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)             # ray.shutdown at exit
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        self.kill([p for p in below if Path(f"/proc/{p}").exists()])
        for pid in _session_pids(self.session) if self.session else []:               # anything of this session left (own sessions)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tree(root: int) -> list[int]:
    """`root` and every process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _session_pids(*marks: str) -> list[int]:
    """Processes whose command line holds every mark (this module's Ray session, or its data dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if args and all(m in args for m in marks):
            pids.append(int(entry.name))
    return pids


def _kill_jobs(data: Path, wait_s: float = 10.0) -> None:
    """Job entrypoints of this module (their config names its data dir) still running once their Ray is gone:
    Ray's fate-sharing watcher does not always outlive a SIGKILLed node here, so they are ended by pid."""
    deadline = time.time() + wait_s
    while (pids := _session_pids("deploy.distill_job", str(data))) and time.time() < deadline:
        time.sleep(0.5)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("rayjobs-data")


@pytest.fixture(scope="module")
def cluster(data):
    pytest.importorskip("ray")
    c = Cluster(data)
    try:
        yield c
    finally:
        c.stop()
        _kill_jobs(data, wait_s=0)
        time.sleep(0.5)
        assert c.session is None or _session_pids(c.session) == [], "processes of the test's Ray were left running"
        assert _session_pids("deploy.distill_job", str(data)) == [], "job processes were left running"


@pytest.fixture(scope="module")
def buffer(tmp_path_factory, redis_url):
    """12 training requests and 4 held-out ones really served into real Redis (unique prefix)."""
    from tests.deploy_helpers import drop_prefix, serve_records
    from tests.tiny_models import save_pair

    root = tmp_path_factory.mktemp("rayjobs-buffer")
    target, draft = save_pair(root)
    prefix = f"test:rayjobs:{uuid.uuid4().hex[:10]}"
    serve_records(target, draft, redis_url, prefix, requests=12, heldout=False, heldout_fraction=HELD, tag="train")
    serve_records(target, draft, redis_url, prefix, requests=4, heldout=True, heldout_fraction=HELD, tag="held")
    yield {"url": redis_url, "prefix": prefix, "key": f"{prefix}:steps", "target": target}
    drop_prefix(redis_url, prefix)


@pytest.fixture
def registry(tmp_path, data, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)            # ray_jobs turns token auth on for its clients
    monkeypatch.setenv("DRAFTSMITH_DATA", str(data))           # where `draftsmith serve` published its Ray
    reg = Registry("tiny-target", tracking_uri=fresh_store(template_db(data.parent), tmp_path / "mlflow"),
                   cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256=SHA)
    reg.promote("1")
    return reg


def overrides(buffer, group, **kw):
    return {"redis_url": buffer["url"], "buffer_prefix": buffer["prefix"], "group": group, "heldout_fraction": HELD,
            "claim_idle_ms": 0, "steps": 2, "batch_tokens": 1024, "min_records": 8, "mlflow": False, **kw}


def make_scheduler(registry, data, runner, over):
    from deploy import cli

    return DistillScheduler(registry, runner, smoke_check=lambda p: (True, "fake"), evidence=synthetic_evidence(0.1),
                            target_sha256=SHA, lock=JobLock(data / "distill.lock"), progress=lambda m: None,
                            ack_records=cli._ack_records(over))


def runner_for(settings_of, **settings):
    """A DistillRunner that must run on Ray; `settings_of()` gives the job's --config keys at each job."""
    from deploy import cli
    from deploy.ray_jobs import DistillRunner, RaySettings

    settings.setdefault("poll_s", 0.3)
    return DistillRunner(lambda req: cli.job_config(req, "tiny-target", settings_of()), "ray",
                         RaySettings(**settings), progress=lambda m: None)


def _pending(buffer, group) -> set[str]:
    from buffer.redis_store import connect

    from redis.exceptions import ResponseError

    c = connect(buffer["url"])
    try:
        rows = c.xpending_range(buffer["key"], group, min="-", max="+", count=100_000)
    except ResponseError as e:                       # the job has not created its consumer group yet
        if "NOGROUP" not in str(e):
            raise
        rows = []
    finally:
        c.close()
    return {r["message_id"].decode() if isinstance(r["message_id"], bytes) else r["message_id"] for r in rows}


def _training_ids(buffer) -> set[str]:
    from buffer.redis_store import BufferConfig, ReplayBufferReader
    from training.data import is_heldout

    reader = ReplayBufferReader(buffer["url"], BufferConfig(prefix=buffer["prefix"]))
    return {e.stream_id for e in reader.newest(100_000) if not is_heldout(e.record.request_id, HELD)}


def _status(registry, capsys) -> str:
    from deploy import cli

    capsys.readouterr()
    assert cli.main(["status", "--target", "tiny-target", "--tracking-uri", registry.tracking_uri]) == 0
    return capsys.readouterr().out


def test_a_failing_ray_job_leaves_its_records_pending_and_the_next_one_registers(cluster, registry, buffer, data,
                                                                                 capsys):
    """Through Ray's job submission API (the cluster has a dashboard): a job whose config the buffer cannot
    satisfy reads its window and fails; the scheduler records a failed job with the Ray job's state and
    log tail, every training record is still pending, `draftsmith status` shows it. The next job
    re-claims them, its candidate is found and registered, and only then are they acked."""
    cluster.ready()
    from ray.job_submission import JobStatus, JobSubmissionClient

    group = f"g-{uuid.uuid4().hex[:8]}"
    good = overrides(buffer, group)
    bad = overrides(buffer, group, min_heldout=100_000)            # more held-out steps than the buffer has
    cfg = {"use": bad}
    runner = runner_for(lambda: cfg["use"], nice=5)                # --job-nice 5: the job lowers its priority
    sched = make_scheduler(registry, data, runner, good)
    seen = []
    record = sched.record_job
    runner.on_state = lambda info: (seen.append(info["state"]), record(info))

    out = sched.run_job()
    assert out.status == "failed" and "records left pending" in out.message, out.message
    job = out.job
    assert job["runner"] == "ray-job" and job["state"] == "failed" and job["id"].startswith("draftsmith-distill-v1-")
    assert "RayJobError" in out.message and job["id"] in out.message
    assert any("held-out step records" in line for line in job["log_tail"]), job["log_tail"]
    assert any("this job runs at nice 5" in line for line in job["log_tail"]), job["log_tail"]
    assert seen[0] == "submitted" and seen[-1] == "failed" and "running" in seen
    client = JobSubmissionClient(cluster.info["dashboard_url"])
    assert client.get_job_status(job["id"]) == JobStatus.FAILED         # it really ran on that cluster
    trained = _training_ids(buffer)
    assert len(trained) > 50 and trained <= _pending(buffer, group)    # read, never acked
    assert registry.aliases() == {CHAMPION: "1"} and sched.cursor() is None
    assert read_job_status(sched.job_status_path)["state"] == "failed"
    text = _status(registry, capsys)
    assert f"job:       ray-job {job['id']} failed" in text and "job log:" in text, text
    assert "held-out step records" in text and "last job:  failed" in text

    cfg["use"] = good
    out = sched.run_job()
    assert out.status == "promoted" and f"{len(trained)} records acked" in out.message, out.message
    assert out.job["state"] == "succeeded" and out.job["runner"] == "ray-job" and out.job["seconds"] > 0
    assert client.get_job_status(out.job["id"]) == JobStatus.SUCCEEDED
    cand = Path(out.job["candidate"])
    assert (cand / "candidate.json").is_file() and (cand / "records.acked.json").is_file()
    assert cand.parent == data / "candidates"                          # the scheduler's data dir, shared
    assert _pending(buffer, group) == set() and registry.champion() == "2"
    assert read_status(sched.status_path)["job"]["id"] == out.job["id"]
    text = _status(registry, capsys)
    assert f"job:       ray-job {out.job['id']} succeeded" in text and "asks 1 CPU, 0 GPU" in text, text


def test_a_cluster_without_the_job_api_gets_the_job_as_a_ray_task(cluster, registry, buffer, data, monkeypatch):
    """The Ray-task path, what the Ray of `draftsmith serve` gets (started without the dashboard, its GCS
    still records a dashboard address where no job API answers), and what a job gets under submit "auto" when
    the job API answers but keeps refusing it for want of an agent (a clean-clone CI run saw that for 180 s;
    here the refusal is made): a driver child process runs the job as a Ray task on the cluster; the candidate
    is registered and the records acked; the driver's log is kept."""
    from ray.job_submission import JobSubmissionClient

    from deploy import ray_jobs

    cluster.ready()
    with monkeypatch.context() as m:
        m.setattr(ray_jobs, "_job_api_answers", lambda url: False)
        found = ray_jobs.find_cluster()
    assert found.dashboard_url is None and found.address == cluster.info["gcs_address"] and found.cpus == 2
    assert ray_jobs.find_cluster().dashboard_url == cluster.info["dashboard_url"]    # the job API answers

    refused = []

    def no_agent(self, **kw):
        refused.append(kw["submission_id"])
        raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try "
                           "again later..")
    monkeypatch.setattr(JobSubmissionClient, "submit_job", no_agent)
    monkeypatch.setattr(ray_jobs, "AUTO_SUBMIT_RETRY_S", 1.0)
    group = f"g-{uuid.uuid4().hex[:8]}"
    over = overrides(buffer, group)
    runner = runner_for(lambda: over)
    sched = make_scheduler(registry, data, runner, over)
    out = sched.run_job()
    assert out.status == "promoted", out.message
    assert out.job["runner"] == "ray-task" and out.job["state"] == "succeeded"
    assert refused and set(refused) == {out.job["id"]} and "No available agent" in out.job["fallback"]
    assert out.job["cluster"] == cluster.info["gcs_address"]
    log_text = Path(out.job["log_file"]).read_text()
    assert "(_ray_task" in log_text and "candidate written to" in log_text
    assert _pending(buffer, group) == set()


def test_a_heads_job_runs_on_ray_like_the_drafts_and_a_failed_one_registers_nothing(cluster, buffer, data, tmp_path,
                                                                                     monkeypatch):
    """`draftsmith distill --kind medusa` hands its heads cycles the same runner as the draft's jobs: on the Ray of
    `draftsmith serve` (no job API) the heads job runs as a Ray task, its candidate is registered as the heads'
    next version and gated, and its state (kind, runner, Ray id) goes to `distill-job.json`; a heads job that
    fails on Ray (a buffer too thin for its minimum) fails the cycle with its log tail and registers nothing."""
    import argparse

    import torch

    from deploy import cli, ray_jobs
    from deploy.gate import GatePolicy
    from deploy.heads import HeadsEvidence, run_heads_cycle
    from deploy.registry import heads_registry
    from serving.engine import Engine
    from tests.deploy.test_heads_registry import make_heads

    cluster.ready()
    monkeypatch.setattr(ray_jobs, "_job_api_answers", lambda url: False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("DRAFTSMITH_DATA", str(data))
    target = str(buffer["target"])
    heads = heads_registry(target, tracking_uri=fresh_store(template_db(data.parent), tmp_path / "mlflow"),
                           cache_root=tmp_path / "cache", candidates_root=tmp_path / "cands")
    model = Engine.from_paths(target, None, dtype=torch.float32).target.model
    heads.promote(heads.register(make_heads(model, tmp_path / "h1", seed=1, scale=0.05)))
    runner = cli._heads_runner(argparse.Namespace(runner="ray", kind="medusa", ray_submit="auto", ray_cpus=1.0,
                                                  ray_gpus="auto", job_nice=0))
    runner.settings.poll_s = 0.3
    job = {"redis_url": buffer["url"], "buffer_prefix": buffer["prefix"], "heldout_fraction": HELD, "budget_s": 3.0,
           "min_train_rows": 16, "min_heldout_rows": 4}
    kw = dict(policy=GatePolicy(min_requests=2, category_min_requests=10, bootstrap=200),
              evidence=HeadsEvidence(target, redis_url=buffer["url"], buffer_prefix=buffer["prefix"],
                                     heldout_fraction=HELD),
              smoke_check=lambda p: (True, "skipped in this test"), run_job=runner, progress=lambda m: None)
    version, verdict = run_heads_cycle(heads, target, job, **kw)
    assert version == "2" and heads.get("2").parent_version == "1" and verdict.reason
    info = runner.last_job
    assert info["runner"] == "ray-task" and info["state"] == "succeeded" and info["id"].startswith("draftsmith-medusa-v1-")
    assert info["cluster"] == cluster.info["gcs_address"]
    log_text = Path(info["log_file"]).read_text()
    assert "(_ray_task" in log_text and "[heads-job]" in log_text and "candidate written to" in log_text
    state = read_job_status()
    assert state["kind"] == "medusa" and state["id"] == info["id"] and state["state"] == "succeeded"

    with pytest.raises(ray_jobs.RayJobError, match="exited with status 2") as failed:
        run_heads_cycle(heads, target, {**job, "min_train_rows": 10**9}, **kw)
    assert any("a heads job needs at least" in line for line in failed.value.log_tail), failed.value.log_tail
    assert runner.last_job["state"] == "failed" and read_job_status()["state"] == "failed"
    assert [v.version for v in heads.versions()] == ["1", "2"]


def test_a_job_lost_with_its_node_leaves_its_records_pending(cluster, registry, buffer, data):
    """The node (here: the whole single-node cluster) dies while the job trains: the scheduler records a
    failed job whose state is "lost", registers nothing, and every record the job had read stays pending
    for the next job. Runs last: it kills the module's cluster."""
    cluster.ready()
    group = f"g-{uuid.uuid4().hex[:8]}"
    over = overrides(buffer, group, steps=100_000)                     # trains until the node dies
    runner = runner_for(lambda: over, lost_after_s=2.0)
    sched = make_scheduler(registry, data, runner, over)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", sched.run_job()))
    t.start()
    trained = _training_ids(buffer)
    deadline = time.time() + 120 + SUBMIT_RETRY_S                      # a submission may wait for the job agent
    while not trained <= _pending(buffer, group):                      # the job has read its window
        assert t.is_alive() and time.time() < deadline, result
        time.sleep(0.3)
    cluster.kill()
    t.join(120)
    out = result["out"]
    assert out.status == "failed" and "records left pending" in out.message, out.message
    assert out.job["state"] == "lost" and "RayJobLost" in out.message
    assert trained <= _pending(buffer, group)
    assert registry.aliases() == {CHAMPION: "1"} and len(registry.versions()) == 1
    _kill_jobs(data, wait_s=0)                  # its orphaned entrypoint would train on (module docstring)
