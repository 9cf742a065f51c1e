"""The decoding rules of issue 7 wired into the engine: typical, mentored, spectr, bild, ngram, staged
(and speculative / mjsd where a check covers every mode).

Tiny fp32 models (tests/tiny_models.py). Three kinds of check:
- temperature 0: every mode that is lossless (speculative, spectr, mentored with D = 0, staged, ngram)
  must equal target greedy token for token; typical, BiLD and MJSD do too at T = 0 (a one-hot target
  accepts exactly its argmax and emits its argmax), which we assert as well;
- seeded temperature-1 runs against a cache-free reference (full forwards, the rule functions called
  directly, randomness drawn in the engine's documented order): equal tokens prove the cache handling
  (crop after rejections, spectr's k-row caches and row selection, staged's partial draft rollback,
  MJSD's forked beam caches); mentored with D = 0 draws exactly like speculative sampling, so a seeded
  run of each gives the same tokens;
- knob extremes with exact consequences for the stats, records, validation, draft-free operation.

DRAFTSMITH_TEST_DEVICE=cuda runs the same checks on a GPU (the reference then draws from a CUDA
generator, as the engine does).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests import tiny_models
from tests.tiny_models import ListSink
from serving import engine as engine_module
from serving.config import DRAFT_FREE_MODES, MODES, SamplingParams, SpecParams
from serving.decoding.bild import bild_should_fallback, bild_verify
from serving.decoding.mentored import mentored_verify
from serving.decoding.mjsd import beam_sample_finalize, beam_sample_step, mjsd_verify
from serving.decoding.ngram import ngram_propose, staged_accept
from serving.decoding.spectr import spectr_verify
from serving.decoding.speculative import speculative_verify
from serving.decoding.typical import typical_verify
from serving.decoding.warp import sample, warp_logprobs
from serving.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
NEW_MODES = ("typical", "mentored", "spectr", "bild", "ngram", "staged", "tree")
PROMPT = "abc abc abd the cat sat on the mat the cat"   # repeats, so n-gram lookups find matches
DEVICE = os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu")
EOS = tiny_models.EOS_ID


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one intra-op thread; on the shared 2-core machine two OpenMP threads
    spinning against other processes made each forward ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


def make_engine(target, draft, **kw):
    return Engine.from_paths(str(target), str(draft) if draft else None, dtype=torch.float32, device=DEVICE, **kw)


@pytest.fixture(scope="module")
def engine(pair):
    target, draft = pair
    return make_engine(target, draft, draft_version="v1")


@pytest.fixture(scope="module")
def self_engine(pair):
    """Draft identical to the target: lossless modes accept every draft token."""
    target, _ = pair
    return make_engine(target, target, draft_version="same")


@pytest.fixture(scope="module")
def near_engine(pair, tmp_path_factory):
    """A draft close to the target (its weights plus noise): acceptances and rejections at every depth, so
    spectr picks chains other than the first and every crop length occurs."""
    target, _ = pair
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("near") / "draft"
    model.save_pretrained(path)
    tiny_models.make_tokenizer().save_pretrained(path)
    return make_engine(target, path, draft_version="near")


@pytest.fixture(scope="module")
def lonely(pair):
    target, _ = pair
    return make_engine(target, None)


def ids(eng, text=PROMPT):
    return eng.tokenizer(text)["input_ids"]


def reference_greedy(model, prompt, n, eos=EOS):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=DEVICE)).logits[0, -1].argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt):]


@pytest.mark.parametrize("mode,extra", [
    ("speculative", {}), ("spectr", {"num_drafts": 3}), ("mentored", {"kl_budget": 0.0}), ("staged", {}),
    ("ngram", {}), ("typical", {}), ("bild", {"fallback_threshold": 0.5, "rollback_threshold": 3.0}),
    ("mjsd", {}), ("tree", {"width": 3, "branch": 2}),
])
def test_temperature_zero_equals_target_greedy(engine, self_engine, mode, extra):
    prompt = ids(engine)
    expected = reference_greedy(engine.target.model, prompt, GREEDY.max_tokens)
    for eng in (engine, self_engine):
        res = eng.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode=mode, gamma=4, beams=3, extra=extra))
        assert res.token_ids == expected, f"{mode} draft={eng.draft_version}"
        assert res.stats.mode == mode and res.stats.tokens == len(expected)
        if mode != "ngram":   # an identical draft is always right at T = 0
            assert (res.stats.acceptance_rate == 1.0) == (eng is self_engine)


def test_ngram_needs_no_draft_and_is_greedy(lonely):
    """ngram verifies its deterministic proposal by speculative sampling with a one-hot draft row, the
    lossless rule; at T = 0 that is exactly HF prompt lookup's token match against the target argmax."""
    prompt = ids(lonely)
    expected = reference_greedy(lonely.target.model, prompt, GREEDY.max_tokens)
    res = lonely.generate_all(prompt, GREEDY, SpecParams(adaptive=False, mode="ngram", gamma=5))
    assert res.token_ids == expected
    assert res.stats.draft_version == "none" and res.stats.draft_tokens > 0
    assert res.stats.accepted_tokens > 0       # the tiny target repeats itself: lookups pay off
    assert res.stats.draft_time_s == 0.0


@pytest.mark.parametrize("mode", [m for m in MODES if m not in DRAFT_FREE_MODES])
def test_draft_modes_need_a_draft(lonely, mode):
    with pytest.raises(ValueError, match=f"mode '{mode}' needs a draft model.*'target' or 'ngram'"):
        lonely.generate_all([1, 2, 3], GREEDY, SpecParams(adaptive=False, mode=mode))


# ---------------------------------------------------------------------------- cache-free references
def reference_run(eng, prompt, sampling, spec, gen, steps, calls=None):
    """At most `steps` decoding steps with full forwards (no caches), calling the rules directly and
    drawing randomness in the engine's order; stops after EOS as the engine does. Returns the tokens;
    appends each rule call's (draft tokens, draft probs, target probs) to `calls`."""
    calls = [] if calls is None else calls
    warp = lambda lg: warp_logprobs(lg, sampling.temperature, sampling.top_k, sampling.top_p)
    logits = lambda model, seqs, n: model(torch.tensor(seqs, device=DEVICE)).logits[:, -n:].float()   # [b, n, V]
    target = lambda seq, n: warp(logits(eng.target.model, [seq], n)[0]).exp()
    draft = lambda seq, n: warp(logits(eng.draft.model, [seq], n)[0]).exp()
    x, gamma = spec.extra, spec.gamma
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            if spec.mode == "spectr":
                chains = [[] for _ in range(x["num_drafts"])]
                rows = []
                for _ in range(gamma):
                    probs = torch.cat([draft(seq + c, 1) for c in chains])           # [k, vocab]
                    for c, t in zip(chains, sample(probs, gen).tolist()):
                        c.append(t)
                    rows.append(probs)
                target_probs = torch.stack([target(seq + c, gamma + 1) for c in chains])
                calls.append((chains, torch.stack(rows, 1), target_probs))
                row, res = spectr_verify(torch.tensor(chains), torch.stack(rows, 1), target_probs, gen)
                tokens = chains[row]
            else:
                if spec.mode == "mjsd":   # beam sampling, each beam re-run from scratch
                    beams, beam_rows = [[]], [[]]
                    step_logprobs = warp(logits(eng.draft.model, [seq], 1)[:, -1])
                    beam_logq = torch.zeros(1, device=DEVICE)
                    for i in range(gamma):
                        parent, token, beam_logq = beam_sample_step(beam_logq, step_logprobs, spec.beams, gen)
                        beam_rows = [beam_rows[b] + [step_logprobs[b].exp()] for b in parent.tolist()]
                        beams = [beams[b] + [t] for b, t in zip(parent.tolist(), token.tolist())]
                        if i + 1 < gamma:
                            step_logprobs = warp(logits(eng.draft.model, [seq + b for b in beams], 1)[:, -1])
                    best = int(beam_sample_finalize(beam_logq)[0])
                    tokens, draft_probs = beams[best], torch.stack(beam_rows[best])
                elif spec.mode == "staged":
                    tokens, rows = [], []
                    while len(tokens) < gamma:
                        room = gamma - len(tokens) - 1
                        proposal = ngram_propose(seq + tokens, x["max_ngram"], room, x["min_ngram"]) if room else []
                        probs = draft(seq + tokens + proposal, len(proposal) + 1)
                        n, nxt = staged_accept(proposal, probs, gen)
                        tokens += proposal[:n] + [nxt]
                        rows.append(probs[: n + 1])
                    draft_probs = torch.cat(rows)
                elif spec.mode == "ngram":
                    tokens = ngram_propose(seq, x["max_ngram"], gamma, x["min_ngram"])
                    tokens = tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens
                    draft_probs = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long),
                                                              eng.vocab_size).float().to(DEVICE)
                else:
                    tokens, rows = [], []
                    for _ in range(gamma):
                        probs = draft(seq + tokens, 1)[0]
                        tokens.append(int(sample(probs, gen)))
                        rows.append(probs)
                        if spec.mode == "bild" and bild_should_fallback(probs, x["fallback_threshold"]):
                            break
                    draft_probs = torch.stack(rows)
                args = (torch.tensor(tokens, dtype=torch.long), draft_probs, target(seq + tokens, len(tokens) + 1), gen)
                calls.append(args[:3])
                if spec.mode == "typical":
                    res = typical_verify(*args, posterior_threshold=x["posterior_threshold"],
                                         posterior_alpha=x["posterior_alpha"])
                elif spec.mode == "mentored":
                    res = mentored_verify(*args, kl_budget=x["kl_budget"])
                elif spec.mode == "bild":
                    res = bild_verify(*args, rollback_threshold=x["rollback_threshold"])
                elif spec.mode == "mjsd":
                    res = mjsd_verify(*args, tau=spec.tau)
                else:
                    res = speculative_verify(*args)
            emitted = tokens[: res.num_accepted] + [res.next_token]
            seq += emitted[: emitted.index(EOS) + 1] if EOS in emitted else emitted
            if EOS in emitted:
                break
    return seq[len(prompt):]


REFERENCE_CASES = [
    ("speculative", {}),
    ("mjsd", {}),
    ("typical", {"posterior_threshold": 0.05, "posterior_alpha": 0.2}),
    ("mentored", {"kl_budget": 0.5}),
    ("spectr", {"num_drafts": 3}),
    ("bild", {"fallback_threshold": 0.6, "rollback_threshold": 2.0}),
    ("staged", {"max_ngram": 2}),
    ("ngram", {"max_ngram": 3}),
]


def seeded_run(eng, prompt, sampling, spec, steps):
    outs = []
    for i, out in enumerate(eng.generate(prompt, sampling, spec)):
        outs.extend(out.token_ids)
        if i + 1 == steps:
            break
    return outs


def capture_rule_inputs(monkeypatch, mode):
    """Record (draft tokens, draft probs, target probs) of every rule call the engine makes."""
    calls = []
    if mode == "spectr":
        rule = engine_module.spectr_verify
        monkeypatch.setattr(engine_module, "spectr_verify",
                            lambda d, dp, tp, g: calls.append((d.tolist(), dp, tp)) or rule(d, dp, tp, g))
    else:
        rule = engine_module.VERIFY_RULES[mode]
        monkeypatch.setitem(engine_module.VERIFY_RULES, mode,
                            lambda d, dp, tp, g, spec: calls.append((d.tolist(), dp, tp)) or rule(d, dp, tp, g, spec))
    return calls


@pytest.mark.parametrize("mode,extra", REFERENCE_CASES)
@pytest.mark.parametrize("eng_name", ["engine", "near_engine", "self_engine"])
def test_seeded_run_matches_cache_free_reference(request, monkeypatch, eng_name, mode, extra):
    """Same tokens AND the same rule inputs: every draft and target probability row the engine computed
    with its caches equals (1e-5) the row a full forward gives, so no stale cache entry slipped by."""
    eng = request.getfixturevalue(eng_name)
    prompt = ids(eng)
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=500, seed=321)
    spec = SpecParams(adaptive=False, mode=mode, gamma=3, beams=3, extra=extra)
    got = capture_rule_inputs(monkeypatch, mode)
    outs = seeded_run(eng, prompt, sampling, spec, steps=8)
    want = []
    ref = reference_run(eng, prompt, sampling, spec, torch.Generator(device=DEVICE).manual_seed(321), 8, want)
    assert len(outs) >= 8 and outs == ref
    # the batch scheduler does not wait for a slow reader: it may have run steps beyond the 8 read
    assert len(got) >= len(want)
    for step, ((tokens, dp, tp), (ref_tokens, ref_dp, ref_tp)) in enumerate(zip(got, want)):
        assert tokens == (ref_tokens.tolist() if torch.is_tensor(ref_tokens) else ref_tokens), f"step {step}"
        torch.testing.assert_close(dp, ref_dp, atol=1e-5, rtol=1e-4, msg=f"draft probs, step {step}")
        torch.testing.assert_close(tp, ref_tp, atol=1e-5, rtol=1e-4, msg=f"target probs, step {step}")


def fresh_kv(model, tokens):
    """[(keys, values)] per layer of a cache built by ONE forward over `tokens` (the no-rollback truth)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(torch.tensor([tokens], device=DEVICE), past_key_values=DynamicCache(), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def assert_cache_holds(runner, tokens, what):
    assert runner.batch == 1 and runner.length == len(tokens), f"{what}: batch {runner.batch}, length {runner.length}"
    for i, ((k, v), layer) in enumerate(zip(fresh_kv(runner.model, tokens), runner.cache.layers)):
        assert layer.keys.shape == k.shape, f"{what} layer {i}: {tuple(layer.keys.shape)} != {tuple(k.shape)}"
        torch.testing.assert_close(layer.keys, k, atol=1e-4, rtol=1e-4, msg=f"{what} layer {i} keys")
        torch.testing.assert_close(layer.values, v, atol=1e-4, rtol=1e-4, msg=f"{what} layer {i} values")


def assert_rows_hold(kv, r, tokens, what):
    """Row r of a batch cache (serving/kvcache.py): its valid slots, in order, equal a cache built by one
    forward over `tokens`; holes (rejected drafts, padding) are the only other slots."""
    assert kv.lengths[r] == len(tokens), f"{what}: {kv.lengths[r]} valid slots for {len(tokens)} tokens"
    if not tokens:
        return
    idx = kv.valid[r].nonzero().flatten()
    assert len(idx) == len(tokens), f"{what}: mask has {len(idx)} valid slots"
    for i, ((k, v), layer) in enumerate(zip(fresh_kv(kv.model, tokens), kv.cache.layers)):
        torch.testing.assert_close(layer.keys[r][:, idx][None], k, atol=1e-4, rtol=1e-4, msg=f"{what} layer {i} keys")
        torch.testing.assert_close(layer.values[r][:, idx][None], v, atol=1e-4, rtol=1e-4, msg=f"{what} layer {i} values")


def check_scheduler_caches(sched, checked: list, errors: list) -> None:
    """After a scheduler round: every running request's caches hold exactly its accepted prefix."""
    try:
        for r, req in enumerate(sched.batch):
            assert_rows_hold(sched.tkv, r, req.seq[:-1], f"{req.spec.mode} target row {r}")
            if sched.dkv is not None and sched.dkv.rows:
                assert sched.dkv.lengths[r] <= len(req.seq) - 1
                assert_rows_hold(sched.dkv, r, req.seq[: sched.dkv.lengths[r]], f"{req.spec.mode} draft row {r}")
            checked.append(("batch", r))
        for req in sched.solo:
            state = req.solo
            if state.target.cache is None:
                continue
            assert_cache_holds(state.target, state.seq[:-1], f"{req.spec.mode} target")
            if state.draft is not None and state.draft.cache is not None:
                assert state.draft.length <= len(state.seq) - 1
                assert_cache_holds(state.draft, state.seq[: state.draft.length], f"{req.spec.mode} draft")
            checked.append(("solo", 0))
    except BaseException as exc:  # noqa: BLE001 - raised on the scheduler thread: hand it to the test
        errors.append(exc)


@pytest.mark.parametrize("mode,extra", REFERENCE_CASES)
def test_caches_hold_exactly_the_accepted_prefix(near_engine, mode, extra):
    """After every scheduler round each request's target cache is seq[:-1] and its draft cache a prefix of
    it, each equal (to 1e-4) to a cache built from scratch over those tokens: rollback left no rejected
    token's keys behind (token-level comparisons alone miss that: a stale key barely moves a sample).
    Three requests of different lengths run at once, so batched modes check ragged rows with holes."""
    prompt = ids(near_engine)
    prompts = [prompt, prompt[:7], prompt + prompt[:5]]
    checked, errors = [], []
    near_engine.scheduler.on_round = lambda sched: check_scheduler_caches(sched, checked, errors)
    try:
        threads_out: dict[int, list] = {}

        def one(i):
            sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=40, seed=5 + i)
            spec = SpecParams(adaptive=False, mode=mode, gamma=3, beams=3, extra=extra)
            threads_out[i] = near_engine.generate_all(prompts[i], sampling, spec).token_ids

        import threading
        ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        near_engine.scheduler.on_round = None
    assert not errors, errors[0]
    assert all(len(threads_out.get(i, [])) > 0 for i in range(3))
    assert len(checked) >= 15


def test_mentored_zero_budget_is_speculative_sampling(engine):
    """D = 0: pi is the target row and mentored_verify draws exactly like speculative_verify, so a seeded
    run gives the same tokens and the same acceptance counts as speculative sampling."""
    prompt = ids(engine)
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=60, seed=99)
    spec = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="speculative", gamma=3))
    mentored = engine.generate_all(prompt, sampling, SpecParams(adaptive=False, mode="mentored", gamma=3, extra={"kl_budget": 0.0}))
    assert mentored.token_ids == spec.token_ids
    assert mentored.stats.accepted_per_position == spec.stats.accepted_per_position
    assert 0 < spec.stats.accepted_tokens < spec.stats.draft_tokens   # the check covers accepts and rejections


# ---------------------------------------------------------------------------- knobs with exact effects
SAMPLED = SamplingParams(temperature=1.0, max_tokens=32, seed=7)


def run(eng, mode, gamma=4, sampling=SAMPLED, **extra):
    return eng.generate_all(ids(eng), sampling, SpecParams(adaptive=False, mode=mode, gamma=gamma, extra=extra)).stats


def test_typical_threshold_extremes(self_engine):
    # bound min(eps, delta e^-H) >= 1 > P(x): nothing is accepted, one token per step
    none = run(self_engine, "typical", posterior_threshold=1.0, posterior_alpha=float(self_engine.vocab_size))
    assert none.accepted_tokens == 0 and none.steps == none.tokens
    # bound 0: every token the target can emit is accepted; the identical draft only proposes those
    every = run(self_engine, "typical", posterior_threshold=0.0, posterior_alpha=0.0)
    assert every.acceptance_rate == 1.0


def test_mentored_budget_extremes(engine, self_engine):
    assert run(self_engine, "mentored", kl_budget=0.0).acceptance_rate == 1.0
    # an unbounded budget lets the output follow the draft: every draft token is accepted
    assert run(engine, "mentored", kl_budget=float("inf")).acceptance_rate == 1.0
    assert run(engine, "mentored", kl_budget=0.0).acceptance_rate < 1.0


def test_bild_thresholds(engine):
    eager = run(engine, "bild", fallback_threshold=1.5)       # max prob < 1.5 always: hand over after 1 token
    assert eager.draft_tokens == eager.steps
    never = run(engine, "bild", fallback_threshold=0.0, rollback_threshold=float("inf"))
    assert never.draft_tokens == 4 * never.steps and never.acceptance_rate == 1.0
    # rollback 0: -log P(x) > 0 unless P(x) = 1, and no token has P = 1 untruncated: target sampling
    flat = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=32, seed=7)
    strict = run(engine, "bild", sampling=flat, rollback_threshold=0.0)
    assert strict.accepted_tokens == 0 and strict.steps == strict.tokens > 0


def test_spectr_more_drafts_accept_more(self_engine, engine):
    assert run(self_engine, "spectr", num_drafts=4).acceptance_rate == 1.0
    one, many = (run(engine, "spectr", sampling=SamplingParams(temperature=1.0, max_tokens=120, seed=11),
                     num_drafts=k) for k in (1, 8))
    assert many.acceptance_rate >= one.acceptance_rate


def count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    return calls, handle


def test_staged_saves_draft_forwards(self_engine):
    """Same greedy output as the chain draft, fewer sequential draft forwards: accepted n-gram
    tokens are checked by one draft forward instead of one each."""
    calls, handle = count_forwards(self_engine.draft.model)
    try:
        chain = self_engine.generate_all(ids(self_engine), GREEDY, SpecParams(adaptive=False, mode="speculative", gamma=6))
        chain_calls = len(calls)
        calls.clear()
        staged = self_engine.generate_all(ids(self_engine), GREEDY, SpecParams(adaptive=False, mode="staged", gamma=6))
    finally:
        handle.remove()
    assert staged.token_ids == chain.token_ids
    assert staged.stats.accepted_tokens == chain.stats.accepted_tokens
    assert len(calls) < chain_calls


@pytest.mark.parametrize("mode", [m for m in MODES if m not in ("target", "medusa", "eagle")])   # test_*_mode
def test_stats_are_consistent(engine, mode):
    s = run(engine, mode, gamma=3)
    assert 0 < s.tokens <= 32 and s.steps > 0 and s.mode == mode   # < 32 only after EOS (CUDA draws differ)
    assert sum(s.accepted_per_position) == s.accepted_tokens <= s.draft_tokens <= 3 * s.steps
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.tokens <= s.accepted_tokens + s.steps        # a step emits accepted + 1 (the last may be cut)
    if mode not in ("bild", "ngram"):                     # every other mode proposes exactly gamma per step
        assert s.draft_tokens == 3 * s.steps
    d = s.to_dict()
    assert d["target_time_s"] > 0 and d["tokens_per_s"] > 0
    assert d["energy_j"] is None if DEVICE == "cpu" else (d["energy_j"] is None) != (d["energy_reason"] is None)
    assert (d["draft_time_s"] > 0) == (mode != "ngram")
    assert d["draft_version"] == ("none" if mode == "ngram" else "v1")


@pytest.mark.parametrize("mode", NEW_MODES)
def test_step_records_rebuild_the_sequence(pair, mode):
    target, draft = pair
    sink = ListSink()
    eng = make_engine(target, draft, draft_version="v7", sink=sink, record_top_k=5)
    prompt = ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=2),
                           SpecParams(adaptive=False, mode=mode, gamma=3), request_id="r1", source="unit")
    assert len(sink.seqs) == 1 and 0 < len(sink.steps) <= res.stats.steps
    seq = sink.seqs[0]
    assert list(seq.token_ids) == prompt + res.token_ids
    for rec in sink.steps:
        g, n = len(rec.draft_tokens), rec.num_accepted
        assert rec.algorithm == mode and rec.draft_version == ("none" if mode == "ngram" else "v7")
        assert 1 <= g <= 3 and rec.target_topk_ids.shape == (g + 1, 5)
        got = list(seq.token_ids[rec.position: rec.position + n + 1])
        want = list(rec.draft_tokens[:n]) + [rec.next_token]
        assert got[: len(want)] == want[: len(got)]


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("mode,extra,match", [
    ("typical", {"posterior_threshold": -0.1}, "posterior_threshold"),
    ("typical", {"posterior_alpha": "0.3"}, "posterior_alpha"),
    ("mentored", {"kl_budget": float("nan")}, "kl_budget"),
    ("mentored", {"kl_budget": True}, "kl_budget"),
    ("spectr", {"num_drafts": 0}, "num_drafts"),
    ("spectr", {"num_drafts": 2.0}, "num_drafts"),
    ("bild", {"fallback_threshold": -1}, "fallback_threshold"),
    ("bild", {"rollback_threshold": None}, "rollback_threshold"),
    ("ngram", {"max_ngram": 0}, "max_ngram"),
    ("staged", {"max_ngram": 2, "min_ngram": 3}, "min_ngram"),
    ("tree", {"width": 0}, "width"),
    ("tree", {"branch": 9}, "branch"),
    ("tree", {"num_drafts": 2}, "unknown parameter.*width, branch"),
    ("medusa", {"rule": "bogus"}, "rule must be one of exact, typical"),
    ("spectr", {"kl_budget": 0.1}, "unknown parameter.*'kl_budget'.*num_drafts"),
    ("speculative", {"num_drafts": 2}, "unknown parameter"),
])
def test_bad_knobs_are_refused(mode, extra, match):
    with pytest.raises(ValueError, match=match):
        SpecParams(adaptive=False, mode=mode, extra=extra)


def test_knob_defaults_and_modes():
    assert set(NEW_MODES) <= set(MODES)
    assert SpecParams(adaptive=False, mode="bild", extra={"rollback_threshold": 2}).extra == {
        "fallback_threshold": 0.9, "rollback_threshold": 2.0}
    assert SpecParams(adaptive=False, mode="speculative").extra == {}
    with pytest.raises(ValueError, match="extra must be a dict"):
        SpecParams(adaptive=False, mode="typical", extra=[("posterior_alpha", 1)])
    with pytest.raises(ValueError, match="unknown decoding mode"):
        SpecParams(adaptive=False, mode="hydra")
