"""The served default's measured choice between the Medusa heads and the draft (serving/mode_choice.py): the
bandit's rules on given figures, then a replica over real HTTP routing unseeded requests that name no mode by what
it measured, and leaving seeded and named requests on the static default."""
from __future__ import annotations

import random

import httpx
import pytest

from serving.config import SamplingParams
from serving.mode_choice import (EXPLORE_FLOOR, EXPLORE_GAP, MAX_LABELS, MIN_OBSERVATIONS, MIN_TOKENS, STEADY,
                                 WINDOW, ModeChooser, explore_share)
from tests.api_helpers import LiveServer
from tests.serving.test_medusa_mode import _Contended, _service, heads_dir, pair  # noqa: F401 - fixtures

C = ("medusa", "mjsd")


def fig(rate, n: int, *, ever: int | None = None) -> dict:
    """A candidate's /health figures: its rate, the observations in its window, and those ever counted."""
    return {"tokens_per_s": rate, "observations": n, "observed_ever": n if ever is None else ever}


def feed(ch: ModeChooser, mode: str, rate: float, n: int, *, t: float = 0.0, label: str = "") -> None:
    for _ in range(n):
        assert ch.observe(mode, t, label, 32, 32 / rate)


def test_warm_up_alternates_then_the_faster_candidate_takes_the_requests():
    ch = ModeChooser(C, explore=0.0)
    seen = []
    for _ in range(2 * MIN_OBSERVATIONS):
        mode, why = ch.choose(0.0)
        assert why == "warmup"
        seen.append(mode)
        feed(ch, mode, 10.0 if mode == "medusa" else 20.0, 1)
    assert seen == ["medusa", "mjsd"] * MIN_OBSERVATIONS              # the least observed first, heads on a tie
    assert [ch.choose(0.0) for _ in range(5)] == [("mjsd", "fastest")] * 5
    snap = ch.snapshot()
    assert snap["greedy"]["mjsd"] == fig(20.0, MIN_OBSERVATIONS)
    assert snap["chosen"] == {"warmup": 2 * MIN_OBSERVATIONS, "fastest": 5, "explore": 0}
    # T > 0 is its own bucket: it warms up on its own
    assert ch.choose(0.7) == ("medusa", "warmup")


def test_concurrent_requests_alternate_while_warming_up():
    # 2 x MIN_OBSERVATIONS requests start before any ends (clients in parallel): each candidate gets half of them,
    # not the heads all of them because neither has been observed yet
    ch = ModeChooser(C, explore=0.0)
    picks = [ch.choose(0.0) for _ in range(2 * MIN_OBSERVATIONS)]
    assert [m for m, _ in picks] == ["medusa", "mjsd"] * MIN_OBSERVATIONS
    assert all(why == "warmup" for _, why in picks)
    for m, _ in picks:                          # they end, the draft's twice as fast
        feed(ch, m, 10.0 if m == "medusa" else 20.0, 1)
    assert ch.choose(0.0) == ("mjsd", "fastest")
    # a routed request that does not count (shorter than MIN_TOKENS) leaves its candidate short: warm-up goes on
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 10.0, MIN_OBSERVATIONS)
    assert ch.choose(0.0) == ("mjsd", "warmup")
    assert not ch.observe("mjsd", 0.0, "", MIN_TOKENS - 1, 0.1)
    assert ch.choose(0.0) == ("mjsd", "warmup")


def test_a_replicas_chooser_leaves_out_each_candidates_cold_first_request():
    ch = ModeChooser(C, explore=0.0, discard_cold=True)
    assert not ch.observe("mjsd", 0.0, "", 64, 64 / 7.7)          # the replica's first request on the draft
    assert not ch.observe("medusa", 0.7, "", 64, 64 / 5.0)        # and on the heads (any bucket)
    assert ch.snapshot()["chosen"] == {"warmup": 0, "fastest": 0, "explore": 0} and "greedy" not in ch.snapshot()
    feed(ch, "mjsd", 20.0, MIN_OBSERVATIONS)                      # every later one counts
    feed(ch, "medusa", 15.0, MIN_OBSERVATIONS)
    assert ch.choose(0.0) == ("mjsd", "fastest")
    assert ch.snapshot()["greedy"]["mjsd"] == fig(20.0, MIN_OBSERVATIONS)


def _explored(ch: ModeChooser, n: int = 4000) -> float:
    picks = [ch.choose(0.0) for _ in range(n)]
    explored = [m for m, why in picks if why == "explore"]
    assert all(m == "mjsd" for m in explored) and all(m == "medusa" for m, why in picks if why == "fastest")
    return len(explored) / n


@pytest.mark.parametrize("loser, share", [(28.5, 0.25 * (1 - 0.05 / EXPLORE_GAP)),     # 5% slower: near the full share
                                          (24.0, 0.25 * (1 - 0.2 / EXPLORE_GAP)),      # 20% slower: half of it
                                          (15.0, 0.25 * EXPLORE_FLOOR)])               # half the speed: the floor
def test_the_explore_share_to_the_slower_candidate_shrinks_with_its_gap(loser, share):
    assert explore_share(0.25, loser, 30.0) == pytest.approx(share)
    ch = ModeChooser(C, explore=0.25, rng=random.Random(7))
    feed(ch, "medusa", 30.0, MIN_OBSERVATIONS)
    feed(ch, "mjsd", loser, STEADY)
    assert share - 0.025 < _explored(ch) < share + 0.025


def test_a_loser_measured_on_few_requests_keeps_the_full_share():
    """A loser's figures from the warm-up alone (a new version's cautious first requests) do not shrink its share:
    it gets EXPLORE until it has STEADY observations where the choice is decided, then the share its gap gives."""
    ch = ModeChooser(C, explore=0.25, rng=random.Random(5))
    feed(ch, "mjsd", 30.0, WINDOW)
    feed(ch, "medusa", 15.0, MIN_OBSERVATIONS)                     # half the speed, on 4 requests
    share = _explored_by(ch, "medusa")
    assert 0.225 < share < 0.275
    feed(ch, "medusa", 15.0, STEADY - MIN_OBSERVATIONS)            # steady now: the floor
    assert 0.25 * EXPLORE_FLOOR - 0.02 < _explored_by(ch, "medusa") < 0.25 * EXPLORE_FLOOR + 0.02


def _explored_by(ch: ModeChooser, loser: str, n: int = 4000) -> float:
    picks = [ch.choose(0.0) for _ in range(n)]
    assert all(m == loser for m, why in picks if why == "explore")
    return sum(why == "explore" for _, why in picks) / n


def test_explore_shares_of_several_losers_follow_their_gaps():
    # the nearest loser's share is the total, split in proportion to each loser's own share
    ch = ModeChooser(("medusa", "mjsd", "eagle"), explore=0.2, rng=random.Random(3))
    for mode, rate in (("medusa", 30.0), ("mjsd", 30.0 * (1 - EXPLORE_GAP / 2)), ("eagle", 10.0)):
        feed(ch, mode, rate, STEADY)
    picks = [ch.choose(0.0) for _ in range(6000)]
    counts = {m: sum(1 for p, why in picks if p == m and why == "explore") for m in ("mjsd", "eagle", "medusa")}
    assert counts["medusa"] == 0
    total = 0.2 * 0.5                                   # mjsd's share: half the base at half of EXPLORE_GAP
    assert total - 0.02 < (counts["mjsd"] + counts["eagle"]) / len(picks) < total + 0.02
    assert 0.2 < counts["eagle"] / counts["mjsd"] < 0.6     # eagle's weight 0.2 x base against mjsd's 0.5 x base


def test_a_label_decides_by_its_own_figures_once_it_has_them():
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 10.0, 2 * MIN_OBSERVATIONS, label="maths")
    feed(ch, "mjsd", 20.0, 2 * MIN_OBSERVATIONS, label="maths")
    feed(ch, "medusa", 30.0, MIN_OBSERVATIONS, label="code")
    feed(ch, "mjsd", 15.0, MIN_OBSERVATIONS - 1, label="code")
    # pooled: medusa (8 x 10 + 4 x 30 tok/s, token-weighted) against mjsd (8 x 20 + 3 x 15)
    pool = ch.snapshot()["greedy"]
    assert pool["medusa"]["observations"] == 3 * MIN_OBSERVATIONS
    assert ch.choose(0.0, "maths")[0] == "mjsd"                         # the label's own figures
    best_pool = max(C, key=lambda m: pool[m]["tokens_per_s"])
    assert ch.choose(0.0, "code")[0] == best_pool                      # too few for code's mjsd: the pool decides
    assert ch.choose(0.0, "never-seen")[0] == best_pool
    feed(ch, "mjsd", 15.0, 1, label="code")
    assert ch.choose(0.0, "code")[0] == "medusa"                        # now code's own figures decide


def test_the_rate_follows_the_latest_window():
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 10.0, WINDOW)
    feed(ch, "mjsd", 20.0, WINDOW)
    assert ch.choose(0.0)[0] == "mjsd"
    feed(ch, "medusa", 40.0, WINDOW)               # heads promoted online: a window of the new speed decides
    assert ch.choose(0.0)[0] == "medusa"
    assert ch.snapshot()["greedy"]["medusa"] == fig(40.0, WINDOW, ever=2 * WINDOW)


def test_what_is_not_counted_and_bad_settings():
    ch = ModeChooser(C)
    assert not ch.observe("target", 0.0, "", 64, 1.0)                 # not a candidate
    assert not ch.observe("medusa", 0.0, "", MIN_TOKENS - 1, 1.0)     # prefill-dominated
    assert not ch.observe("medusa", 0.0, "", 64, 0.0)
    assert ch.observe("medusa", 0.0, "", MIN_TOKENS, 1.0)
    assert ch.snapshot()["greedy"]["medusa"]["observations"] == 1
    for bad in (("medusa",), ("medusa", "medusa")):
        with pytest.raises(ValueError, match="two or more distinct"):
            ModeChooser(bad)
    with pytest.raises(ValueError, match="explore"):
        ModeChooser(C, explore=1.0)
    with pytest.raises(ValueError, match="min_observations"):
        ModeChooser(C, min_observations=0)


def test_a_forgotten_candidate_warms_up_again_and_the_other_keeps_its_figures():
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 10.0, MIN_OBSERVATIONS, label="sql")
    feed(ch, "mjsd", 20.0, MIN_OBSERVATIONS, label="sql")
    feed(ch, "medusa", 10.0, MIN_OBSERVATIONS, t=0.7)
    assert ch.choose(0.0, "sql") == ("mjsd", "fastest")
    assert ch.forget("medusa") and not ch.forget("target")
    snap = ch.snapshot()
    assert snap["remeasured_after_swap"] == {"medusa": 1, "mjsd": 0}
    assert snap["greedy"]["medusa"] == fig(None, 0, ever=MIN_OBSERVATIONS)
    assert snap["sampled"]["medusa"]["tokens_per_s"] is None and snap["greedy"]["mjsd"]["tokens_per_s"] == 20.0
    assert snap["labels"]["greedy"]["sql"]["medusa"]["tokens_per_s"] is None
    # the heads get the requests until they have MIN_OBSERVATIONS new figures; faster now, they win
    for _ in range(MIN_OBSERVATIONS):
        assert ch.choose(0.0, "sql") == ("medusa", "warmup")
        feed(ch, "medusa", 30.0, 1, label="sql")
    assert ch.choose(0.0, "sql") == ("medusa", "fastest")


def test_labels_are_bounded():
    ch = ModeChooser(C)
    for i in range(MAX_LABELS + 10):
        ch.observe("medusa", 0.0, f"label-{i}", 16, 1.0)
    labels = ch.snapshot()["labels"]["greedy"]
    assert len(labels) == MAX_LABELS and "label-0" not in labels and f"label-{MAX_LABELS + 9}" in labels


def test_figures_beside_a_job_are_compared_with_figures_beside_a_job():
    """The fortieth session's online run: the heads won between jobs; a job started and the heads, serving the
    traffic, were measured beside it at half speed, while the draft's figures were from between jobs. Compared
    across states, the draft would win the job's requests; compared within a state, the heads keep them."""
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 30.0, WINDOW, label="sql")
    feed(ch, "mjsd", 20.0, MIN_OBSERVATIONS, label="sql")
    assert ch.choose(0.0, "sql") == ("medusa", "fastest")
    for _ in range(MIN_OBSERVATIONS):                   # a job starts: the heads' requests run beside it
        assert ch.observe("medusa", 0.0, "sql", 32, 32 / 15.0, busy=True)
    assert ch.choose(0.0, "sql", busy=True) == ("medusa", "fastest")   # the draft has no busy figures: quiet decide
    assert ch.choose(0.0, "sql") == ("medusa", "fastest")
    snap = ch.snapshot()
    assert snap["busy"]["labels"]["greedy"]["sql"]["medusa"] == fig(15.0, MIN_OBSERVATIONS)
    assert snap["busy"]["greedy"]["mjsd"]["tokens_per_s"] is None
    assert snap["labels"]["greedy"]["sql"]["medusa"]["tokens_per_s"] == 30.0      # between jobs: unchanged
    # the draft measured beside a job too, faster there than the heads: busy requests go to it, quiet ones not
    feed_busy = [ch.observe("mjsd", 0.0, "sql", 32, 32 / 18.0, busy=True) for _ in range(MIN_OBSERVATIONS)]
    assert all(feed_busy)
    assert ch.choose(0.0, "sql", busy=True) == ("mjsd", "fastest")
    assert ch.choose(0.0, "sql") == ("medusa", "fastest")
    # a label with no figures of its own: the pool of the request's state decides
    assert ch.choose(0.0, "new", busy=True) == ("mjsd", "fastest")
    # forgetting a swapped drafter drops its figures of both states
    ch.forget("mjsd")
    snap = ch.snapshot()
    assert snap["busy"]["greedy"]["mjsd"]["tokens_per_s"] is None and snap["greedy"]["mjsd"]["tokens_per_s"] is None
    assert ch.choose(0.0, "sql", busy=True) == ("mjsd", "warmup")


def test_steps_taken_alone_are_compared_with_steps_taken_alone():
    """The forty-second session's online run: the draft won and its requests stepped in a two-row pass with the
    other client's, while the explored heads stepped alone. Compared on whole requests, the heads' one-row passes
    beat the draft's two-row ones; each request's steps are split by company (tokens by steps, seconds as
    measured) and steps taken alone decide."""
    ch = ModeChooser(C, explore=0.0)
    for _ in range(MIN_OBSERVATIONS):
        # the draft: 64 tokens, 3/4 of its steps shared (48 tokens in 3.0 s), the rest alone (16 tokens in 0.5 s)
        assert ch.observe("mjsd", 0.0, "chat", 64, 3.5, shared_share=0.75, shared_s=3.0)
        assert ch.observe("medusa", 0.0, "chat", 64, 3.2)                 # alone throughout: 20 tok/s
    snap = ch.snapshot()
    assert snap["greedy"]["mjsd"] == fig(pytest.approx(32.0), MIN_OBSERVATIONS)
    assert snap["shared"]["greedy"]["mjsd"] == fig(pytest.approx(16.0), MIN_OBSERVATIONS)
    assert snap["shared"]["greedy"]["medusa"]["tokens_per_s"] is None
    # whole requests: 64 / 3.5 = 18.3 tok/s for the draft against the heads' 20; alone: 32 against 20
    assert ch.choose(0.0, "chat") == ("mjsd", "fastest")
    # shared figures decide where the alone ones cannot (no candidate of a key short of MIN_OBSERVATIONS)
    ch2 = ModeChooser(C, explore=0.0)
    for _ in range(MIN_OBSERVATIONS):
        assert ch2.observe("mjsd", 0.0, "", 64, 4.0, shared_share=1.0, shared_s=4.0)     # 16 tok/s shared
        assert ch2.observe("medusa", 0.0, "", 64, 3.2, shared_share=1.0, shared_s=3.2)   # 20 tok/s shared
    assert ch2.choose(0.0) == ("medusa", "fastest")
    # one request in both companies counts once for the warm-up; a split that disagrees with its time counts
    # the request alone, as measured
    ch3 = ModeChooser(C, explore=0.0)
    assert ch3.observe("mjsd", 0.0, "", 64, 2.0, shared_share=0.5, shared_s=1.0)
    assert ch3.observe("mjsd", 0.0, "", 64, 2.0, shared_share=0.5, shared_s=0.0)      # no shared seconds: alone
    assert ch3.snapshot()["greedy"]["mjsd"]["observations"] == 2 and ch3._seen("greedy", "mjsd") == 2
    assert ch3.snapshot()["shared"]["greedy"]["mjsd"]["observations"] == 1


def test_warm_up_counts_observations_of_either_state():
    ch = ModeChooser(C, explore=0.0)
    feed(ch, "medusa", 10.0, MIN_OBSERVATIONS)
    for _ in range(MIN_OBSERVATIONS - 1):
        assert ch.observe("mjsd", 0.0, "", 32, 32 / 20.0, busy=True)
    assert ch.choose(0.0) == ("mjsd", "warmup")
    assert ch.observe("mjsd", 0.0, "", 32, 32 / 20.0)
    # warmed up, yet each state has a candidate short of MIN_OBSERVATIONS: both states' pool together decides
    assert ch.choose(0.0) == ("mjsd", "fastest") and ch.choose(0.0, busy=True) == ("mjsd", "fastest")


def test_the_choice_leaves_out_the_time_a_request_waited_through_other_requests_passes(pair, heads_dir):  # noqa: F811
    """A heads request beside a draft request waits through the draft's pass at every round, and the other way
    round (serving/scheduler.py `other_steps_s`); the replica's choice measures each at wall time less that wait,
    i.e. as it would run serving the traffic alone."""
    svc = _service(pair[0], draft=str(pair[1]), medusa_heads=str(heads_dir))
    routing = {"temperature": 0.0, "label": "chat"}

    def finished(mode, wall, other):
        svc.record({"mode": mode, "tokens": 64, "wall_time_s": wall, "other_steps_s": other}, 8, "length", wall,
                   None, routing)

    for mode in C:
        finished(mode, 1.0, 0.0)                          # each drafter's cold start: not counted
    finished("medusa", 4.0, 2.0)                          # beside a draft request: half its time was the draft's
    finished("mjsd", 2.5, 0.5)
    figures = svc.health()[1]["auto_choice"]["greedy"]
    assert figures["medusa"]["tokens_per_s"] == pytest.approx(32.0) and figures["mjsd"]["tokens_per_s"] == \
        pytest.approx(32.0)
    # a request that ran mostly while a job beside serving held cores counts apart (`beside_jobs_s`)
    svc.record({"mode": "mjsd", "tokens": 64, "wall_time_s": 4.0, "beside_jobs_s": 3.0}, 8, "length", 4.0, None,
               routing)
    svc.record({"mode": "mjsd", "tokens": 64, "wall_time_s": 2.0, "beside_jobs_s": 0.5}, 8, "length", 2.0, None,
               routing)
    choice = svc.health()[1]["auto_choice"]
    assert choice["busy"]["greedy"]["mjsd"] == fig(pytest.approx(16.0), 1)
    assert choice["greedy"]["mjsd"] == fig(pytest.approx(128 / 4.0), 2)
    # the company of its steps: 3 of 4 steps in its kind's batch (1.5 s of passes) and 0.5 s outside any pass
    # (its prefill), shared by steps: 48 tokens in 1.875 s shared, 16 tokens in 0.625 s alone
    svc.record({"mode": "medusa", "tokens": 64, "wall_time_s": 2.5, "steps": 4, "shared_steps": 3,
                "shared_steps_s": 1.5, "own_steps_s": 2.0}, 8, "length", 2.5, None, routing)
    choice = svc.health()[1]["auto_choice"]
    assert choice["shared"]["greedy"]["medusa"] == fig(pytest.approx(48 / 1.875), 1)
    assert choice["greedy"]["medusa"] == fig(pytest.approx((64 + 16) / (2.0 + 0.625), abs=0.01), 2)
    # the state a request is routed in: whether jobs beside serving hold cores now
    for cores, busy in ((1, True), (0, False)):
        svc.engine.scheduler.contention = _Contended(cores)
        assert svc._beside_jobs() is busy


def test_a_replica_routes_unseeded_default_requests_by_measured_speed(pair, heads_dir):  # noqa: F811
    # no cost calibration at start: its requests would share passes with the first ones (the "shared" figures)
    svc = _service(pair[0], draft=str(pair[1]), medusa_heads=str(heads_dir), calibrate=False)
    srv = LiveServer(svc).start()

    def mode_of(c, **extra) -> str:
        r = c.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 12, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= MIN_TOKENS    # long enough to count
        return r.json()["metrics"]["speculative_decoding"]["mode"]

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").json()["default_mode"] == "medusa"
            # each drafter's first request is its cold start, left out: one more warm-up request each
            assert [mode_of(c) for _ in range(2 * MIN_OBSERVATIONS + 2)] == ["medusa", "mjsd"] * (MIN_OBSERVATIONS + 1)
            choice = c.get("/health").json()["auto_choice"]
            assert {m: choice["greedy"][m]["observations"] for m in C} == {m: MIN_OBSERVATIONS for m in C}
            assert all(choice["greedy"][m]["tokens_per_s"] > 0 for m in C)
            svc.chooser.explore = 0.0
            for _ in range(3):                          # each request goes to the one /health shows faster now
                figures = c.get("/health").json()["auto_choice"]["greedy"]
                assert mode_of(c) == max(C, key=lambda m: figures[m]["tokens_per_s"])
            # seeded and named requests keep the static default and are not counted
            before = c.get("/health").json()["auto_choice"]
            assert mode_of(c, temperature=0.7, seed=3) == "medusa"
            assert mode_of(c, speculative={"gamma": 2}) == "medusa"
            assert mode_of(c, speculative={"mode": "mjsd"}) == "mjsd"
            after = c.get("/health").json()["auto_choice"]
            assert after["chosen"] == before["chosen"] and "sampled" not in after
            # an unseeded sampled request: its own warm-up. Unseeded, the tiny model may sample EOS within a few
            # tokens (CI saw 2): then it is routed but, shorter than MIN_TOKENS, not counted
            r = c.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 12, "temperature": 0.7})
            assert r.status_code == 200, r.text
            assert r.json()["metrics"]["speculative_decoding"]["mode"] == "medusa"
            counted = int(r.json()["usage"]["completion_tokens"] >= MIN_TOKENS)
            # a bucket appears with its first counted request: none when that one was too short
            sampled = c.get("/health").json()["auto_choice"].get("sampled", {})
            seen = {m: sampled.get(m, {}).get("observations", 0) for m in C}
            assert seen == {"medusa": counted, "mjsd": 0}
    finally:
        srv.stop()
    off = _service(pair[0], draft=str(pair[1]), medusa_heads=str(heads_dir), auto_choice=False)
    assert off.chooser is None and off.request_mode(False, SamplingParams(temperature=0.0)) == ("medusa", None)
    assert off.health()[1]["auto_choice"] is None


def test_the_environment_turns_the_choice_off(monkeypatch):
    from serving.service import ServiceSettings, settings_from_env

    assert ServiceSettings().auto_choice is True
    monkeypatch.setenv("DRAFTSMITH_AUTO_CHOICE", "0")
    assert settings_from_env().auto_choice is False
    monkeypatch.setenv("DRAFTSMITH_AUTO_CHOICE", "1")
    assert settings_from_env().auto_choice is True
