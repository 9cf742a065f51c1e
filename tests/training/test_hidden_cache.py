"""What makes a heads job cheaper beside serving (issue 15): the target's hidden states kept on disk between
jobs and gates (training/hidden_cache.py), and training that stops once held-out agreement stops rising
(training/heads.py `BestEpoch`, `train_heads(patience=...)`)."""
from __future__ import annotations

import time

import pytest
import torch

from serving.decoding.medusa import HeadsConfig, MedusaHeads
from tests.tiny_models import make_model
from tests.training.test_heads import teacher_examples
from training.heads import BestEpoch, HeadData, kept_index, target_hidden_rows, target_hidden_states, train_heads
from training.hidden_cache import HiddenStateCache, hidden_cache_for, max_bytes_from_env, target_key


def _quiet(_msg):
    pass


def _examples(target, n=4):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (5 + i,), generator=g).tolist() for i in range(n)]
    return teacher_examples(target, prompts, 6)


def test_a_second_pass_reads_every_sequence_back_exactly(tmp_path):
    target = make_model(seed=0, sharp=3.0)
    exs = _examples(target)
    plain = target_hidden_states(target, exs, batch_size=3, progress=_quiet)
    cache = HiddenStateCache(tmp_path, max_bytes=1 << 30)
    first = target_hidden_states(target, exs, batch_size=3, cache=cache, progress=_quiet)
    assert (cache.hits, cache.misses) == (0, len(exs))
    assert len(list(tmp_path.glob("*.safetensors"))) == len(exs)

    again = HiddenStateCache(tmp_path, max_bytes=1 << 30)        # a later job: a new process, the same folder
    msgs = []
    second = target_hidden_states(target, exs, batch_size=3, cache=again, progress=msgs.append)
    assert (again.hits, again.misses) == (len(exs), 0)
    assert any("read from the cache" in m for m in msgs)
    for a, b, c in zip(plain, first, second):
        assert torch.equal(a, b) and torch.equal(b, c)          # what the pass gave, bit for bit

    # the Medusa rows go through the same cache and equal the uncached rows (of the same batching: padding
    # to another length moves the last bits of a pass)
    rows = target_hidden_rows(target, exs, cache=again, progress=_quiet)
    for r, ref in zip(rows, target_hidden_rows(target, exs, batch_size=3, progress=_quiet)):
        assert torch.equal(r, ref)


def test_a_sequence_that_grew_is_a_miss_and_a_corrupt_file_is_recomputed(tmp_path):
    target = make_model(seed=0, sharp=3.0)
    exs = _examples(target, 2)
    cache = HiddenStateCache(tmp_path, max_bytes=1 << 30)
    target_hidden_states(target, exs, cache=cache, progress=_quiet)
    grown = dict(exs[0], tokens=exs[0]["tokens"] + [7])
    assert cache.get(grown["tokens"]) is None

    victim = cache._path(exs[1]["tokens"])
    victim.write_bytes(victim.read_bytes()[:40])                  # truncated by a crash or a full disk
    before = cache.misses
    out = target_hidden_states(target, exs, cache=cache, progress=_quiet)
    assert cache.misses == before + 1
    ref = target_hidden_states(target, exs, progress=_quiet)
    torch.testing.assert_close(out[1], ref[1])
    assert cache.get(exs[1]["tokens"]) is not None               # rewritten whole

    with pytest.raises(ValueError, match="states of shape"):
        cache.put([1, 2, 3], torch.zeros(2, 4))


def test_the_folder_keeps_to_its_bound_least_recently_used_first(tmp_path):
    cache = HiddenStateCache(tmp_path, max_bytes=3 * 4096 + 1024)   # room for three 4 KB files
    seqs = [[i] * 64 for i in range(5)]
    for n, s in enumerate(seqs):
        cache.put(s, torch.full((64, 16), float(n)))              # 64 x 16 fp32 = 4 KB each
        time.sleep(0.02)
        if n == 2:
            assert cache.get(seqs[0]) is not None                 # used again: it should outlive 1 and 2
            time.sleep(0.02)
    cache.trim()
    kept = [s for s in seqs if cache._path(s).exists()]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) <= cache.max_bytes
    assert seqs[0] in kept and seqs[4] in kept and seqs[1] not in kept


def test_the_setting_and_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HIDDEN_CACHE_MB", "0")
    assert hidden_cache_for(tmp_path, torch.float32) is None
    monkeypatch.setenv("DRAFTSMITH_HIDDEN_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="DRAFTSMITH_HIDDEN_CACHE_MB must be a number"):
        max_bytes_from_env()
    monkeypatch.setenv("DRAFTSMITH_HIDDEN_CACHE_MB", "2")
    monkeypatch.setenv("DRAFTSMITH_HIDDEN_CACHE_DIR", str(tmp_path / "hc"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    c = hidden_cache_for(model, torch.bfloat16)
    assert c.max_bytes == 2 * 1024 * 1024 and c.root.parent == tmp_path / "hc"
    # another dtype, or the target rewritten in place, is another folder
    assert target_key(model, torch.float32) != target_key(model, torch.bfloat16)
    k = target_key(model, torch.bfloat16)
    time.sleep(0.01)
    (model / "config.json").write_text('{"changed": 1}')
    assert target_key(model, torch.bfloat16) != k


def test_best_epoch_stops_after_patience_epochs_without_a_real_gain():
    m = torch.nn.Linear(2, 2)
    best = BestEpoch(patience=2, min_gain=0.01)
    seen = []
    for epoch, score in enumerate([0.30, 0.40, 0.405, 0.409, 0.50], start=1):
        best.update(score, epoch, m)
        seen.append(best.converged)
        if best.converged:
            break
    # 0.405 and 0.409 beat the best by less than 0.01: stop after the second, keeping epoch 4 (0.409)
    assert seen == [False, False, False, True] and best.epoch == 4 and best.score == 0.409
    never = BestEpoch()
    for epoch in range(1, 10):
        never.update(0.1, epoch, m)
    assert not never.converged
    with pytest.raises(ValueError, match="patience"):
        BestEpoch(patience=0)


def test_training_stops_early_and_keeps_the_best_epoch():
    target = make_model(seed=0, sharp=3.0)
    exs = _examples(target, 6)
    heads = MedusaHeads.for_target(target, HeadsConfig(num_heads=2, hidden_size=target.config.hidden_size),
                                   list(range(64)))
    vi = kept_index(target, heads.output_token_ids)
    data = HeadData(exs, target_hidden_rows(target, exs, progress=_quiet), 2, vi)
    # no epoch can gain 1.0 of agreement: one epoch, then stop, long before the deadline and max_epochs
    t0 = time.time()
    fig = train_heads(heads, data, data, deadline=time.time() + 600, batch_size=8, lr=1e-3, max_epochs=50,
                      patience=1, min_gain=1.0, progress=_quiet)
    assert fig["epochs"] == 1 and fig["converged"] and fig["best_epoch"] == 1
    assert time.time() - t0 < 60
    fig = train_heads(heads, data, data, deadline=time.time() + 600, batch_size=8, lr=1e-3, max_epochs=3,
                      progress=_quiet)
    assert fig["epochs"] == 3 and not fig["converged"]           # without patience: to max_epochs
