"""Safe defaults (issue 17, item 5), over real HTTP and real processes:

- without an admin key the admin routes answer loopback callers only: a caller on this host's own
  non-loopback address gets 403, through uvicorn and through Ray Serve's proxy (the replica sees the
  proxy's client, not the proxy); an admin key opens them from anywhere, the inference key never does;
- deploy/serve_config.yaml holds no key: the app builder takes both from the environment;
- `draftsmith serve --admin-key` / DRAFTSMITH_ADMIN_KEY reach the service, equal keys are refused;
- SIGTERM or SIGINT to `draftsmith serve` leaves no process of its tree running;
- concurrent first-start conversions of a model folder convert once, under a lock, into one folder.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests import tiny_models
from tests.api_helpers import REDIS_URL, LiveServer, free_port, tiny_service
from serving.api import is_loopback

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers
def non_loopback_ip() -> str | None:
    """This host's own address on its default route (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback(ip) or ip == "0.0.0.0" else ip


HOST_IP = non_loopback_ip()
needs_ip = pytest.mark.skipif(HOST_IP is None, reason="this machine has no non-loopback IPv4 address")


def remote_client(port: int, **kw) -> httpx.Client:
    """A client whose connections come from HOST_IP (not 127.0.0.1), to HOST_IP:port."""
    return httpx.Client(base_url=f"http://{HOST_IP}:{port}", transport=httpx.HTTPTransport(local_address=HOST_IP),
                        timeout=60, **kw)


def assert_error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


class OpenServer(LiveServer):
    """LiveServer bound to 0.0.0.0, so that callers on a non-loopback address reach it too."""

    def __init__(self, service) -> None:
        import uvicorn

        from serving.api import build_app

        super().__init__(service)
        config = uvicorn.Config(build_app(service), host="0.0.0.0", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


# ----------------------------------------------------------------------------- admin access
def test_is_loopback():
    for host in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("192.0.2.2", "10.0.0.1", "0.0.0.0", "::", "::ffff:10.0.0.1", "fe80::1%eth0", "localhost",
                 "testclient", "", None):
        assert not is_loopback(host), host


@needs_ip
def test_without_an_admin_key_admin_routes_answer_loopback_only(pair):
    srv = OpenServer(tiny_service(*pair, buffer=False)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as local, remote_client(srv.port) as remote:
            assert local.get("/v1/admin/draft").json()["draft_version"] == "local"
            assert_error(local.post("/v1/admin/reload"), 409, code="no_registry")   # passed auth: explicit draft
            assert_error(local.post("/v1/admin/rollback", json={}), 409, code="no_registry")
            # a caller on a real non-loopback address: inference and probes work, admin is refused
            r = remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert remote.get("/health").status_code == 200
            for r in (remote.get("/v1/admin/draft"), remote.post("/v1/admin/reload"),
                      remote.post("/v1/admin/rollback", json={"reason": "x"})):
                err = assert_error(r, 403, code="admin_loopback_only")
                assert err["type"] == "permission_error" and "loopback" in err["message"]
            # a remote caller cannot claim loopback: X-Forwarded-For is honoured only from 127.0.0.1
            assert_error(remote.get("/v1/admin/draft", headers={"X-Forwarded-For": "127.0.0.1"}), 403)
            # a trusted local proxy naming a remote client is the remote client
            assert_error(local.get("/v1/admin/draft", headers={"X-Forwarded-For": HOST_IP}), 403)
    finally:
        srv.stop()


@needs_ip
def test_an_admin_key_opens_admin_routes_from_anywhere_and_the_inference_key_does_not(pair):
    srv = OpenServer(tiny_service(*pair, buffer=False, api_key="inf-key", admin_api_key="adm-key")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as local, remote_client(srv.port) as remote:
            adm, inf = {"Authorization": "Bearer adm-key"}, {"Authorization": "Bearer inf-key"}
            assert remote.get("/v1/admin/draft", headers=adm).status_code == 200
            assert_error(remote.post("/v1/admin/reload", headers=adm), 409, code="no_registry")
            assert_error(remote.post("/v1/admin/reload", headers=inf), 403, code="admin_key_required")
            assert_error(remote.post("/v1/admin/reload"), 401, code="invalid_admin_key")
            assert_error(local.post("/v1/admin/reload"), 401, code="invalid_admin_key")   # loopback needs it too
            assert_error(local.get("/v1/admin/draft", headers=inf), 403, code="admin_key_required")
            assert remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=inf).status_code == 200
            assert_error(remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=adm), 401)
    finally:
        srv.stop()


def test_an_open_probe_does_not_see_exception_text_but_an_admin_does(pair):
    svc = tiny_service(*pair, buffer=False, admin_api_key="adm-key")
    srv = LiveServer(svc).start()
    try:
        svc.swap_error = "draft version 7 failed to load (OSError: /srv/secret/path unreadable); still serving local"
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            anon = c.get("/health").json()
            assert "secret" not in anon["swap_error"] and "failed" in anon["swap_error"]
            assert c.get("/health", headers={"Authorization": "Bearer adm-key"}).json()["swap_error"] == svc.swap_error
            assert c.get("/v1/admin/draft", headers={"Authorization": "Bearer adm-key"}).json()["swap_error"] \
                == svc.swap_error
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- config and command line
def test_cluster_config_takes_keys_from_the_environment(monkeypatch):
    from deploy.app import settings_from_args

    text = (ROOT / "deploy" / "serve_config.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg["http_options"]["host"] == "0.0.0.0"
    args = cfg["applications"][0]["args"]
    assert not {"api_key", "admin_api_key"} & set(args), args      # no key literal, live or commented out
    assert not [ln for ln in text.splitlines() if ln.strip().startswith("#") and "_key:" in ln]
    assert "DRAFTSMITH_ADMIN_KEY" in text
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    monkeypatch.delenv("DRAFTSMITH_ADMIN_KEY", raising=False)
    s, replicas, num_cpus = settings_from_args(args)
    assert (s.api_key, s.admin_api_key, replicas, num_cpus) == (None, None, 2, 1.0)
    monkeypatch.setenv("DRAFTSMITH_ADMIN_KEY", "from-env-admin")
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "from-env-inference")
    s, _, _ = settings_from_args(args)
    assert (s.api_key, s.admin_api_key) == ("from-env-inference", "from-env-admin")
    s, _, _ = settings_from_args({**args, "admin_api_key": "explicit"})         # `serve run ... admin_api_key=`
    assert s.admin_api_key == "explicit"
    monkeypatch.setenv("DRAFTSMITH_ADMIN_KEY", "from-env-inference")
    with pytest.raises(ValueError, match="must differ"):
        settings_from_args(args)



def test_replicas_decode_prefill_and_draft_on_their_share_of_the_cores(monkeypatch):
    """Thread defaults of `build`: each replica decodes, prefills and drafts on its share of the cores (2 for
    one replica on 2 cores, 1 for two, 1 for three); a replica told to decode on fewer (leaving a core to the
    proxy) still prefills and drafts on its share; explicit settings are kept."""
    import deploy.app as app
    from serving.service import ServiceSettings

    monkeypatch.setattr(app.os, "cpu_count", lambda: 2)
    for replicas, want in ((1, (2, 2, 2)), (2, (1, 1, 1)), (3, (1, 1, 1))):
        s = ServiceSettings()
        app.build(s, replicas=replicas)
        assert (s.torch_threads, s.prefill_threads, s.wide_threads) == want, replicas
    s = ServiceSettings(torch_threads=1)
    app.build(s, replicas=1)
    assert (s.torch_threads, s.prefill_threads, s.wide_threads) == (1, 2, 2)
    s = ServiceSettings(torch_threads=2, prefill_threads=1, wide_threads=1)
    app.build(s, replicas=1)
    assert (s.torch_threads, s.prefill_threads, s.wide_threads) == (2, 1, 1)
    monkeypatch.setenv("DRAFTSMITH_PREFILL_THREADS", "3")
    monkeypatch.setenv("DRAFTSMITH_WIDE_THREADS", "4")
    from serving.service import settings_from_env

    assert (settings_from_env().prefill_threads, settings_from_env().wide_threads) == (3, 4)
    monkeypatch.setenv("DRAFTSMITH_YIELD_TO_JOBS", "0")
    assert settings_from_env().yield_to_jobs is False and ServiceSettings().yield_to_jobs is True
    for value, want in (("false", False), ("off", False), ("true", True), (False, False)):
        assert app.settings_from_args({"yield_to_jobs": value})[0].yield_to_jobs is want, value

def test_the_cost_profile_is_kept_under_the_cache_dir_unless_told_otherwise(monkeypatch, tmp_path):
    from serving.service import ServiceSettings, settings_from_env

    monkeypatch.delenv("DRAFTSMITH_PROFILE_DIR", raising=False)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    assert settings_from_env().profile_dir == str(tmp_path / "cache" / "cost-profiles")
    monkeypatch.setenv("DRAFTSMITH_PROFILE_DIR", str(tmp_path / "p"))
    assert settings_from_env().profile_dir == str(tmp_path / "p")
    assert settings_from_env(profile_dir="/elsewhere").profile_dir == "/elsewhere"
    assert ServiceSettings().profile_dir is None and ServiceSettings().calibrate is True
    monkeypatch.setenv("DRAFTSMITH_CALIBRATE", "0")
    assert settings_from_env().calibrate is False


def test_settings_from_env_reads_the_admin_key(monkeypatch):
    from serving.service import settings_from_env

    monkeypatch.delenv("DRAFTSMITH_ADMIN_KEY", raising=False)
    assert settings_from_env().admin_api_key is None
    monkeypatch.setenv("DRAFTSMITH_ADMIN_KEY", "k-env")
    assert settings_from_env().admin_api_key == "k-env"
    assert settings_from_env(admin_api_key="k-flag").admin_api_key == "k-flag"


def test_serve_admin_key_flag_and_env(monkeypatch, capsys):
    import types

    from deploy import cli

    seen = []
    fake = types.ModuleType("deploy.app")
    fake.serve_forever = lambda **kw: seen.append(kw)
    monkeypatch.setitem(sys.modules, "deploy.app", fake)
    monkeypatch.delenv("DRAFTSMITH_ADMIN_KEY", raising=False)
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    base = ["serve", "--no-bootstrap", "--draft", "/tmp/d"]
    assert cli.main(base + ["--admin-key", "adm", "--api-key", "inf"]) == 0
    assert seen[-1]["admin_api_key"] == "adm" and seen[-1]["api_key"] == "inf"
    assert cli.main(base) == 0
    assert "admin_api_key" not in seen[-1]          # serve_forever then reads DRAFTSMITH_ADMIN_KEY itself
    assert cli.main(base + ["--admin-key", "same", "--api-key", "same"]) == 2
    assert "must differ" in capsys.readouterr().err
    monkeypatch.setenv("DRAFTSMITH_ADMIN_KEY", "same")
    assert cli.main(base + ["--api-key", "same"]) == 2
    assert cli.main(base + ["--admin-key", " "]) == 2
    assert len(seen) == 2


# ----------------------------------------------------------------------------- conversion lock
CONVERT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from tests import tiny_models
    from serving.models import convert_once

    out, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {tmp}\\n")
        tiny_models.make_model(0).save_pretrained(tmp)
        time.sleep(1.5)                  # a second converter in the same folder now would collide
        tiny_models.make_tokenizer().save_pretrained(tmp)

    Path(sys.argv[4]).touch()            # imported; both processes start converting at the same moment
    while not go.exists():
        time.sleep(0.01)
    print(convert_once(out, build, what="tiny"))
""")


def _start_together(procs, ready: list[Path], go: Path, timeout_s: float = 120.0) -> None:
    """Wait until every process has imported what it needs (its ready file), then let them all go."""
    deadline = time.monotonic() + timeout_s
    while not all(r.exists() for r in ready):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(f"converters not ready: {[p.communicate()[0][-1000:] for p in procs]}")
        time.sleep(0.05)
    go.touch()


def _check_converted(out: Path, log: Path):
    from transformers import AutoModelForCausalLM

    builds = log.read_text().splitlines()
    assert len(builds) == 1, builds                                  # converted once, not once per caller
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert (out / "tokenizer.json").exists()
    assert [p.name for p in out.parent.iterdir() if ".tmp" in p.name] == []
    AutoModelForCausalLM.from_pretrained(out)                         # a complete, loadable folder


def test_two_processes_converting_at_once_convert_once_into_one_folder(tmp_path):
    script = tmp_path / "convert.py"
    script.write_text(CONVERT)
    out, log, go = tmp_path / "cache" / "models" / "tiny", tmp_path / "builds.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(out), str(log), str(go), str(r)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    _start_together(procs, ready, go)
    results = [p.communicate(timeout=180) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-2000:]
        assert stdout.strip() == str(out)
    _check_converted(out, log)


def test_threads_converting_at_once_and_a_stale_temporary_folder(tmp_path):
    from serving.models import convert_once

    out, log = tmp_path / "models" / "tiny", tmp_path / "builds.log"
    out.parent.mkdir(parents=True)
    stale = out.with_name("tiny.tmp-99999")                     # left by a converter that crashed
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{threading.get_ident()}\n")
        tiny_models.make_model(0).save_pretrained(tmp)
        time.sleep(0.5)
        tiny_models.make_tokenizer().save_pretrained(tmp)

    results, start = [], threading.Barrier(3)

    def convert():
        start.wait()
        results.append(convert_once(out, build, what="tiny"))

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [out] * 3
    _check_converted(out, log)


REAL = textwrap.dedent("""
    import logging, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s")
    from serving.models import ensure_default_target
    go = Path(sys.argv[2])
    Path(sys.argv[3]).touch()            # imported; both processes start converting at the same moment
    while not go.exists():
        time.sleep(0.01)
    print("->", ensure_default_target(Path(sys.argv[1])), flush=True)
""")


@pytest.mark.slow
def test_two_first_starts_convert_the_real_default_target_once(tmp_path):
    """The packaged GGUF of the default target, converted by two processes starting together (~20 s):
    one converts, the other waits for it; one folder, no temporary folder left."""
    from serving.models import DEFAULT_TARGET, ModelLoadError, gguf_path

    try:
        gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", REAL, str(tmp_path / "cache"), str(go), str(r)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in ready]
    _start_together(procs, ready, go)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    folder = tmp_path / "cache" / "models" / DEFAULT_TARGET
    assert all(f"-> {folder}" in o for o in outs)
    converting = [o for o in outs if "to a plain model folder" in o]
    waiting = [o for o in outs if "another process is converting" in o]
    assert len(converting) == 1 and len(waiting) == 1, outs
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))
    assert [p.name for p in folder.parent.iterdir() if ".tmp" in p.name] == []


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    from serving.models import ModelLoadError, convert_once

    out = tmp_path / "models" / "tiny"

    def broken(tmp):
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="simulated"):
        convert_once(out, broken)
    with pytest.raises(ModelLoadError, match="wrote no model folder"):
        convert_once(out, lambda tmp: tmp.mkdir(parents=True))
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.lock"]


# ----------------------------------------------------------------------------- stopping a process tree
REAPER = textwrap.dedent("""
    import subprocess, sys
    from deploy.app import become_subreaper, descendants, stop_descendants

    assert become_subreaper()
    # children that start a sleeper in a new session and exit: the sleepers are orphaned, the way Ray's
    # agents are when their raylet dies; one of them ignores SIGTERM
    orphans = []
    for cmd in (["sleep", "300"], ["sh", "-c", "trap '' TERM; sleep 300 & wait"]):
        code = (f"import subprocess; print(subprocess.Popen({cmd!r}, start_new_session=True, stdin=subprocess.DEVNULL, "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
        orphans.append(int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout))
    below = descendants()
    assert set(orphans) <= set(below), (orphans, below)     # re-parented to this process, not to init
    left = stop_descendants(grace_s=2.0)
    assert set(orphans) <= set(left), (orphans, left)
    assert descendants() == [], descendants()
    print(" ".join(map(str, orphans)))
""")


def test_stop_descendants_finds_and_stops_orphans_through_the_subreaper():
    out = subprocess.run([sys.executable, "-c", REAPER], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    for pid in map(int, out.stdout.split()):
        info = _proc_info(pid)
        assert info is None or info[2] in ("Z", "X"), (pid, info)


# ----------------------------------------------------------------------------- the real service: Ray Serve + signals
def _proc_info(pid: int) -> tuple[int, int, str, int] | None:
    """(ppid, session id, state, start time) of a process from /proc, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = stat[stat.rfind(")") + 2:].split()
    return int(f[1]), int(f[3]), f[0], int(f[19])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _tree(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root`."""
    info = {int(p): _proc_info(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    info = {p: i for p, i in info.items() if i is not None}
    out, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for p, (ppid, _, state, start) in info.items():
            if ppid == parent and p not in out:
                if state not in ("Z", "X"):
                    out[p] = start
                todo.append(p)
    return out


def _survivors(snapshot: dict[int, int], session: int) -> list[str]:
    """Processes of `snapshot` (same pid and start time) or of `session` that are still running."""
    left = []
    for p in [int(x) for x in os.listdir("/proc") if x.isdigit()]:
        i = _proc_info(p)
        if i is None or i[2] in ("Z", "X"):
            continue
        if snapshot.get(p) == i[3] or i[1] == session:
            try:
                name = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100]
            except OSError:
                name = "?"
            left.append(f"{p} {name}")
    return left


@pytest.fixture
def serve_env(tmp_path, pair):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DRAFTSMITH_"))}
    env.update({"DRAFTSMITH_DATA": str(tmp_path / "data"), "DRAFTSMITH_CACHE": str(tmp_path / "cache"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}", "REDIS_URL": REDIS_URL,
                "DRAFTSMITH_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _start_service(env: dict, pair, port: int, log: Path, *extra: str) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("draftsmith")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "deploy.cli"]
    cmd += ["serve", "--host", "0.0.0.0", "--port", str(port), "--target", str(pair[0]), "--draft", str(pair[1]),
            *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"draftsmith serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    _stop_hard(proc)
    raise AssertionError(f"draftsmith serve did not answer within 240 s:\n{log.read_text()[-3000:]}")


def _stop_hard(proc: subprocess.Popen) -> None:
    for p in _tree(proc.pid):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    proc.kill()
    proc.wait(timeout=30)


def _signal_and_check_tree_empty(proc: subprocess.Popen, sig: int, log: Path, timeout_s: float = 90.0,
                                 after_exit_s: float = 3.0) -> float:
    """Send `sig`; the command must exit 0 within `timeout_s`, and `after_exit_s` later nothing of its tree
    may run. (Ray's DashboardAgent and RuntimeEnvAgent, orphaned by a dead raylet, exit by themselves
    only after their own parent checks and GCS timeouts, anywhere from seconds to minutes later: the
    command must not leave them to that.)"""
    snapshot = _tree(proc.pid)
    names = " ".join(Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in snapshot
                     if Path(f"/proc/{p}/cmdline").exists())
    assert "raylet" in names and "ray::ServeReplica" in names, names[:500]   # Ray really runs below it
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_hard(proc)
        raise AssertionError(f"draftsmith serve did not exit within {timeout_s} s of {sig!r}")
    exited = time.monotonic()
    left = _survivors(snapshot, proc.pid)
    while left and time.monotonic() - exited < after_exit_s:
        time.sleep(0.2)
        left = _survivors(snapshot, proc.pid)
    text = log.read_text()
    for p in left:                                   # never leave them to the next test
        try:
            os.kill(int(p.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"still running {time.monotonic() - t0:.0f} s after {sig!r} (exit code {rc}): {left}\n" \
                     f"{text[-2000:]}"
    assert rc == 0, text[-3000:]
    assert "shutting down" in text and "[serve] stopped" in text
    return time.monotonic() - t0


@pytest.mark.slow
@needs_ip
def test_ray_serve_admin_loopback_only_then_sigterm_empties_the_process_tree(serve_env, pair, tmp_path):
    """The real `draftsmith serve` (Ray Serve, proxy + replica) on 0.0.0.0 with no admin key: the replica
    sees the caller's own address (the proxy forwards the ASGI scope's client), so a caller on this
    host's non-loopback address gets 403 and a loopback caller gets in. Then SIGTERM: the command exits
    0 and no process of its tree (descendants at the time, or its session) is left."""
    port, log = free_port(), tmp_path / "serve.log"
    proc = _start_service(serve_env, pair, port, log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as local, remote_client(port) as remote:
            assert local.get("/v1/admin/draft").json()["draft_version"] == "local"
            r = remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            for r in (remote.get("/v1/admin/draft"), remote.post("/v1/admin/rollback", json={})):
                assert_error(r, 403, code="admin_loopback_only")
        # the replica runs at the command's own priority, not at Ray's default worker niceness of 15
        replicas = [p for p in _tree(proc.pid) if b"ray::ServeReplica" in _cmdline(p)]
        assert replicas, "no replica process found below draftsmith serve"
        for p in replicas:
            assert os.getpriority(os.PRIO_PROCESS, p) == os.getpriority(os.PRIO_PROCESS, proc.pid)
    except BaseException:
        _stop_hard(proc)
        raise
    took = _signal_and_check_tree_empty(proc, signal.SIGTERM, log)
    print(f"process tree empty {took:.1f} s after SIGTERM")


def test_sigint_and_sigterm_take_the_same_shutdown_path():
    """`draftsmith serve` stops the same way on SIGINT (Ctrl-C) and SIGTERM: both raise the same `_Stop` in the
    main thread, so the end-to-end SIGTERM test above (process tree empty, exit 0) covers Ctrl-C too."""
    from deploy.app import _install_stop_handlers, _Stop

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _install_stop_handlers()
        handlers = {sig: signal.getsignal(sig) for sig in before}
        assert handlers[signal.SIGINT] is handlers[signal.SIGTERM]
        for sig in before:
            with pytest.raises(_Stop) as stop:
                handlers[sig](sig, None)
            assert stop.value.args == (sig,)
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


@pytest.mark.slow
@needs_ip
def test_serve_config_yaml_takes_the_keys_from_the_environment(serve_env, pair, tmp_path):
    """deploy/serve_config.yaml as `serve run` deploys it (Ray Serve builds the app from the config through
    app_builder), only pointed at the tiny models and a free port: the admin key exported in the
    environment guards the admin routes from a remote address, and the inference key exported beside it
    guards inference and does not open the admin routes; the file itself holds neither."""
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(target=str(pair[0]), draft=str(pair[1]), buffer=False, replicas=1)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exe = Path(sys.executable).with_name("serve")
    if not exe.exists():
        pytest.skip("Ray's `serve` command is not installed")
    log = tmp_path / "serve-run.log"
    env = {**serve_env, "DRAFTSMITH_ADMIN_KEY": "adm-from-env", "DRAFTSMITH_API_KEY": "inf-from-env",
           "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "run", str(path)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        with remote_client(port) as remote:
            adm, inf = {"Authorization": "Bearer adm-from-env"}, {"Authorization": "Bearer inf-from-env"}
            r = remote.get("/v1/admin/draft", headers=adm)
            assert r.status_code == 200 and r.json()["draft_version"] == "local", r.text
            assert_error(remote.get("/v1/admin/draft"), 401, code="invalid_admin_key")
            assert_error(remote.get("/v1/admin/draft", headers=inf), 403, code="admin_key_required")
            assert remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=inf).status_code == 200
            assert remote.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        assert_error(httpx.get(f"http://127.0.0.1:{port}/v1/admin/draft", timeout=30), 401)   # loopback too
    finally:
        os.killpg(proc.pid, signal.SIGTERM)            # `serve run` is Ray's command: clean up its session
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for p in _survivors({}, proc.pid):
            try:
                os.kill(int(p.split()[0]), signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=30)


def test_a_replica_freezes_its_startup_heap_once(monkeypatch):
    """gc.freeze after start (serving/service.py `freeze_startup_heap`): what is alive then leaves the collector's
    walk; a second call freezes nothing new; objects made later are collected as usual. DRAFTSMITH_GC_FREEZE=0
    turns it off."""
    import gc

    from serving import service as svc

    assert svc.ServiceSettings().gc_freeze is True
    monkeypatch.setenv("DRAFTSMITH_GC_FREEZE", "0")
    assert svc.settings_from_env().gc_freeze is False
    monkeypatch.setattr(svc, "_heap_frozen", 0)
    probe = [object()]                                   # a container alive at start
    try:
        n = svc.freeze_startup_heap()
        assert n > 0 and not any(o is probe for o in gc.get_objects())
        later = [object()]
        assert svc.freeze_startup_heap() == n            # once per process: the count frozen at start,
        assert gc.get_freeze_count() <= n                # and nothing new frozen (frozen objects may die since)
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is probe for o in gc.get_objects())
