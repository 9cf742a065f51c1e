"""The Ray Serve application end to end on a real local Ray: two replicas over tiny models, drafts from a
real MLflow registry (SQLite), the replay buffer on the real Redis. Under continuous load from 4 clients:
two promotions and one rollback (over HTTP), every replica on the new version within 10 s of each alias
move, zero failed requests, every response naming its draft version; /metrics merges both replicas;
live acceptance per draft version reaches MLflow; promoted Medusa heads reach both replicas and serve mode medusa."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest

from tests import deploy_helpers as dh
from tests import tiny_models
from tests.api_helpers import REDIS_URL, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from deploy.registry import Registry
    from deploy.app import APP_NAME, build, start_hub
    from serving.metrics import HUB_NAMESPACE
    from serving.service import ServiceSettings

    root = tmp_path_factory.mktemp("raystack")
    old_env = {k: os.environ.get(k) for k in ("DRAFTSMITH_DATA", "DRAFTSMITH_CACHE")}
    os.environ["DRAFTSMITH_DATA"] = str(root / "data")
    os.environ["DRAFTSMITH_CACHE"] = str(root / "cache")
    target, _ = tiny_models.save_pair(root / "models")
    uri = dh.fresh_store(dh.template_db(root), root / "data")
    reg = Registry(str(target), name="tiny-drafts", tracking_uri=uri)
    v1 = reg.register_base(dh.make_base_draft(root / "base"), description="tiny base")
    reg.promote(v1, reason="test")
    prefix = f"test:ray:{uuid.uuid4().hex[:8]}"
    settings = ServiceSettings(target=str(target), registry_model="tiny-drafts", tracking_uri=uri, redis_url=REDIS_URL,
                               buffer_prefix=prefix, served_model_name="tiny", watch_interval_s=0.5,
                               live_interval_s=1.0, torch_threads=1, device="cpu")
    ray.init(num_cpus=2, namespace=HUB_NAMESPACE, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        hub = start_hub(settings)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(settings, replicas=2, num_cpus=0.5), name=APP_NAME, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "reg": reg, "root": root, "v1": v1, "hub": hub, "prefix": prefix}
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        from buffer.redis_store import connect

        client = connect(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)


def replica_versions(url: str, tries: int = 40) -> dict[str, str]:
    """replica id -> draft version, from /health on whichever replica answers (Serve balances)."""
    seen: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(tries):
            h = c.get("/health").json()
            seen[h["replica"]] = h["draft_version"]
            if len(seen) >= 2 and _ > 8:
                break
    return seen


def wait_all_on(url: str, version: str, timeout_s: float = 10.0) -> float:
    """Seconds until both replicas report `version` (AssertionError past timeout_s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        seen = replica_versions(url, tries=12)
        if len(seen) == 2 and set(seen.values()) == {version}:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"replicas not all on version {version} within {timeout_s} s: {replica_versions(url)}")


def test_two_replicas_serve_the_champion_and_merge_metrics(stack):
    url = stack["url"]
    wait_all_on(url, stack["v1"], timeout_s=30)
    blocks = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(8):
            r = c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 8, "temperature": 0.8,
                                                "seed": i, "speculative": {"mode": "speculative"}})
            assert r.status_code == 200, r.text
            blocks.append(r.json()["metrics"]["speculative_decoding"])
        assert {b["draft_version"] for b in blocks} == {stack["v1"]}
        time.sleep(1.5)                      # both replicas publish to the hub every second
        text = c.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    info = [s for s in samples if s.name == "draftsmith:draft_version_info"]
    assert len(info) == 2 and {s.labels["version"] for s in info} == {stack["v1"]}
    drafted = next(s.value for s in samples if s.name == "draftsmith:spec_decode_num_draft_tokens_total")
    assert drafted == sum(b["draft_tokens"] for b in blocks)      # both replicas' requests, from either one


def test_hot_swap_and_rollback_under_load_lose_no_request(stack):
    import ray

    url, reg, root = stack["url"], stack["reg"], stack["root"]
    wait_all_on(url, stack["v1"], timeout_s=30)
    results: list[tuple[int, str | None, float]] = []
    stop = threading.Event()

    def client(i: int):
        with httpx.Client(base_url=url, timeout=60) as c:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"prompt": f"client {i} request {n}", "max_tokens": 12, "temperature": 0.7,
                        "speculative": {"mode": "mjsd" if n % 2 else "speculative"}}
                if n % 3 == 0:
                    body["stream"] = True
                    r = c.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
                    events = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    ok = r.status_code == 200 and not any("error" in e for e in events)
                    version = events[-1]["metrics"]["speculative_decoding"]["draft_version"] if ok else None
                else:
                    r = c.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                    version = r.json()["metrics"]["speculative_decoding"]["draft_version"] if ok else None
                results.append((r.status_code if ok else -r.status_code, version, time.monotonic()))

    workers = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    lags = {}
    try:
        time.sleep(2)
        cand = [reg.register_candidate(dh.make_candidate(root / f"cand{j}", root / "base", parent_version=stack["v1"],
                                                          seed=j, target=str(reg.target))) for j in (1, 2)]
        for v in cand:
            reg.promote(v, reason="test swap")
            lags[v] = wait_all_on(url, v)
            time.sleep(1.5)
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v1/admin/rollback", json={"reason": "test rollback"})
            assert r.status_code == 200, r.text
            assert r.json()["champion"] == cand[0] and r.json()["changed"]
        lags["rollback"] = wait_all_on(url, cand[0])
        time.sleep(1.5)
    finally:
        stop.set()
        for w in workers:
            w.join()
    failed = [r for r in results if r[0] != 200]
    assert len(results) >= 20 and failed == [], failed[:5]
    versions = {v for _, v, _ in results}
    assert {stack["v1"], *cand} <= versions        # every response says which draft produced it
    assert all(lag < 10 for lag in lags.values()), lags
    # live acceptance per draft version reaches MLflow (the hub logs every second here)
    ray.get(stack["hub"].flush_live.remote())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=reg.tracking_uri)
    exp = client.get_experiment_by_name("draftsmith-live")
    runs = client.search_runs([exp.experiment_id])
    logged = {r.data.tags.get("draftsmith.draft_version") for r in runs if "acceptance_rate" in r.data.metrics}
    assert {stack["v1"], *cand} <= logged


def test_replicas_follow_the_heads_registries(stack):
    """Medusa heads and an EAGLE head promoted in their own registered models reach both Ray Serve replicas
    (the heads sources deploy/app.py gives each Service) and serve modes medusa / eagle over HTTP; the admin
    route's rollback of one kind moves it back (and not the draft, nor the other kind)."""
    import torch

    from deploy.registry import heads_registry
    from serving.decoding.eagle import EagleHead
    from serving.decoding.medusa import HeadsConfig, MedusaHeads
    from serving.engine import Engine

    reg, root = stack["reg"], stack["root"]
    model = Engine.from_paths(reg.target, None, dtype=torch.float32).target.model
    regs, versions = {}, {}
    for kind in ("medusa", "eagle"):
        regs[kind] = heads_registry(reg.target, kind, name=reg.name, tracking_uri=reg.tracking_uri)
        versions[kind] = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            h = (MedusaHeads.for_target(model, HeadsConfig(model.config.hidden_size, 2, 1, True), list(range(259)))
                 if kind == "medusa" else EagleHead.for_target(model, list(range(259 - seed))))
            versions[kind].append(regs[kind].register(h.save(root / f"{kind}-{seed}")))
        for v in versions[kind]:
            regs[kind].promote(v, reason="test")

    def heads_on(want: dict, timeout_s: float = 15.0) -> None:
        t0, seen = time.monotonic(), {}
        with httpx.Client(base_url=stack["url"], timeout=10) as c:
            while time.monotonic() - t0 < timeout_s:
                h = c.get("/health").json()
                seen[h["replica"]] = (h["medusa_heads"], h["eagle_head"])
                if len(seen) == 2 and set(seen.values()) == {(want["medusa"], want["eagle"])}:
                    return
                time.sleep(0.1)
        raise AssertionError(f"replicas not all on heads {want} within {timeout_s} s: {seen}")

    heads_on({k: f"{k}-v{versions[k][1]}" for k in regs})
    with httpx.Client(base_url=stack["url"], timeout=60) as c:
        for kind in regs:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                "speculative": {"mode": kind}})
            assert r.status_code == 200, r.text
            assert r.json()["metrics"]["speculative_decoding"]["draft_version"] == f"{kind}-v{versions[kind][1]}"
    draft_champion = reg.champion()
    with httpx.Client(base_url=stack["url"], timeout=60) as c:          # loopback: the admin route is open
        r = c.post("/v1/admin/rollback", json={"kind": "medusa", "reason": "test heads rollback"})
        assert r.status_code == 200, r.text
        assert r.json()["champion"] == versions["medusa"][0]
        assert r.json()["replica_medusa_heads"] == f"medusa-v{versions['medusa'][0]}"
        r = c.post("/v1/admin/rollback", json={"kind": "eagle", "reason": "test eagle rollback"})
        assert r.status_code == 200, r.text
        assert r.json()["replica_eagle_head"] == f"eagle-v{versions['eagle'][0]}"
        bad = c.post("/v1/admin/rollback", json={"kind": "hydra"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert regs["medusa"].champion() == versions["medusa"][0] and regs["eagle"].champion() == versions["eagle"][0]
    assert reg.champion() == draft_champion
    heads_on({k: f"{k}-v{versions[k][0]}" for k in regs})
