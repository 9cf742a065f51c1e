"""The adaptive speculation controller (serving/controller.py) on synthetic acceptance streams: it stops
drafting a hopeless draft, recovers when the draft starts to pay, never drafts beyond the request's gamma,
and switches to n-gram proposals only when they are the better buy. Plus the engine with the controller
on: T=0 output equal to target-only greedy output, and steps that draft nothing still recorded."""
from __future__ import annotations

import json
import random

import pytest

from serving.controller import (AcceptanceEstimate, CostModel, ReplicaPriors, RequestController, best_k,
                                expected_tokens)


def costs(target_ms: float = 30.0, draft_ms: float = 3.0, slope: float = 0.03) -> CostModel:
    """A cost model with measured values: a target pass over n tokens costs target_ms * (1 + slope (n-1))."""
    c = CostModel(weight=1.0)
    for n in range(1, 18):
        c.observe_target(n, target_ms * (1 + slope * (n - 1)) / 1000)
    c.observe_draft("chain", 1, draft_ms / 1000)
    return c


def controller(gamma=4, c=None, prior=0.5, use_ngram=False) -> RequestController:
    return RequestController(gamma=gamma, costs=c or costs(), priors=ReplicaPriors(prior=prior), version="v1",
                             greedy=True, use_ngram=use_ngram)


def run(ctrl: RequestController, accept_p: float, steps: int, rng: random.Random, ngram_len: int = 0):
    """Drive the controller with a draft whose tokens are each accepted with probability accept_p (and
    an n-gram proposer accepted with the same probability); returns the plans."""
    plans = []
    for _ in range(steps):
        plan = ctrl.plan(ngram_len)
        n = 0
        while n < plan.k and rng.random() < accept_p:
            n += 1
        ctrl.observe(plan, n)
        plans.append(plan)
    return plans


def test_expected_tokens_matches_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.9, 0) == 1.0


def test_expected_tokens_of_a_per_depth_curve():
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(expected_tokens(0.5, 3))
    assert expected_tokens([0.6, 0.1], 2) == pytest.approx(1 + 0.6 + 0.06)
    assert expected_tokens([0.6, 0.1], 4) == pytest.approx(1 + 0.6 + 0.06 + 0.006 + 0.0006)   # the last repeats
    assert expected_tokens([0.6, 0.1], 0) == 1.0
    est = AcceptanceEstimate(prior=0.5, decay=1.0)
    assert est.curve(3) == [0.5, 0.5, 0.5]              # no evidence at any depth: the single alpha everywhere
    for _ in range(200):                                 # the first token always accepted, the second never
        est.update(3, 1)
    a1, a2, a3 = est.curve(3)
    assert a1 > 0.95 and a2 < 0.05
    assert a3 == pytest.approx(est.alpha)                # never reached: priced at the single alpha
    bounded = AcceptanceEstimate(prior=0.5, prior_curve=(0.9, 0.2))
    assert bounded.curve(3) == pytest.approx([0.9, 0.2, 0.5])


def test_best_k_follows_the_speedup_formula():
    step = lambda k: 1.0 + 0.1 * k          # c = 0.1, free verification
    assert best_k(0.05, 8, step)[0] == 0     # hopeless draft: a plain target step is best
    k_mid, _ = best_k(0.6, 8, step)
    k_high, _ = best_k(0.9, 8, step)
    assert 1 <= k_mid < k_high <= 8
    # a marginal gain (here 1.3 / 1.2 = 8%) does not clear a 10% bar: a plain step instead
    marginal = lambda k: 1.0 + 0.2 * k
    assert best_k(0.3, 1, marginal)[0] == 1 and best_k(0.3, 1, marginal, min_gain=0.1)[0] == 0
    # brute force: the returned k maximises E / T
    for a in (0.2, 0.5, 0.8):
        k, rate = best_k(a, 8, step)
        assert rate == pytest.approx(max(expected_tokens(a, j) / step(j) for j in range(9)))


def test_hopeless_draft_falls_to_zero_and_only_probes():
    rng = random.Random(0)
    ctrl = controller(prior=0.5)
    plans = run(ctrl, accept_p=0.0, steps=200, rng=rng)
    tail = plans[50:]
    assert all(p.k <= 1 for p in tail)
    drafting = [p for p in tail if p.k > 0]
    assert all(p.probe for p in drafting)                 # only probes draft
    assert len(drafting) <= len(tail) / 16                # probe gap grew to >= 16 steps
    assert sum(p.k for p in plans) / len(plans) < 0.1


def test_where_no_acceptance_could_pay_probes_are_rare():
    """Verifying a second token costs 1.7x a one-token step (measured in fp32 on this project's CPU): even
    a draft accepted half the time never pays, so after its first plain steps the request probes only every
    HOPELESS_PROBE_GAP steps, accepted probes or not. With cheap verification the same draft drafts."""
    from serving.controller import HOPELESS_PROBE_GAP

    rng = random.Random(3)
    dear = costs(target_ms=70.0, draft_ms=10.0, slope=0.7)
    ctrl = controller(prior=0.5, c=dear)
    assert ctrl.hopeless() and not controller(c=costs()).hopeless()
    plans = run(ctrl, accept_p=0.5, steps=200, rng=rng)
    drafting = [i for i, p in enumerate(plans) if p.k > 0]
    assert all(plans[i].probe and plans[i].k == 1 for i in drafting)
    assert len(drafting) <= 200 / HOPELESS_PROBE_GAP + 1, drafting
    cheap = run(controller(prior=0.5), accept_p=0.5, steps=200, rng=rng)
    assert sum(p.k > 0 for p in cheap) > 150


def test_hopeless_costs_are_probed_across_short_requests_and_recover():
    """A cold replica measured a dear verification once (a new shape's first pass): a probe looks too dear to
    come more often than every ~90 plain steps (`affordable_gap`). Requests shorter than that still probe,
    the gap counted over the replica's plain steps, and once the probes measure the true (cheap) costs the
    next requests draft again. Before, each request counted its own plain steps, so 60-step requests never
    probed and the replica never drafted again."""

    rng = random.Random(5)
    c = CostModel(weight=0.3)
    for n in (1, 2, 3, 4, 5):
        c.observe_target(n, 0.030 if n == 1 else 0.080)    # 1 token warm, every longer pass cold
    c.observe_draft("chain", 1, 0.003)
    priors = ReplicaPriors(prior=0.5)
    probes = []
    for r in range(20):                                     # 20 requests of 60 steps
        ctrl = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True)
        for _ in range(60):
            plan = ctrl.plan()
            if plan.k:
                probes.append((r, plan.probe))
                # what a warm pass over 1 + k tokens costs on this machine: the measurement the probe brings
                c.observe_target(1 + plan.k, 0.030 * (1 + 0.03 * plan.k))
                c.observe_draft("chain", plan.k, 0.003 * plan.k)
            n = 0
            while n < plan.k and rng.random() < 0.7:
                n += 1
            ctrl.observe(plan, n)
    assert probes and probes[0][1]                          # the first drafting step was a probe ...
    assert 1 <= probes[0][0] <= 3                           # ... within a few requests, though each is < the gap
    late = [p for p in probes if p[0] >= 15]
    assert len(late) > 100 and not all(is_probe for _, is_probe in late)   # drafting for real again
    # a frozen cost model (a seeded request's) never changes: it keeps to its own per-request count
    frozen = CostModel.frozen({"target": {"1": 1.0, "2": 2.5, "3": 3.0, "4": 3.5, "5": 4.0},
                               "draft": {"chain": 0.1}, "overhead": {}, "digest": "x"})
    ctrl = RequestController(gamma=4, costs=frozen, priors=ReplicaPriors(prior=0.5), version="v1", greedy=True)
    assert ctrl.hopeless() and sum(ctrl.plan().k for _ in range(100)) == 0


def test_a_seeded_request_probes_only_where_its_remaining_probes_could_make_drafting_pay():
    """A seeded request (frozen costs) learns from its own steps only. Where one verified draft token costs
    1.7x a step (fp32 on a 2-core AVX2 CPU), a 64-token request has room for one probe at most, and even an
    accepted one would not make drafting pay: it does not probe. A long request could collect enough
    accepted probes, and probes; so does a short one where verification is cheap."""
    def frozen(verify_2, verify_more):
        c = CostModel(weight=1.0)
        c.observe_target(1, 1.0)
        for n in range(2, 6):
            c.observe_target(n, verify_2 if n == 2 else verify_more)
        c.observe_draft("chain", 1, 0.1)
        from serving.controller import cost_profile
        return CostModel.frozen(cost_profile(c))

    def probes(costs, max_tokens):
        ctrl = RequestController(gamma=4, costs=costs, priors=ReplicaPriors(prior=0.2), version="v1",
                                 greedy=False, max_tokens=max_tokens)      # a prior at which nothing is drafted
        out = []
        for _ in range(max_tokens):
            plan = ctrl.plan()
            ctrl.observe(plan, plan.k)                      # every proposed token accepted
            out.append(plan.probe)
        return sum(out)

    dear, cheap = frozen(1.7, 2.0), frozen(1.05, 1.12)
    assert probes(dear, 64) == 0
    assert probes(dear, 2000) >= 1
    assert probes(cheap, 64) >= 1
    # the replica's own (unseeded) requests keep probing: their evidence serves the requests after them
    shared = RequestController(gamma=4, costs=CostModel(), priors=ReplicaPriors(prior=0.5), version="v1",
                               greedy=False, max_tokens=64)
    for n in range(1, 6):
        shared.costs.observe_target(n, 1.0 if n == 1 else 1.7)
    shared.costs.observe_draft("chain", 1, 0.1)
    assert any(shared.plan().probe for _ in range(200))


def test_probes_stay_within_their_time_budget():
    """A probe costs c + slope more than a plain step: probes are spaced to cost at most PROBE_BUDGET of the
    time (cheap verification: about every 7 steps; a second token at 0.6 of a step: about every 35)."""
    from serving.controller import PROBE_BUDGET

    for slope, low, high in ((0.03, 7, 7), (0.6, 35, 36)):
        ctrl = controller(prior=0.5, c=costs(target_ms=30.0, draft_ms=3.0, slope=slope))
        gap = ctrl.affordable_gap()
        assert low <= gap <= high, (slope, gap)
        extra = (3.0 + 30.0 * slope) / 30.0
        assert extra / gap <= PROBE_BUDGET + 1e-9
        plans = run(ctrl, accept_p=0.0, steps=400, rng=random.Random(4))
        probes = [i for i, p in enumerate(plans) if p.probe]
        assert all(b - a >= gap for a, b in zip(probes, probes[1:])), (slope, probes)   # a probe per gap steps


def test_rejected_probes_back_off_only_as_far_as_their_cost_warrants():
    """A rejected probe doubles the gap; where a probe costs most of a step it backs off to max_probe_gap (32),
    where it costs a few percent of a step (a one-token Medusa tree when verification is nearly free, with no
    draft to catch up) only to where probes cost 0.5% of the time, so a request stopped by a bad stretch
    finds out within its own tokens when drafting pays again."""
    from serving.controller import PROBE_BUDGET

    def gaps(c, catches_up=True):
        ctrl = RequestController(gamma=3, costs=c, priors=ReplicaPriors(prior=0.05), version="v1", greedy=True,
                                 catches_up=catches_up)
        run(ctrl, accept_p=0.0, steps=600, rng=random.Random(3))
        return ctrl.probe_gap, ctrl

    dear, ctrl = gaps(costs(target_ms=30.0, draft_ms=3.0, slope=0.2))
    assert dear == ctrl.max_probe_gap == 32
    cheap = costs(target_ms=30.0, draft_ms=0.3, slope=0.01)
    cheap._catch_up = 0.003                        # a draft model's catch-up: 10% of a step per skipped token
    gap, ctrl = gaps(cheap, catches_up=False)      # ... which heads never pay
    d = (ctrl.step_s(1) - ctrl.step_s(0)) / ctrl.step_s(0)
    assert gap == ctrl._cheap_probe_gap() < 32 and d / gap <= PROBE_BUDGET / 4 + 1e-9
    assert gaps(cheap, catches_up=True)[0] >= 32   # with the catch-up priced in, probes are dear again


def test_recovers_when_the_draft_starts_to_pay():
    rng = random.Random(1)
    ctrl = controller(prior=0.5)
    run(ctrl, accept_p=0.0, steps=100, rng=rng)
    plans = run(ctrl, accept_p=0.9, steps=150, rng=rng)
    late = plans[-50:]
    assert sum(p.k for p in late) / len(late) >= 3        # back to long drafts
    assert not any(p.probe for p in late)


def test_never_exceeds_gamma():
    rng = random.Random(2)
    for gamma in (1, 2, 5):
        ctrl = controller(gamma=gamma, c=costs(draft_ms=0.1, slope=0.0), prior=0.99)
        plans = run(ctrl, accept_p=1.0, steps=50, rng=rng, ngram_len=16)
        assert max(p.k for p in plans) == gamma
        assert all(0 <= p.k <= gamma for p in plans)


def test_ngram_chosen_only_when_it_pays_more():
    rng = random.Random(3)
    # a draft accepted 30% of the time vs an n-gram proposer accepted 95%: the lookup wins (it is free)
    ctrl = controller(prior=0.3, use_ngram=True)
    plans = []
    for _ in range(120):
        plan = ctrl.plan(4)
        p = 0.95 if plan.proposer == "ngram" else 0.3
        n = 0
        while n < plan.k and rng.random() < p:
            n += 1
        ctrl.observe(plan, n)
        plans.append(plan)
    assert sum(p.proposer == "ngram" for p in plans[-40:]) >= 35
    # no lookup match: the controller falls back to the draft (or a plain step), never to n-gram
    assert ctrl.plan(0).proposer in ("draft", "none")


def test_replica_prior_carries_acceptance_to_new_requests():
    priors = ReplicaPriors(prior=0.5)
    c = costs()
    rng = random.Random(4)
    first = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True)
    run(first, accept_p=0.0, steps=60, rng=rng)
    second = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True)
    assert second.plan().k == 0                           # learnt from the first request's traffic
    fresh = RequestController(gamma=4, costs=c, priors=priors, version="v2", greedy=True)
    assert fresh.plan().k > 0                             # a new draft version starts from the default prior


def test_a_categorys_prior_is_its_own_and_starts_from_the_pooled_one():
    """Labelled traffic keeps a prior per category: one category whose trees are accepted deep does not make
    another's new requests draft deep, and a category never seen starts from the pooled figures."""
    priors = ReplicaPriors(prior=0.5)
    c = costs()
    for _ in range(60):
        priors.update("v1", "chain", True, 4, 4, category="sql")       # deep: every token accepted
        priors.update("v1", "chain", True, 4, 0, category="chat")      # the first token rejected
    sql = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True, category="sql")
    chat = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True, category="chat")
    new = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True, category="new")
    pooled = RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=True)
    assert sql.curve("draft")[0] > 0.85 and chat.curve("draft")[0] < 0.15
    assert sql.plan().k == 4 and chat.plan().k == 0
    assert new.curve("draft") == pytest.approx(pooled.curve("draft"))    # no traffic of its own: the pooled prior
    assert 0.3 < pooled.curve("draft")[0] < 0.7
    assert new.evidence["draft"] == pooled.evidence["draft"] == 120      # the pooled traffic stands behind it
    # a category's own traffic outweighs the pooled prior after a few steps: 8 rejected steps move a new
    # category's first-depth acceptance most of the way
    for _ in range(8):
        priors.update("v1", "chain", True, 4, 0, category="new")
    assert priors.curve("v1", "chain", True, 4, category="new")[0] < 0.6 * pooled.curve("draft")[0]


def test_acceptance_estimate_and_cost_model_basics():
    est = AcceptanceEstimate(prior=0.5, strength=2.0, decay=1.0)
    est.update(4, 4)          # 4 successes, no failure
    est.update(4, 1)          # 1 success, 1 failure
    assert est.alpha == pytest.approx((5 + 1) / (5 + 1 + 2))
    c = CostModel(weight=0.5)
    assert c.target_s(3) == pytest.approx(1.06)              # prior, relative units
    c.observe_target(1, 0.02)
    c.observe_target(1, 0.04)
    assert c.target_s(1) == pytest.approx(0.03)
    assert c.target_s(5) == pytest.approx(0.03 * 1.12)        # extrapolated with the prior slope
    assert c.draft_token_s("ngram") == 0.0
    # a controller that always drafts never measures a one-token pass: the line through what it measured
    # gives that cost (here 30 ms + 5 ms per extra token)
    line = CostModel(weight=1.0)
    for n in (2, 3, 4, 5):
        line.observe_target(n, 0.030 + 0.005 * (n - 1))
    assert line.target_s(1) == pytest.approx(0.030)
    assert line.target_s(8) == pytest.approx(0.065)
    with pytest.raises(ValueError):
        controller(gamma=0)


# ---------------------------------------------------------------------------- the engine with the controller
def test_a_lone_stall_cannot_make_a_size_look_dear_but_a_real_change_moves_the_cost(monkeypatch):
    """A stall (one 4-token pass at 7x its cost) enters clipped to SPIKE_RATIO x the estimate, so 4- and
    5-token steps stay about as cheap as the measured neighbours say and a good draft still drafts 4 tokens;
    without the clip the one sample put 4- and 5-token passes at 1.6x a plain step and the plan fell to 2. A
    lasting change (plain steps 1.5x slower) still reaches the estimate."""
    import serving.controller as controller_module

    clip, load_share = controller_module.SPIKE_RATIO, controller_module.LOAD_SHARE

    def measured(spike_ratio: float, load_share: float = 0.0) -> CostModel:
        # per-size means alone (LOAD_SHARE 0), as before the load factor: the clip is what protects them
        monkeypatch.setattr(controller_module, "SPIKE_RATIO", spike_ratio)
        monkeypatch.setattr(controller_module, "LOAD_SHARE", load_share)
        c = CostModel(weight=0.1)
        for n in range(1, 6):
            for _ in range(20):
                c.observe_target(n, 0.070)
        c.observe_draft("chain", 1, 0.008)
        c.observe_target(4, 0.500)                             # one stall
        return c

    plan = lambda c: best_k(0.8, 4, lambda k: c.step_s("chain", k))[0]   # noqa: E731
    raw = measured(float("inf"))
    assert raw.target_s(5) / raw.target_s(1) > 1.6 and plan(raw) == 2
    c = measured(clip)
    assert c.target_s(4) <= 0.070 * (1 + 0.1 * (clip - 1)) + 1e-9
    assert c.target_s(5) == pytest.approx(c.target_s(4))       # more tokens never cheaper: the floor follows 4
    assert plan(c) == 4
    for _ in range(40):
        c.observe_target(1, 0.105)                             # a lasting 1.5x slowdown of plain steps
    assert c.target_s(1) == pytest.approx(0.105, rel=0.02)
    # with the load factor (the default), the clipped stall leaves the plan as it was too
    shared = measured(clip, load_share=load_share)
    assert shared.target_s(5) / shared.target_s(1) < 1.12 and plan(shared) == 4


def test_a_lasting_slowdown_seen_at_one_size_moves_every_size_alike(monkeypatch):
    """A distillation job starts beside serving: every pass gets 1.3x slower, but only the size the controller
    keeps choosing (here 4 tokens) is timed. With per-size means alone the plain step kept its idle cost and
    the other stale sizes looked 1.3x cheaper than the timed one, and the plan moved to them; with the load factor
    the relative costs hold, and so does the idle plan. A size's first timings still settle its own cost:
    a cold first pass corrected by the next ones leaves the load alone."""
    import serving.controller as controller_module

    default_share = controller_module.LOAD_SHARE

    def run(load_share: float, loaded: int = 0) -> CostModel:
        monkeypatch.setattr(controller_module, "LOAD_SHARE", load_share)
        c = CostModel(weight=0.1)
        for _ in range(controller_module.WARM_OBSERVATIONS + 5):       # idle, every size warm
            for n in range(1, 6):
                c.observe_target(n, 0.050 * (1 + 0.06 * (n - 1)))
        for _ in range(30 if loaded else 0):                         # idle traffic: the plan's size
            c.observe_target(loaded, 0.050 * (1 + 0.06 * (loaded - 1)))
        c.observe_draft("chain", 1, 0.004)
        for _ in range(60 if loaded else 0):                         # loaded: only the chosen size is timed
            c.observe_target(loaded, 1.3 * 0.050 * (1 + 0.06 * (loaded - 1)))
        return c

    plan = lambda c: best_k(0.5, 4, lambda k: c.step_s("chain", k), 0.05)[0]   # noqa: E731
    idle = plan(run(default_share))
    n = idle + 1                                                     # the size the idle plan verifies
    idle_ratio = 1 + 0.06 * (n - 1)
    per_size, shared = run(0.0, loaded=n), run(default_share, loaded=n)
    assert per_size.target_s(n) / per_size.target_s(1) == pytest.approx(1.3 * idle_ratio, rel=0.01)
    assert shared.target_s(n) / shared.target_s(1) < 1.3 ** (1 - default_share) * idle_ratio * 1.001
    assert shared.target_s(n) == pytest.approx(per_size.target_s(n), rel=0.01)   # the timed size: the same estimate
    assert shared.load == pytest.approx(1.3 ** default_share, rel=0.05)
    assert idle >= 1 and plan(shared) == idle and plan(per_size) != idle     # per size: the stale sizes look cheap
    assert shared.snapshot()["load"] == shared.load and shared.snapshot()["target_s"][1] == shared.target_s(1)
    # a new size: its first timings are its own (a cold 3x first pass, then warm ones), the load does not move
    cold = CostModel(weight=0.3)
    for _ in range(controller_module.WARM_OBSERVATIONS):
        cold.observe_target(1, 0.050)
    cold.observe_target(6, 0.150)
    for _ in range(controller_module.WARM_OBSERVATIONS - 1):
        cold.observe_target(6, 0.055)
    assert cold.load == 1.0 and cold.target_s(6) < 0.085 and cold.target_s(1) == pytest.approx(0.050)



def tree_run(c: CostModel, truth: dict, steps: int, accept_p: float, rng: random.Random, gamma: int = 2) -> list:
    """Requests of 64 steps on a (2,1,1)-like tree (3, 5, 7 tokens verified at depth 1, 2, 3) on the replica's
    cost model `c`, each step timed at its `truth` cost as the served path times it; returns the plans."""
    return depth_run(c, truth, steps, [accept_p] * gamma, rng, gamma, prior=accept_p)[0]


def test_a_deeper_size_priced_too_dear_is_re_timed_and_then_chosen(monkeypatch):
    """A calibration that ran beside start-up priced the deeper tree too dear (5 tokens at 1.5x a one-token step,
    truly 1.1x): a controller that times only what it chooses kept drafting one level deep for good (the nineteenth
    session's run 4; without depth probes this run never drafts two deep). Now a stale deeper size is re-timed now
    and then, its first timings averaged with the seed, and the plan moves deeper; where the deeper size truly is
    dear it stays unchosen and its re-timings stay rare."""
    import serving.controller as cm

    truth = {1: 0.020, 3: 0.021, 5: 0.022}

    def wrong_calibration() -> CostModel:
        c = CostModel(weight=0.1)
        for n, dear in ((1, 0.020), (3, 0.021), (5, 0.032)):
            c.observe_target_if_unmeasured(n, dear)
        return c

    c = wrong_calibration()
    assert c.stale(5) and c.stale(3), "a calibration's seed is not a timing by traffic"
    first = tree_run(c, truth, 64, 0.7, random.Random(0))
    assert max(p.k for p in first[:8]) == 1, "the wrong prices keep the first steps one level deep"
    plans = first + tree_run(c, truth, 1500, 0.7, random.Random(1))
    assert c.target_s(5) == pytest.approx(truth[5], rel=0.15)
    late = plans[-500:]
    assert sum(p.k == 2 for p in late) > 0.9 * len(late), [p.k for p in late][:40]
    with monkeypatch.context() as m:                     # the same run without depth probes stays one level deep
        m.setattr(cm, "DEPTH_PROBE_MIN_GAP", 10 ** 9)
        off = wrong_calibration()
        assert max(p.k for p in tree_run(off, truth, 1564, 0.7, random.Random(1))) == 1
        assert off.target_s(5) == pytest.approx(0.032)
    # where the deeper tree truly is dear, it stays dear and is seldom tried
    dear = {1: 0.020, 3: 0.021, 5: 0.036}
    d = CostModel(weight=0.1)
    for n, t in dear.items():
        d.observe_target_if_unmeasured(n, t)
    plans = tree_run(d, dear, 3000, 0.7, random.Random(2))
    assert sum(p.k > 1 for p in plans) <= 3000 / cm.STALE_TIMINGS + 2, sum(p.k > 1 for p in plans)
    assert d.snapshot()["depth_probes"] == sum(p.k > 1 for p in plans) >= 1
    assert d.target_s(5) == pytest.approx(dear[5], rel=0.05)


def depth_run(c: CostModel, truth: dict, steps: int, accept: list, rng: random.Random, gamma: int = 3,
              prior: float = 0.5):
    """`tree_run` with a different acceptance at each depth (`accept[d - 1]`, given the earlier tokens were
    accepted); returns (plans, tokens emitted, seconds at the `truth` costs)."""
    priors, plans, ctrl, tokens, seconds = ReplicaPriors(prior=prior), [], None, 0, 0.0
    for i in range(steps):
        if i % 64 == 0:
            ctrl = RequestController(gamma=gamma, costs=c, priors=priors, version="v1", greedy=True,
                                     catches_up=False, verify_tokens=lambda k: 2 * k + 1)
        plan = ctrl.plan(0)
        n = 0
        while n < plan.k and rng.random() < accept[n]:
            n += 1
        t = truth[ctrl.verified(plan.k)]
        c.observe_target(ctrl.verified(plan.k), t)
        ctrl.observe(plan, n)
        plans.append(plan)
        tokens, seconds = tokens + n + 1, seconds + t
    return plans, tokens, seconds


def test_a_tree_whose_later_depths_are_seldom_accepted_drafts_one_deep(monkeypatch):
    """Medusa heads accept the tree's first token far more often than later ones (0.6, then 0.1). One alpha for
    every depth, fitted to such steps (about 0.4-0.6), prices the two- and three-deep trees as paying on a tree
    whose deeper levels cost 10% and 20% more (the twentieth session's traffic mix drafted 2-3 deep for few more
    accepted tokens; here 39% of the steps go two deep, each losing 5%). Per-depth estimates keep to the one-deep
    tree, and the run emits more tokens a second."""
    import serving.controller as cm

    truth = {1: 0.020, 3: 0.020, 5: 0.022, 7: 0.024}
    accept = [0.6, 0.1, 0.1]

    def fresh() -> CostModel:
        c = CostModel(weight=0.1)
        for n, t in truth.items():
            c.observe_target_if_unmeasured(n, t)
        return c

    plans, tokens, seconds = depth_run(fresh(), truth, 1500, accept, random.Random(0))
    late = plans[-1000:]
    assert sum(p.k == 1 for p in late) > 0.85 * len(late), [p.k for p in late][:60]
    with monkeypatch.context() as m:                     # one alpha for every depth: deeper trees for nothing
        m.setattr(cm, "DEPTH_STRENGTH", 1e12)
        one, tokens1, seconds1 = depth_run(fresh(), truth, 1500, accept, random.Random(0))
    assert sum(p.k >= 2 for p in one[-1000:]) > 0.3 * 1000
    assert tokens / seconds > 1.01 * tokens1 / seconds1
    # where the later depths are accepted as often as the first, the curve still drafts deep
    deep, _, _ = depth_run(fresh(), truth, 1500, [0.8, 0.8, 0.8], random.Random(3))
    assert sum(p.k == 3 for p in deep[-1000:]) > 0.85 * 1000


def test_a_stale_calibrated_size_neither_floors_nor_undercuts_sizes_traffic_times():
    """The twentieth session's loaded calibration priced a 2-token pass at 1.5x a one-token step. A Medusa tree
    never verifies 2 tokens, so traffic never timed it again, and as more tokens never cost less it floored the
    3-, 5- and 7-node trees at 1.5x while traffic timed them at 1.1x: 57% of steps drafted nothing. The fresher
    timing now wins either way; with no traffic timings at all the floor holds as before."""
    c = CostModel(weight=0.1)
    for n, t in {1: 0.020, 2: 0.030, 3: 0.023, 5: 0.024, 7: 0.025}.items():
        c.observe_target_if_unmeasured(n, t)
    assert c.target_s(3) == pytest.approx(0.030) and c.target_s(7) == pytest.approx(0.030), "no traffic: the floor"
    for _ in range(5):
        for n, t in {1: 0.020, 3: 0.022, 5: 0.022, 7: 0.023}.items():
            c.observe_target(n, t)
    assert c.stale(2) and not c.stale(3)
    assert c.target_s(3) == pytest.approx(0.022, rel=0.02) and c.target_s(7) == pytest.approx(0.023, rel=0.02)
    assert c.target_s(2) == pytest.approx(c.target_s(3)), "a stale size is no dearer than a fresh larger one"
    assert c.target_s(4) == pytest.approx(0.022, rel=0.02)      # between fresh neighbours
    c.observe_target(2, 0.021)          # timed by traffic again: fresh, the mean of its seed and this timing,
    assert not c.stale(2) and c.target_s(2) < 0.027                   # and among fresh sizes the floor holds
    assert c.target_s(3) == pytest.approx(c.target_s(2))


def test_a_frozen_cost_model_never_re_times_a_deeper_size():
    """A seeded sampled request plans on the frozen profile: its plan, and so its output, must not follow anything
    else, so it never drafts deeper than its plan to re-time a size."""
    c = costs(slope=0.2)
    frozen = CostModel.frozen({"target": {n: c.target_s(n) for n in range(1, 18)}, "draft": {"chain": 0.003},
                               "overhead": {}})
    ctrl = RequestController(gamma=4, costs=frozen, priors=ReplicaPriors(prior=0.6), version="v1", greedy=False)
    ks = [ctrl.plan(0).k for _ in range(400)]
    assert 0 < ks[0] < 4 and set(ks) == {ks[0]} and frozen.depth_probes == 0
    seeded = CostModel()
    for n in range(1, 18):
        seeded.observe_target_if_unmeasured(n, c.target_s(n))
    seeded.observe_draft("chain", 1, 0.003)
    live = RequestController(gamma=4, costs=seeded, priors=ReplicaPriors(prior=0.6), version="v1", greedy=False)
    assert max(live.plan(0).k for _ in range(400)) == ks[0] + 1, "the same plan on live, never-timed costs re-times"


import numpy as np   # noqa: E402
import torch   # noqa: E402
from scipy import stats as scipy_stats   # noqa: E402

from tests import tiny_models   # noqa: E402
from serving import engine as engine_module   # noqa: E402
from serving.config import ADAPTIVE_MODES, NGRAM_SWITCH_MODES, SamplingParams, SpecParams   # noqa: E402
from serving.controller import Plan   # noqa: E402
from serving.engine import Engine   # noqa: E402
from tests.tiny_models import ListSink   # noqa: E402

def test_without_evidence_a_request_drafts_only_where_drafting_pays_pessimistically():
    """A request whose prior has seen no traffic (a seeded request; a new draft version) starts drafting only
    if drafting pays at alpha - CAUTION_Z standard errors: where verification is dear (fp32 on a CPU) it
    waits for its probes' evidence, where it is cheap it starts as before, with k from the point estimate;
    the same prior backed by traffic drafts at once."""
    from serving.controller import CAUTION_Z

    def profile(slope: float, draft: float) -> CostModel:
        c = CostModel(weight=1.0)
        for n in (1, 5):
            c.observe_target(n, 0.1 * (1 + slope * (n - 1)))
        c.observe_draft("beams", 1, 0.1 * draft)
        c.observe_overhead(True, 0.1 * 0.0625)
        c.observe_overhead(False, 0.1 * 0.031)
        return c

    def ctrl(c: CostModel, priors: ReplicaPriors) -> RequestController:
        return RequestController(gamma=4, costs=c, priors=priors, version="v1", greedy=False, draft_key="beams")

    dear, cheap = profile(0.17, 0.21), profile(0.0, 0.15)
    step = lambda c: (lambda k: c.step_s("beams", k))   # noqa: E731
    assert best_k(0.5, 4, step(dear), 0.05)[0] > 0                         # the point estimate alone drafts
    assert best_k(0.5 - CAUTION_Z * (0.25 / 2) ** 0.5, 4, step(dear), 0.05)[0] == 0
    assert ctrl(dear, ReplicaPriors()).plan().k == 0
    backed = ReplicaPriors()
    for _ in range(10):
        backed.update("v1", "beams", False, proposed=2, accepted=1)         # alpha stays 0.5, with evidence
    assert backed.alpha("v1", "beams", False) == pytest.approx(0.5) and ctrl(dear, backed).plan().k > 0
    assert ctrl(cheap, ReplicaPriors()).plan().k == best_k(0.5, 4, step(cheap), 0.05)[0] > 0
    # a good draft still gets going where verification is dear: its probes bring the evidence
    plans = run(ctrl(dear, ReplicaPriors()), accept_p=0.9, steps=120, rng=random.Random(3))
    assert plans[0].k == 0 and sum(p.k > 0 for p in plans[-40:]) >= 30


PROMPT = "abc abc abd the cat sat on the mat the cat"   # repeats: the n-gram lookup finds matches
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("ctrl"))


def make_engine(target, draft, **kw):
    return Engine.from_paths(str(target), str(draft), dtype=torch.float32, device="cpu", **kw)


@pytest.fixture(scope="module")
def engines(pair):
    """The module's engines, without a suffix store: one that learned every earlier test's answers would offer the
    n-gram proposer whole answers, and the controller would take it instead of the draft these tests observe (the
    store's own test sets one)."""
    target, draft = pair
    made = {"random": make_engine(target, draft, draft_version="v1"),
            "same": make_engine(target, target, draft_version="same")}
    for eng in made.values():
        eng.suffix_store = None
    return made


def sampled_requests(eng, prompt, n, spec, chunk=50):
    """n seeded requests (seeds 0..n-1) at T=1 for 2 tokens, sent `chunk` at a time so the batch scheduler
    runs them together (the served path; each request keeps its own generator, so draws stay independent)."""
    from tests.serving.test_batching import run_concurrently

    out = []
    for lo in range(0, n, chunk):
        jobs = [(prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=2, seed=i), spec)
                for i in range(lo, min(n, lo + chunk))]
        out += run_concurrently(eng, jobs)
    return out


def reference_greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[-1] == tiny_models.EOS_ID:
                break
    return seq[len(prompt):]


def random_plans(monkeypatch, seed: int):
    """Replace the controller's choice by a random plan every step (k in 0..gamma, the draft, the n-gram
    lookup or nothing): whatever the controller decides, the output must stay exact."""
    rng = random.Random(seed)

    def plan(self, ngram_available=0, ngram_source="ngram"):
        proposer = rng.choice(["draft", "none"] + (["ngram"] if ngram_available else []))
        if proposer == "none":
            return Plan("none", 0)
        top = self.gamma if proposer == "draft" else min(self.gamma, ngram_available)
        return Plan(proposer, rng.randint(1, top), source=ngram_source)

    monkeypatch.setattr(engine_module.RequestController, "plan", plan)


@pytest.mark.parametrize("mode", ADAPTIVE_MODES)
@pytest.mark.parametrize("plans", ["controller", "random"])
def test_adaptive_greedy_equals_target_greedy(engines, monkeypatch, mode, plans):
    if plans == "random":
        random_plans(monkeypatch, seed=len(mode))
    for name, eng in engines.items():
        prompt = eng.tokenizer(PROMPT)["input_ids"]
        expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
        extra = {"kl_budget": 0.0} if mode == "mentored" else {}     # D = 0: exact at T = 0
        res = eng.generate_all(prompt, GREEDY, SpecParams(mode=mode, gamma=4, beams=3, extra=extra))
        assert res.token_ids == expected, (name, mode, plans)
        st = res.stats
        assert st.adaptive and st.draft_tokens <= 4 * st.steps
        assert sum(st.accepted_per_position) == st.accepted_tokens
        if plans == "random":
            assert st.zero_draft_steps > 0 and (st.ngram_steps > 0) == (mode in NGRAM_SWITCH_MODES)


@pytest.mark.parametrize("mode", NGRAM_SWITCH_MODES)
def test_the_ngram_switch_proposes_from_the_suffix_store(engines, monkeypatch, mode):
    """Where the context proposes nothing, the chain modes' deterministic proposer takes the suffix store's
    continuation (serving/engine.py `ngram_tokens`): T=0 output stays target greedy whether the store is empty,
    holds a wrong continuation or the right one (random plans: whatever is offered gets used), and with the right
    one stored the lookup is offered, and taken, at many more steps."""
    from serving.decoding.suffix import SuffixStore

    eng = engines["random"]
    prompt = eng.tokenizer("zz top zq")["input_ids"]
    expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    monkeypatch.setattr(eng, "suffix_learn", False)
    stats = {}
    for name, answer in (("empty", []), ("wrong", [(t + 7) % 200 for t in expected]), ("right", expected)):
        store = SuffixStore()
        if answer:
            store.add(prompt, answer)
        monkeypatch.setattr(eng, "suffix_store", store)
        random_plans(monkeypatch, seed=11)
        res = eng.generate_all(prompt, GREEDY, SpecParams(mode=mode, gamma=4, beams=3))
        assert res.token_ids == expected, (mode, name)
        stats[name] = res.stats
    assert stats["right"].ngram_steps > stats["empty"].ngram_steps + 2, {k: v.ngram_steps for k, v in stats.items()}
    assert stats["empty"].store_steps == 0 < stats["right"].store_steps <= stats["right"].ngram_steps
    gaps = [t for t in range(1, len(expected) - 1) if not eng.ngram_tokens(prompt + expected[:t], 4)]
    assert gaps and all(eng.ngram_tokens(prompt + expected[:t], 4, store=store)[:1] == expected[t: t + 1]
                        for t in gaps)
    # the store's proposals are named as such, so that the controller prices them apart from the lookup's
    assert all(eng.proposal(prompt + expected[:t], 4, store=store)[1] == "store" for t in gaps)
    looked_up = [t for t in range(1, len(expected) - 1) if t not in gaps]
    assert all(eng.proposal(prompt + expected[:t], 4, store=store)[1] == "ngram" for t in looked_up)
    assert eng.proposal(prompt + expected[:gaps[0]], 4) == ([], "ngram")      # no store: nothing proposed


def test_the_prompt_lookup_and_the_suffix_store_are_priced_apart():
    """The chain modes' deterministic proposer is the prompt lookup where it matches and the suffix store
    elsewhere; each has its own acceptance estimate (Plan.source). A lookup accepted 0.7 of the time beside a
    store accepted 0.03 of the time, over a replica's requests: the lookup's proposals keep being taken and the
    store's only as probes, one in `offer_gap` of its offers. One estimate for both (what the controller had,
    `merged`) priced the store at the mixture and took every one of its proposals (the forty-fifth session's
    science requests). When the store turns good, its probes bring it back."""
    def replay(merged: bool, store_p, requests: int = 8) -> list[tuple[int, int]]:
        rng = random.Random(5)
        pri = ReplicaPriors(prior=0.5)
        c = costs(target_ms=57.0, draft_ms=5.0, slope=0.08)
        out = []
        for r in range(requests):
            ctrl = RequestController(gamma=4, costs=c, priors=pri, version="v1", greedy=True, use_ngram=True)
            taken = probes = 0
            for step in range(64):
                source = "ngram" if step % 2 == 0 else "store"
                plan = ctrl.plan(4, "ngram" if merged else source)
                p = {"ngram": 0.7, "store": store_p(r)}[source] if plan.proposer == "ngram" else 0.0   # no draft
                a = 0
                while a < plan.k and rng.random() < p:
                    a += 1
                ctrl.observe(plan, a)
                if plan.proposer == "ngram":
                    assert plan.estimate_key == plan.source == ("ngram" if merged else source)
                    assert plan.k == 1 or not plan.probe
                    taken += source == "store"
                    probes += source == "store" and plan.probe
            out.append((taken, probes))
        if not merged:
            assert pri.alpha("v1", "ngram", True) > 0.5
        return out

    bad = lambda r: 0.03
    split = replay(False, bad)                      # (store offers taken, of them probes) per request, of 32
    assert all(taken - probes <= 4 and probes <= 32 / ctrl_gap() + 1 for taken, probes in split[4:]), split
    assert all(taken == 32 for taken, _ in replay(True, bad)[4:])
    back = replay(False, lambda r: 0.03 if r < 4 else 0.8, requests=10)
    assert all(taken >= 28 for taken, _ in back[-3:]), back      # the probes found it good again
    assert Plan("draft", 2).estimate_key == "draft" and Plan("ngram", 2, source="store").estimate_key == "store"


def ctrl_gap() -> int:
    """offer_gap of the costs in test_the_prompt_lookup_and_the_suffix_store_are_priced_apart."""
    return RequestController(gamma=4, costs=costs(target_ms=57.0, draft_ms=5.0, slope=0.08), priors=ReplicaPriors(),
                             version="v1", greedy=True, use_ngram=True).offer_gap()


def test_fixed_gamma_when_adaptive_is_off(engines):
    eng = engines["random"]
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    st = eng.generate_all(prompt, GREEDY, SpecParams(mode="speculative", gamma=3, adaptive=False)).stats
    assert not st.adaptive and st.zero_draft_steps == 0 and st.ngram_steps == 0
    assert st.draft_tokens == 3 * st.steps


def test_a_hopeless_draft_stops_drafting(engines, monkeypatch):
    """The random draft is almost never accepted: after a few steps the controller drafts nothing but
    probes, and later requests start from the replica's learnt prior."""
    eng = engines["random"]
    fixed = costs()                        # the costs of a real pair (c = 0.1), not the tiny models' timing noise
    fixed.observe_target = fixed.observe_draft = lambda *a: None
    monkeypatch.setattr(eng, "costs", fixed)
    monkeypatch.setattr(eng, "priors", ReplicaPriors())
    prompt = eng.tokenizer("zz top zq")["input_ids"]
    sampling = SamplingParams(temperature=0.0, max_tokens=60)
    spec = SpecParams(mode="speculative", gamma=4)
    eng.generate_all(prompt, sampling, spec)
    st = eng.generate_all(prompt, sampling, spec).stats
    draft_model_steps = st.steps - st.zero_draft_steps - st.ngram_steps
    assert draft_model_steps <= 0.3 * st.steps, st


def test_a_labelled_request_teaches_its_categorys_prior(engines, monkeypatch):
    """The request's traffic label (metadata.category, the engine's `source`) reaches its controller: its steps
    count in its category's replica prior and in the pooled one, and an unlabelled request's only in the pooled."""
    eng = engines["same"]                  # the draft is the target: every request drafts
    fixed = costs()
    fixed.observe_target = fixed.observe_draft = lambda *a: None
    monkeypatch.setattr(eng, "costs", fixed)
    priors = ReplicaPriors()
    monkeypatch.setattr(eng, "priors", priors)
    prompt = eng.tokenizer("zz top zq")["input_ids"]
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    spec = SpecParams(mode="speculative", gamma=4)
    st = eng.generate_all(prompt, sampling, spec, source="sql").stats
    drafted = st.steps - st.zero_draft_steps - st.ngram_steps
    assert drafted > 0
    pooled = priors.observations(st.draft_version, "chain", True)
    assert pooled == drafted
    assert priors.observations(st.draft_version, "chain", True, category="sql") == 2 * drafted
    assert priors.observations(st.draft_version, "chain", True, category="chat") == drafted   # pooled alone
    eng.generate_all(prompt, sampling, spec)
    assert priors.observations(st.draft_version, "chain", True) > pooled
    assert priors.observations(st.draft_version, "chain", True, category="sql") - \
        priors.observations(st.draft_version, "chain", True) == drafted


def joint_second_token(model, prompt, sampling):
    """Exact distribution of the 2nd generated token under the warped target, summed over the first;
    the last bin is 'stopped after one token' (the first token was EOS)."""
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1].float(), sampling).exp()          # [V]
        V = p1.shape[0]
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2 = warp(model(seqs).logits[:, -1].float(), sampling).exp()                              # [V, V]
    go = torch.ones(V)
    go[tiny_models.EOS_ID] = 0.0
    return np.append(((p1 * go)[:, None] * p2).sum(0).numpy(), float(p1[tiny_models.EOS_ID]))


def warp(logits, sampling):
    from serving.decoding.warp import warp_logprobs

    return warp_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)


@pytest.mark.slow
def test_speculative_sampling_stays_exact_under_any_plan(engines, monkeypatch):
    """Chi-square: the 2nd token of speculative sampling with random controller plans (k = 0..gamma,
    draft / n-gram / none) against its exact target distribution; negative control: the same test rejects
    the draft's own distribution. 2,000 samples; bins with expected count >= 5 (tail merged); the
    threshold p > 1e-4 makes a false failure a 1-in-10,000 event for a correct engine."""
    random_plans(monkeypatch, seed=11)
    eng = engines["random"]
    prompt = eng.tokenizer("the cat sat")["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=2)
    n = 2000
    counts = np.zeros(len(eng.tokenizer) + 1)
    for res in sampled_requests(eng, prompt, n, SpecParams(mode="speculative", gamma=3)):
        out = res.token_ids
        counts[out[1] if len(out) > 1 else -1] += 1

    def pvalue(p):
        exp = p * n
        big = exp >= 5
        obs = np.append(counts[big], counts[~big].sum())
        ex = np.append(exp[big], exp[~big].sum())
        keep = ex > 0
        return scipy_stats.chisquare(obs[keep], ex[keep] * obs[keep].sum() / ex[keep].sum()).pvalue

    assert pvalue(joint_second_token(eng.target.model, prompt, sampling)) > 1e-4
    assert pvalue(joint_second_token(eng.draft.model, prompt, sampling)) < 1e-4


def test_steps_that_draft_nothing_are_recorded(pair, monkeypatch):
    random_plans(monkeypatch, seed=5)
    target, draft = pair
    sink = ListSink()
    eng = make_engine(target, draft, draft_version="v9", sink=sink, record_top_k=5)
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    res = eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=3),
                           SpecParams(mode="speculative", gamma=3), request_id="r1")
    seq = sink.seqs[0].token_ids
    assert list(seq) == prompt + res.token_ids
    algos = {r.algorithm for r in sink.steps}
    assert algos <= {"speculative", "ngram", "target"} and "target" in algos
    assert len(sink.steps) == res.stats.steps
    for rec in sink.steps:
        g, k = len(rec.draft_tokens), rec.num_accepted
        assert rec.target_topk_ids.shape == (g + 1, 5)
        assert rec.draft_version == ("v9" if rec.algorithm == "speculative" else "none")
        got = list(seq[rec.position: rec.position + k + 1])
        want = list(rec.draft_tokens[:k]) + [rec.next_token]
        assert got[: len(want)] == want[: len(got)]


# ---------------------------------------------------------------------------- one draft length for a batch
def _costs(target_per_token=0.001, target_fixed=0.04, draft_fwd=0.01):
    from serving.controller import CostModel

    c = CostModel()
    for n in (1, 2, 4, 8, 16, 32, 40):
        c.observe_target(n, target_fixed + target_per_token * n)
    for rows in (1, 8, 64):
        c.observe_draft_forward(rows, 1, draft_fwd * (1 + rows / 32))
    return c


def test_plan_batch_drafts_only_when_the_whole_batch_gains():
    from serving.controller import RowOption, expected_tokens, plan_batch

    row = lambda a, rows=1: RowOption(alpha_draft=a, draft_rows=rows, alpha_ngram=None, ngram_available=0, gamma=4)
    cheap = _costs()
    plans = plan_batch([row(0.8)] * 8, cheap)
    assert {p.proposer for p in plans} == {"draft"} and len({p.k for p in plans}) == 1 and plans[0].k >= 2
    # the same rows with a weak draft: a plain batched step is the better buy
    assert all(p.k == 0 for p in plan_batch([row(0.15)] * 8, cheap))
    # beams make the draft forward 8x wider: the batch drafts less than with chains
    k_chain = plan_batch([row(0.6)] * 8, _costs(draft_fwd=0.02))[0].k
    k_beams = plan_batch([row(0.6, rows=8)] * 8, _costs(draft_fwd=0.02))[0].k
    assert k_beams <= k_chain
    # the chosen K maximises the batch's predicted rate (recomputed here)
    c = _costs(draft_fwd=0.02)
    rates = [sum(expected_tokens(0.6, K) for _ in range(8))
             / (c.target_s(8 * (K + 1)) + (K * c.draft_forward_s(8) if K else 0.0)) for K in range(5)]
    best = max(range(5), key=lambda K: rates[K])
    if rates[best] >= rates[0] * 1.05:
        assert k_chain == best


def test_plan_batch_uses_the_ngram_lookup_where_it_beats_the_draft_and_respects_gamma():
    from serving.controller import RowOption, plan_batch

    rows = [RowOption(alpha_draft=0.3, draft_rows=1, alpha_ngram=0.9, ngram_available=4, gamma=4),
            RowOption(alpha_draft=0.8, draft_rows=1, alpha_ngram=None, ngram_available=0, gamma=2),
            RowOption(alpha_draft=None, draft_rows=1, alpha_ngram=None, ngram_available=0, gamma=4)]
    plans = plan_batch(rows, _costs())
    assert plans[0].proposer == "ngram" and plans[0].k >= 1
    assert plans[1].proposer == "draft" and 1 <= plans[1].k <= 2
    assert plans[2].proposer == "none" and plans[2].k == 0


# ---------------------------------------------------------------------------- the draft-confidence stop
def always_draft(monkeypatch, k: int):
    """Every step plans the draft model at k tokens, so only the confidence stop can shorten a chain."""
    monkeypatch.setattr(engine_module.RequestController, "plan", lambda self, *offer: Plan("draft", k))


@pytest.mark.parametrize("mode", ["speculative", "mjsd"])
def test_confidence_stop_shortens_chains_and_keeps_greedy_exact(engines, monkeypatch, mode):
    """Threshold above 1: every chain ends after its first token; 0: never; a middle threshold (the median
    confidence of this draft) ends some chains early. Every output equals target greedy."""
    always_draft(monkeypatch, 4)
    eng = engines["same"]
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    with torch.no_grad():
        conf = torch.softmax(eng.draft.model(torch.tensor([prompt + expected])).logits[0].float(), -1).max(-1).values
    drafted = {}
    for threshold in (1.01, float(conf.median()), 0.0):
        monkeypatch.setattr(eng, "stop_confidence", threshold)
        res = eng.generate_all(prompt, GREEDY, SpecParams(mode=mode, gamma=4, beams=3))
        assert res.token_ids == expected, threshold
        st = res.stats
        drafted[threshold] = st.draft_tokens / st.steps
        assert sum(st.accepted_per_position) == st.accepted_tokens <= st.draft_tokens
    low, mid, high = drafted[0.0], drafted[float(conf.median())], drafted[1.01]
    assert high == 1.0                       # stopped after the first token, every step
    assert low > 3.0                         # never stopped (the last step may be cut by max_tokens)
    assert high < mid < low, drafted


def test_controller_learns_from_the_tokens_actually_proposed():
    ctrl = controller(gamma=4, prior=0.5)
    ctrl.observe(Plan("draft", 4), accepted=1, proposed=1)      # a chain stopped after one token, accepted
    est = ctrl._estimate("draft")
    assert est.accepted == 1.0 and est.rejected == 0.0
    ctrl.observe(Plan("draft", 4), accepted=0, proposed=2)
    assert est.rejected == 1.0
    ctrl.observe(Plan("draft", 4), accepted=0, proposed=0)      # nothing proposed: no evidence
    assert est.observations == 2


@pytest.mark.slow
def test_speculative_sampling_stays_exact_with_the_confidence_stop(engines, monkeypatch):
    """Chi-square, as above, with chains ending on the draft's doubt at the median confidence of this draft
    after the prompt's one-token continuations: whether the second token is drafted depends on the first
    draft sample, and the 2nd emitted token must still follow the target exactly."""
    always_draft(monkeypatch, 3)
    eng = engines["random"]
    prompt = eng.tokenizer("the cat sat")["input_ids"]
    V = len(eng.tokenizer)
    with torch.no_grad():
        conf = torch.softmax(eng.draft.model(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].float(),
                             -1).max(-1).values
    monkeypatch.setattr(eng, "stop_confidence", float(conf.median()))
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=2)
    n = 2000
    counts = np.zeros(V + 1)
    lengths = set()
    for res in sampled_requests(eng, prompt, n, SpecParams(mode="speculative", gamma=3)):
        out = res.token_ids
        lengths.add(res.stats.draft_tokens)
        counts[out[1] if len(out) > 1 else -1] += 1
    assert len(lengths) > 1                   # the stop did cut some chains and not others
    p = joint_second_token(eng.target.model, prompt, sampling)
    exp = p * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    assert scipy_stats.chisquare(obs[keep], ex[keep] * obs[keep].sum() / ex[keep].sum()).pvalue > 1e-4


def test_a_seeded_greedy_request_uses_the_replicas_costs_a_seeded_sampled_one_the_frozen_profile(engines,
                                                                                              monkeypatch):
    """A seed must reproduce a sampled output, so a seeded T > 0 request plans from the replica's frozen cost
    profile (Engine.calibrate), never from its live costs or other traffic's acceptance; at T=0 the output
    is the target's greedy whatever the plan, so a seeded greedy request plans with the replica's measured
    costs and recent acceptance, like an unseeded one (the OpenAI client's seed no longer turns the
    controller blind)."""
    eng = engines["same"]
    seen = []
    real_submit = eng.scheduler.submit

    def submit(req):
        seen.append(req)
        real_submit(req)

    monkeypatch.setattr(eng.scheduler, "submit", submit)
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    results = [eng.generate_all(prompt, sampling, SpecParams(mode="speculative", gamma=4))
               for sampling in (SamplingParams(temperature=0.0, max_tokens=4, seed=1),
                                SamplingParams(temperature=0.0, max_tokens=4),
                                SamplingParams(temperature=1.0, max_tokens=4, seed=1))]
    greedy_seeded, greedy, sampled_seeded = [r.controller for r in seen if r.controller is not None]
    assert greedy_seeded.costs is eng.costs and greedy_seeded.priors is eng.priors
    assert greedy.costs is eng.costs
    assert sampled_seeded.costs is not eng.costs and sampled_seeded.priors is not eng.priors
    profile = eng.seeded_profile
    assert profile is not None and sampled_seeded.costs.frozen_profile == profile
    assert results[2].stats.cost_profile == profile["digest"] and results[0].stats.cost_profile == ""
    # the calibration's own requests are fixed-gamma, unrecorded, and teach a cost model of their own
    eng.calibrate(force=True)
    calib = [r for r in seen if r.id.startswith("calibration-")]
    assert {r.spec.mode for r in calib} == {"target", "speculative", "mjsd"}
    assert calib and all(r.controller is None and r.sink is None and r.costs is not eng.costs for r in calib)


def test_probes_pay_for_the_drafts_catch_up_too():
    """A probe after g plain steps also makes the draft catch up on the g tokens it skipped: where that is
    dear the gap grows until probe + catch-up stay within PROBE_BUDGET, and where catching up alone costs more
    than the budget per token probes come only every HOPELESS_PROBE_GAP steps."""
    from serving.controller import HOPELESS_PROBE_GAP, PROBE_BUDGET

    base = controller(prior=0.5, c=costs(target_ms=30.0, draft_ms=3.0, slope=0.6))
    c = costs(target_ms=30.0, draft_ms=3.0, slope=0.6)
    c.observe_draft_forward(1, 1, 0.003)
    c.observe_catch_up(41, 0.003 + 40 * 0.0003)           # 0.3 ms a skipped token beyond a one-token forward
    assert c.catch_up_token_s() == pytest.approx(0.0003)
    ctrl = controller(prior=0.5, c=c)
    gap = ctrl.affordable_gap()
    assert gap > base.affordable_gap()
    extra = (3.0 + 30.0 * 0.6) / 30.0                      # the probe's draft token and its verified token
    assert (extra + gap * 0.3 / 30.0) / gap <= PROBE_BUDGET + 1e-9
    assert (extra + (gap - 1) * 0.3 / 30.0) / (gap - 1) > PROBE_BUDGET          # the fewest such steps
    plans = run(ctrl, accept_p=0.0, steps=500, rng=random.Random(5))
    probes = [i for i, p in enumerate(plans) if p.probe]
    assert probes and all(b - a >= gap for a, b in zip(probes, probes[1:]))
    c2 = costs(target_ms=30.0, draft_ms=3.0, slope=0.6)
    c2.observe_draft_forward(1, 1, 0.003)
    c2.observe_catch_up(11, 0.003 + 10 * 0.001)            # catching up alone costs more than the budget
    assert controller(prior=0.5, c=c2).affordable_gap() == HOPELESS_PROBE_GAP


def test_catch_up_cost_enters_the_profile_and_is_frozen_with_it():
    from serving.controller import cost_profile

    c = CostModel(weight=1.0)
    c.observe_target(1, 0.1)
    c.observe_draft_forward(1, 1, 0.01)
    assert cost_profile(c).get("catch_up") is None and c.catch_up_token_s() == 0.0   # nothing measured yet
    c.observe_catch_up(1, 5.0)                             # one token is no catch-up: ignored
    assert c.catch_up_token_s() == 0.0
    c.observe_catch_up(21, 0.01 + 20 * 0.002)
    prof = cost_profile(c)
    assert prof["catch_up"] == pytest.approx(0.02, rel=0.1)   # per token, relative to a one-token step
    frozen = CostModel.frozen(prof)
    frozen.observe_catch_up(21, 99.0)
    assert frozen.catch_up_token_s() == prof["catch_up"]
    older = {k: v for k, v in prof.items() if k != "catch_up"}   # a profile kept before catch-ups were priced
    assert CostModel.frozen(older).catch_up_token_s() == 0.0
    c.set_catch_up(0.5, if_unmeasured=True)                # traffic measured it: a calibration only seeds
    assert c.catch_up_token_s() == pytest.approx(0.002)
    c.set_catch_up(0.5)
    assert c.catch_up_token_s() == 0.5


def test_cost_profile_is_relative_rounded_and_stable_under_timing_noise():
    from serving.controller import PROFILE_GRID, cost_profile

    g = PROFILE_GRID

    def measured(scale: float, noise: float) -> CostModel:
        """Costs at the grid's points (x a target step of 0.1 s), timed with `noise` either way."""
        c = CostModel(weight=1.0)
        c.observe_target(1, scale * 0.1 * (1 + noise))
        c.observe_target(5, scale * 0.1 * g ** 4 * (1 - noise))
        c.observe_draft("beams", 2, scale * 2 * 0.1 * g ** -3 * (1 + noise))
        c.observe_overhead(True, scale * 0.1 * g ** -13, rows=1)
        c.observe_overhead(False, scale * 0.1 * g ** -18 * (1 - noise), rows=1)
        c.observe_overhead(True, scale * 0.050, rows=4)        # a batch's overhead: not one request's
        c.observe_target(40, 1.0)                              # beyond any gamma: left out
        return c

    assert cost_profile(CostModel()) is None                   # nothing measured: the prior applies
    a, b = cost_profile(measured(1.0, 0.0)), cost_profile(measured(3.0, 0.04))
    assert a == b                                              # another speed, 4% noise: the same profile
    assert a["target"] == {"1": 1.0, "5": pytest.approx(2.0, rel=1e-5)}
    assert a["draft"] == {"beams": pytest.approx(g ** -3, rel=1e-5)}
    assert cost_profile(measured(1.0, 0.0)) == a
    assert set(a["overhead"]) == {"draft", "plain"}
    frozen = CostModel.frozen(a)
    frozen.observe_target(1, 99.0)
    frozen.observe_draft("beams", 1, 99.0)
    assert frozen.target_s(1) == 1.0 and frozen.draft_token_s("beams") == a["draft"]["beams"]
    assert frozen.target_s(3) == pytest.approx(1.5, rel=1e-5)   # between measured sizes: the line from one to the next
    assert frozen.overhead_s(True) == a["overhead"]["draft"]
    assert cost_profile(measured(1.0, 0.3))["digest"] != a["digest"]


def test_a_seeded_sampled_request_follows_the_profile_and_reproduces_its_output(engines, monkeypatch):
    """Where the replica measured that verification is dear (a second verified token costing 2x a step), a
    seeded T > 0 request drafts (almost) nothing, whatever the prior ratio would say; where drafting is
    cheap it drafts. And its output with one seed is the same before and after the live costs change."""
    from serving.controller import cost_profile

    eng = engines["same"]
    eng.calibrate()
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=30, seed=7)
    spec = SpecParams(mode="speculative", gamma=4)

    def profile(verify_slope: float, draft_ratio: float) -> dict:
        c = CostModel(weight=1.0)
        for n in (1, 5):
            c.observe_target(n, 0.1 * (1 + verify_slope * (n - 1)))
        c.observe_draft("chain", 1, 0.1 * draft_ratio)
        return cost_profile(c)

    monkeypatch.setattr(eng, "seeded_profile", profile(verify_slope=1.0, draft_ratio=0.1))
    dear = eng.generate_all(prompt, sampling, spec).stats
    assert dear.steps - dear.zero_draft_steps <= 1, dear          # one probe at most
    monkeypatch.setattr(eng, "seeded_profile", profile(verify_slope=0.01, draft_ratio=0.01))
    cheap = eng.generate_all(prompt, sampling, spec)
    assert cheap.stats.draft_tokens > 0 and cheap.stats.cost_profile != dear.cost_profile
    monkeypatch.setattr(eng, "costs", CostModel())
    for n in range(1, 6):                                         # live timings change; the seed's output doesn't
        eng.costs.observe_target(n, 5.0 * n)
    again = eng.generate_all(prompt, sampling, spec)
    assert again.token_ids == cheap.token_ids and again.stats.cost_profile == cheap.stats.cost_profile


def test_costs_between_measured_sizes_follow_their_neighbours_not_one_line():
    """fp32 on a 2-core AVX2 CPU (docs/benchmarks.md, twelfth session): 2 verified tokens cost 1.65x a
    one-token pass and 3..5 about 2x. One line through sizes 1 and 5 called 2 tokens 1.17x, so requests
    drafted single tokens that cost 1.7x and ran 4-10% slower than target-only."""
    c = CostModel(weight=1.0)
    c.observe_target(1, 1.0)
    c.observe_target(5, 1.7)
    assert c.target_s(2) == pytest.approx(1.175)                   # only the two ends known: their line
    c.observe_target(2, 1.65)
    assert c.target_s(3) == pytest.approx(1.65 + 0.05 / 3)        # from 2 to 5, not a line through all three
    c.observe_target(4, 1.6)                                      # timing noise: 4 looks cheaper than 2
    assert c.target_s(3) == pytest.approx(1.65)                   # never below a smaller size's cost
    assert c.target_s(4) == pytest.approx(1.65)                   # measured sizes too
    xs, ys = (1, 2, 4, 5), (1.0, 1.65, 1.6, 1.7)
    mx, my = sum(xs) / 4, sum(ys) / 4
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert c.target_s(9) == pytest.approx(1.7 + slope * 4)        # past the largest: its cost + the fitted slope
    # with these costs a chain of one token at acceptance 0.4 does not pay; the line said it did
    line = CostModel(weight=1.0)
    for n in (1, 5):
        line.observe_target(n, c.target_s(n))
    for m in (c, line):
        m.observe_draft("chain", 1, 0.1)
    gain = lambda m: expected_tokens(0.4, 1) / m.step_s("chain", 1) * m.step_s("chain", 0)
    assert gain(line) > 1.05 and gain(c) < 1.0


def test_the_served_path_measures_what_a_catch_up_costs(pair, monkeypatch):
    """The batch scheduler times the draft forward that catches a request up on the tokens it skipped during
    plain steps and teaches the replica's cost model its per-token price; steady steps teach it nothing."""
    target, draft = pair
    eng = make_engine(target, target)
    prompt = eng.tokenizer(PROMPT)["input_ids"]
    sampling, spec = SamplingParams(temperature=0.0, max_tokens=24), SpecParams(mode="speculative", gamma=2)
    seen, real = [], CostModel.observe_catch_up

    def observe(self, tokens, seconds, rows=1):
        seen.append((self, tokens, seconds))
        real(self, tokens, seconds, rows)

    monkeypatch.setattr(CostModel, "observe_catch_up", observe)
    monkeypatch.setattr(engine_module.RequestController, "plan", lambda self, *offer: Plan("draft", 2))
    eng.generate_all(prompt, sampling, spec)                   # drafts every step: no catch-up
    assert seen == []
    steps = iter(range(10 ** 6))                               # 7 plain steps, then one that drafts, ...
    monkeypatch.setattr(engine_module.RequestController, "plan",
                        lambda self, *offer: Plan("draft", 2) if next(steps) % 8 == 7 else Plan("none", 0))
    eng.generate_all(prompt, sampling, spec)
    assert seen and all(m is eng.costs and n >= 7 and t > 0 for m, n, t in seen)
    # a tiny model's catch-up may cost no more than a one-token forward: the price is >= 0, never negative
    assert eng.costs.catch_up_token_s() >= 0.0 and eng.costs.snapshot()["catch_up_token_s"] is not None


def test_calibration_times_every_verified_size_and_seeds_the_live_costs(pair, monkeypatch):
    """Engine.calibrate times target passes of 1..CALIBRATION_SIZES tokens directly (a BatchKV row, the
    engine lock held): the profile has every size a default request verifies, and the replica's live
    cost model starts from them where traffic has measured nothing yet."""
    from serving import engine as engine_mod

    target, draft = pair
    eng = make_engine(target, draft)
    eng.costs.observe_target(1, 123.0)                            # traffic measured this size: it stays
    prof = eng.calibrate()
    assert prof is not None and set(prof["target"]) == {str(n) for n in range(1, engine_mod.CALIBRATION_SIZES + 1)}
    assert prof["target"]["1"] == 1.0 and all(v > 0 for v in prof["target"].values())
    snap = eng.costs.snapshot()["target_s"]
    assert snap[1] == 123.0 and set(snap) >= set(range(1, engine_mod.CALIBRATION_SIZES + 1))
    # the draft's catch-up over skipped tokens is timed too, for the profile and the live costs
    assert prof["catch_up"] >= 0.0 and eng.costs.snapshot()["catch_up_token_s"] is not None
    # the timed passes leave nothing behind them: a short prompt's calibration still fits the context
    seen = []
    real = engine_mod.BatchKV.feed

    def feed(self, blocks, keep):
        seen.append(max(len(b) for b in blocks))
        return real(self, blocks, keep)

    monkeypatch.setattr(engine_mod.BatchKV, "feed", feed)
    sizes = eng._time_target_sizes([1, 2, 3])
    assert sorted(sizes) == list(range(1, engine_mod.CALIBRATION_SIZES + 1))
    assert seen.count(engine_mod.CALIBRATION_SIZES) == engine_mod.CALIBRATION_REPEATS + 1


def test_confidence_replay_matches_greedy_speculative_decoding_by_hand():
    """scripts/bench_confidence.py's replay: one example of 6 answer positions, the draft agreeing on all but
    position 2 and doubting position 1."""
    import numpy as np

    from scripts.bench_confidence import simulate

    agree = np.array([1, 1, 0, 1, 1, 1], dtype=bool)
    conf = np.array([0.9, 0.3, 0.9, 0.9, 0.9, 0.9])
    ex = np.zeros(6, dtype=int)
    # fixed k=4, no stop: step 1 drafts 0..3, accepts 2, emits 3 (pos -> 3); step 2 drafts 3..5, accepts 3,
    # emits min(4, 3) = 3: 6 tokens, 7 drafted, 5 accepted
    r = simulate(conf, agree, ex, max_k=4, threshold=0.0, c=0.0, slope=0.0)
    assert r["acceptance"] == pytest.approx(5 / 7) and r["speedup"] == pytest.approx(6 / 2)
    # stop below 0.5: step 1 ends after position 1 (2 drafted, both accepted, emits 3: pos -> 3)
    s = simulate(conf, agree, ex, max_k=4, threshold=0.5, c=0.1, slope=0.0)
    assert s["acceptance"] == pytest.approx(5 / 5)
    assert s["speedup"] == pytest.approx(6 / (5 * 0.1 + 2))


def test_a_kept_profile_is_shared_by_the_next_start_and_a_damaged_one_is_measured_again(pair, tmp_path,
                                                                                         monkeypatch):
    """Rounding cannot keep a ratio that sits on a grid boundary from flipping between two measurements, so
    a replica keeps its profile in `profile_dir`: the next start (and every other replica of the machine)
    reads it instead of measuring, and plans seeded requests alike."""
    target, draft = pair
    first, second = make_engine(target, draft), make_engine(target, draft)
    first.profile_dir = second.profile_dir = tmp_path
    prof = first.calibrate()
    assert prof is not None and len(list(tmp_path.glob("profile-*.json"))) == 1
    measured = []
    monkeypatch.setattr(second, "generate_all", lambda *a, **k: measured.append(a))
    assert second.calibrate() == prof and measured == []          # read, not measured
    # a profile measured under another few-row product policy (serving/models.py skinny_policy) is not this one's
    sig = first._draft_signature()
    served = first._profile_path(sig)
    monkeypatch.setenv("DRAFTSMITH_SKINNY_LINEAR", "1")
    assert first._profile_path(sig) != served
    monkeypatch.delenv("DRAFTSMITH_SKINNY_LINEAR")
    assert first._profile_path(sig) == served
    (path,) = tmp_path.glob("profile-*.json")
    path.write_text("{not json")
    third = make_engine(target, draft)
    third.profile_dir = tmp_path
    again = third.calibrate()                                     # measured again, and the file replaced
    assert again is not None and json.loads(path.read_text())["digest"] == again["digest"]
    assert not list(tmp_path.glob("*.tmp"))


def test_load_share_env_override(monkeypatch, caplog):
    """DRAFTSMITH_LOAD_SHARE sets the load share (0: per-size means alone); a value outside [0, 1) or not a
    number is a warning and the default stays."""
    from serving.controller import _load_share_from_env

    monkeypatch.delenv("DRAFTSMITH_LOAD_SHARE", raising=False)
    assert _load_share_from_env(0.9) == 0.9
    monkeypatch.setenv("DRAFTSMITH_LOAD_SHARE", "0")
    assert _load_share_from_env(0.9) == 0.0
    for bad in ("1", "-0.1", "half"):
        monkeypatch.setenv("DRAFTSMITH_LOAD_SHARE", bad)
        with caplog.at_level("WARNING"):
            assert _load_share_from_env(0.9) == 0.9
        assert f"DRAFTSMITH_LOAD_SHARE={bad!r}" in caplog.text
