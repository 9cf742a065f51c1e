"""The served default's drafter, chosen by measured speed (`ServiceSettings.auto_choice`, mode "auto").

A replica that has both the Medusa heads and the draft model can serve a request that names no mode either way:
"medusa" (the heads' tree, adaptive depth) or "mjsd" (the draft model's beams, adaptive length). Which one is
faster depends on the host and the traffic. On a host where a tree node costs almost a target step (AVX2, fp32),
the 2-layer draft won on GSM8K at T=0 (1.72x against 1.48x) and at T=1 (1.67x against 1.18x); on bf16 hosts the
heads won at T=0 (docs/benchmarks.md, the thirty-fifth and thirty-second sessions). So "auto" measures instead of
assuming: `ModeChooser` is an epsilon-greedy bandit over the candidate modes on each replica's own traffic.

- Each finished request that the chooser routed is one observation: its completion tokens and its decoding wall
  time (`GenerationStats.wall_time_s`) less the time it waited while the replica stepped requests that were not in
  its pass (`other_steps_s`, serving/scheduler.py `_round`). Requests of one drafter share a pass (the draft's
  chains batch together, the heads' trees too), but a draft request and a heads request in flight together each
  wait through the other's pass. So the drafter that won the warm-up got a partner of its own kind almost always,
  and the other was measured beside it, paying both passes: on an AMX host in the fortieth session, at two
  clients, the heads' requests ran at 6-17 tok/s against 26 on the draft, and lost (docs/benchmarks.md). Left out,
  each drafter is measured as it would run if it served the traffic alone. A request shorter than MIN_TOKENS is
  not counted: prefill dominates it.
- With `discard_cold` (a replica's chooser) each candidate's first counted request is left out: it pays the
  drafter's cold start (first shapes, lazy allocations). Measured on an AVX2 host, the draft's first request ran
  at 7.7 tok/s and its next at 22.8, and that one figure sent every later request to the heads
  (docs/benchmarks.md, "The thirty-seventh session").
- Observations are kept per key: the sampling bucket ("greedy" at T=0, "sampled" above: the rules differ) and
  the request's traffic label (`metadata.category`), and pooled per bucket. A candidate's speed is the
  token-weighted rate of its last WINDOW observations (tokens / seconds), so it follows drift (a promoted heads
  version, a shift of traffic) within WINDOW of that candidate's requests.
- Choosing for a key: while a candidate has fewer than MIN_OBSERVATIONS in the bucket's pool (either state), it
  gets the request (the one routed the fewest requests first, so concurrent requests that start before any has
  ended alternate too; ties go to the static order, heads first). Then the first of these where every candidate
  has MIN_OBSERVATIONS decides: the label in the request's state, the label in the other state, the pool in the
  request's state, the pool in the other state (else both states' pool together); the fastest candidate gets the
  request except for an exploration share that goes to another, so a loser is re-measured as heads and draft
  improve online.
- The exploration share shrinks with the gap (`explore_share`): EXPLORE for a loser as fast as the best, falling
  linearly to EXPLORE x EXPLORE_FLOOR at EXPLORE_GAP slower and beyond. A close loser may overtake soon and is
  re-measured often; a far one needs a large gain first, and each request sent to it costs the gap. In the
  thirty-eighth session's online run a flat 10% sent 104 of 1,000 requests to the draft at 18-19 tok/s against
  23-30 on the heads (docs/benchmarks.md); at that gap (about 0.7x) the share is now under 3%. A loser at half
  the speed or less is still tried about once in 50 requests. That shrinking waits until the loser's figures in
  the key that decides are steady (STEADY observations); before, the loser gets the full EXPLORE share. Its
  figures are otherwise the warm-up's few requests, which a new version's controller serves cautiously (it drafts
  only where drafting pays at the pessimistic end of an estimate without evidence, serving/controller.py): in the
  forty-first session's online run the heads' first requests ran at 9-12 tok/s (18 tok/s of their own time, to the
  draft's 29), and at the 2% share they then got, their next 2 requests, at 32.5 tok/s of their own time, came
  at 325 and 348 s; the heads took the traffic only at 900 s (docs/results/online-2026-12-01-fortyfirst-busy/).
- Figures taken while a job beside serving held cores are kept apart (`busy`: the replica yields those cores,
  serving/contention.py; a request counts as busy when it ran more than half its time so, `beside_jobs_s`). A
  loser's figures are renewed only by its exploration share, so they trail the winner's: when a job starts, the
  winner is measured beside it first and the loser's figures, taken between jobs, looked faster. In the fortieth
  session's online run that moved SQL, then JSON, to the draft for the job's 170 s and after it (25 of 31 SQL
  requests at 1,100-1,200 s), at accepted / proposed 0.49-0.52 against the heads' 0.68-0.73 (docs/benchmarks.md).
  So every comparison is between figures of one state: the request's own state where every candidate has
  MIN_OBSERVATIONS there, else the other state's (both taken between jobs, or both beside one).
- Figures are kept apart by company too (`ALONE` / `SHARED`). A request's own time still differs with its company:
  the drafter that wins steps in its own kind's batch (two rows in one pass cost more than one), while the
  explored one steps as the only row of its pass. Measured so, the loser's figure was a one-row pass against the
  winner's two-row one. In the forty-second session's online run on an AVX2 host, the heads got 59 of the 114
  requests on the known traffic at 7.8 tok/s a request against the draft's 10.2-12.8 (docs/benchmarks.md). The
  replica counts each request's steps in a shared pass and their time (`GenerationStats.shared_steps`,
  `shared_steps_s`); the chooser splits the request's tokens between the companies in proportion to its steps, its
  pass time as measured (its time outside any pass, its prefill, in proportion to steps), and compares steps taken
  alone first (the loser's exploration and the winner's requests beside it renew both), then shared steps, in
  each state and key order above.
- A drafter that changes is measured again (`forget`): when a replica hot-swaps a promoted version of the heads or
  of the draft, that candidate's figures are dropped everywhere and it warms up again (MIN_OBSERVATIONS requests).
  Its old figures measured another model. On an fp32 host in the thirty-ninth session the draft won the warm-up,
  the online loop then promoted five heads versions that raised their fixed-tree acceptance on the new traffic
  from 0.24 to 0.47, and the heads were sent 4 requests in 1,700 s (docs/benchmarks.md). Where the swapped
  candidate is the faster one, its re-measuring requests cost nothing.
- Seeded requests at T > 0 are not routed (`Service.request_mode`): a seed reproduces its text only on one mode,
  so they keep the static default (config.served_mode). At T = 0 both modes emit the target's greedy text.

What it costs: while warming up, MIN_OBSERVATIONS requests per bucket go to the slower candidate, and afterwards an
exploration share of at most EXPLORE, times the gap's cost. What it does not see: how much a larger batch of one
kind costs each of its rows (each request's own rate under the load of its time is what is compared).
"""
from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field

MIN_TOKENS = 8              # a shorter request measures its prefill, not its drafter
MIN_OBSERVATIONS = 4        # per candidate in a bucket's pool before the figures decide
WINDOW = 24                 # the latest observations per candidate and key that make its rate
EXPLORE = 0.1               # the share of decided requests sent to a loser as fast as the fastest candidate
EXPLORE_GAP = 0.4           # a loser this much slower (relative) or more gets only EXPLORE_FLOOR of that share
EXPLORE_FLOOR = 0.2         # so a loser at any speed is still re-measured now and then (0.02 of the requests)
STEADY = WINDOW // 2        # a loser's figures count as steady from this many observations (the gap shrinks its share)
MAX_LABELS = 64             # labelled keys kept per bucket (the oldest label is forgotten past it)


def explore_share(base: float, loser_rate: float, best_rate: float) -> float:
    """The share of decided requests a loser gets: `base` when it is as fast as the best, falling linearly with
    its relative gap to `base` x EXPLORE_FLOOR at EXPLORE_GAP slower and beyond (module docstring)."""
    if not best_rate > 0:
        return base
    gap = max(0.0, 1.0 - loser_rate / best_rate)
    return base * max(EXPLORE_FLOOR, 1.0 - gap / EXPLORE_GAP)


def bucket_of(temperature: float) -> str:
    """The sampling bucket a request's figures count in: greedy (T=0) or sampled."""
    return "greedy" if temperature == 0 else "sampled"


QUIET, BUSY = "quiet", "busy"    # figures taken between jobs / while a job beside serving held cores
ALONE, SHARED = "alone", "shared"    # steps a request took as the only row of its pass / in its kind's batch


@dataclass
class _Arm:
    obs: deque = field(default_factory=lambda: deque(maxlen=WINDOW))     # (tokens, seconds)
    total: int = 0                                                        # observations ever
    routed: int = 0                                                       # requests chosen for it ever

    def rate(self) -> float | None:
        return token_rate(self.obs)


def token_rate(obs) -> float | None:
    """The token-weighted rate of (tokens, seconds) observations; None without any time."""
    s = sum(sec for _, sec in obs)
    return sum(t for t, _ in obs) / s if s > 0 else None


class ModeChooser:
    """Chooses among `candidates` (the static order breaks ties) per request; thread-safe."""

    def __init__(self, candidates: tuple[str, ...], *, explore: float = EXPLORE,
                 min_observations: int = MIN_OBSERVATIONS, rng: random.Random | None = None,
                 discard_cold: bool = False) -> None:
        if len(candidates) < 2 or len(set(candidates)) != len(candidates):
            raise ValueError(f"a choice needs two or more distinct candidates, got {candidates!r}")
        if not 0.0 <= explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {explore!r}")
        if not isinstance(min_observations, int) or min_observations < 1:
            raise ValueError(f"min_observations must be an integer >= 1, got {min_observations!r}")
        self.candidates = tuple(candidates)
        self.explore = explore
        self.min_observations = min_observations
        self.rng = rng or random.Random()
        self._lock = threading.Lock()
        # (bucket, label, state, company) -> arms
        self._keys: dict[tuple[str, str, str, str], dict[str, _Arm]] = {}
        self._routed: dict[tuple[str, str], int] = {}                       # (bucket, mode) -> requests routed
        self._counted: dict[tuple[str, str], int] = {}                      # (bucket, mode) -> requests counted
        self._chosen = {"warmup": 0, "fastest": 0, "explore": 0}
        self._forgotten = {m: 0 for m in self.candidates}    # times a candidate's figures were dropped (`forget`)
        self._cold = set(self.candidates) if discard_cold else set()    # whose first request is still to come

    def _arms(self, key: tuple[str, str, str, str]) -> dict[str, _Arm]:
        arms = self._keys.get(key)
        if arms is None:
            labelled = [k for k in self._keys if k[0] == key[0] and k[1]]
            if key[1] and len({k[1] for k in labelled}) >= MAX_LABELS:
                oldest = labelled[0][1]                   # dicts keep insertion order: the oldest label goes
                for k in [k for k in labelled if k[1] == oldest]:
                    del self._keys[k]
            arms = self._keys[key] = {m: _Arm() for m in self.candidates}
        return arms

    def _decided(self, arms: dict[str, _Arm] | None) -> dict[str, tuple[float, int]] | None:
        """Each candidate's (rate, observations in the window) where every one has MIN_OBSERVATIONS, else None."""
        if arms is None:
            return None
        rates = {m: a.rate() for m, a in arms.items()}
        if any(len(a.obs) < self.min_observations or rates[m] is None for m, a in arms.items()):
            return None
        return {m: (rates[m], len(a.obs)) for m, a in arms.items()}

    def _pool(self, bucket: str, mode: str, company: tuple[str, ...] = (ALONE, SHARED)) -> list:
        """`mode`'s observations in the bucket's pool of both states (of the given companies)."""
        return [o for st in (QUIET, BUSY) for co in company if (bucket, "", st, co) in self._keys
                for o in self._keys[(bucket, "", st, co)][mode].obs]

    def _seen(self, bucket: str, mode: str) -> int:
        """Requests of `mode` counted in the bucket since its figures were last dropped (one request can add a
        step-share to both companies)."""
        return self._counted.get((bucket, mode), 0)

    def _merged(self, bucket: str) -> dict[str, tuple[float, int]]:
        """Each candidate's (rate, observations) over the bucket's pool of both states and companies: where no key
        has MIN_OBSERVATIONS of every candidate (warm-up counts them all)."""
        return {m: (token_rate(self._pool(bucket, m)) or 0.0, self._seen(bucket, m)) for m in self.candidates}

    def choose(self, temperature: float, label: str = "", busy: bool = False) -> tuple[str, str]:
        """(mode, why) for a request: why is "warmup", "fastest" or "explore". `busy`: a job beside serving holds
        cores now (the figures of that state decide where they can, module docstring)."""
        bucket = bucket_of(temperature)
        state, other = (BUSY, QUIET) if busy else (QUIET, BUSY)
        with self._lock:
            short = [m for m in self.candidates if self._seen(bucket, m) < self.min_observations]
            if short:
                # by requests routed, not observed: concurrent requests are routed before the first ends
                mode = min(short, key=lambda m: self._routed.get((bucket, m), 0))
                why = "warmup"
            else:
                # steps taken alone first: the explored drafter runs as the only row of its pass, the winner
                # mostly in its own kind's batch (module docstring, "company")
                order = [(bucket, lb, st, co) for lb in ([label, ""] if label else [""]) for st in (state, other)
                         for co in (ALONE, SHARED)]
                figures = next((r for r in (self._decided(self._keys.get(k)) for k in order) if r is not None),
                               None) or self._merged(bucket)
                best = max(self.candidates, key=lambda m: figures[m][0])
                # a loser measured on fewer than STEADY requests keeps the full share (module docstring)
                shares = {m: explore_share(self.explore, figures[m][0], figures[best][0]) if figures[m][1] >= STEADY
                          else self.explore for m in self.candidates if m != best}
                # the nearest loser's share is the total; each loser's part is in proportion to its own
                total = max(shares.values())
                if total and self.rng.random() < total:
                    losers = list(shares)
                    mode = self.rng.choices(losers, weights=[shares[m] for m in losers])[0]
                    why = "explore"
                else:
                    mode, why = best, "fastest"
            self._routed[(bucket, mode)] = self._routed.get((bucket, mode), 0) + 1
            self._chosen[why] += 1
            return mode, why

    def observe(self, mode: str, temperature: float, label: str, tokens: int, seconds: float,
                busy: bool = False, shared_share: float = 0.0, shared_s: float = 0.0) -> bool:
        """Count one finished request routed by `choose`; returns whether it counted (a known mode, at least
        MIN_TOKENS tokens, a positive time, not a candidate's cold first request under `discard_cold`). `busy`: it
        ran mostly while a job beside serving held cores. `shared_share` of its steps, taking `shared_s` of its
        `seconds`, were in a pass shared with other requests' rows: its tokens are split between the two companies
        in proportion to steps, its seconds as measured (module docstring, "company")."""
        if mode not in self.candidates or tokens < MIN_TOKENS or not seconds > 0:
            return False
        bucket, state = bucket_of(temperature), BUSY if busy else QUIET
        share = min(1.0, max(0.0, float(shared_share)))
        shared_s = min(float(seconds), max(0.0, float(shared_s)))
        split = ((ALONE, 1.0 - share, seconds - shared_s), (SHARED, share, shared_s))
        if any((w > 0) != (sec > 0) for _, w, sec in split):   # steps and seconds that disagree: as measured
            parts = [(ALONE, float(tokens), float(seconds))]
        else:
            parts = [(co, tokens * w, sec) for co, w, sec in split if w > 0]
        with self._lock:
            if mode in self._cold:          # the replica's first request on it: its cold start, not its speed
                self._cold.discard(mode)
                return False
            self._counted[(bucket, mode)] = self._counted.get((bucket, mode), 0) + 1
            for co, toks, sec in parts:
                for key in {(bucket, "", state, co), (bucket, label, state, co)}:
                    arm = self._arms(key)[mode]
                    arm.obs.append((float(toks), float(sec)))
                    arm.total += 1
        return True

    def forget(self, mode: str) -> bool:
        """Drop `mode`'s figures in every bucket and label: its drafter changed (a promoted version was swapped
        in), so it warms up again. False for a mode that is not a candidate."""
        if mode not in self.candidates:
            return False
        with self._lock:
            dropped = False
            for arms in self._keys.values():
                dropped |= bool(arms[mode].obs)
                arms[mode].obs.clear()
            for key in [k for k in self._counted if k[1] == mode]:
                del self._counted[key]
            self._forgotten[mode] += dropped        # counts the swaps that dropped figures
        return True

    def snapshot(self) -> dict:
        """For /health: per bucket (and label), each candidate's tokens/s between jobs with the observations it is
        made of (its latest WINDOW; none after a swap, `forget`) and those ever counted, the same under "busy" for
        figures taken beside a job, and how many requests were routed by warm-up, by speed and by exploration."""
        with self._lock:
            out: dict = {"candidates": list(self.candidates), "explore": self.explore, "chosen": dict(self._chosen),
                         "remeasured_after_swap": dict(self._forgotten)}
            for (bucket, label, state, company), arms in self._keys.items():
                rates = {m: a.rate() for m, a in arms.items()}
                figures = {m: {"tokens_per_s": None if rates[m] is None else round(rates[m], 2),
                               "observations": len(a.obs), "observed_ever": a.total} for m, a in arms.items()}
                into = out if state == QUIET else out.setdefault(BUSY, {})
                if company == SHARED:
                    into = into.setdefault(SHARED, {})
                if label:
                    into.setdefault("labels", {}).setdefault(bucket, {})[label] = figures
                else:
                    into[bucket] = figures
            return out
