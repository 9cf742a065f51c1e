import os
import tempfile
from pathlib import Path

# tests/ is a package grouped like the code (tests/buffer, tests/serving, tests/training, tests/deploy); the
# shared helpers import as `tests.tiny_models`, `tests.deploy_helpers`, `tests.api_helpers` (pytest puts the
# repository root on the path because tests/ has an __init__.py; no sys.path edits)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# replicas that tests start (in-process or as `draftsmith serve`) keep their measured cost profiles here, not
# in the user's cache (serving/engine.py Engine.calibrate)
os.environ.setdefault("DRAFTSMITH_PROFILE_DIR", tempfile.mkdtemp(prefix="draftsmith-test-profiles-"))
# ... and heads jobs and gates keep the target's hidden states here (training/hidden_cache.py)
os.environ.setdefault("DRAFTSMITH_HIDDEN_CACHE_DIR", tempfile.mkdtemp(prefix="draftsmith-test-hidden-"))
# ... and the jobs and gates that tests run mark the cores they hold here (serving/contention.py), not in the user's
# cache, where a replica serving on this machine would yield its cores to them
os.environ.setdefault("DRAFTSMITH_BUSY_DIR", tempfile.mkdtemp(prefix="draftsmith-test-busy-"))

# Tiny-model forwards are dominated by thread hand-offs: on a shared 2-core machine two torch threads
# per process made them up to 30x slower than one. Every test process runs torch on one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the suffix store of a served engine is not seeded from a developer's bootstrap data (tests use tiny vocabularies)
os.environ.setdefault("DRAFTSMITH_SUFFIX_SEED", "none")
import torch  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- Redis
# Every test that needs Redis uses one server, found once per run: REDIS_URL when set, else a Redis on
# 127.0.0.1:6379, else an embedded real redis-server (buffer/embedded.py) started for the run, so the
# suite passes on a machine that has only Python and make. Test modules read the URL from
# DRAFTSMITH_TEST_REDIS_URL (api_helpers.REDIS_URL, the `redis_url` fixture).
_embedded = None


def pytest_configure(config):
    global _embedded
    import tempfile

    from buffer.embedded import EmbeddedRedis, ping

    # (a pytest-xdist worker inherits its controller's choice, an embedded server included)
    candidates = [u for u in (os.environ.get("DRAFTSMITH_TEST_REDIS_URL"), os.environ.get("REDIS_URL"),
                              "redis://127.0.0.1:6379/0") if u]
    url = next((u for u in candidates if ping(u)), None)
    if url is None:
        try:
            _embedded = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="draftsmith-test-redis-")), persist=False)
            url = _embedded.start()
        except (OSError, RuntimeError) as exc:   # the tests that need Redis then fail with this reason
            url = f"redis://unavailable:0/0?reason={type(exc).__name__}"
    os.environ["DRAFTSMITH_TEST_REDIS_URL"] = url


def pytest_unconfigure(config):
    if _embedded is not None:
        _embedded.stop()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def redis_url():
    return os.environ["DRAFTSMITH_TEST_REDIS_URL"]


# ----------------------------------------------------------------------------- parallel runs
# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup): most tests hold one core (torch
# on one thread) or wait on a subprocess, so two at once halve the wall time on 2 cores. The modules below
# start Ray clusters, `mlflow server` or `draftsmith serve` process trees of their own and check that
# things happen within seconds: they run on one worker, one after another, so two such trees never compete.
PROCESS_TREE_MODULES = {"test_app_ray.py", "test_safe_defaults.py", "test_bench_online.py", "test_ray_jobs.py",
                        "test_promotion_safety.py", "test_distill.py"}


# tryfirst: an xdist worker reads the xdist_group marks in its own pytest_collection_modifyitems (it suffixes the
# node ids with "@process-trees"); a mark added after that hook ran would not group anything
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in PROCESS_TREE_MODULES:
            item.add_marker(pytest.mark.xdist_group("process-trees"))


_UNGROUPED: set[str] = set()


def pytest_collection_finish(session):
    """On an xdist worker under --dist loadgroup: the process-tree tests whose group did not take (a pytest that
    pytest-xdist cannot suffix node ids in, pyproject.toml) would run on both workers at once, which they are not
    written for; each of them then fails with the reason (pytest_runtest_setup) instead of running."""
    if getattr(session.config.option, "loadgroup", False):
        _UNGROUPED.update(i.nodeid for i in session.items
                          if i.path.name in PROCESS_TREE_MODULES and not i.nodeid.endswith("@process-trees"))


def pytest_runtest_setup(item):
    if item.nodeid in _UNGROUPED:
        pytest.fail("pytest-xdist did not group this process-tree test on one worker: this pytest-xdist cannot group "
                    "under this pytest; install the versions pyproject.toml names (`bash scripts/setup.sh`)",
                    pytrace=False)


# ----------------------------------------------------------------------------- one torch thread per test
# Code under test may set torch's thread count for its process (a benchmark script's main() run in-process,
# `--threads`; the CLI's job settings). Left at 2 in a worker that shares 2 cores with the other worker, it
# made every later tiny-model test in that worker spin OpenMP threads: the exact-distribution tests took
# 84-152 s in the suite against 10-18 s alone. Each test starts on the thread count the session started with.
_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
