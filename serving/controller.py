"""The adaptive speculation controller: how many tokens to draft at each step, and from where.

Speculation pays only when the draft is accepted often enough for its cost. With per-token acceptance
alpha (the chance that the next draft token is accepted, given the earlier ones were), a step that drafts
k tokens emits on average

    E(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)      tokens

(the accepted ones plus the target's own token) and costs

    T(k) = k * draft_s + target_s(k + 1)                                           seconds

where draft_s is the measured draft time per drafted token (per proposer: a chain, MJSD's beams) and
target_s(n) the measured time of a target pass over n new tokens (plus the measured time a step spends
outside the forwards: warping, sampling, the rule). The controller picks, before each step,
the k in 0..gamma (gamma: the request's upper bound) with the largest E / T; k = 0 is a plain target step,
and drafting must promise at least MIN_GAIN (5%) more tokens/s than that plain step.
It may also pick the prompt-lookup (n-gram) proposer, whose proposals cost no draft time, when its own
acceptance makes it the better buy. (The speed-up analysis of Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, with measured instead of assumed costs.)

Where the numbers come from:
- `CostModel` (one per replica): exponentially weighted means of measured step times, by number of tokens
  the target verified and by proposer (a sample clipped to SPIKE_RATIO x the estimate, so one stall does
  not price a size out of the plans that would measure it again); before the first measurement a prior ratio (draft token = 0.1 of a
  target step, +3% per extra verified token). A size not measured is read off its measured neighbours,
  never below a smaller size's cost (the cost is far from linear on a CPU; where a size traffic timed lately and
  one it has not disagree, the fresher wins: `_target_s`); the replica's calibration
  (Engine.calibrate) times every size a default request verifies, so the live model starts from them.
  The machine's load is one factor shared by every cost: a target pass of a warm size that runs slower than
  predicted moves that factor by LOAD_SHARE x (that size's share of the recent timings) of its surprise and its own
  size's cost by the rest, so that when a distillation job
  starts beside serving, the sizes the controller keeps choosing and the ones it seldom measures (a plain
  step, under a draft that is usually accepted) slow down together instead of the seldom-measured ones
  looking cheap (`CostModel.load`).
- `AcceptanceEstimate`: decayed counts of accepted / rejected draft positions (a rejected step is one
  failure; a fully accepted step none), shrunk towards a prior. Each request has one per proposer; its
  prior is the replica's estimate for that (draft version, proposer, greedy or sampled) from recent
  traffic, which every request's steps update too. Beside the single alpha, per-depth counts give a curve of
  conditional acceptances a_1..a_gamma (`AcceptanceEstimate.curve`; a depth without evidence takes the single
  alpha), and plans price E = 1 + a_1 + a_1 a_2 + ... : Medusa heads accept a tree's first token far more often
  than its later ones, which one alpha for all depths hid (it priced deep trees as paying where they did not).
- Caution without evidence: a request whose prior has seen no traffic (a seeded request, whose prior must
  not depend on other requests; a new draft version) drafts only if drafting pays at its estimate minus
  CAUTION_Z standard errors; the number of tokens still follows the point estimate.
- Probing: once a request stops drafting (k = 0) no new evidence arrives, so every `probe_gap` plain steps
  it drafts one token; a probe that is rejected doubles the gap (up to `max_probe_gap`, or where probes would
  cost 0.5% of the time if that comes first: `_cheap_probe_gap`), one that is
  accepted resets it. Where the measured costs say drafting would not pay even at an acceptance of
  HOPELESS_ALPHA (verification of a second token costing nearly a whole step, as in fp32 on a CPU without
  fast small-batch matmuls), the gap goes to HOPELESS_PROBE_GAP at once: such probes only refresh the costs.
  And no gap is shorter than what keeps probes within PROBE_BUDGET (2%) of the time at the measured
  cost of a probe (`affordable_gap`): 10 plain steps where a probe costs 0.2 of a step, 44 where it costs 0.87,
  more where the draft's catch-up over the skipped tokens (`CostModel.catch_up_token_s`) is dear.
  The gap is the replica's (`ReplicaPriors.probe_gap`: a new request starts from the gap the last one of its
  draft version left) and counted in plain steps since any request of the replica drafted
  (`CostModel.count_plain`), or the request's own if longer: costs that say drafting does not pay are only refreshed by a probe, and requests
  shorter than the gap would otherwise never probe, so one bad measurement (a cold first pass of a new shape)
  stopped a replica drafting for good. (A seeded request, on a frozen cost model, counts its own steps only,
  and probes only where all the probes its remaining tokens leave room for, accepted, would make drafting
  pay: its evidence serves no other request.)

Seeded sampled requests: a seed must reproduce the output, and the plan changes the output at T > 0, so such
a request plans from its own acceptance history (the default prior) and a *frozen* cost model
(`CostModel.frozen`) holding the replica's cost profile (`cost_profile`): the costs measured once by
`Engine.calibrate`, relative to a one-token target step and rounded to a log grid (PROFILE_GRID), so that
the profile, and with it the seed's output, survives timing noise and restarts on the same hardware.

The draft's own doubt: the planned k is an upper bound for a chain. After each drafted token the chain
ends when the draft's confidence in it (the largest probability of its raw softmax) is below
`stop_below` (STOP_CONFIDENCE for adaptive chains; MJSD's beams and fixed-gamma requests never stop):
a token the draft doubts is often rejected, and every token drafted after a rejected one is wasted
(BiLD's fallback test, Kim et al., "Speculative Decoding with Big Little Decoder", NeurIPS 2023, used here
to end a proposal rather than to hand over). The estimate learns from the tokens actually proposed.

Re-timing a deeper draft (`RequestController._depth_probe`): the cost model times only the sizes the controller
chooses, so a size priced too dear (a calibration that ran beside the replica's start-up priced 5- and 7-node trees
at 1.19x a one-token step on the nineteenth session's host, and that replica drafted at most one level deep for a
30-minute run) is never chosen and never timed again. While a request drafts k tokens deep and the size of k + 1
has not been timed by traffic in the last STALE_TIMINGS target passes, one step in a gap drafts k + 1 instead;
the gap keeps what those steps are predicted to lose within DEPTH_PROBE_BUDGET of the time. A size's first
WARM_OBSERVATIONS timings (its calibration among them) are averaged equally, so one re-timing corrects a wrong
seed by half, not by the running mean's tenth.

Trees of Medusa heads (mode medusa, `verify_tokens`): the same choice picks the tree's depth k, priced by the
nodes its trees put in the verification pass and the heads' measured time per depth; there is no draft model to
catch up (`catches_up=False`), so a probe costs only its one-token tree, often 2-4% of a step where verification
is nearly free. The shape bounds the nodes (a (2,1,1) tree: 3, 5, 7 tokens for k = 1, 2, 3, its root included),
but the heads' doubt prunes it (serving/decoding/medusa.py `node_floor`), so a tree planned k deep is priced at
what this replica's trees of the same version and traffic category verified at each depth (`tree_nodes`,
`ReplicaPriors.nodes`: a decayed mean per depth, 0 where a depth was pruned whole), and its acceptance curve
counts a depth the floor cut as not accepted: both sides of the rate, tokens and seconds, are what a plan of
depth k gets. (The twenty-fourth session priced the full shape and counted only the depths a tree reached: an
upper bound on both.)

Deterministic proposals: where the prompt lookup finds nothing, the chain modes' deterministic proposer offers the
suffix store's continuation from earlier answers instead (Engine.proposal). The two are priced apart (`Plan.source`:
"ngram" and "store", each an estimate of its own, per request and in the replica's priors): on the bootstrap's
held-out answers a lookup proposal (3 tokens deep) had 1.2-2.0 tokens accepted and a store proposal 0.4-0.7
(docs/results/suffix-offline-2026-11-30-thirtyfourth), and one estimate for both priced the store's proposals at
the lookup's acceptance. On the forty-fifth session's traffic mix, a science request proposed 52 tokens in 15 such
steps and 2 were accepted (0.96x target-only for that request, its category 0.93x). A source whose offers keep being
passed over for plain steps takes one token of every `offer_gap`-th offer (within PROBE_BUDGET of the time), so an
estimate a bad stretch pushed down sees evidence again when that source turns good.

What the controller never touches: the acceptance rule. It only chooses, from the history of earlier
steps, how many tokens to propose and which proposer makes them; every rule verifies whatever is
proposed as it always does, so lossless modes stay exactly lossless (the choice never depends on the
current step's random draws).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

MAX_GAMMA = 16
PRIOR_DRAFT_RATIO = 0.1        # draft token / target step, before anything is measured
PRIOR_VERIFY_SLOPE = 0.03      # extra target time per extra verified token, relative to a one-token step
# Drafting must promise this much more than a plain step: the estimates are noisy and a step has costs the
# model leaves out (a draft catch-up after plain steps), so a predicted 1-3% gain measured as a loss on the
# traffic-mix benchmark's low-acceptance categories (docs/benchmarks.md).
MIN_GAIN = 0.05
# A measured step time enters its running mean clipped to this factor of the current estimate (CostModel._ewma):
# on the Intel AMX host one stall left a 4-token target pass at 1.6x a 5-token one (0.115 s against 0.069 s), and
# since more tokens never count as cheaper, 4- and 5-token steps then looked 1.6x a plain step and were not chosen,
# so not measured again (docs/benchmarks.md, "The fourteenth session").
SPIKE_RATIO = 2.0
# The share of a target pass's timing surprise that the cost model books as the machine's load (every cost moves
# by it) rather than as that size's own cost (CostModel.observe_target). Each size is timed only when it is
# chosen, so with per-size means alone a lasting slowdown (a distillation job starting on the cores serving
# uses) reached only the sizes chosen since: on a 2-core host the sizes a request seldom chose, the plain
# step among them, kept their idle cost, and the relative costs went to 0.52-1.72x their idle values
# (scripts/bench_controller_load.py, docs/benchmarks.md, the nineteenth session). The share is scaled by how much
# of the recent timings are of that size: a surprise at the size the controller keeps choosing is load, one at
# a rarely timed size is that size's own. 0: per-size means only. A size's first WARM_OBSERVATIONS timings settle its own cost
# (a new shape's first pass can run cold at 2-3x, and a probe that measures the true cost must correct that size,
# not the machine's load).
LOAD_SHARE = 0.9      # DRAFTSMITH_LOAD_SHARE overrides it (a value in [0, 1); 0: per-size means alone)
WARM_OBSERVATIONS = 5
# Per-depth acceptance (AcceptanceEstimate.curve): the weight, in steps, of a depth's prior (a request's: its replica's
# curve) against its own counts. At 4, four rejected one-token trees in a row took a request's first-depth estimate
# from 0.28 to 0.15, below what drafting needs, and with probes backing off a science answer whose heads were
# accepted 0.3-0.38 of the time drafted on 2 of its 64 steps (the twenty-first session's trace); 8 halves such stops
# on synthetic streams and reacts within a request where acceptance truly collapses (scripts/bench_controller_streams.py).
DEPTH_STRENGTH = 8.0
# A tree's expected nodes per depth (ReplicaPriors.nodes) are shrunk towards the full shape's with this many steps'
# weight: the first few trees of a version move the price most of the way to what they verified.
NODE_STRENGTH = 2.0
RECENT_WEIGHT = 0.2


def _load_share_from_env(default: float) -> float:
    raw = os.environ.get("DRAFTSMITH_LOAD_SHARE", "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0.0 <= v < 1.0:
        logging.getLogger(__name__).warning("DRAFTSMITH_LOAD_SHARE=%r is not a number in [0, 1); using %s", raw, default)
        return default
    logging.getLogger(__name__).info("DRAFTSMITH_LOAD_SHARE: the cost model's load share is %s", v)
    return v


LOAD_SHARE = _load_share_from_env(LOAD_SHARE)
# Without evidence (a request whose prior carries no traffic: a seeded request, a new draft version) the
# controller drafts only when drafting pays at the pessimistic end of its estimate, alpha - CAUTION_Z standard
# errors (AcceptanceEstimate.lower); how many tokens it then drafts still follows the point estimate. Where
# verification is cheap the start is unchanged; where it is dear the request waits for its probes' evidence.
CAUTION_Z = 0.5
# Probing (RequestController.take) backs off to the longest gap at once when drafting would not pay at this
# acceptance under the measured costs: a probe there costs most of a step and can only refresh the costs.
HOPELESS_ALPHA = 0.9
HOPELESS_PROBE_GAP = 128     # plain steps between such probes (a probe costs about one more step)
# Elsewhere probes are spaced so that they take at most this share of a request's time (affordable_gap).
PROBE_BUDGET = 0.02
# A size not timed by traffic in this many target passes is stale: a request drafting one level shallower
# re-times it now and then, at most DEPTH_PROBE_BUDGET of the time by the current (maybe wrong) prices and never
# more often than every DEPTH_PROBE_MIN_GAP drafting steps of the replica (RequestController._depth_probe).
STALE_TIMINGS = 256
DEPTH_PROBE_BUDGET = 0.005
DEPTH_PROBE_MIN_GAP = 8
# A draft chain ends after a token whose draft confidence (the largest probability of the draft's raw
# softmax) is below this; the planned k is then an upper bound. Chosen on the bootstrap's held-out teacher
# data (scripts/bench_confidence.py, docs/benchmarks.md); 0 turns the stop off.
STOP_CONFIDENCE = 0.6
# A seeded sampled request plans from a frozen cost profile (`cost_profile`, `CostModel.frozen`): the replica's
# costs measured once (Engine.calibrate), relative to a one-token target step and rounded to this log grid, so
# that timing noise between runs and restarts rarely changes the profile, and with it the seed's output.
PROFILE_GRID = 2 ** 0.25


def expected_tokens(alpha: float | Sequence[float], k: int) -> float:
    """Tokens emitted by a step drafting k tokens. `alpha` one acceptance for every depth: E(alpha, k) =
    sum_{i=0..k} alpha^i; or per-depth conditional acceptances a_1, a_2, ... (`AcceptanceEstimate.curve`):
    1 + a_1 + a_1 a_2 + ..., depths past the sequence's end taking its last value."""
    if k <= 0:
        return 1.0
    if not isinstance(alpha, (int, float)):
        curve = [min(max(float(a), 0.0), 1.0) for a in alpha] or [0.0]
        e, reach = 1.0, 1.0
        for d in range(k):
            reach *= curve[min(d, len(curve) - 1)]
            e += reach
        return e
    a = min(max(float(alpha), 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostModel:
    """Measured costs of one replica (thread-safe). `draft_token_s(proposer)` and `target_s(n)` in seconds."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.frozen_profile: dict | None = None      # set by `frozen`: observations are then ignored
        self._target: dict[int, float] = {}          # tokens verified -> EWMA seconds
        self._draft: dict[str, float] = {}           # proposer -> EWMA seconds per drafted token
        self._overhead: dict[tuple, float] = {}      # (batch rows, drafted?) -> EWMA seconds outside the forwards
        self._draft_rows: dict[int, float] = {}      # rows in a batched draft forward -> EWMA seconds per forward
        self._catch_up: float | None = None          # EWMA seconds per token of a draft catch-up beyond one token
        self._plain_run = 0                          # plain request steps since any request drafted (take)
        # the machine's load now, relative to when the tables' first entries were measured: every table holds
        # costs divided by the load of their observation, and every read multiplies by the load now
        self._load = 1.0
        self._target_seen: dict[int, int] = {}       # tokens -> timings of that size so far (WARM_OBSERVATIONS)
        self._recent: dict[int, float] = {}          # tokens -> share of the recent target timings (RECENT_WEIGHT)
        self._timings = 0                            # target passes traffic timed so far (not calibration seeds)
        self._last_timed: dict[int, int] = {}        # tokens -> _timings when traffic last timed that size
        self._depth_wait = 0                         # drafting steps since the last depth probe (depth_probe_due)
        self.depth_probes = 0                        # depth probes taken (snapshot)
        self._lock = threading.Lock()

    def _ewma(self, table: dict, key, value: float, weight: float | None = None) -> None:
        """Running mean of one cost. A sample enters clipped to [1/SPIKE_RATIO, SPIKE_RATIO] x the current
        estimate: a lone stall cannot make a size look dear (and a size that looks dear is seldom chosen, so
        seldom measured again), while a real change still moves the estimate by up to weight x (SPIKE_RATIO - 1)
        per sample."""
        if self.frozen_profile is not None:
            return
        w = self.weight if weight is None else weight
        value = value / self._load                     # the tables hold costs at load 1
        old = table.get(key)
        if old is not None:
            value = min(max(value, old / SPIKE_RATIO), old * SPIKE_RATIO)
        table[key] = value if old is None else (1 - w) * old + w * value

    @property
    def load(self) -> float:
        """The machine's load factor now (1.0 until a measured size is timed slower or faster than its estimate)."""
        with self._lock:
            return self._load

    def count_plain(self, drafted: bool) -> int:
        """One request step of this replica (RequestController.take): a plain one adds to the run of plain steps
        since any request drafted, a drafting one (or a probe) ends it; returns the run."""
        with self._lock:
            self._plain_run = 0 if drafted else self._plain_run + 1
            return self._plain_run

    def observe_target(self, tokens: int, seconds: float, seed: bool = False) -> None:
        """A target pass over `tokens` tokens took `seconds`. A size measured before moves its estimate (load x
        its cost) as a running mean would (clipped to SPIKE_RATIO, weight `weight`); LOAD_SHARE of that move goes
        to the load factor, which every cost follows, and the rest to this size's own cost. A size's first
        WARM_OBSERVATIONS timings are averaged equally. `seed`: a calibration's timing, which counts among those
        but does not make the size fresh (`stale`)."""
        if tokens < 1 or seconds <= 0 or self.frozen_profile is not None:
            return
        n = int(tokens)
        with self._lock:
            old = self._target.get(n)
            seen = self._target_seen.get(n, 0)
            self._target_seen[n] = seen + 1
            if not seed:
                self._timings += 1
                self._last_timed[n] = self._timings
            for m in self._recent:                   # how much of the recent timings are of each size
                self._recent[m] *= 1.0 - RECENT_WEIGHT
            self._recent[n] = self._recent.get(n, 0.0) + RECENT_WEIGHT
            share = LOAD_SHARE * min(1.0, self._recent[n]) if seen >= WARM_OBSERVATIONS else 0.0
            if old is None or share <= 0:
                self._ewma(self._target, n, float(seconds),
                           weight=max(self.weight, 1.0 / (seen + 1)) if seen < WARM_OBSERVATIONS else None)
                return
            predicted = old * self._load
            value = min(max(float(seconds), predicted / SPIKE_RATIO), predicted * SPIKE_RATIO)
            q = ((1 - self.weight) * predicted + self.weight * value) / predicted
            self._load *= q ** share
            self._target[n] = old * q ** (1.0 - share)

    def set_target(self, tokens: int, seconds: float) -> None:
        """A directly timed target pass over `tokens` tokens (Engine.calibrate): replaces the running mean."""
        if tokens >= 1 and seconds > 0 and self.frozen_profile is None:
            with self._lock:
                self._target[int(tokens)] = float(seconds) / self._load

    def observe_target_if_unmeasured(self, tokens: int, seconds: float) -> None:
        """`observe_target` for a size this model has not measured yet (a replica's calibration seeding its
        live costs: traffic's own measurements, once there are any, stay)."""
        with self._lock:
            known = int(tokens) in self._target
        if not known:
            self.observe_target(tokens, seconds, seed=True)

    def stale(self, tokens: int) -> bool:
        """Whether traffic has not timed a target pass of this size in the last STALE_TIMINGS passes (or ever)."""
        with self._lock:
            return self._stale(int(tokens))

    def _stale(self, tokens: int) -> bool:
        last = self._last_timed.get(tokens)
        return last is None or self._timings - last > STALE_TIMINGS

    def depth_probe_due(self, gap: int) -> bool:
        """Counts one drafting step that could re-time a stale deeper size; True (and the count restarts) once
        `gap` such steps have passed since the last depth probe of this replica."""
        with self._lock:
            self._depth_wait += 1
            if self._depth_wait < gap:
                return False
            self._depth_wait = 0
            self.depth_probes += 1
            return True

    def observe_draft(self, proposer: str, drafted: int, seconds: float) -> None:
        if drafted >= 1 and seconds > 0:
            with self._lock:
                self._ewma(self._draft, proposer, float(seconds) / drafted)

    def observe_overhead(self, drafted: bool, seconds: float, rows: int = 1) -> None:
        """A step's time outside the model forwards (warping, sampling, the rule, bookkeeping), for a batch
        of `rows` requests."""
        if seconds >= 0:
            with self._lock:
                self._ewma(self._overhead, (int(rows), bool(drafted)), float(seconds))

    def overhead_s(self, drafted: bool, rows: int = 1) -> float:
        with self._lock:
            v = self._overhead.get((int(rows), bool(drafted)))
            if v is None:   # another batch size measured: scale per row
                near = [(r, t) for (r, d), t in self._overhead.items() if d == bool(drafted)]
                if near:
                    r, t = min(near, key=lambda rt: abs(rt[0] - rows))
                    v = t * rows / r
            return (v or 0.0) * self._load

    def observe_draft_forward(self, rows: int, forwards: int, seconds: float) -> None:
        """A batched proposal: `forwards` draft forwards over `rows` rows (chains + beams) took `seconds`."""
        if rows >= 1 and forwards >= 1 and seconds > 0:
            with self._lock:
                self._ewma(self._draft_rows, int(rows), float(seconds) / forwards)

    def observe_catch_up(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """A draft forward that fed `tokens` tokens per row (a catch-up over the tokens the draft skipped during
        plain steps, or a prompt) took `seconds`: what it cost beyond a one-token forward, per extra token."""
        if tokens < 2 or seconds <= 0 or self.frozen_profile is not None:
            return
        extra = max(0.0, float(seconds) - self.draft_forward_s(rows)) / (tokens - 1)
        with self._lock:
            extra /= self._load
            old = self._catch_up
            self._catch_up = extra if old is None else (1 - self.weight) * old + self.weight * extra

    def set_catch_up(self, seconds_per_token: float, if_unmeasured: bool = False) -> None:
        """A directly timed catch-up price (Engine.calibrate): replaces the running mean, or with
        `if_unmeasured` only seeds it where traffic has measured none."""
        if seconds_per_token >= 0 and self.frozen_profile is None:
            with self._lock:
                if not (if_unmeasured and self._catch_up is not None):
                    self._catch_up = float(seconds_per_token) / self._load

    def catch_up_token_s(self) -> float:
        """Seconds per token the draft spends catching up on tokens it did not see (0 until measured)."""
        with self._lock:
            return (self._catch_up or 0.0) * self._load

    def draft_forward_s(self, rows: int) -> float:
        """Seconds of one draft forward over `rows` rows: measured; else the line through measured sizes;
        else the one-request per-token figures (a chain is one row); else the prior ratio."""
        with self._lock:
            load = self._load
            table = {r: t * load for r, t in self._draft_rows.items()}
            per_token = {k: t * load for k, t in self._draft.items()}
        if rows in table:
            return table[rows]
        if len(table) >= 2:
            xs, ys = zip(*table.items())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            den = sum((x - mx) ** 2 for x in xs)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den) if den else 0.0
            return max(my + slope * (rows - mx), 0.25 * min(ys))
        if table:
            (r, t), = table.items()
            return t * (1.0 + 0.05 * (rows - r))
        if "chain" in per_token:
            return per_token["chain"] * (1.0 + 0.05 * (rows - 1))
        return PRIOR_DRAFT_RATIO * self.target_s(1) * (1.0 + 0.05 * (rows - 1))

    def target_s(self, tokens: int) -> float:
        """Seconds for a target pass over `tokens` new tokens at the machine's load now (`_target_s` x load)."""
        with self._lock:
            load = self._load
        return self._target_s(tokens) * load

    def _target_s(self, tokens: int) -> float:
        """Seconds for a target pass over `tokens` new tokens, never below the cost of a smaller measured size:
        measured; else, between two measured sizes, the straight line from the nearest smaller to the nearest
        larger one; past the largest (or before the smallest), the least-squares slope through the measured sizes
        (two or more: a controller that always drafts still learns what a plain one-token step would cost);
        else the one measured size scaled with the prior slope; 1.0 (relative units) when nothing is
        measured yet. Not one line through every size: on a CPU the cost is far from linear (fp32 on AVX2:
        2 tokens 1.65x a one-token pass, 5 tokens 1.7-2x; docs/benchmarks.md), and a line through 1 and 5
        made a second verified token look nearly free."""
        with self._lock:
            if not self._target:
                return 1.0 + PRIOR_VERIFY_SLOPE * (tokens - 1)
            # more tokens never cost less: a size measured below a smaller one's cost (timing noise: on a
            # shared 2-core VM one calibration put 5 tokens at 1.41x and 3 and 4 at 2x) counts at that cost.
            # Where the two disagree the fresher timing wins: a size traffic timed lately is not floored by a
            # stale one (a calibration's 2-token pass at 1.5x, run beside start-up, never verified by a tree and
            # so never timed again, priced every tree at 1.5x: the twentieth session), and a stale size is no
            # dearer than a larger fresh one
            fresh = {n for n in self._target if not self._stale(n)}
            mine = tokens in fresh
            floor = max((v for n, v in self._target.items() if n < tokens and (n in fresh or not mine)), default=0.0)
            floor_fresh = max((v for n, v in self._target.items() if n < tokens and n in fresh), default=0.0)
            ceiling = min((v for n, v in self._target.items() if n > tokens and n in fresh and not mine),
                          default=math.inf)
            return max(min(max(self._raw_target_s(tokens), floor), ceiling), floor_fresh)

    def _raw_target_s(self, tokens: int) -> float:
        """`_target_s` before the floor and ceiling of the other sizes (called under the lock)."""
        if tokens in self._target:
            return self._target[tokens]
        if len(self._target) >= 2:
            lower = [n for n in self._target if n < tokens]
            upper = [n for n in self._target if n > tokens]
            if lower and upper:
                lo, hi = max(lower), min(upper)
                a, b = self._target[lo], self._target[hi]
                return a + (b - a) * (tokens - lo) / (hi - lo)
            xs, ys = zip(*self._target.items())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            slope = max(0.0, slope)                      # timing noise must not make tokens free
            edge = max(xs) if lower else min(xs)
            return max(self._target[edge] + slope * (tokens - edge), 0.25 * min(ys))
        (near, value), = self._target.items()
        base = value / (1.0 + PRIOR_VERIFY_SLOPE * (near - 1))
        return base * (1.0 + PRIOR_VERIFY_SLOPE * (tokens - 1))

    def draft_token_s(self, proposer: str) -> float:
        if proposer == "ngram":
            return 0.0
        with self._lock:
            measured = self._draft.get(proposer)
            load = self._load
        return measured * load if measured is not None else PRIOR_DRAFT_RATIO * self.target_s(1)

    def step_s(self, proposer: str, k: int) -> float:
        return k * self.draft_token_s(proposer) + self.target_s(k + 1) + self.overhead_s(k > 0)

    def snapshot(self) -> dict:
        """The measured costs in seconds at the load now, and the load factor."""
        with self._lock:
            m = self._load
            return {"target_s": {n: t * m for n, t in self._target.items()},
                    "draft_token_s": {k: t * m for k, t in self._draft.items()},
                    "draft_forward_s": {r: t * m for r, t in self._draft_rows.items()},
                    "catch_up_token_s": None if self._catch_up is None else self._catch_up * m,
                    "overhead_s": {f"{r}/{'draft' if d else 'plain'}": t * m for (r, d), t in self._overhead.items()},
                    "load": m, "depth_probes": self.depth_probes}

    @classmethod
    def frozen(cls, profile: dict) -> "CostModel":
        """A cost model that holds `profile` (from `cost_profile`) and ignores observations: the costs of a
        seeded request, whose plan, and so whose output, must not follow the replica's timing."""
        m = cls()
        m._target = {int(n): float(v) for n, v in profile["target"].items()}
        m._draft = {str(k): float(v) for k, v in profile["draft"].items()}
        m._overhead = {(1, key == "draft"): float(v) for key, v in profile["overhead"].items()}
        m._catch_up = float(profile["catch_up"]) if profile.get("catch_up") else None   # older profiles lack it
        m.frozen_profile = profile
        return m


def _grid(x: float) -> float:
    """`x` rounded to the nearest point of the log grid PROFILE_GRID**i (0 stays 0)."""
    if x <= 0:
        return 0.0
    return round(PROFILE_GRID ** round(math.log(x) / math.log(PROFILE_GRID)), 6)


def cost_profile(costs: CostModel, max_tokens: int = MAX_GAMMA + 1) -> dict | None:
    """The one-request costs that `costs` has measured, relative to a one-token target step and rounded to
    PROFILE_GRID: {"target": {tokens: ratio}, "draft": {proposer: ratio per token}, "overhead": {"plain" |
    "draft": ratio}, "catch_up": ratio per token (once measured), "digest": 12 hex}. None until a one-token target step has been measured."""
    snap = costs.snapshot()
    base = snap["target_s"].get(1)
    if not base:
        return None
    prof = {"target": {str(n): _grid(t / base) for n, t in sorted(snap["target_s"].items()) if n <= max_tokens},
            "draft": {k: _grid(t / base) for k, t in sorted(snap["draft_token_s"].items())},
            "overhead": {key.split("/")[1]: _grid(t / base) for key, t in sorted(snap["overhead_s"].items())
                         if key.startswith("1/")}}
    if snap["catch_up_token_s"] is not None:     # below a tenth of the probe budget it moves the gap < 11%: 0, so
        c = snap["catch_up_token_s"] / base      # that its timing noise does not change the digest
        prof["catch_up"] = _grid(c) if c >= 0.1 * PROBE_BUDGET else 0.0
    prof["digest"] = hashlib.sha256(json.dumps(prof, sort_keys=True).encode()).hexdigest()[:12]
    return prof


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance from decayed counts, shrunk towards `prior` with weight `strength`."""

    prior: float = 0.5
    strength: float = 2.0
    decay: float = 0.95
    accepted: float = 0.0
    rejected: float = 0.0
    observations: int = 0
    # per depth d = i + 1: decayed counts of steps whose proposal reached depth d with every earlier token
    # accepted, and of those whose token at depth d was accepted too (`curve`)
    reached: list = field(default_factory=list)
    passed: list = field(default_factory=list)
    prior_curve: tuple = ()      # per-depth priors (a request's: its replica's curve); () = alpha at every depth

    @property
    def alpha(self) -> float:
        return (self.accepted + self.strength * self.prior) / (self.accepted + self.rejected + self.strength)

    def lower(self, z: float) -> float:
        """alpha minus z standard errors, the prior's strength counted as observations."""
        a, n = self.alpha, self.accepted + self.rejected + self.strength
        return max(0.0, a - z * math.sqrt(a * (1.0 - a) / n))

    def update(self, proposed: int, accepted: int) -> None:
        """A step proposed `proposed` tokens and `accepted` of them were accepted."""
        if proposed <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1.0 if accepted < proposed else 0.0)
        self.observations += 1
        depth = min(int(proposed), MAX_GAMMA)
        if len(self.reached) < depth:
            self.reached += [0.0] * (depth - len(self.reached))
            self.passed += [0.0] * (depth - len(self.passed))
        for i in range(len(self.reached)):
            self.reached[i] *= self.decay
            self.passed[i] *= self.decay
        for i in range(min(int(accepted) + 1, depth)):
            self.reached[i] += 1.0
        for i in range(min(int(accepted), depth)):
            self.passed[i] += 1.0

    def curve(self, k: int) -> list[float]:
        """Conditional acceptance at depths 1..k: the chance the token at depth d is accepted given the d - 1
        before it were. Each depth's own counts, shrunk (weight DEPTH_STRENGTH) towards its prior: the
        `prior_curve`, else the estimate's single alpha, so a depth without evidence is priced as before.
        Trees of Medusa heads accept their first token far more often than later ones (0.6 then 0.1-0.35 on the
        bootstrap's heads, docs/benchmarks.md, the twenty-first session), which one alpha for every depth
        hides: it priced deep trees as paying where they did not."""
        alpha = self.alpha
        out = []
        for i in range(max(0, int(k))):
            p = self.prior_curve[i] if i < len(self.prior_curve) else alpha
            r = self.reached[i] if i < len(self.reached) else 0.0
            q = self.passed[i] if i < len(self.passed) else 0.0
            out.append((q + DEPTH_STRENGTH * p) / (r + DEPTH_STRENGTH))
        return out


class ReplicaPriors:
    """Acceptance from recent traffic of one replica, per (draft version, proposer, greedy?): the prior of
    every new request. A new draft version starts from the default prior.

    Labelled traffic (a request's `metadata.category`, its replay-buffer `source`) also gets an estimate of its
    own per category, shrunk towards the pooled one: alpha with weight 2 steps, each depth with DEPTH_STRENGTH,
    so a category without traffic yet starts from the pooled figures and one with traffic prices its own. Pooled
    alone, a category whose trees the draft learnt to accept deep (SQL after online distillation) made every
    other category's requests start from its deep curve: known traffic went from 1.9 to 3.0 drafted tokens per
    step for no more accepted (docs/benchmarks.md, the twenty-first session)."""

    def __init__(self, prior: float = 0.5, decay: float = 0.98) -> None:
        self.default, self.decay = prior, decay
        self._est: dict[tuple, AcceptanceEstimate] = {}
        self._gaps: dict[tuple, int] = {}
        self._nodes: dict[tuple, tuple[list[float], list[float]]] = {}
        self._lock = threading.Lock()

    def _get(self, key: tuple, k: int = MAX_GAMMA) -> AcceptanceEstimate:
        """The estimate of `key` = (version, proposer, greedy, category); a category's has its priors set from
        the pooled (category "") estimate of its version, proposer and greedy, at depths 1..k."""
        if key not in self._est:
            self._est[key] = AcceptanceEstimate(prior=self.default, strength=2.0, decay=self.decay)
        est = self._est[key]
        if key[3]:
            pooled = self._get(key[:3] + ("",))
            est.prior, est.prior_curve = pooled.alpha, tuple(pooled.curve(k))
        return est

    def alpha(self, version: str, proposer: str, greedy: bool, category: str = "") -> float:
        with self._lock:
            return self._get((version, proposer, greedy, category)).alpha

    def curve(self, version: str, proposer: str, greedy: bool, k: int, category: str = "") -> list[float]:
        with self._lock:
            return self._get((version, proposer, greedy, category), k).curve(k)

    def observations(self, version: str, proposer: str, greedy: bool, category: str = "") -> int:
        """How many steps of recent traffic the prior for this key has seen (0: the default prior alone); a
        category's prior counts its pooled one's."""
        with self._lock:
            return self._get((version, proposer, greedy, "")).observations + (
                self._get((version, proposer, greedy, category)).observations if category else 0)

    def update(self, version: str, proposer: str, greedy: bool, proposed: int, accepted: int,
               category: str = "") -> None:
        with self._lock:
            self._get((version, proposer, greedy, "")).update(proposed, accepted)
            if category:
                self._get((version, proposer, greedy, category)).update(proposed, accepted)

    def update_nodes(self, version: str, proposer: str, greedy: bool, per_depth: Sequence[int],
                     category: str = "") -> None:
        """A tree planned len(per_depth) deep verified per_depth[d - 1] nodes at depth d (0 where the heads'
        doubt pruned the whole depth): decayed sums per depth, pooled and for the category."""
        with self._lock:
            for key in {(version, proposer, greedy, ""), (version, proposer, greedy, category)}:
                sums, steps = self._nodes.setdefault(key, ([], []))
                if len(sums) < len(per_depth):
                    sums += [0.0] * (len(per_depth) - len(sums))
                    steps += [0.0] * (len(per_depth) - len(steps))
                for i, n in enumerate(per_depth):
                    sums[i] = self.decay * sums[i] + float(n)
                    steps[i] = self.decay * steps[i] + 1.0

    def nodes(self, version: str, proposer: str, greedy: bool, shape: Sequence[int],
              category: str = "") -> list[float]:
        """Expected nodes per depth 1..len(shape) of a tree whose full shape has shape[d - 1] nodes at depth d:
        the decayed mean of what this key's trees verified there, shrunk (weight NODE_STRENGTH steps) towards
        the pooled key's mean, itself shrunk towards the shape; the shape where nothing was seen."""
        with self._lock:
            pooled = self._nodes.get((version, proposer, greedy, ""), ([], []))
            own = self._nodes.get((version, proposer, greedy, category), ([], [])) if category else ([], [])
            out = []
            for i, full in enumerate(shape):
                mean = float(full)
                for sums, steps in (pooled, own):
                    if i < len(sums):
                        mean = (sums[i] + NODE_STRENGTH * mean) / (steps[i] + NODE_STRENGTH)
                out.append(min(float(full), mean))
            return out

    def probe_gap(self, version: str, proposer: str, greedy: bool, default: int, category: str = "") -> int:
        """The probe gap the replica's latest request of this key ended with (RequestController: probing); a
        category without one of its own takes the pooled one."""
        with self._lock:
            pooled = self._gaps.get((version, proposer, greedy, ""), default)
            return self._gaps.get((version, proposer, greedy, category), pooled)

    def set_probe_gap(self, version: str, proposer: str, greedy: bool, gap: int, category: str = "") -> None:
        with self._lock:
            self._gaps[(version, proposer, greedy, category)] = int(gap)
            if category:
                self._gaps[(version, proposer, greedy, "")] = int(gap)


@dataclass
class Plan:
    proposer: str      # "draft" (the mode's own proposer), "ngram", or "none" (k = 0)
    k: int
    probe: bool = False
    # of an "ngram" plan: which deterministic source proposed, "ngram" (the prompt lookup) or "store" (the suffix
    # store's earlier answers); each has its own acceptance estimate (module docstring, "Deterministic proposals")
    source: str = "ngram"

    @property
    def estimate_key(self) -> str:
        """The acceptance estimate this plan's outcome teaches: the draft's, or its deterministic source's."""
        return self.source if self.proposer == "ngram" else self.proposer


def best_k(alpha: float | Sequence[float], max_k: int, step_s, min_gain: float = 0.0) -> tuple[int, float]:
    """argmax over k in 0..max_k of E(alpha, k) / step_s(k) (`alpha`: one value, or a per-depth curve);
    returns (k, tokens per second). Drafting
    (k > 0) must beat the plain step's rate by the factor 1 + min_gain."""
    rate0 = expected_tokens(alpha, 0) / step_s(0)
    best, rate = 0, rate0
    for k in range(1, max_k + 1):
        r = expected_tokens(alpha, k) / step_s(k)
        if r > rate * (1 + 1e-9):
            best, rate = k, r
    if best and rate < rate0 * (1 + min_gain):
        return 0, rate0
    return best, rate


@dataclass
class RequestController:
    """The controller of one request. `plan()` before a step, `observe()` after it."""

    gamma: int
    costs: CostModel
    priors: ReplicaPriors
    version: str
    greedy: bool
    draft_key: str = "chain"          # cost key of the mode's proposer ("chain", "beams")
    category: str = ""                # the request's traffic label: its replica prior's (ReplicaPriors); "" pooled
    use_ngram: bool = False
    min_gain: float = MIN_GAIN
    stop_below: float = 0.0           # chains end after a token the draft doubts (STOP_CONFIDENCE; 0: off)
    probe_gap0: int = 4
    max_probe_gap: int = 32
    max_tokens: int | None = None     # the request's token budget: a seeded request probes only where it can pay
    # tokens the target verifies for a proposal of depth k (default k + 1, a chain): a Medusa tree of depth k
    # (mode medusa) verifies at most every node of its shape, e.g. 7 for (2,1,1) with its root; where the heads'
    # doubt prunes it, what its trees verified (`observe(..., nodes=)`, `tree_nodes`) prices it
    verify_tokens: Callable[[int], int] | None = None
    catches_up: bool = True           # a probe first feeds the draft model the tokens it skipped (not heads)
    est: dict = field(default_factory=dict)
    evidence: dict = field(default_factory=dict)   # proposer -> observations behind its prior (CAUTION_Z)
    zero_run: int = 0
    probe_gap: int = 4
    steps: int = 0
    skipped: dict = field(default_factory=dict)    # deterministic source -> its offers passed over since its last step

    def __post_init__(self) -> None:
        if not (1 <= self.gamma <= MAX_GAMMA):
            raise ValueError(f"gamma must be in [1, {MAX_GAMMA}], got {self.gamma}")
        # probing state is the replica's (module docstring, "Probing"), except on a frozen cost model
        self.shared = self.costs.frozen_profile is None
        self.probe_gap = (self.priors.probe_gap(self.version, self.draft_key, self.greedy, self.probe_gap0,
                                               self.category)
                          if self.shared else self.probe_gap0)

    def step_s(self, k: int) -> float:
        """Seconds of a step that proposes k tokens deep with the mode's own proposer (k = 0: a plain step)."""
        if self.verify_tokens is None or k == 0:
            return self.costs.step_s(self.draft_key, k)
        return (k * self.costs.draft_token_s(self.draft_key) + self.costs.target_s(self.tree_nodes(k))
                + self.costs.overhead_s(True))

    def _shape_per_depth(self, k: int) -> list[int]:
        """Nodes per depth 1..k of the full tree shape (`verify_tokens` differences)."""
        sizes = [1] + [int(self.verify_tokens(d)) for d in range(1, k + 1)]
        return [b - a for a, b in zip(sizes, sizes[1:])]

    def tree_nodes(self, k: int) -> float:
        """Tokens a tree planned k deep is expected to put in the verification pass, its root included: per depth,
        the replica's running mean of the nodes its trees of this version and category verified there
        (`ReplicaPriors.nodes`), never more than the shape's. The shape alone priced a tree the heads' doubt
        pruned as if every node stayed (module docstring, "Trees of Medusa heads")."""
        if self.verify_tokens is None or k == 0:
            return float(k + 1)
        per_depth = self.priors.nodes(self.version, self.draft_key, self.greedy, self._shape_per_depth(k),
                                      self.category)
        return 1.0 + sum(per_depth)

    def _set_gap(self, gap: int) -> None:
        self.probe_gap = gap
        if self.shared:
            self.priors.set_probe_gap(self.version, self.draft_key, self.greedy, gap, self.category)

    def _estimate(self, proposer: str) -> AcceptanceEstimate:
        if proposer not in self.est:
            key = self.draft_key if proposer == "draft" else proposer
            self.est[proposer] = AcceptanceEstimate(
                prior=self.priors.alpha(self.version, key, self.greedy, self.category),
                prior_curve=tuple(self.priors.curve(self.version, key, self.greedy, self.gamma, self.category)))
            self.evidence[proposer] = self.priors.observations(self.version, key, self.greedy, self.category)
        return self.est[proposer]

    def alpha(self, proposer: str) -> float:
        return self._estimate(proposer).alpha

    def curve(self, proposer: str) -> list[float]:
        """Per-depth acceptance of `proposer` at depths 1..gamma (`AcceptanceEstimate.curve`): what plans price."""
        return self._estimate(proposer).curve(self.gamma)

    def plan(self, ngram_available: int = 0, ngram_source: str = "ngram") -> Plan:
        """The next step's proposer and draft length. `ngram_available`: how many tokens the deterministic
        proposer offers now (0: none), `ngram_source` which one offers them: "ngram" (the prompt lookup) or "store"
        (the suffix store), each priced by its own acceptance."""
        step_s = self.step_s
        k, rate = best_k(self.curve("draft"), self.gamma, step_s, self.min_gain)
        est = self._estimate("draft")
        if k and not self.evidence["draft"] and best_k(est.lower(CAUTION_Z), self.gamma, step_s, self.min_gain)[0] == 0:
            k, rate = 0, 1.0 / step_s(0)     # no traffic behind the prior: draft only where it pays pessimistically
        plan = Plan("draft" if k else "none", k)
        if 0 < k < self.gamma and self._depth_probe(k):
            plan = Plan("draft", k + 1)
        if self.use_ngram and ngram_available:
            kn, rate_n = best_k(self.curve(ngram_source), min(self.gamma, ngram_available),
                                lambda k: self.costs.step_s("ngram", k), self.min_gain)
            if kn and rate_n > rate:
                plan = Plan("ngram", kn, source=ngram_source)
        return self.take(plan, (ngram_available, ngram_source))

    def take(self, plan: Plan, offer: tuple[int, str] = (0, "ngram")) -> Plan:
        """Accept a plan made for this request (alone, or by `plan_batch` for its batch): while it drafts
        nothing, count the plain steps and turn every `probe_gap`-th into a one-token probe. Where the
        measured costs say no acceptance could make drafting pay (`hopeless`), a probe only refreshes
        those costs, so probes come every HOPELESS_PROBE_GAP plain steps. `offer`: the deterministic proposal
        this step had (tokens, source); a source whose offers keep being passed over for plain steps takes one
        token of an offer now and then (`offer_gap`), or an estimate pushed down by a bad stretch would never
        see evidence again."""
        if plan.k == 0 and offer[0] and self.use_ngram:
            passed = self.skipped.get(offer[1], 0) + 1
            due = passed >= self.offer_gap()
            self.skipped[offer[1]] = 0 if due else passed
            if due:
                plan = Plan("ngram", 1, probe=True, source=offer[1])
        elif plan.proposer == "ngram":
            self.skipped[plan.source] = 0
        if plan.k == 0:
            self.zero_run += 1
            # plain steps since drafting last happened: on the replica (any request), or this request's own if
            # longer; requests shorter than the gap still probe between them (module docstring, "Probing")
            run = max(self.zero_run, self.costs.count_plain(False)) if self.shared else self.zero_run
            if run >= self.probe_gap:       # no evidence arrives while not drafting: probe
                if self.probe_gap < HOPELESS_PROBE_GAP and self.hopeless():
                    self._set_gap(HOPELESS_PROBE_GAP)
                    return plan
                floor = self.affordable_gap()
                if run < floor:
                    self._set_gap(floor)
                    return plan
                if not self.shared and not self._probing_could_pay(floor):
                    self._set_gap(HOPELESS_PROBE_GAP)
                    return plan
                plan = Plan("draft", 1, probe=True)
        if plan.k and self.shared:
            self.costs.count_plain(True)
        return plan

    def _probing_could_pay(self, gap: int) -> bool:
        """A seeded request learns only from its own steps (its output depends on its plan, so no other
        request's evidence may enter it): probing is worth its cost only if every probe the rest of the request
        has room for (at most max_tokens - steps tokens remain, one probe per `gap`) being accepted would
        make drafting pay. On a CPU where one verified draft token costs 1.7x a step, a 64-token request
        probing after 40 plain steps could never draft after it: each such probe cost about 1.1 steps and
        bought nothing (docs/benchmarks.md, the twelfth session)."""
        if self.max_tokens is None:
            return True
        probes = (self.max_tokens - self.steps) // max(1, gap)
        if probes < 1:
            return False
        est = replace(self._estimate("draft"))        # a copy: the request's own estimate stays as it is
        for _ in range(probes):
            est.update(1, 1)
        alpha = est.alpha if self.evidence["draft"] else est.lower(CAUTION_Z)
        return best_k(alpha, self.gamma, self.step_s, self.min_gain)[0] > 0

    def verified(self, k: int) -> int:
        """Tokens the target verifies for a proposal k deep (a chain's k + 1; a tree's expected nodes and its
        root, rounded: the size the cost model times; at least 2, the root's first child always stays)."""
        return k + 1 if self.verify_tokens is None or k == 0 else max(2, round(self.tree_nodes(k)))

    def _depth_probe(self, k: int) -> bool:
        """Whether this step, planned k deep, drafts k + 1 instead to re-time that size (module docstring,
        "Re-timing a deeper draft"): only on the replica's live costs, only while that size is stale, and one
        step in a gap that keeps the predicted loss (what k + 1 yields per second below k, at the current prices)
        within DEPTH_PROBE_BUDGET."""
        if not self.shared or not self.costs.stale(self.verified(k + 1)):
            return False
        alpha = self.curve("draft")
        rate = expected_tokens(alpha, k) / self.step_s(k)
        loss = max(0.0, 1.0 - expected_tokens(alpha, k + 1) / self.step_s(k + 1) / rate)
        return self.costs.depth_probe_due(max(DEPTH_PROBE_MIN_GAP, math.ceil(loss / DEPTH_PROBE_BUDGET - 1e-9)))

    def affordable_gap(self) -> int:
        """The fewest plain steps between probes that keep probing within PROBE_BUDGET of the time. A probe after
        g plain steps costs step_s(1) - step_s(0) more than the plain step it replaces (0.2 of a step where
        verifying a second token is nearly free, most of a step where it is not) plus the draft's catch-up over
        the g tokens it skipped (`CostModel.catch_up_token_s`; measured ~1 ms a token on an fp32 CPU, as much as
        the extra verification at the gaps such a CPU needs): (d + c g) / g <= PROBE_BUDGET, in plain steps."""
        plain = max(self.step_s(0), 1e-9)
        d = max(0.0, self.step_s(1) - plain) / plain
        c = self.costs.catch_up_token_s() / plain if self.catches_up else 0.0
        if c >= PROBE_BUDGET:
            return HOPELESS_PROBE_GAP
        return min(HOPELESS_PROBE_GAP, max(self.probe_gap0, math.ceil(d / (PROBE_BUDGET - c) - 1e-9)))

    def offer_gap(self) -> int:
        """Passed-over offers of a deterministic source between its probes: one token of an offer costs the
        verification of one more token and no draft time, so probes every this many offers stay within
        PROBE_BUDGET of the time even if every step had an offer."""
        plain = max(self.step_s(0), 1e-9)
        d = max(0.0, self.costs.step_s("ngram", 1) - plain) / plain
        return min(HOPELESS_PROBE_GAP, max(self.probe_gap0, math.ceil(d / PROBE_BUDGET - 1e-9)))

    def _cheap_probe_gap(self) -> int:
        """The longest gap that rejected probes double to: where probes would cost a quarter of PROBE_BUDGET
        (0.5% of the time), or `max_probe_gap`. A probe costing most of a step (a chain's on a CPU) still backs
        off to `max_probe_gap`; one costing 2-4% of a step (a one-token Medusa tree where verification is
        nearly free) keeps probing every few steps, so a request that a bad stretch stopped, or one whose
        replica prior an earlier request dragged down, finds out within its own tokens when drafting pays
        again."""
        return max(self.probe_gap0, min(self.max_probe_gap, 4 * self.affordable_gap()))

    def hopeless(self) -> bool:
        """Whether, at the measured costs, drafting would not pay even if HOPELESS_ALPHA of the draft's
        tokens were accepted (e.g. a CPU where verifying two tokens costs 1.7x one-token step)."""
        return best_k(HOPELESS_ALPHA, self.gamma, self.step_s,
                      self.min_gain)[0] == 0

    def observe(self, plan: Plan, accepted: int, proposed: int | None = None,
                nodes: Sequence[int] | None = None) -> None:
        """After a step: `accepted` of the `proposed` tokens (default plan.k; fewer when the chain stopped on
        the draft's doubt) were accepted. `nodes`: a tree's nodes per depth 1..plan.k (what `tree_nodes`
        learns)."""
        self.steps += 1
        proposed = plan.k if proposed is None else min(int(proposed), plan.k)
        if plan.k == 0 or proposed == 0:
            return
        if nodes is not None and plan.proposer == "draft" and self.verify_tokens is not None:
            per_depth = [int(n) for n in list(nodes)[: plan.k]]
            self.priors.update_nodes(self.version, self.draft_key, self.greedy,
                                     per_depth + [0] * (plan.k - len(per_depth)), self.category)
        self._estimate(plan.estimate_key).update(proposed, accepted)
        key = self.draft_key if plan.proposer == "draft" else plan.estimate_key
        self.priors.update(self.version, key, self.greedy, proposed, accepted, self.category)
        if plan.proposer == "draft":
            if plan.probe:
                self._set_gap(self.probe_gap0 if accepted else min(self.max_probe_gap, 2 * self.probe_gap,
                                                                    self._cheap_probe_gap()))
            self.zero_run = 0


@dataclass
class RowOption:
    """What one request of a batch could do this step (input of `plan_batch`)."""

    alpha_draft: float | Sequence[float] | None   # acceptance of its draft proposer, one value or per depth (None: no draft model)
    draft_rows: int                # rows it adds to the batched draft forward when drafting (1, or beams)
    alpha_ngram: float | Sequence[float] | None   # acceptance of the deterministic proposer (None: not offered)
    ngram_available: int           # tokens it proposes now
    gamma: int                     # its upper bound
    ngram_source: str = "ngram"    # which one: "ngram" (the prompt lookup) or "store" (the suffix store)


def plan_batch(rows: list[RowOption], costs: CostModel, *, fixed_width: int = 0,
               min_gain: float = MIN_GAIN) -> list[Plan]:
    """One draft length K for a whole batch, and each row's proposer at that K.

    In a batched step every request pays for the widest proposal (the target verifies a padded block of
    K + 1 tokens per row), so per-row choices made as if alone overspend: the batch picks the K in
    0..max gamma with the largest  sum_r E(alpha_r, min(K, gamma_r)) / T(K)  where
    T(K) = target_s(rows * (max(K, fixed_width) + 1)) + K * draft_forward_s(drafting rows) + overhead,
    and each row takes the draft or the n-gram lookup, whichever emits more at that K (the lookup costs no
    draft forward). `fixed_width`: the widest proposal of rows that plan for themselves (fixed gamma,
    seeded requests), which the block pays anyway. Drafting must beat K = 0 by `min_gain`."""
    n = len(rows)
    if n == 0:
        return []
    max_k = max(r.gamma for r in rows)

    def choose(K: int) -> tuple[float, float, list[Plan]]:
        plans, tokens, drows = [], 0.0, 0
        for r in rows:
            e_d = expected_tokens(r.alpha_draft, min(K, r.gamma)) if r.alpha_draft is not None and K else 1.0
            kn = min(K, r.gamma, r.ngram_available) if r.alpha_ngram is not None else 0
            e_n = expected_tokens(r.alpha_ngram, kn) if kn else 1.0
            if kn and e_n >= e_d:
                plans.append(Plan("ngram", kn, source=r.ngram_source))
                tokens += e_n
            elif K and r.alpha_draft is not None:
                plans.append(Plan("draft", min(K, r.gamma)))
                tokens += e_d
                drows += r.draft_rows
            else:
                plans.append(Plan("none", 0))
                tokens += 1.0
        width = max(K, fixed_width) + 1
        t = costs.target_s(n * width) + (K * costs.draft_forward_s(drows) if drows else 0.0) \
            + costs.overhead_s(K > 0, n)
        return tokens / t, t, plans

    rate0, _, plans0 = choose(0)
    best_rate, best = rate0, plans0
    for K in range(1, max_k + 1):
        rate, _, plans = choose(K)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best = rate, plans
    if best is not plans0 and best_rate < rate0 * (1 + min_gain):
        return plans0
    return best
