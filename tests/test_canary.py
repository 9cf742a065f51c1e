"""Issue 17, canary then champion: per-request routing of a share of traffic to the canary draft
(deterministic by request id), one batch decoding rows of two drafts losslessly, the canary judge
(promote when live acceptance and tokens/s are not significantly worse than the champion's on the same
window, drop with the reason otherwise, decide on timeout), the scheduler starting a canary after a gate
pass, `draftsmith status` showing it, the replica's watcher loading it; and a real watchdog rolling back a
degraded champion under 4-client load with no failed request (real MLflow store, tiny models)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import tiny_models
from serving.config import SamplingParams, SpecParams
from serving.engine import Engine, canary_bucket, routes_to_canary

PROMPTS = ["abc abc abd the cat sat on the mat the cat", "hello", "the mat the cat sat on the cat abc abd abc x",
           "q: 1 + 2 = 3; 2 + 3 = 5; 3 + 4 =", "one two three one two three one", "zz"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory):
    """A draft close to the target with a reduced output vocabulary (its own rows, unlike the champion's)."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("near") / "draft"
    model.save_pretrained(path)
    tiny_models.make_tokenizer().save_pretrained(path)
    (path / "draftsmith.json").write_text(json.dumps({"output_token_ids": list(range(0, 259, 2)) + [257]}))
    return path


def ids_for(arm_canary: bool, share: float, n: int, tag: str = "r") -> list[str]:
    out, i = [], 0
    while len(out) < n:
        rid = f"{tag}-{i}"
        if routes_to_canary(rid, share) == arm_canary:
            out.append(rid)
        i += 1
    return out


# ----------------------------------------------------------------------------- routing
def test_routing_is_deterministic_by_request_id_and_takes_the_share():
    from training.data import is_heldout

    rids = [f"chatcmpl-{i:05d}" for i in range(20000)]
    for share in (0.1, 0.25, 0.5):
        chosen = [r for r in rids if routes_to_canary(r, share)]
        assert abs(len(chosen) / len(rids) - share) < 0.015
        assert chosen == [r for r in rids if routes_to_canary(r, share)]          # same ids every time
    assert not any(routes_to_canary(r, 0.0) for r in rids[:500])
    assert all(canary_bucket(r) == canary_bucket(r) and 0 <= canary_bucket(r) < 1 for r in rids[:100])
    # a larger share keeps every request of a smaller one (raising the share only adds traffic)
    assert {r for r in rids if routes_to_canary(r, 0.1)} <= {r for r in rids if routes_to_canary(r, 0.25)}
    # independent of the held-out split (which hashes the bare id): the canary sees the same traffic mix
    held = [r for r in rids if is_heldout(r, 0.1)]
    assert abs(sum(routes_to_canary(r, 0.25) for r in held) / len(held) - 0.25) < 0.04


# ----------------------------------------------------------------------------- two drafts in one batch
def test_a_batch_with_rows_on_two_drafts_decodes_losslessly(pair, near_draft):
    """Champion and canary rows share the batch (and its target forward); each drafts with its own draft;
    at T=0 every output equals target-only greedy; steps are credited to the right version; a canary that
    goes away mid-request hands its rows to the champion, still lossless."""
    target, own = pair
    eng = Engine.from_paths(str(target), str(own), dtype=torch.float32, device="cpu", draft_version="1")
    eng.set_canary(near_draft, "2", 0.5)
    assert eng.canary.output_token_ids is not None and eng.draft.output_token_ids is None
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = [eng.tokenizer(p)["input_ids"] for p in PROMPTS]
    want = [eng.generate_all(p, sampling, SpecParams(mode="target"), log_mode="none").token_ids for p in prompts]
    canary_ids, champion_ids = ids_for(True, 0.5, 3), ids_for(False, 0.5, 3)
    rids = [canary_ids[0], champion_ids[0], canary_ids[1], champion_ids[1], canary_ids[2], champion_ids[2]]
    specs = [SpecParams(mode="speculative", gamma=3, adaptive=i % 2 == 0) for i in range(6)]
    mixed = []

    def watch(sched):
        arms = {eng.draft_for(r)[1] for r in sched.batch if r.spec.needs_draft}
        if arms == {"1", "2"}:
            mixed.append(len(sched.batch))

    def run(drop_after: int | None = None):
        results: list = [None] * 6
        errors: list = []
        start = threading.Barrier(6)

        def one(i):
            try:
                start.wait(10)
                results[i] = eng.generate_all(prompts[i], sampling, specs[i], request_id=rids[i], log_mode="none")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        if drop_after is not None:
            while eng.scheduler.rounds < drop_after and any(t.is_alive() for t in threads):
                time.sleep(0.002)
            eng.set_canary(None)
        for t in threads:
            t.join(120)
        assert not errors, errors
        return results

    eng.scheduler.on_round = watch
    eng.scheduler.rounds = 0
    results = run()
    assert [r.token_ids for r in results] == want
    assert mixed and max(mixed) >= 4, mixed                        # both drafts' rows really shared batches
    for i, r in enumerate(results):
        assert set(r.stats.draft_versions) - {"none"} == ({"2"} if i % 2 == 0 else {"1"}), (i, r.stats.draft_versions)
        assert r.stats.draft_version == ("2" if i % 2 == 0 else "1")
        assert r.stats.draft_tokens > 0
    # the canary goes away mid-request: its rows continue on the champion draft, outputs unchanged
    eng.scheduler.rounds = 0
    results = run(drop_after=4)
    eng.scheduler.on_round = None
    assert [r.token_ids for r in results] == want
    assert eng.canary is None and len(eng.scheduler.dkvs) <= 1
    assert any({"1", "2"} <= set(r.stats.draft_versions) for r in results[::2]), [r.stats.draft_versions for r in results]
    # promotion reuses the loaded canary model (no second load)
    eng.set_canary(near_draft, "2", 0.25)
    canary_model = eng.canary
    eng.swap_draft(near_draft, "2")
    assert eng.draft is canary_model and eng.draft_version == "2"
