"""Engine tests on tiny fp32 models (exactness needs fp32: bf16 multi-token and one-token forwards
round differently). DRAFTSMITH_TEST_DEVICE=cuda runs them on a GPU."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from tests import tiny_models
from tests.tiny_models import ListSink
from serving.config import SamplingParams, SpecParams
from serving.decoding.speculative import speculative_verify
from serving.decoding.warp import sample, warp_logprobs
from serving.engine import Engine
from serving.models import ModelLoadError, TokenizerMismatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
DEVICE = os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one intra-op thread (two spinning OpenMP threads on the shared 2-core
    machine made forwards ~100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def engine(pair):
    target, draft = pair
    return Engine.from_paths(str(target), str(draft), dtype=torch.float32, device=DEVICE, draft_version="v1")


@pytest.fixture(scope="module")
def self_engine(pair):
    """Draft identical to the target: every draft token must be accepted."""
    target, _ = pair
    return Engine.from_paths(str(target), str(target), dtype=torch.float32, device=DEVICE, draft_version="same")


def prompt_ids(engine, text="the quick brown fox"):
    return engine.tokenizer(text)["input_ids"]


def reference_greedy(model, prompt, n, eos=tiny_models.EOS_ID):
    """Target-only greedy decoding with NO cache: a full forward per token, stopping after EOS."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=DEVICE)).logits[0, -1].argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt):]


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_speculative_greedy_equals_target_greedy(engine, self_engine, gamma):
    prompt = prompt_ids(engine)
    expected = reference_greedy(engine.target.model, prompt, GREEDY.max_tokens)
    target_only = engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="target"))
    assert target_only.token_ids == expected
    for eng in (engine, self_engine):
        res = eng.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="speculative", gamma=gamma))
        assert res.token_ids == expected, f"gamma={gamma} draft={eng.draft_version}"
    same = self_engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="speculative", gamma=gamma))
    assert same.stats.acceptance_rate == 1.0
    # all accepted -> gamma + 1 tokens per step (the last step may be cut by max_tokens)
    assert same.stats.steps == -(-len(expected) // (gamma + 1))


def test_random_draft_is_mostly_rejected_but_output_exact(engine):
    prompt = prompt_ids(engine, "zz top")
    res = engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="speculative", gamma=4))
    assert res.token_ids == reference_greedy(engine.target.model, prompt, GREEDY.max_tokens)
    assert res.stats.acceptance_rate < 0.5  # an untrained random draft disagrees with the target


def reference_speculative(engine, prompt, sampling, gamma, gen, steps):
    """Speculative sampling with NO caches (full forwards every time), drawing randomness in the
    same order as the engine, so a seeded run must give identical tokens."""
    warp = lambda lg: warp_logprobs(lg, sampling.temperature, sampling.top_k, sampling.top_p)
    seq = list(prompt)
    tm, dm = engine.target.model, engine.draft.model
    with torch.no_grad():
        for _ in range(steps):
            drafts, dprobs = [], []
            for _ in range(gamma):
                p = warp(dm(torch.tensor([seq + drafts], device=DEVICE)).logits[0, -1].float()).exp()
                drafts.append(int(sample(p, gen)))
                dprobs.append(p)
            tlog = tm(torch.tensor([seq + drafts], device=DEVICE)).logits[0, -gamma - 1:].float()
            res = speculative_verify(torch.tensor(drafts), torch.stack(dprobs), warp(tlog).exp(), gen)
            seq += drafts[: res.num_accepted] + [res.next_token]
    return seq[len(prompt):]


@pytest.mark.parametrize("eng_name", ["engine", "self_engine"])
def test_kv_cache_rollback_matches_no_cache_reference(eng_name, request):
    """Sampling at T=1 with a seed: the cached engine (crop after rejections) and a cache-free
    reference consume the same random draws and so must emit the same tokens."""
    eng = request.getfixturevalue(eng_name)
    prompt = prompt_ids(eng)
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=200, seed=123)
    steps = 12
    outs = []
    for i, out in enumerate(eng.generate(prompt, sampling, SpecParams(adaptive=False, mode="speculative", gamma=3))):
        outs.extend(out.token_ids)
        if i + 1 == steps:
            break
    gen = torch.Generator(device=DEVICE).manual_seed(123)
    ref = reference_speculative(eng, prompt, sampling, 3, gen, steps)
    assert outs == ref


def test_mjsd_identical_draft_accepts_everything(self_engine):
    prompt = prompt_ids(self_engine)
    sampling = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
    res = self_engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", gamma=4, beams=4, tau=0.5))
    assert res.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("beams", [1, 8])
def test_mjsd_greedy_equals_target_greedy(engine, self_engine, beams):
    """At T=0 both warps are one-hot: the joint test accepts exactly the draft tokens that match the
    target's argmax, so MJSD (any tau < 1, any beams; it runs the plain chain there) is greedy decoding."""
    prompt = prompt_ids(engine)
    expected = reference_greedy(engine.target.model, prompt, GREEDY.max_tokens)
    for eng in (engine, self_engine):
        res = eng.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="mjsd", gamma=4, beams=beams, tau=0.1))
        assert res.token_ids == expected, eng.draft_version
    same = self_engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="mjsd", gamma=4, beams=beams))
    assert same.stats.acceptance_rate == 1.0


def test_mjsd_one_beam_keeps_the_tau_extremes(engine, self_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=30, seed=4)
    prompt = prompt_ids(engine)
    none = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", beams=1, tau=1.0))
    assert none.stats.accepted_tokens == 0 and none.stats.tokens > 0
    every = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", gamma=4, beams=1, tau=0.0))
    assert every.stats.acceptance_rate == 1.0
    same = self_engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", gamma=4, beams=1, tau=0.5))
    assert same.stats.acceptance_rate == 1.0


def test_mjsd_tau_extremes(engine):
    prompt = prompt_ids(engine)
    sampling = SamplingParams(temperature=1.0, max_tokens=30, seed=9)
    none = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", tau=1.0))
    assert none.stats.accepted_tokens == 0 and none.stats.steps == none.stats.tokens > 0
    every = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mjsd", gamma=4, tau=0.0))
    assert every.stats.acceptance_rate == 1.0


def test_stats_are_consistent(engine):
    prompt = prompt_ids(engine)
    res = engine.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=64, seed=1),
                              SpecParams(adaptive=False, mode="speculative", gamma=4))
    s = res.stats
    assert s.tokens == len(res.token_ids) == (64 if res.finish_reason == "length" else s.tokens)
    assert res.finish_reason == "length" or res.token_ids[-1] == tiny_models.EOS_ID
    assert sum(s.accepted_per_position) == s.accepted_tokens
    # acceptance at a position implies acceptance at every earlier one
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.draft_tokens == 4 * s.steps
    d = s.to_dict()
    if DEVICE == "cpu":
        assert d["energy_j"] is None and "CPU" in d["energy_reason"]
    else:   # NVML: a reading, or null with the reason (never 0)
        assert (d["energy_j"] is None) != (d["energy_reason"] is None) and d["energy_j"] != 0
    assert d["draft_time_s"] > 0 and d["target_time_s"] > 0
    assert d["mean_accepted_length"] == pytest.approx(s.accepted_tokens / s.steps)


def test_stop_token_max_tokens_and_cancel(engine):
    prompt = prompt_ids(engine)
    free = engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="target"))
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    res = engine.generate_all(prompt, SamplingParams(temperature=0, max_tokens=48, stop_token_ids=(stop_at,)),
                              SpecParams(adaptive=False, mode="speculative", gamma=4))
    assert res.finish_reason == "stop" and res.token_ids == free.token_ids[: first + 1]
    short = engine.generate_all(prompt, SamplingParams(temperature=0, max_tokens=3), SpecParams(adaptive=False, mode="speculative"))
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    cancel = threading.Event()
    cancel.set()
    cancelled = engine.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="speculative"), cancel=cancel)
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []


def test_bad_input_is_refused(engine, pair, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        engine.generate_all([], GREEDY, SpecParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.generate_all([10**6], GREEDY, SpecParams())
    with pytest.raises(ValueError, match="context"):
        engine.generate_all([1] * engine.max_context, GREEDY, SpecParams())
    target, _ = pair
    lonely = Engine.from_paths(str(target), None, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="needs a draft"):
        lonely.generate_all([1, 2], GREEDY, SpecParams(adaptive=False, mode="mjsd"))
    # a draft with another tokenizer is refused with a clear message
    other = tmp_path / "other"
    tiny_models.make_model(3).save_pretrained(other)
    tok = tiny_models.make_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(TokenizerMismatch, match="tokenizer"):
        Engine.from_paths(str(target), str(other), dtype=torch.float32)


@pytest.mark.parametrize("mode", ["speculative", "mjsd"])
def test_step_records_rebuild_the_sequence(pair, mode):
    target, draft = pair
    sink = ListSink()
    eng = Engine.from_paths(str(target), str(draft), dtype=torch.float32, device=DEVICE, draft_version="v7",
                            sink=sink, record_top_k=5)
    prompt = prompt_ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=2),
                           SpecParams(adaptive=False, mode=mode, gamma=3), request_id="r1", source="unit")
    assert len(sink.seqs) == 1 and len(sink.steps) == res.stats.steps
    seq = sink.seqs[0]
    assert list(seq.token_ids) == prompt + res.token_ids and seq.prompt_len == len(prompt)
    assert seq.source == "unit"
    for rec in sink.steps:
        n = rec.num_accepted
        assert rec.draft_version == "v7" and rec.algorithm == mode
        assert rec.target_topk_ids.shape == (4, 5) and rec.target_topk_logprobs.dtype.name == "float16"
        got = list(seq.token_ids[rec.position: rec.position + n + 1])
        want = list(rec.draft_tokens[:n]) + [rec.next_token]
        assert got[: len(want)] == want[: len(got)]
        # top-k log-probs are sorted and are log-probabilities
        lp = rec.target_topk_logprobs.astype("float32")
        assert (lp <= 1e-3).all() and (lp[:, :-1] >= lp[:, 1:] - 1e-3).all()


def test_reduced_output_vocabulary_draft_stays_exact(pair, tmp_path):
    target, draft = pair
    import shutil

    small = tmp_path / "small-draft"
    shutil.copytree(draft, small)
    text_ids = sorted(set(range(0, 259, 2)) | {258})
    (small / "draftsmith.json").write_text(json.dumps({"output_token_ids": text_ids}))
    eng = Engine.from_paths(str(target), str(small), dtype=torch.float32, device=DEVICE)
    prompt = prompt_ids(eng)
    res = eng.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="speculative", gamma=3))
    assert res.token_ids == reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    # the draft can only propose the kept rows
    sink = ListSink()
    eng.sink = sink
    eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=0), SpecParams(adaptive=False, mode="speculative"))
    assert all(int(t) in set(text_ids) for r in sink.steps for t in r.draft_tokens)


def test_swap_draft_between_steps(pair):
    target, draft = pair
    sink = ListSink()
    eng = Engine.from_paths(str(target), str(draft), dtype=torch.float32, device=DEVICE, draft_version="old", sink=sink)
    prompt = prompt_ids(eng)
    gen = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=40), SpecParams(adaptive=False, mode="speculative"))
    tokens = list(next(gen).token_ids)
    eng.swap_draft(str(target), "new")
    for out in gen:
        tokens.extend(out.token_ids)
    assert tokens == reference_greedy(eng.target.model, prompt, 40)
    versions = [r.draft_version for r in sink.steps]
    assert versions[0] == "old" and versions[-1] == "new"
    with pytest.raises(Exception, match="config.json"):
        eng.swap_draft(str(target / "missing"), "broken")
    assert eng.draft_version == "new"


def test_cpu_dtype_follows_native_bf16(monkeypatch):
    """bf16 only where the CPU computes it natively (emulated bf16 is ~2.5x slower than fp32)."""
    from serving.models import cpu_has_fast_bf16, default_dtype

    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "bfloat16")
    assert cpu_has_fast_bf16() and default_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "float32")
    assert not cpu_has_fast_bf16() and default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.float16
    monkeypatch.delenv("DRAFTSMITH_CPU_DTYPE")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert default_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


def test_skinny_linear_matches_linear(monkeypatch):
    """SkinnyLinear (W @ x^T for few rows) gives nn.Linear's values and gradients, keeps the state dict, and
    hands many rows, or another dtype, to nn.Linear's own path."""
    from serving.models import SKINNY_MAX_ROWS, SkinnyLinear, use_skinny_linears, wants_skinny_linears

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7, bias=False))
    fast = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7, bias=False))
    fast.load_state_dict(ref.state_dict())
    assert use_skinny_linears(fast, measure=False) == 2 and all(isinstance(m, SkinnyLinear) for m in (fast[0], fast[2]))
    assert list(fast.state_dict()) == list(ref.state_dict())
    calls = []
    monkeypatch.setattr(torch, "mm", lambda a, b, _mm=torch.mm: calls.append(a.shape) or _mm(a, b))
    for shape in [(1, 24), (3, 24), (2, 5, 24), (1, SKINNY_MAX_ROWS, 24), (SKINNY_MAX_ROWS + 1, 24)]:
        x = torch.randn(*shape, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        calls.clear()
        y, y_ref = fast(x), ref(x2)
        assert y.shape == y_ref.shape and torch.allclose(y, y_ref, atol=1e-5)
        assert len(calls) == (2 if x.numel() // 24 <= SKINNY_MAX_ROWS else 0)   # the weight is mm's left operand
        assert all(c[0] in (40, 7) for c in calls)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        assert torch.allclose(x.grad, x2.grad, atol=1e-5)
        assert torch.allclose(fast[0].weight.grad, ref[0].weight.grad, atol=1e-4)
        fast.zero_grad(), ref.zero_grad()
    calls.clear()
    assert fast.to(torch.float64)(torch.randn(2, 24, dtype=torch.float64)).dtype == torch.float64
    monkeypatch.setenv("DRAFTSMITH_SKINNY_LINEAR", "1")
    assert wants_skinny_linears("cpu", torch.float32) and not wants_skinny_linears("cpu", torch.bfloat16)
    assert not wants_skinny_linears("cuda:0", torch.float32)
    monkeypatch.setenv("DRAFTSMITH_SKINNY_LINEAR", "0")
    assert not wants_skinny_linears("cpu", torch.float32)


def test_skinny_linear_takes_the_product_this_host_times_faster(monkeypatch):
    """Which product SkinnyLinear takes per row count is measured per layer shape at load: W @ x^T where it is
    faster (an AMD host with AVX2), nn.Linear's x @ W^T where that is (an Intel host with AVX-512, where W @ x^T
    over 2-3 rows took 2.5x). Here each product in turn is slowed and the choice follows."""
    import time as _time

    import serving.models as models

    def slowed(fn):
        return lambda *a, **k: (_time.sleep(0.002), fn(*a, **k))[1]

    def fresh():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7, bias=False))

    monkeypatch.setattr(models, "_skinny_choices", {})
    with monkeypatch.context() as m:
        m.setattr(torch, "mm", slowed(torch.mm))
        slow_left = fresh()
        models.use_skinny_linears(slow_left)
    assert not any(slow_left[0].skinny_rows) and not any(slow_left[2].skinny_rows)
    monkeypatch.setattr(models, "_skinny_choices", {})
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "linear", slowed(torch.nn.functional.linear))
        slow_right = fresh()
        models.use_skinny_linears(slow_right)
    table = slow_right[0].skinny_rows
    assert len(table) == models.SKINNY_MAX_ROWS + 1 and not table[0] and all(table[1:])
    # cached per shape: a second model of the same shapes is not timed again
    assert len(models._skinny_choices) == 2
    calls = []
    monkeypatch.setattr(models, "_median_ms", lambda *a: calls.append(1) or 1.0)
    models.use_skinny_linears(fresh())
    assert calls == []
    # DRAFTSMITH_SKINNY_LINEAR=1 puts every row count on W @ x^T without timing anything
    monkeypatch.setenv("DRAFTSMITH_SKINNY_LINEAR", "1")
    forced = torch.nn.Sequential(torch.nn.Linear(5, 9))
    models.use_skinny_linears(forced)
    assert calls == [] and all(forced[0].skinny_rows)
    # the values do not depend on the choice
    x = torch.randn(3, 24)
    assert torch.allclose(slow_left(x), slow_right(x), atol=1e-5)


def _os_threads() -> set:
    """The ids of the process's OS threads. Compared as sets: other threads of a test worker (clients and
    pools left by earlier tests) may start or end meanwhile, which made a count's difference read 0 in CI."""
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_release_openmp_threads_gives_back_a_threads_workers():
    """A thread that ran a 2-thread parallel region keeps an OpenMP worker; release_openmp_threads ends it."""
    from serving.models import _openmp_runtime, release_openmp_threads

    if _openmp_runtime() is None:
        pytest.skip("torch runs without an OpenMP runtime here")
    seen = {}

    def work():
        before = _os_threads()
        torch.set_num_threads(2)
        try:
            a = torch.randn(512, 512)
            for _ in range(3):
                a = torch.tanh(a @ a)                  # parallel regions on 2 threads
            workers = _os_threads() - before           # threads born during this thread's parallel regions
            seen["with_pool"] = len(workers)
            seen["released"] = release_openmp_threads()
            seen["after"] = len(workers & _os_threads())
        finally:
            torch.set_num_threads(1)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert seen["with_pool"] >= 1 and seen["released"] is True
    assert seen["after"] < seen["with_pool"]


def test_engine_loads_and_swaps_give_back_openmp_threads(pair, monkeypatch):
    """Model loading and swaps (outside the scheduler thread) release their OpenMP workers; the scheduler's
    own thread keeps its pool."""
    import serving.engine as engine_mod
    from serving.scheduler import SCHEDULER_THREAD

    calls = []
    monkeypatch.setattr(engine_mod, "release_openmp_threads", lambda: calls.append(threading.current_thread().name))
    target, draft = pair
    eng = Engine.from_paths(str(target), str(draft), dtype=torch.float32, device=DEVICE)
    assert calls == [threading.current_thread().name]
    eng.swap_draft(str(draft), "again")
    assert len(calls) == 2
    th = threading.Thread(target=eng.swap_draft, args=(str(draft), "in-scheduler"), name=SCHEDULER_THREAD)
    th.start()
    th.join()
    assert len(calls) == 2 and eng.draft_version == "in-scheduler"
    with pytest.raises(ModelLoadError):
        eng.swap_draft(str(target / "missing"), "broken")
    assert len(calls) == 3                              # released on failure too


def test_scheduler_gives_back_openmp_threads_when_idle(engine, monkeypatch):
    """After its last round the scheduler thread releases its OpenMP workers before it waits for work."""
    import time

    import serving.scheduler as sched_mod
    from serving.scheduler import SCHEDULER_THREAD

    calls = []
    monkeypatch.setattr(sched_mod, "release_openmp_threads", lambda: calls.append(threading.current_thread().name))
    res = engine.generate_all([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=6), SpecParams(mode="mjsd"),
                              log_mode="none")
    assert len(res.token_ids) == 6
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls and set(calls) == {SCHEDULER_THREAD}
    n = len(calls)
    time.sleep(0.2)
    assert len(calls) == n                      # once per idle period, not on every wait
