"""deploy/cli.py: every subcommand end to end on a temp MLflow store with tiny models and real held-out
records in real Redis for the gate, and bad input -> a message saying what to fix, exit code 2, never a
traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from deploy import cli
from deploy.registry import Registry
from tests.deploy_helpers import (artifact_dir, drop_prefix, fresh_store, make_base_draft, make_candidate,
                            make_degraded_draft, serve_records, template_db)
from tests.tiny_models import save_pair

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture(scope="module")
def gate_config(tmp_path_factory, redis_url):
    """24 held-out requests served into real Redis, and the --config YAML that points the gate at them."""
    import uuid

    root = tmp_path_factory.mktemp("cli-records")
    target, draft = save_pair(root)
    prefix = f"test:cli:{uuid.uuid4().hex[:10]}"
    serve_records(target, draft, redis_url, prefix, requests=24, heldout_fraction=0.25)
    cfg = root / "gate.yaml"
    cfg.write_text(f"redis_url: {redis_url}\nbuffer_prefix: {prefix}\nheldout_fraction: 0.25\n")
    yield cfg
    drop_prefix(redis_url, prefix)


GATE = ("--min-requests", "10", "--category-min-requests", "8")


@pytest.fixture
def env(template, tmp_path, monkeypatch):
    """A temp data dir/cache, a tiny target folder; returns (target path, tracking uri)."""
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    uri = fresh_store(template, tmp_path / "data")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    target, _ = save_pair(tmp_path / "pair")
    monkeypatch.setenv("DRAFTSMITH_TARGET", str(target))
    return target, uri


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def argparse_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return e.value.code, err


def test_bad_arguments_exit_2_with_a_hint(capsys, tmp_path):
    cases = [
        (("promote", "abc"), "a version is a registry version number such as 3"),
        (("rollback", "--to", "0"), "a version is a registry version number"),
        (("register", str(tmp_path / "missing")), "is not an existing folder"),
        (("distill", "--every", "10x"), "cannot read duration '10x'; use e.g. 90s, 10m or 2h"),
        (("distill", "--min-records", "0"), "expected a whole number >= 1"),
        (("distill", "--margin", "2"), "expected a number in [0, 1)"),
        (("distill", "--job-share", "0"), "expected a fraction in (0, 1], got '0'"),
        (("distill", "--job-share", "half"), "expected a fraction in (0, 1], got 'half'"),
        (("serve", "--port", "70000"), "port must be a number in 1..65535"),
        (("serve", "--replicas", "none"), "expected a whole number >= 1"),
        (("serve", "--default-mode", "fastest"), "invalid choice: 'fastest'"),
        (("frobnicate",), "invalid choice"),
        ((), "the following arguments are required: COMMAND"),
    ]
    for argv, text in cases:
        code, err = argparse_error(capsys, *argv)
        assert code == 2 and text in err, (argv, err)


def test_pipeline_needs_a_schedule_and_a_canary(capsys):
    for argv in (("--pipeline", "--every", "5m", "--canary-share", "0"), ("--pipeline",),
                 ("--pipeline", "--every", "5m", "--kind", "medusa")):
        code, _, err = run(capsys, "distill", *argv)
        assert code == 2 and "--pipeline" in err and ("canary" in err or "--kind medusa" in err), (argv, err)


def test_operator_workflow(env, capsys, tmp_path, gate_config):
    target, uri = env
    base = make_degraded_draft(tmp_path / "base", target)              # a poor draft of this target
    name = Registry(str(target)).name
    assert name == "draftsmith-target-draft"

    code, out, _ = run(capsys, "versions")
    assert code == 0 and "no versions yet" in out
    code, _, err = run(capsys, "rollback")
    assert code == 2 and "nothing to roll back to" in err and "--to VERSION" in err

    code, out, _ = run(capsys, "register", str(base))
    sha = Registry(str(target)).get("1").target_sha256
    assert code == 0 and f"version 1 (base; target {sha[:12]})" in out
    code, out, _ = run(capsys, "promote", "1", *GATE)                # no champion yet: target pin + smoke only
    assert code == 0 and "version 1 is the champion: no champion yet" in out

    cand = make_candidate(tmp_path / "c2", base, parent_version="1", target=str(target), before=0.40, after=0.55,
                          seed=5, scale=0.6, sign=-1)                 # repairs version 1 exactly
    code, out, _ = run(capsys, "register", str(cand))
    assert code == 0 and "version 2 (adapter on version 1" in out
    code, out, _ = run(capsys, "promote", "2", "--config", str(gate_config), *GATE)   # real gate, real smoke
    assert code == 0 and "version 2 is the champion" in out and "identical to target greedy" in out
    assert "gate sample of 24 held-out requests" in out

    worse = make_candidate(tmp_path / "c3", Registry(str(target)).materialize("2"), parent_version="2",
                           target=str(target), seed=7, scale=0.6, before=0.55, after=0.95)   # claims +0.40
    run(capsys, "register", str(worse))
    code, _, err = run(capsys, "promote", "3", "--config", str(gate_config), *GATE)
    assert code == 1 and "was not promoted" in err and "gate sample of 24 held-out requests" in err

    code, out, _ = run(capsys, "versions")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["1"][1:3] == ["previous", "base"]
    assert rows["2"][1:4] == ["champion", "adapter", "1"] and rows["2"][5] == "0.550" and rows["2"][6] == "accepted"
    assert float(rows["2"][7]) > 0.9 and float(rows["2"][8]) > 0.5          # gate-measured, not the job's
    assert rows["3"][1] == "candidate" and rows["3"][5] == "0.950" and rows["3"][6] == "rejected"
    assert float(rows["3"][8]) < 0                                         # claimed +0.40, measured worse

    code, out, _ = run(capsys, "rollback")
    assert code == 0 and "version 1 is now the champion (was 2)" in out
    code, out, _ = run(capsys, "rollback")
    assert code == 0 and "already rolled back" in out and "(nothing changed)" in out
    code, out, _ = run(capsys, "status")
    assert code == 0 and "champion:  1" in out and "rollback -> 1 (from 2): operator rollback" in out
    assert "no job running" in out and "last rollback: version 2 -> 1: operator rollback" in out
    assert "paused:    scheduled distillation paused" in out and "operator rollback" in out
    code, _, err = run(capsys, "promote", "2", "--config", str(gate_config), *GATE)     # the pause holds
    assert code == 1 and "paused" in err and "draftsmith resume" in err
    code, out, _ = run(capsys, "resume")
    assert code == 0 and "resumed" in out
    code, out, _ = run(capsys, "resume")
    assert code == 0 and "was not paused" in out
    code, out, _ = run(capsys, "status")
    assert "paused:" not in out

    # a corrupt artifact: refused with exit 1, aliases unchanged
    reg = Registry(str(target))
    before = reg.aliases()
    (artifact_dir(reg, "3") / "candidate.json").write_text("{}")
    code, _, err = run(capsys, "promote", "3", "--force")
    assert code == 1 and "candidate.json" in err and "corrupt" in err
    assert reg.aliases() == before


def test_status_reports_an_mlflow_outage_instead_of_no_champion(env, capsys, monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    for cmd in (("status",), ("promote", "2"), ("rollback",)):
        code, out, err = run(capsys, *cmd, "--tracking-uri", f"http://127.0.0.1:{port}")
        assert code == 1 and "MLflow unavailable" in err, (cmd, out, err)
        assert "champion:  -" not in out


def test_a_tracking_server_that_is_down_is_reported_in_seconds_not_minutes(env, capsys, monkeypatch):
    """MLflow's own client retries a refused request for about 4 minutes; the CLI asks for a few seconds unless
    the environment says otherwise (deploy/registry.py MLFLOW_CLIENT_DEFAULTS)."""
    import socket
    import time

    from deploy.registry import MLFLOW_CLIENT_DEFAULTS, fail_fast_mlflow_client

    for k in MLFLOW_CLIENT_DEFAULTS:        # set then unset: monkeypatch restores "unset" after the CLI sets them
        monkeypatch.setenv(k, "1")
        monkeypatch.delenv(k)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    code, _, err = run(capsys, "rollback", "--tracking-uri", f"http://127.0.0.1:{port}")
    took = time.monotonic() - t0
    assert code == 1 and "MLflow unavailable" in err, err
    assert took < 90, f"the outage took {took:.0f} s to report (MLflow's own retries: about 240 s)"
    assert {k: os.environ[k] for k in MLFLOW_CLIENT_DEFAULTS} == MLFLOW_CLIENT_DEFAULTS
    # what an operator sets wins
    mine = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7"}
    rest = {k: v for k, v in MLFLOW_CLIENT_DEFAULTS.items() if k not in mine}
    assert fail_fast_mlflow_client(mine) == rest and mine == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7", **rest}


def test_register_and_bootstrap_errors(env, capsys, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "register", str(empty))
    assert code == 2 and "neither a distillation candidate" in err
    code, _, err = run(capsys, "promote", "4")
    assert code == 2 and "version 4 is not registered" in err
    code, _, err = run(capsys, "distill")
    assert code == 2 and "run `draftsmith bootstrap` first" in err

    built = []

    def fake_bootstrap(out_dir, target, budget_s, **kw):
        built.append((Path(out_dir), target, budget_s))
        return make_base_draft(Path(out_dir))

    monkeypatch.setattr(cli, "_bootstrap_builder", lambda: fake_bootstrap)
    code, out, _ = run(capsys, "bootstrap", "--budget", "2m")
    assert code == 0 and "version 1" in out and "is now the champion" in out
    assert built == [(tmp_path / "data" / "bootstrap-draft", str(env[0]), 120.0)]
    code, _, err = run(capsys, "bootstrap")
    assert code == 2 and "pass --force" in err and len(built) == 1


def test_bootstrap_makes_medusa_heads_their_champion_and_a_heads_failure_keeps_the_draft(env, capsys, tmp_path,
                                                                                         monkeypatch):
    import torch

    from deploy.registry import heads_registry
    from serving.engine import Engine
    from tests.deploy.test_heads_registry import make_heads

    target, _ = env
    monkeypatch.setattr(cli, "_bootstrap_builder",
                        lambda: lambda out_dir, target, budget_s, **kw: make_base_draft(Path(out_dir)))
    budgets = []

    def heads_builder(target_path, teacher, out, budget_s, progress):
        budgets.append(budget_s)
        assert teacher == tmp_path / "data" / "bootstrap" / "teacher.safetensors"
        return make_heads(Engine.from_paths(str(target), None, dtype=torch.float32).target.model, out, seed=1)

    monkeypatch.setattr(cli, "_heads_builder", lambda: heads_builder)
    code, out, _ = run(capsys, "bootstrap", "--heads-budget", "90s")
    assert code == 0 and budgets == [90.0]
    assert Registry(str(target)).champion() == "1" and heads_registry(str(target)).champion() == "1"

    def broken(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(cli, "_heads_builder", lambda: broken)
    code, out, _ = run(capsys, "bootstrap", "--force")
    assert code == 0 and "Medusa heads not built (RuntimeError: out of memory)" in out
    assert Registry(str(target)).champion() == "2" and heads_registry(str(target)).champion() == "1"
    monkeypatch.setattr(cli, "_heads_builder", lambda: heads_builder)
    code, out, _ = run(capsys, "bootstrap", "--force", "--heads-budget", "0")
    assert code == 0 and budgets == [90.0] and Registry(str(target)).champion() == "3"


def test_distill_runs_one_job_through_the_gate(env, capsys, tmp_path, monkeypatch, gate_config):
    target, _ = env
    reg = Registry(str(target))
    reg.register_base(make_degraded_draft(tmp_path / "base", target))
    reg.promote("1")
    requests = []

    def distill(req):
        requests.append(req)
        return make_candidate(tmp_path / "cand", req.parent_path, parent_version=req.parent_version,
                              target=str(target), before=0.3, after=0.5, seed=5, scale=0.6, sign=-1,
                              target_sha256=req.target_sha256)

    monkeypatch.setattr(cli, "_real_distill", lambda args: distill)
    code, out, _ = run(capsys, "distill", "--config", str(gate_config), "--canary-share", "0", *GATE)
    assert code == 0 and "version 2 promoted to champion" in out, out   # (the default share starts a canary)
    assert requests[0].parent_version == "1" and reg.champion() == "2"
    assert requests[0].target_sha256 == reg.get("1").target_sha256 == reg.get("2").target_sha256

    def broken(req):
        raise RuntimeError("killed by the OOM killer")

    monkeypatch.setattr(cli, "_real_distill", lambda args: broken)
    code, out, _ = run(capsys, "distill")
    assert code == 1 and "killed by the OOM killer" in out and reg.champion() == "2"
    code, out, _ = run(capsys, "status")
    assert "last job:  failed" in out


def test_serve_delegates(env, capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("deploy.app")
    fake.serve_forever = lambda **kw: seen.update(kw)
    monkeypatch.setitem(sys.modules, "deploy.app", fake)
    spawned = []

    class FakePopen:        # no draft registered: serve starts `draftsmith bootstrap` in the background
        def __init__(self, cmd, **kw):
            spawned.append((cmd, kw))
            self.pid = 4242

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    code, out, _ = run(capsys, "serve", "--host", "0.0.0.0", "--port", "8123", "--replicas", "2", "--api-key", "k")
    assert code == 0
    assert seen == {"host": "0.0.0.0", "port": 8123, "target": str(env[0]), "draft": None, "replicas": 2,
                    "api_key": "k", "default_mode": "auto"}
    (cmd, kw), = spawned
    assert cmd[1:4] == ["-m", "deploy.cli", "bootstrap"] and str(env[0]) in cmd
    assert kw["start_new_session"] is True and kw["env"]["PYTHONUNBUFFERED"] == "1"
    assert "serving target-only while `draftsmith bootstrap` (pid 4242)" in out
    code, _, _ = run(capsys, "serve", "--no-bootstrap")
    assert code == 0 and len(spawned) == 1
    # the deployment's default mode: from the flag, else from the environment, checked either way
    code, _, _ = run(capsys, "serve", "--no-bootstrap", "--default-mode", "medusa")
    assert code == 0 and seen["default_mode"] == "medusa"
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_MODE", "eagle")
    code, _, _ = run(capsys, "serve", "--no-bootstrap")
    assert code == 0 and seen["default_mode"] == "eagle"
    seen.clear()
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_MODE", "fastest")
    code, _, err = run(capsys, "serve", "--no-bootstrap")
    assert code == 2 and "$DRAFTSMITH_DEFAULT_MODE is 'fastest'; use one of mjsd," in err and not seen


def test_console_script_reports_without_traceback(tmp_path):
    exe = Path(sys.executable).with_name("draftsmith")
    if not exe.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = {**os.environ, "DRAFTSMITH_DATA": str(tmp_path / "d"), "MLFLOW_TRACKING_URI": ""}
    out = subprocess.run([str(exe), "rollback", "--to", "2"], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "version 2 is not registered" in out.stderr and "Traceback" not in out.stderr


def test_distill_wiring_errors_are_clear(env, capsys, tmp_path, monkeypatch):
    target, _ = env
    reg = Registry(str(target))
    reg.register_base(make_base_draft(tmp_path / "base"))
    reg.promote("1")
    import training.job as real_job

    monkeypatch.setitem(sys.modules, "deploy.distill_job", None)    # the job modules cannot be imported
    monkeypatch.setitem(sys.modules, "training.job", None)
    code, _, err = run(capsys, "distill")
    assert code == 1 and "training.job.run_distillation) is not available" in err
    bad = tmp_path / "cfg.yaml"
    bad.write_text("- just\n- a list\n")
    fake = types.ModuleType("training.job")                          # a job module without pending_records
    fake.__dict__.update({k: v for k, v in vars(real_job).items() if k != "pending_records" and k[:2] != "__"})
    monkeypatch.setitem(sys.modules, "training.job", fake)
    monkeypatch.delitem(sys.modules, "deploy.distill_job")          # re-imported against the fake
    code, _, err = run(capsys, "distill", "--config", str(bad))
    assert code == 2 and "must hold a YAML mapping" in err
    code, _, err = run(capsys, "distill", "--every", "1s", "--min-records", "5")
    assert code == 1 and "--min-records needs training.job.pending_records" in err
    assert reg.champion() == "1" and [v.version for v in reg.versions()] == ["1"]


def test_job_config_maps_the_request():
    from deploy.scheduler import JobRequest

    cfg = cli.job_config(JobRequest("4", Path("/cache/v4"), "tgt", "17-9", "ab" * 32), "tgt",
                         {"lr": 1e-4, "since_id": "x", "ack": "step"})
    assert cfg == {"lr": 1e-4, "parent_version": "4", "base_draft_path": "/cache/v4", "target": "tgt",
                   "since_id": "17-9", "target_sha256": "ab" * 32, "ack": "registered"}   # acks after registration


def test_serve_does_not_start_a_bootstrap_while_the_registry_is_unreachable(monkeypatch, capsys):
    """`draftsmith serve` on a fresh machine starts a bootstrap only when the registry says there is no
    champion; an unreachable registry is not "no champion": serving goes on and nothing is built."""
    import subprocess
    import types

    from deploy import cli
    from deploy.registry import RegistryUnavailable

    class Down:
        def champion(self):
            raise RegistryUnavailable("MLflow tracking server unreachable (simulated)")

    monkeypatch.setattr(cli, "_registry", lambda args: Down())
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    cli._bootstrap_in_background(types.SimpleNamespace(target=None, model_name=None, tracking_uri=None))
    assert started == []
    assert "registry is unreachable" in capsys.readouterr().out


def test_promote_with_a_canary_share_starts_a_canary(env, capsys, tmp_path, gate_config):
    """`draftsmith promote V --canary-share S`: a version that passes the real gate becomes the canary on S of
    requests instead of the champion (the watchdog's canary judge decides later); with --force it skips the
    gate; a share outside [0, 1) or no champion to compare with is a clear exit 2."""
    target, _ = env
    base = make_degraded_draft(tmp_path / "base", target)
    run(capsys, "register", str(base))
    code, _, err = run(capsys, "promote", "1", "--canary-share", "0.5", *GATE)
    assert code == 2 and "needs a champion" in err
    code, err = argparse_error(capsys, "promote", "1", "--canary-share", "1.5")
    assert code == 2 and "canary share must be in [0, 1)" in err
    assert run(capsys, "promote", "1", *GATE)[0] == 0
    cand = make_candidate(tmp_path / "c2", base, parent_version="1", target=str(target), before=0.40, after=0.55,
                          seed=5, scale=0.6, sign=-1)
    run(capsys, "register", str(cand))
    code, out, _ = run(capsys, "promote", "2", "--canary-share", "0.5", "--config", str(gate_config), *GATE)
    assert code == 0 and "passed the gate" in out and "version 2 is the canary on 50% of requests" in out, out
    reg = Registry(str(target))
    assert reg.champion() == "1" and reg.canary()["version"] == "2" and reg.canary()["share"] == 0.5
    code, out, _ = run(capsys, "status")
    assert code == 0 and "canary" in out and "2" in out
    third = make_candidate(tmp_path / "c3", reg.materialize("1"), parent_version="1", target=str(target), seed=9)
    run(capsys, "register", str(third))
    code, out, _ = run(capsys, "promote", "3", "--force", "--canary-share", "0.25")
    assert code == 0 and "version 3 is the canary on 25% of requests" in out
    assert reg.champion() == "1" and reg.canary()["version"] == "3"        # replaced the running canary
