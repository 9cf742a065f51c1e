"""Batched speculative decoding across requests (serving/scheduler.py, serving/kvcache.py).

Exactness: at temperature 0 in fp32 a request produces the same tokens whether it runs alone or batched
with others of different lengths, for every batched mode. Speculative sampling keeps the target's
distribution for a request batched with others. Requests leave (cancel, disconnect) and a draft is
hot-swapped with a full batch without disturbing the others, and the KV budget refuses or queues what
does not fit.
"""
from __future__ import annotations

import threading

import pytest
import torch

from tests import tiny_models
from serving.config import SamplingParams, SpecParams
from serving.engine import Engine
from serving.kvcache import BatchKV
from serving.modes import MODE_TABLE, UNBATCHED_MODES

PROMPTS = ["abc abc abd the cat sat on the mat the cat", "hello", "the mat the cat sat on the cat abc abd abc x",
           "q: 1 + 2 = 3; 2 + 3 = 5; 3 + 4 ="]
BATCHED = [m for m, info in MODE_TABLE.items() if info.batched]


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
    """A draft close to the target: acceptances and rejections at every depth."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("near") / "draft"
    model.save_pretrained(path)
    tiny_models.make_tokenizer().save_pretrained(path)
    return path


def make_engine(pair, draft=None, **kw):
    target, own_draft = pair
    return Engine.from_paths(str(target), str(draft or own_draft), dtype=torch.float32, device="cpu",
                             draft_version="v1", **kw)


@pytest.fixture(scope="module")
def engine(pair, near_draft):
    return make_engine(pair, near_draft)


def ids(eng, text):
    return eng.tokenizer(text)["input_ids"]


def run_concurrently(eng, jobs):
    """jobs: [(prompt ids, SamplingParams, SpecParams)] started at once; returns their results in order."""
    results: list = [None] * len(jobs)
    errors: list = []
    start = threading.Barrier(len(jobs))

    def one(i):
        try:
            start.wait(10)
            results[i] = eng.generate_all(*jobs[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def max_batch(eng) -> int:
    return max(eng.scheduler.batch_sizes or {0: 0})


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", BATCHED)
def test_greedy_batched_equals_alone(engine, mode):
    """T=0, fp32: each request's tokens are the same batched with three others as alone (fixed gamma, so
    the plan does not depend on timing)."""
    spec = SpecParams(mode=mode, gamma=3, beams=3, adaptive=False)
    jobs = [(ids(engine, p), SamplingParams(temperature=0.0, max_tokens=40, seed=i), spec)
            for i, p in enumerate(PROMPTS)]
    alone = [engine.generate_all(*job).token_ids for job in jobs]
    engine.scheduler.batch_sizes.clear()
    batched = run_concurrently(engine, jobs)
    assert max_batch(engine) >= 2, engine.scheduler.batch_sizes     # they really shared forwards
    assert [r.token_ids for r in batched] == alone
    assert all(len(t) > 0 for t in alone)


@pytest.mark.parametrize("mode", BATCHED)
def test_seeded_sampling_batched_equals_alone(engine, mode):
    """T=1 with a seed per request (MJSD: beam sampling with 3 beams, each request's beam group a slice of
    the batched draft fork): the same tokens batched as alone; the rows' float differences (~1e-7) do not
    move a draw."""
    spec = SpecParams(mode=mode, gamma=3, beams=3, adaptive=False)
    jobs = [(ids(engine, p), SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=7 + i), spec)
            for i, p in enumerate(PROMPTS)]
    alone = [engine.generate_all(*job).token_ids for job in jobs]
    batched = run_concurrently(engine, jobs)
    assert [r.token_ids for r in batched] == alone


def test_adaptive_default_mode_batched_is_target_greedy(engine):
    """The served default (mjsd, adaptive) at T=0 is target greedy whatever k each row's controller picks,
    and a long-prompt request (chunked prefill) joins a running batch without changing anyone's output."""
    long_prompt = ids(engine, " ".join(PROMPTS) * 3)
    jobs = [(ids(engine, p), SamplingParams(temperature=0.0, max_tokens=30), SpecParams()) for p in PROMPTS]
    jobs.append((long_prompt, SamplingParams(temperature=0.0, max_tokens=30), SpecParams()))
    want = [engine.generate_all(p, s, SpecParams(mode="target")).token_ids for p, s, _ in jobs]
    engine.scheduler.prefill_chunk = 16
    try:
        got = run_concurrently(engine, jobs)
    finally:
        engine.scheduler.prefill_chunk = 512
    assert [r.token_ids for r in got] == want


# ---------------------------------------------------------------------------- distribution
def test_speculative_sampling_keeps_the_target_distribution_in_a_batch(engine):
    """The first token of 480 requests, decoded 8 at a time by speculative sampling with a draft that
    differs from the target: its frequencies match the target's warped distribution (chi-square), and
    clearly not the draft's (the test can fail)."""
    prompt = ids(engine, "the cat sat on")
    sampling_kw = dict(temperature=1.0, top_k=4, max_tokens=1)
    with torch.no_grad():
        t_logits = engine.target.model(torch.tensor([prompt])).logits[0, -1].float()
        d_logits = engine.draft.model(torch.tensor([prompt])).logits[0, -1].float()
    from serving.decoding.warp import warp_logprobs

    p_target = warp_logprobs(t_logits, 1.0, 4, 1.0).exp()
    p_draft = warp_logprobs(d_logits, 1.0, 4, 1.0).exp()
    support = torch.nonzero(p_target > 0).flatten().tolist()
    counts: dict[int, int] = {}
    lock = threading.Lock()
    engine.scheduler.batch_sizes.clear()

    def worker(w):
        for i in range(60):
            r = engine.generate_all(prompt, SamplingParams(seed=1000 * w + i, **sampling_kw),
                                    SpecParams(mode="speculative", gamma=3, adaptive=False))
            with lock:
                counts[r.token_ids[0]] = counts.get(r.token_ids[0], 0) + 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    n = sum(counts.values())
    assert n == 480 and max_batch(engine) >= 4
    assert set(counts) <= set(support)

    def chi2(p):
        return sum((counts.get(t, 0) - n * float(p[t])) ** 2 / max(n * float(p[t]), 1e-9) for t in support)

    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001
    assert chi2(p_target) < 16.27, (counts, p_target[support])
    assert (p_target - p_draft).abs().sum() > 0.2      # the draft really differs ...
    assert chi2(p_draft) > chi2(p_target)              # ... and the sample follows the target, not it


# ---------------------------------------------------------------------------- leaving and swapping
def test_cancelled_and_abandoned_requests_leave_without_disturbing_others(engine):
    spec = SpecParams(mode="speculative", gamma=3, adaptive=False)
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    keep = [ids(engine, PROMPTS[0]), ids(engine, PROMPTS[2])]
    alone = [engine.generate_all(p, sampling, spec).token_ids for p in keep]
    cancel = threading.Event()
    leaving = engine.generate(ids(engine, PROMPTS[3]), sampling, spec, cancel=cancel)
    abandoned = engine.generate(ids(engine, PROMPTS[1]), sampling, spec)
    next(leaving)
    next(abandoned)
    results: list = [None, None]

    def one(i):
        results[i] = engine.generate_all(keep[i], sampling, spec).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    cancel.set()
    abandoned.close()            # the client went away
    finals = [o for o in leaving]
    for t in threads:
        t.join(60)
    assert results == alone
    assert finals and finals[-1].finish_reason == "cancelled"
    sched = engine.scheduler
    deadline = threading.Event()
    for _ in range(50):          # the abandoned request leaves at the next round
        if not (sched.batch or sched.prefilling or sched.waiting):
            break
        deadline.wait(0.05)
    assert not sched.batch and sched.tkv is None or sched.tkv.rows == len(sched.batch)


def test_hot_swap_with_a_full_batch_loses_nothing(pair, near_draft):
    """Swap the draft while 4 requests decode: every request finishes with target-greedy tokens (lossless
    at T=0), and steps are credited to the version that proposed them: some request lists both."""
    eng = make_engine(pair)
    target, own_draft = pair
    sampling = SamplingParams(temperature=0.0, max_tokens=60)
    spec = SpecParams(mode="speculative", gamma=3, adaptive=False)
    prompts = [ids(eng, p) for p in PROMPTS]
    want = [eng.generate_all(p, sampling, SpecParams(mode="target")).token_ids for p in prompts]
    rounds0 = threading.Event()

    def swap_after_some_rounds(sched):
        if sched.rounds >= 4 and not rounds0.is_set():
            rounds0.set()

    eng.scheduler.on_round = swap_after_some_rounds
    results: list = [None] * 4

    def one(i):
        results[i] = eng.generate_all(prompts[i], sampling, spec)

    eng.scheduler.rounds = 0
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert rounds0.wait(30)
    eng.swap_draft(near_draft, "v2")
    for t in threads:
        t.join(60)
    eng.scheduler.on_round = None
    assert [r.token_ids for r in results] == want
    versions = [set(r.stats.draft_versions) for r in results]
    assert any({"v1", "v2"} <= v for v in versions), versions
    for r in results:   # per-version counts add up to the request's totals
        assert sum(v["draft_tokens"] for v in r.stats.draft_versions.values()) == r.stats.draft_tokens
        assert sum(v["accepted_tokens"] for v in r.stats.draft_versions.values()) == r.stats.accepted_tokens


# ---------------------------------------------------------------------------- the KV budget
def test_kv_budget_refuses_a_request_too_large_and_queues_the_rest(pair):
    eng = make_engine(pair, max_batch_tokens=200)
    prompt = ids(eng, PROMPTS[0])
    with pytest.raises(ValueError, match="budget of 200"):
        eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=50), SpecParams(beams=8))
    # each request reserves len(prompt) + 40 + gamma + 1 < 100 tokens: two fit at once, four queue
    spec = SpecParams(mode="speculative", gamma=3, adaptive=False)
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    assert 2 * eng.footprint(len(prompt), sampling, spec) <= 200 < 3 * eng.footprint(len(prompt), sampling, spec)
    results = run_concurrently(eng, [(prompt, sampling, spec)] * 4)
    assert all(r.token_ids == results[0].token_ids for r in results)
    assert max_batch(eng) == 2


def test_unbatched_modes_run_beside_the_batch(engine):
    """A mode that cannot batch (spectr, staged, bild, tree; medusa and eagle in tests/serving/test_medusa_mode.py, test_eagle_mode.py) runs
    alone between batched steps; all finish."""
    assert set(UNBATCHED_MODES) == {"spectr", "staged", "bild", "tree", "medusa", "eagle"}
    sampling = SamplingParams(temperature=0.0, max_tokens=30)
    jobs = [(ids(engine, PROMPTS[0]), sampling, SpecParams(mode="speculative", gamma=3, adaptive=False)),
            (ids(engine, PROMPTS[2]), sampling, SpecParams(mode="spectr", gamma=3, extra={"num_drafts": 2})),
            (ids(engine, PROMPTS[3]), sampling, SpecParams(mode="staged", gamma=3)),
            (ids(engine, PROMPTS[1]), sampling, SpecParams(mode="tree", gamma=3, extra={"width": 2, "branch": 2}))]
    want = [engine.generate_all(p, s, SpecParams(mode="target")).token_ids for p, s, _ in jobs]
    got = run_concurrently(engine, jobs)
    assert [r.token_ids for r in got] == want


def test_prefix_cache_prefills_a_shared_prompt_start_once(pair):
    """A prompt that starts like an earlier one prefills only the rest, and decodes the same tokens (T=0)
    as with a cold cache; a prompt sharing nothing misses."""
    eng = make_engine(pair)
    system = ids(eng, "system: you are a helpful assistant who answers briefly and well. ")
    a, b = system + ids(eng, "user: the cat sat"), system + ids(eng, "user: abc abd abc")
    sampling, spec = SamplingParams(temperature=0.0, max_tokens=20), SpecParams(mode="speculative", gamma=3)
    cold = make_engine(pair).generate_all(b, sampling, spec).token_ids
    eng.generate_all(a, sampling, spec)
    pc = eng.scheduler.prefix_cache
    assert (pc.hits, pc.lookups) == (0, 1)
    assert eng.generate_all(b, sampling, spec).token_ids == cold
    assert pc.hits == 1 and pc.tokens_saved >= len(system)
    eng.generate_all(ids(eng, "zzz unrelated"), sampling, spec)
    assert pc.hits == 1 and pc.lookups == 3



def test_prompts_prefill_on_the_prefill_threads_and_decoding_keeps_its_own(pair, monkeypatch):
    """The replica prefills prompts on `prefill_threads` torch threads (a prompt is one compute-bound
    forward) and decodes on its own count; T=0 output is unchanged by it."""
    from serving.runner import SequenceRunner

    eng = make_engine(pair)
    sampling, spec = SamplingParams(temperature=0.0, max_tokens=12), SpecParams(mode="speculative", gamma=3)
    prompt = ids(eng, PROMPTS[0])
    alone = eng.generate_all(prompt, sampling, spec).token_ids
    seen = {"prefill": set(), "step": set()}
    feed, step = SequenceRunner.feed, type(eng.scheduler)._batch_step

    def spy_feed(self, *a, **kw):
        seen["prefill"].add(torch.get_num_threads())
        return feed(self, *a, **kw)

    def spy_step(self, *a, **kw):
        seen["step"].add(torch.get_num_threads())
        return step(self, *a, **kw)

    monkeypatch.setattr(SequenceRunner, "feed", spy_feed)
    monkeypatch.setattr(type(eng.scheduler), "_batch_step", spy_step)
    decode_threads = torch.get_num_threads()
    eng.scheduler.prefill_threads = decode_threads + 1
    assert eng.generate_all(prompt, sampling, spec).token_ids == alone
    assert seen["prefill"] == {decode_threads + 1}, seen
    assert seen["step"] == {decode_threads}, seen
    assert torch.get_num_threads() == decode_threads


def test_drafting_steps_verify_on_the_wide_threads_and_plain_steps_keep_the_decoding_count(pair, monkeypatch):
    """A step that drafts runs its proposal and its target pass (k + 1 tokens a row, compute-bound) on
    `wide_threads`; a plain step (target mode) stays on the replica's decoding count; T=0 output is unchanged
    and the thread count is restored after every step."""
    from serving.kvcache import BatchKV

    eng = make_engine(pair)
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    spec, plain = SpecParams(mode="speculative", gamma=3, adaptive=False), SpecParams(mode="target")
    prompt = ids(eng, PROMPTS[0])
    alone = eng.generate_all(prompt, sampling, spec).token_ids
    decode_threads = torch.get_num_threads()
    seen: list[tuple[int, int]] = []      # (tokens per row fed, torch threads) of every batched target pass
    feed = BatchKV.feed

    def spy_feed(self, blocks, keep, *a, **kw):
        seen.append((max(len(b) for b in blocks), torch.get_num_threads()))
        return feed(self, blocks, keep, *a, **kw)

    monkeypatch.setattr(BatchKV, "feed", spy_feed)
    from serving.service import Service, ServiceSettings

    # yield_to_jobs off: the machine-wide busy markers of other tests' jobs (serving/contention.py) would cap the
    # wide threads at the decoding count while they run (a CI failure: every drafting step on 1 thread)
    svc = Service(ServiceSettings(target=str(pair[0]), buffer=False, watch_interval_s=3600, calibrate=False,
                                  gc_freeze=False, wide_threads=decode_threads + 1, yield_to_jobs=False),
                  engine=eng)    # the replica hands it on
    try:
        assert eng.scheduler.wide_threads == decode_threads + 1
        assert svc.health()[1]["threads"]["drafting"] == decode_threads + 1
    finally:
        svc.close()
    assert eng.generate_all(prompt, sampling, spec).token_ids == alone
    drafting = {t for n, t in seen if n > 1}
    assert drafting == {decode_threads + 1}, seen
    assert torch.get_num_threads() == decode_threads
    seen.clear()
    eng.generate_all(prompt, sampling, plain)
    assert seen and {t for _, t in seen} == {decode_threads}, seen

# ---------------------------------------------------------------------------- the cache itself
def _fresh_and_prefill(model):
    """(fresh(seq): last-position logits of a fresh forward over seq, prefill(seq): a batch-1 cache of seq)."""
    from transformers import DynamicCache

    def fresh(seq):
        with torch.no_grad():
            return model(input_ids=torch.tensor([seq])).logits[0, -1].float()

    def prefill(seq):
        with torch.no_grad():
            return model(input_ids=torch.tensor([seq]), past_key_values=DynamicCache(), use_cache=True).past_key_values

    return fresh, prefill


def test_batch_cache_rows_with_holes_match_fresh_forwards():
    """BatchKV: ragged blocks, rejected slots, joins, leaves, forks and compaction keep every row's logits
    equal to a fresh forward over its tokens."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    fresh, prefill = _fresh_and_prefill(model)

    gen = torch.Generator().manual_seed(0)
    A = torch.randint(0, 256, (12,), generator=gen).tolist()
    B = torch.randint(0, 256, (5,), generator=gen).tolist()
    kv = BatchKV(model, torch.device("cpu"))
    kv.add_row(prefill(A[:-1]), len(A) - 1)
    kv.add_row(prefill(B[:-1]), len(B) - 1)
    lg = kv.feed([[A[-1], 5, 6, 7], [B[-1]]], keep=4)
    torch.testing.assert_close(lg[0, -1], fresh(A + [5, 6, 7]))
    torch.testing.assert_close(lg[1, -1], fresh(B))
    kv.drop_last(0, 2)                                      # keep A + [5]
    lg = kv.feed([[9], [1, 2]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(A + [5, 9]))
    torch.testing.assert_close(lg[1, -1], fresh(B + [1, 2]))
    assert kv.holes() > 0 and kv.compact(slack=0) and kv.holes() == kv.slots - kv.lengths[1]
    fork = kv.fork([0, 0, 1])
    lg = fork.feed([[1], [2], [3]], keep=1)
    torch.testing.assert_close(lg[1, -1], fresh(A + [5, 9, 2]))
    torch.testing.assert_close(lg[2, -1], fresh(B + [1, 2, 3]))
    lg = kv.feed([[8], []], keep=1)                         # the fork did not touch kv; a row may get nothing
    torch.testing.assert_close(lg[0, -1], fresh(A + [5, 9, 8]))
    kv.select([1])
    kv.add_row(None, 0)                                     # a one-token prompt: nothing cached yet
    lg = kv.feed([[4], [7]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(B + [1, 2, 4]))
    torch.testing.assert_close(lg[1, -1], fresh([7]))


def test_rejected_newest_slots_that_no_row_holds_are_given_back_not_left_as_holes():
    """A lone request's rejected draft tokens are the cache's newest slots: drop_last gives them back (the
    next block overwrites them), so its cache never has holes; in a batch, only slots no row holds go."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    fresh, prefill = _fresh_and_prefill(model)
    gen = torch.Generator().manual_seed(1)
    A = torch.randint(0, 256, (9,), generator=gen).tolist()
    B = torch.randint(0, 256, (6,), generator=gen).tolist()
    kv = BatchKV(model, torch.device("cpu"))
    kv.add_row(prefill(A[:-1]), len(A) - 1)
    for draft, accepted in (([5, 6, 7], 1), ([8, 9], 0), ([3], 1)):
        lg = kv.feed([[A[-1]] + draft], keep=len(draft) + 1)
        torch.testing.assert_close(lg[0, -1], fresh(A + draft))
        kv.drop_last(0, len(draft) - accepted)
        A = A + draft[:accepted]
        assert kv.holes() == 0 and kv.slots == len(A) - 1 + 1          # the fed last token is cached too
        assert all(layer.keys.shape[2] == kv.slots for layer in kv.cache.layers)
        A.append(int(lg[0, accepted].argmax()))                        # the target's own next token
    lg = kv.feed([[A[-1]]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(A))

    kv = BatchKV(model, torch.device("cpu"))
    kv.add_row(prefill(A[:-1]), len(A) - 1)
    kv.add_row(prefill(B[:-1]), len(B) - 1)
    kv.feed([[A[-1], 1, 2, 3], [B[-1], 4]], keep=4)
    before = kv.slots
    kv.drop_last(0, 3)                                                 # row 1 still holds the newest slot
    assert kv.slots == before and kv.holes() > 0
    kv.drop_last(1, 1)                                                 # now no row holds it: given back
    assert kv.slots == before - 1
    lg = kv.feed([[7], [8]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(A + [7]))
    torch.testing.assert_close(lg[1, -1], fresh(B + [8]))


def test_rows_leave_and_join_without_moving_the_other_rows():
    """BatchKV.remove moves the last row into the leaving row's place and add_row writes into a spare row:
    every row's logits stay equal to a fresh forward over its tokens, and neither touches the buffers of
    the rows that stay (no whole-cache copy per request that leaves or joins)."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    fresh, prefill = _fresh_and_prefill(model)

    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 4, 7, 6)]
    kv = BatchKV(model, torch.device("cpu"))
    for s in seqs[:3]:
        kv.add_row(prefill(s[:-1]), len(s) - 1)
    rows = seqs[:3]
    lg = kv.feed([[s[-1]] for s in rows], keep=1)
    for r, s in enumerate(rows):
        torch.testing.assert_close(lg[r, -1], fresh(s))
    layer = kv.cache.layers[0]
    buffers = (layer._kbuf.data_ptr(), layer._vbuf.data_ptr())
    kv.remove(0)                                            # the last row (seqs[2]) takes row 0
    rows[0] = rows[-1]
    rows.pop()
    assert kv.rows == 2 and kv.lengths == [len(rows[0]), len(rows[1])]
    kv.add_row(prefill(seqs[3][:-1]), len(seqs[3]) - 1)     # shorter than the slots: right-aligned in a spare row
    rows.append(seqs[3][:-1])
    assert (layer._kbuf.data_ptr(), layer._vbuf.data_ptr()) == buffers
    lg = kv.feed([[5], [6], [seqs[3][-1]]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(rows[0] + [5]))
    torch.testing.assert_close(lg[1, -1], fresh(rows[1] + [6]))
    torch.testing.assert_close(lg[2, -1], fresh(seqs[3]))
    kv.remove(2)                                            # the last row leaves: nothing moves
    lg = kv.feed([[7], [8]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(rows[0] + [5, 7]))
    torch.testing.assert_close(lg[1, -1], fresh(rows[1] + [6, 8]))
    with pytest.raises(IndexError):
        kv.remove(2)
    # a reused fork (the draft's beams at every step) fills the previous fork's buffers, correctly
    first = kv.fork([0, 0, 1], extra_slots=2, reuse=True)
    lg = first.feed([[1], [2], [3]], keep=1)
    torch.testing.assert_close(lg[2, -1], fresh(rows[1] + [6, 8, 3]))
    ptr = first.cache.layers[0]._kbuf.data_ptr()
    second = kv.fork([1, 0], extra_slots=2, reuse=True)
    assert second.cache.layers[0]._kbuf.data_ptr() == ptr
    lg = second.feed([[4], [9]], keep=1)
    torch.testing.assert_close(lg[0, -1], fresh(rows[1] + [6, 8, 4]))
    torch.testing.assert_close(lg[1, -1], fresh(rows[0] + [5, 7, 9]))
    lg = kv.feed([[2], [3]], keep=1)                        # forks never write into kv
    torch.testing.assert_close(lg[0, -1], fresh(rows[0] + [5, 7, 2]))


def test_live_statistics_credit_each_version_its_own_steps():
    """A request that spans a swap: MLflow's live per-version sums get each version's own draft and accepted
    tokens (serving/metrics.py split_by_version), and the parts add up to the request."""
    from serving.metrics import split_by_version

    stats = {"draft_version": "4", "steps": 10, "draft_tokens": 30, "accepted_tokens": 12, "tokens": 25,
             "wall_time_s": 2.0, "energy_j": None,
             "draft_versions": {"3": {"steps": 4, "draft_tokens": 16, "accepted_tokens": 2},
                                "4": {"steps": 4, "draft_tokens": 14, "accepted_tokens": 10},
                                "none": {"steps": 2, "draft_tokens": 0, "accepted_tokens": 0}}}
    parts = {p["draft_version"]: p for p in split_by_version(stats)}
    assert set(parts) == {"3", "4"}
    assert parts["3"]["accepted_tokens"] / parts["3"]["draft_tokens"] == 2 / 16
    assert parts["4"]["accepted_tokens"] / parts["4"]["draft_tokens"] == 10 / 14
    assert sum(p["tokens"] for p in parts.values()) == 25
    assert sum(p["wall_time_s"] for p in parts.values()) == 2.0
    one = dict(stats, draft_versions={"4": {"steps": 10, "draft_tokens": 30, "accepted_tokens": 12}})
    assert split_by_version(one) == [one]


def test_http_request_over_the_kv_budget_is_a_clear_400(pair):
    """Over HTTP a request whose beams x context exceed the replica's KV budget is answered 400 with an
    OpenAI-style body saying what to lower; a request within it is served."""
    import httpx

    from tests.api_helpers import LiveServer, tiny_service

    target, draft = pair
    eng = Engine.from_paths(str(target), str(draft), dtype=torch.float32, draft_version="local",
                            max_batch_tokens=300)
    srv = LiveServer(tiny_service(target, draft, engine=eng, buffer=False)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 100, "temperature": 1.0,
                                                "speculative": {"mode": "mjsd", "beams": 8}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"} and "budget of 300" in err["message"]
            assert "beams" in err["message"]
            ok = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 8, "temperature": 1.0,
                                                 "speculative": {"mode": "mjsd", "beams": 2}})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
    finally:
        srv.stop()


def test_a_fault_in_the_scheduler_fails_the_running_requests_and_it_keeps_serving(pair, monkeypatch):
    """A bug outside the model forwards (here: compaction raising) fails the requests of that round with the
    error, instead of hanging them, and the next request is served normally."""
    eng = make_engine(pair)
    spec, sampling = SpecParams(mode="speculative", gamma=3), SamplingParams(temperature=0.0, max_tokens=12)
    prompt = ids(eng, PROMPTS[0])
    want = eng.generate_all(prompt, sampling, spec).token_ids

    def broken(self, slack=32):
        raise RuntimeError("compaction bug (simulated)")

    monkeypatch.setattr(BatchKV, "compact", broken)
    with pytest.raises(RuntimeError, match="compaction bug"):
        eng.generate_all(prompt, sampling, spec)
    monkeypatch.undo()
    assert eng.generate_all(prompt, sampling, spec).token_ids == want


class _SlowSink(tiny_models.ListSink):
    """A replay-buffer sink whose sequence push takes a while (a loaded host, a slow Redis client)."""

    def push_sequence(self, r):
        import time
        time.sleep(0.3)
        super().push_sequence(r)


@pytest.mark.parametrize("mode", ["mjsd", "spectr"])
def test_the_sequence_record_is_in_the_buffer_when_the_answer_arrives(pair, mode):
    """The scheduler pushes a finished request's sequence record before it hands over the last tokens, so
    whoever reads the answer (a test, the canary, a job started right after) finds the record there."""
    sink = _SlowSink()
    eng = make_engine(pair, sink=sink, record_top_k=5)
    res = eng.generate_all(ids(eng, PROMPTS[0]), SamplingParams(temperature=1.0, max_tokens=12, seed=3),
                           SpecParams(adaptive=False, mode=mode, gamma=3), request_id="r1", source="unit")
    assert res.stats.steps > 0 and len(sink.steps) > 0
    assert len(sink.seqs) == 1 and sink.seqs[0].request_id == "r1"


def test_a_script_that_decoded_exits_cleanly(tmp_path):
    """The scheduler thread has run torch ops; left alive at interpreter exit it made in-process scripts
    abort after their work was done (exit status 134, "terminate called without an active exception").
    An atexit hook ends every scheduler thread first."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    target, draft = tiny_models.save_pair(tmp_path)
    script = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(2)
        from serving.config import SamplingParams, SpecParams
        from serving.engine import Engine
        eng = Engine.from_paths({str(target)!r}, {str(draft)!r}, device="cpu", dtype=torch.float32)
        for mode in ("target", "speculative", "mjsd"):
            eng.generate_all([1, 2, 3, 4, 5], SamplingParams(temperature=0.7, max_tokens=8, seed=0),
                             SpecParams(mode=mode, adaptive=False, beams=3))
        print("decoded")
    """)
    root = Path(__file__).resolve().parents[2]
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "decoded" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_tree_blocks_of_several_rows_score_each_path_and_keep_only_the_accepted_one():
    """BatchKV.feed_tree (the heads' trees of several requests in one target pass): every node's logits and
    hidden state equal a fresh forward over its row's tokens plus that node's path (ragged rows, a row that
    also feeds context, a row with no tree); after keep_new each row's valid slots equal a fresh cache over
    its accepted sequence, and the next plain feed continues it exactly."""
    from serving.decoding.tree import DraftTree
    from tests.serving.test_engine_rules import assert_rows_hold

    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    fresh, prefill = _fresh_and_prefill(model)

    def fresh_hidden(seq):
        with torch.no_grad():
            return model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]

    gen = torch.Generator().manual_seed(2)
    A = torch.randint(0, 256, (11,), generator=gen).tolist()
    B = torch.randint(0, 256, (6,), generator=gen).tolist()
    C = torch.randint(0, 256, (4,), generator=gen).tolist()
    kv = BatchKV(model, torch.device("cpu"))
    kv.add_row(prefill(A[:-1]), len(A) - 1)                  # row 0: the root only, then a tree
    kv.add_row(prefill(B[:-3]), len(B) - 3)                  # row 1: two context tokens before its root
    kv.add_row(prefill(C[:-1]), len(C) - 1)                  # row 2: no tree (a plain step)
    trees = [DraftTree((5, 6, 7, 8), (-1, -1, 0, 2)), DraftTree((9, 10), (-1, 0)), DraftTree((), ())]
    contexts = [A[-1:], B[-3:], C[-1:]]
    blocks, masks, positions = [], [], []
    for ctx, tree in zip(contexts, trees):
        c, n = len(ctx), len(tree)
        mask = torch.ones(c + n, c + n, dtype=torch.bool).tril()
        if n:
            mask[c:, c:] = tree.ancestor_mask()
        blocks.append(ctx + list(tree.tokens))
        masks.append(mask)
        positions.append(torch.cat([torch.arange(c), c - 1 + torch.tensor(tree.depth, dtype=torch.long)]))
    keep = 1 + max(len(t) for t in trees)
    logits, hidden = kv.feed_tree(blocks, masks, positions, keep)
    assert logits.shape[:2] == hidden.shape[:2] == (3, keep)
    for r, (seq, tree) in enumerate(zip((A, B, C), trees)):
        for node in [-1, *range(len(tree))]:                 # -1: the root
            path = [] if node == -1 else [tree.tokens[i] for i in tree.path_to(node)]
            col = keep - len(tree) - 1 + (node + 1)
            torch.testing.assert_close(logits[r, col], fresh(seq + path), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[r, col], fresh_hidden(seq + path), atol=1e-4, rtol=1e-4)
    width = max(len(b) for b in blocks)
    accepted = [[0, 2, 3], [0], []]                          # row 0 keeps the path 5 -> 7 -> 8
    keeps = []
    for b, ctx, path in zip(blocks, contexts, accepted):
        pad = width - len(b)
        keeps.append([pad + j for j in range(len(ctx))] + [pad + len(ctx) + p for p in path])
    kv.keep_new(width, keeps)
    A, B = A + [5, 7, 8], B + [9]
    for r, seq in enumerate((A, B, C)):
        assert_rows_hold(kv, r, seq, f"row {r}")
    assert kv.slots == len(A) - 4 + 4                        # the new slots past the longest kept run went back
    lg = kv.feed([[1], [2], [3]], keep=1)
    for r, seq in enumerate((A + [1], B + [2], C + [3])):
        torch.testing.assert_close(lg[r, -1], fresh(seq), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        kv.keep_new(1, [[0, 1], [0], [0]])
