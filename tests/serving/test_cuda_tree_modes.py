"""The tree modes (tree, medusa, eagle) on a GPU: T=0 equal to target greedy in fp32, and sampled requests
(T=1) that finish. Skipped without CUDA (CI has none). Written after the first H200 run of these modes
(docs/benchmarks.md, "On a GPU"), which found two device bugs the CPU suite cannot see: the EAGLE head's
tree mask and positions left on the CPU, and the tree rules drawing their uniforms from a CUDA generator
on the CPU. tests/serving/test_engine_rules.py covers the chain modes with DRAFTSMITH_TEST_DEVICE=cuda;
DRAFTSMITH_TEST_DEVICE=cpu runs this module's checks on the CPU."""
from __future__ import annotations

import os

import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.decoding.medusa import HeadsConfig, MedusaHeads
from serving.engine import Engine
from tests import tiny_models
from tests.serving.test_eagle import random_head
from tests.serving.test_engine_rules import reference_greedy

DEV = os.environ.get("DRAFTSMITH_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-tree")
    target_path, draft_path = tiny_models.save_pair(root / "pair")
    cpu_target = Engine.from_paths(str(target_path), None, dtype=torch.float32).target.model
    torch.manual_seed(3)
    heads = MedusaHeads.for_target(cpu_target, HeadsConfig(cpu_target.config.hidden_size, 3, 1, True),
                                   list(range(259)))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    heads_dir = heads.save(root / "heads")
    eagle_dir = random_head(cpu_target).save(root / "eagle")
    return Engine.from_paths(str(target_path), str(draft_path), device=DEV, dtype=torch.float32,
                             heads=heads_dir, eagle=eagle_dir)


@pytest.mark.parametrize("mode", ["tree", "medusa", "eagle"])
def test_tree_modes_on_cuda_are_greedy_at_t0_and_sample_at_t1(cuda_engine, mode):
    prompt = [5, 17, 42, 9, 100, 3, 77]
    res = cuda_engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=12),
                                   SpecParams(mode=mode, gamma=3))
    assert res.token_ids == reference_greedy(cuda_engine.target.model, prompt, 12)
    assert res.stats.draft_tokens > 0
    for seed in range(3):           # sampled requests: the tree rules draw uniforms from the request's generator
        sampled = cuda_engine.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=seed),
                                           SpecParams(mode=mode, gamma=3))
        assert sampled.finish_reason in ("length", "stop") and len(sampled.token_ids) >= 1
        assert sampled.stats.draft_tokens > 0
