"""The replica's step scheduler: continuous batching of speculative decoding across requests.

One thread owns the models. Every round it
1. takes new requests (admitted while their KV footprint fits the replica's token budget),
2. prefills waiting prompts in chunks (at most `prefill_chunk` tokens per round, so a long prompt does
   not stall the others), each alone into a batch-1 cache that then joins the batch,
3. runs ONE batched step for every request of a batched mode (serving/modes.py):
   - the controller (serving/controller.py) of each request chooses its proposer and k (0..gamma);
   - one draft forward catches every row up, then the chains and MJSD beam groups of all requests
     advance together, one forward per drafted position, on a fork of the draft cache whose rows are
     each request's chain (1 row) or beams (its beam width);
   - one target forward verifies every request's proposal: ragged blocks, left-padded, with position ids
     and masks (serving/kvcache.py), so requests of any length and any k share the pass;
   - each request's own rule, sampling parameters and generator decide its accepted prefix; rejected
     slots become holes in both caches,
4. runs ONE target pass for every medusa request (the served default with heads): each row's controller
   picks its tree's depth, its heads read the hidden state its last pass left, and the rows' blocks (the
   context its cache lacks, its root, its tree) are verified together under per-row tree masks; each
   row's rule keeps a path plus one target token and the cache keeps that path only (`_tree_step`),
5. runs one step of each request whose mode cannot batch (staged, bild, spectr, tree, eagle) alone,
6. emits tokens, retires finished or cancelled requests (their rows leave the caches) and squeezes the
   caches' holes out when they grow.

Requests join and leave between rounds. A hot-swapped draft takes effect at the next round: the draft
cache is rebuilt for the new model (every row re-fed once), and each step is attributed to the draft
version that proposed it.

Canary (issue 17): while the engine holds a canary draft (`Engine.set_canary`), the requests routed to it
(`Request.arm`, by a hash of the request id) draft with it and the others with the champion, in the SAME
batch: there is one draft cache per live draft model, each with a row for every batch row (rows of the
other draft stay empty, as target-only rows always did), and step 3's proposal runs once per draft group
(its own catch-up forward and fork), while the target forward still verifies every row at once. Rows of
two drafts never share a draft forward, so each proposal is exactly its draft's. The cost: with both
drafts in a batch a step takes two sets of draft forwards (each group's catch-up also pads over the other
group's rows), and since both arms share the rounds, a request's tokens/s reflects both drafts' cost; the
canary comparison of tokens/s therefore mainly measures acceptance, not a difference in draft cost
(per-replica time slicing would isolate cost but compare different traffic and time). A request whose
canary goes away (promoted or dropped) drafts with the champion from its next step on. A failed batched forward fails the requests of that round (their clients get
the error) and leaves the scheduler running for the rest.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from buffer.records import RecordSink, SequenceRecord, StepRecord
from serving.config import ADAPTIVE_TREE_MODES, TREE_BATCHED_MODES, SamplingParams, SpecParams
from serving.controller import CostModel, Plan, RequestController, RowOption, plan_batch
from serving.decoding.bild import bild_should_fallback
from serving.decoding.mjsd import beam_sample_finalize, beam_sample_step
from serving.decoding.tree import TreeVerifyResult, tree_branching, tree_size, verdict_on_demand
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample, warp_logprobs
from serving.kvcache import BatchKV, PrefixCache
from serving.models import release_openmp_threads
from serving.modes import MODE_TABLE, VERIFY_RULES, proposer
from serving.runner import SequenceRunner, full_vocab_logits

if TYPE_CHECKING:
    from serving.engine import Engine, GenerationStats

log = logging.getLogger(__name__)
SCHEDULER_THREAD = "batch-scheduler"   # the one thread that runs the models' decoding steps

IDLE_EXIT_S = 30.0   # the scheduler thread exits after this long with nothing to do (restarted on submit)
_EXIT = object()     # put in a scheduler's inbox at interpreter exit: its thread ends there (_stop_all)
_LIVE: "weakref.WeakSet[BatchScheduler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """End every scheduler thread before the interpreter tears torch down: a daemon thread that has run
    torch ops and is still alive at exit can make the process abort ("terminate called without an active
    exception", exit status 134) after its work is done, seen with in-process scripts and test runs."""
    for sched in list(_LIVE):
        t = sched._thread
        if t is not None and t.is_alive():
            sched._inbox.put(_EXIT)
            t.join(timeout=10.0)


@dataclass
class Request:
    """One request as the scheduler sees it. The engine's `generate()` reads `out`."""

    id: str
    prompt: list[int]
    sampling: SamplingParams
    spec: SpecParams
    gen: torch.Generator
    stats: "GenerationStats"
    stop_ids: set[int]
    footprint: int                       # KV tokens it may hold at most (budget accounting)
    sink: RecordSink | None = None
    log_mode: str = "full"
    source: str = ""
    cancel: threading.Event | None = None
    controller: RequestController | None = None
    arm: str = "champion"                # "canary": drafts with the engine's canary while it has one
    costs: CostModel | None = None       # where its steps' costs go when it steps alone (None: the engine's)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    closed: threading.Event = field(default_factory=threading.Event)   # the consumer went away
    seq: list[int] = field(default_factory=list)
    solo: object | None = None           # engine._RequestState of a mode that runs alone
    prefill: SequenceRunner | None = None
    hidden: torch.Tensor | None = None   # a tree row (medusa): the target's last hidden state at seq[-2] ...
    hidden_for: int = -1                 # ... valid while len(seq) equals this
    recorded_steps: int = 0
    t_start: float = 0.0
    energy0: object = None
    done: bool = False

    def __post_init__(self) -> None:
        self.seq = list(self.prompt)

    @property
    def gone(self) -> bool:
        return self.closed.is_set() or (self.cancel is not None and self.cancel.is_set())


@dataclass
class _TreeStep:
    """A tree row's proposal for one step of the tree batch (BatchScheduler._tree_block)."""
    plan: Plan | None
    tree: object                 # serving.decoding.tree.DraftTree
    node_logq: torch.Tensor | None
    warp: object
    version: str                 # the heads version that proposed it
    block: list[int]             # the context its cache lacks (ending with the root), then the nodes
    mask: torch.Tensor           # [len(block), len(block)] bool
    positions: torch.Tensor      # [len(block)] offsets from the row's next position
    context: int                 # tokens of the block before the nodes
    draft_s: float


@dataclass
class _RowPlan:
    proposer: str            # "none", "chain", "beams", "ngram"
    k: int
    plan: Plan | None = None
    ngram: list[int] = field(default_factory=list)


class BatchScheduler:
    """See the module docstring. `submit` is thread-safe; everything else runs on the scheduler thread."""

    def __init__(self, engine: "Engine", *, max_batch_tokens: int, prefill_chunk: int = 512,
                 compact_slack: int = 64) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.compact_slack = compact_slack
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.waiting: list[Request] = []     # not yet admitted (budget)
        self.prefilling: list[Request] = []  # admitted, prompt being prefilled
        self.batch: list[Request] = []       # rows of tkv / dkv, in order
        self.solo: list[Request] = []        # modes that run alone
        self.trees: list[Request] = []       # rows of tree_kv: the heads' trees, verified together (medusa)
        self.tkv: BatchKV | None = None
        self.tree_kv: BatchKV | None = None  # the target's cache of the tree rows
        self.dkvs: list[BatchKV] = []        # one draft cache per live draft model (champion, canary)
        self.rounds = 0
        self._steady_draft = True
        self._fork_rows = 0          # rows of the last batched draft proposal (0: nothing drafted)
        self._forwards = 0           # draft forwards it took
        self._groups: list[tuple[int, int, float]] = []   # per draft group: (fork rows, forwards, seconds)
        self._row_draft_s: list[float] = []               # draft seconds of each row's group this step
        self.batch_sizes: dict[int, int] = {}    # rows per batched step -> count (telemetry)
        # torch threads for prompt prefill (None: the decoding steps' count). A prefill is one compute-bound
        # forward over the whole prompt, where a second core nearly halves the time, while batch-1 decoding
        # steps are faster on the replica's one thread (docs/benchmarks.md); the replica sets it
        # (ServiceSettings.prefill_threads) so a new request's first token waits less
        self.prefill_threads: int | None = None
        # torch threads for a step that drafts (None: the decoding steps' count). Its target pass verifies k + 1
        # tokens per row (a tree: its nodes) and is compute-bound like a prefill, while a plain step's one token
        # is not; on a replica that decodes on one thread to leave a core to the Serve proxy, a drafting step
        # priced at one thread made drafting outside the easiest traffic look not worth it (docs/benchmarks.md,
        # "The thirty-eighth session"); the replica sets it (ServiceSettings.wide_threads)
        self.wide_threads: int | None = None
        # cores that processes beside serving hold now (serving/contention.py ContentionWatch; None: not watched,
        # the replica sets one): every thread count above runs that many lower meanwhile, at least 1
        self.contention = None
        self._busy = 0
        self.on_round = None                     # test hook: called with self after every round
        self.prefix_cache = PrefixCache()        # target KV of recent prompts (shared prefixes prefill once)

    # ------------------------------------------------------------------ public
    def submit(self, req: Request) -> None:
        self._inbox.put(req)
        _LIVE.add(self)
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=SCHEDULER_THREAD, daemon=True)
                self._thread.start()

    @property
    def used_tokens(self) -> int:
        return sum(r.footprint for r in self.prefilling + self.batch + self.solo + self.trees)

    def snapshot(self) -> dict:
        return {"running": len(self.batch) + len(self.solo) + len(self.trees), "prefilling": len(self.prefilling),
                "waiting": len(self.waiting), "kv_budget_tokens": self.max_batch_tokens,
                "kv_reserved_tokens": self.used_tokens,
                "target_cache_slots": self.tkv.slots if self.tkv else 0,
                "prefix_cache_hits": self.prefix_cache.hits, "prefix_cache_lookups": self.prefix_cache.lookups,
                "prefix_tokens_saved": self.prefix_cache.tokens_saved}

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        idle_since = time.monotonic()
        pooled = False                  # a round ran since this thread last gave back its OpenMP workers
        while True:
            active = self.waiting or self.prefilling or self.batch or self.solo or self.trees
            if pooled and not active:
                # about to wait idle: give back this thread's OpenMP workers (serving/models.py
                # release_openmp_threads), so a calibration or a load in another thread meanwhile is not slowed
                # by them; the next round makes them again
                release_openmp_threads()
                pooled = False
            try:
                timeout = 0.0 if active else max(0.0, IDLE_EXIT_S - (time.monotonic() - idle_since))
                req = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
                while True:
                    if req is _EXIT:
                        with self._start_lock:
                            self._thread = None
                        return
                    self.waiting.append(req)
                    req = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if not (self.waiting or self.prefilling or self.batch or self.solo or self.trees):
                if time.monotonic() - idle_since >= IDLE_EXIT_S:
                    with self._start_lock:
                        if self._inbox.empty():
                            self._thread = None
                            self.tkv, self.dkvs, self.tree_kv = None, [], None
                            return
                continue
            pooled = True
            try:
                self._round()
            except Exception as exc:   # noqa: BLE001 - the loop must survive anything a round throws
                # a fault outside the guarded forwards (bookkeeping): fail what is running rather than
                # repeat it every round, and start the caches afresh
                log.exception("scheduler round failed; failing the running requests")
                for req in self.prefilling + self.batch + self.solo + self.trees:
                    self._fail(req, exc)
                self.tkv, self.dkvs, self.tree_kv = None, [], None
            idle_since = time.monotonic()

    def _round(self) -> None:
        self.rounds += 1
        self._retire_gone()
        self._admit()
        self._busy = self.contention.busy_cores() if self.contention is not None else 0
        running = (self.prefilling + self.batch + self.solo + self.trees) if self._busy else ()
        t_round = time.perf_counter()
        with self._threads(self._capped(torch.get_num_threads())):
            if self.prefilling:
                with self._prefill_threads():
                    self._prefill()
            groups = [([req], lambda req=req: self._solo_step(req)) for req in list(self.solo)]
            if self.batch:
                groups.append((list(self.batch), self._batch_step))
            if self.trees:
                groups.append((list(self.trees), self._tree_step))
            for members, step in groups:
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                for req in members:
                    req.stats.own_steps_s += dt
                    if len(members) > 1:     # a step in a pass shared with other rows (its own kind's batch)
                        req.stats.shared_steps += 1
                        req.stats.shared_steps_s += dt
                for others, _ in groups:     # who waited through a pass they were not part of
                    if others is not members:
                        for req in others:
                            if not req.done:
                                req.stats.other_steps_s += dt
        if self._busy:                       # a round on fewer threads: jobs beside serving held cores
            dt = time.perf_counter() - t_round
            for req in running:
                if not req.done:
                    req.stats.beside_jobs_s += dt
        self._compact()
        if self.on_round is not None:
            with self.engine._lock:
                self.on_round(self)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        for req in list(self.waiting):
            if self.used_tokens + req.footprint > self.max_batch_tokens and (self.batch or self.solo
                                                                              or self.prefilling):
                break   # first come, first served: later requests wait behind it
            self.waiting.remove(req)
            req.t_start = time.perf_counter()
            req.energy0 = self.engine._energy.read_mj()
            if MODE_TABLE[req.spec.mode].batched or self._tree_row(req):
                self.prefilling.append(req)
            else:
                from serving.engine import _RequestState

                req.solo = _RequestState(self.engine, req.prompt, req.arm)
                self.solo.append(req)

    def _capped(self, n: int | None) -> int | None:
        """`n` threads less the cores that jobs beside serving hold this round (serving/contention.py), at least 1;
        None stays None (unchanged)."""
        return max(1, n - self._busy) if n and self._busy else n

    def _prefill_threads(self):
        return self._threads(self._capped(self.prefill_threads))

    def _wide_threads(self, drafting: bool):
        """`wide_threads` inside the block when the step drafts (verifies more than one token per row)."""
        return self._threads(self._capped(self.wide_threads) if drafting else None)

    @staticmethod
    @contextlib.contextmanager
    def _threads(n: int | None):
        """torch on `n` threads inside the block (this thread is the only one running the models, so the
        process-wide setting is this thread's), restored after; None or 0: unchanged."""
        before = torch.get_num_threads()
        if not n or n == before:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _prefill(self) -> None:
        """Up to `prefill_chunk` prompt tokens this round; a finished prompt joins the batch."""
        budget = self.prefill_chunk
        eng = self.engine
        for req in list(self.prefilling):
            if budget <= 0:
                break
            tree = self._tree_row(req)
            if req.prefill is None:
                req.prefill = SequenceRunner(eng.target, eng.vocab_size)
                # a tree row's heads read the hidden state of the prompt's last fed token: it feeds at least one
                hit, cache = self.prefix_cache.get(req.seq[: len(req.seq) - 1 - tree])
                if hit:
                    req.prefill.cache, req.prefill.length = cache, hit
            todo = req.seq[req.prefill.length: len(req.seq) - 1]
            chunk = todo[:budget]
            with eng._lock:
                try:
                    if chunk:
                        t0 = time.perf_counter()
                        if tree and len(chunk) == len(todo):    # the prompt's last chunk: its hidden state too
                            req.hidden, req.hidden_for = req.prefill.feed_hidden(chunk), len(req.seq)
                        else:
                            req.prefill.feed(chunk, keep=1)
                        req.stats.target_time_s += time.perf_counter() - t0
                    budget -= max(1, len(chunk))
                    if req.prefill.length == len(req.seq) - 1:
                        self._join(req)
                except Exception as exc:  # noqa: BLE001
                    eng._step_failed(exc)
                    self._fail(req, exc)

    def _join(self, req: Request) -> None:
        """A prefilled request becomes a row of both batch caches."""
        eng = self.engine
        n = len(req.seq) - 1
        if n:
            self.prefix_cache.put(req.seq[:n], req.prefill.cache)
        if self._tree_row(req):
            if self.tree_kv is None:
                self.tree_kv = BatchKV(eng.target.model, eng.target_device)
            self.tree_kv.add_row(req.prefill.cache if n else None, n)
            req.prefill = None
            self.prefilling.remove(req)
            self.trees.append(req)
            return
        if self.tkv is None:
            self.tkv = BatchKV(eng.target.model, eng.target_device)
        self._sync_draft_cache()
        self.tkv.add_row(req.prefill.cache if n else None, n)
        own = eng.draft_for(req)[0] if req.spec.needs_draft else None
        for dkv in self.dkvs:
            if own is None or dkv.model is not own.model:
                dkv.add_row(None, 0)      # target / ngram rows, rows of the other draft: this draft never reads them
                continue
            t0 = time.perf_counter()
            d = SequenceRunner(own, eng.vocab_size)
            if n:
                d.feed(req.seq[:n], keep=1)
            dkv.add_row(d.cache if n else None, n)
            req.stats.draft_time_s += time.perf_counter() - t0
        req.prefill = None
        self.prefilling.remove(req)
        self.batch.append(req)

    def _sync_draft_cache(self) -> None:
        """One draft cache per live draft model (the champion's, and the canary's during a canary), each
        with a row per batch row. A cache belongs to one model: after a hot-swap the new model's cache
        starts empty, with every row re-fed at its next draft forward; a model no longer live loses its cache."""
        eng = self.engine
        live = [m.model for m in (eng.draft, eng.canary) if m is not None]
        self.dkvs = [kv for kv in self.dkvs if any(kv.model is m for m in live)]
        for m in live:
            if not any(kv.model is m for kv in self.dkvs):
                kv = BatchKV(m, eng.target_device)
                for _ in self.batch:
                    kv.add_row(None, 0)
                self.dkvs.append(kv)

    def _dkv_for(self, loaded) -> BatchKV | None:
        if loaded is None:
            return None
        return next((kv for kv in self.dkvs if kv.model is loaded.model), None)

    @property
    def dkv(self) -> BatchKV | None:
        """The champion draft's cache (tools and tests read it); `dkvs` holds every live draft's."""
        return self._dkv_for(self.engine.draft)

    # ------------------------------------------------------------------ leaving
    def _retire_gone(self) -> None:
        for req in [r for r in self.waiting + self.prefilling + self.solo + self.batch + self.trees if r.gone]:
            self._finish(req, "cancelled", [])

    def _remove(self, req: Request) -> None:
        for lst in (self.waiting, self.prefilling, self.solo):
            if req in lst:
                lst.remove(req)
        if req in self.batch:
            # the last row takes the leaving row's place in the caches (BatchKV.remove moves one row, where
            # a selection of the other rows would copy every cache) and in the batch list
            row = self.batch.index(req)
            for kv in (self.tkv, *self.dkvs):
                if kv is not None:
                    kv.remove(row)
            self.batch[row] = self.batch[-1]
            self.batch.pop()
        if req in self.trees:
            row = self.trees.index(req)
            if self.tree_kv is not None:
                self.tree_kv.remove(row)
            self.trees[row] = self.trees[-1]
            self.trees.pop()

    def _compact(self) -> None:
        for kv in (self.tkv, self.tree_kv, *self.dkvs):
            if kv is not None and kv.rows:
                kv.compact(self.compact_slack)
        if self.tkv is not None and not self.batch:
            self.tkv = BatchKV(self.engine.target.model, self.engine.target_device)
            self.dkvs = [BatchKV(kv.model, self.engine.target_device) for kv in self.dkvs]
        if self.tree_kv is not None and not self.trees:
            self.tree_kv = None

    # ------------------------------------------------------------------ output
    def _emit(self, req: Request, new: list[int]) -> None:
        """Stop tokens, then length; hand the tokens to the consumer."""
        stats = req.stats
        finish = None
        out: list[int] = []
        for t in new:
            out.append(t)
            if t in req.stop_ids:
                finish = "stop"
                break
        if finish is None and stats.tokens + len(out) >= req.sampling.max_tokens:
            out = out[: req.sampling.max_tokens - stats.tokens]
            finish = "length"
        if finish is None and len(req.seq) >= self.engine.max_context:
            finish = "length"
        stats.tokens += len(out)
        if finish is not None:
            self._finish(req, finish, out)
        else:
            stats.wall_time_s = time.perf_counter() - req.t_start
            req.out.put(("step", out, None))

    def _finish(self, req: Request, reason: str, out: list[int]) -> None:
        if req.done:
            return
        req.done = True
        self._remove(req)
        stats = req.stats
        if req.t_start:
            self.engine._finish_stats(stats, req.t_start, req.energy0)
        if req.log_mode != "none":       # a request that keeps nothing in the buffer leaves nothing in the store
            self.engine.learn_answer(req.prompt, self._seq(req)[len(req.prompt): len(req.prompt) + stats.tokens],
                                     key=req.id)
        self._push_sequence(req)    # before the answer: whoever reads the finish finds the record there
        req.out.put(("step", out, reason))

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.done:
            return
        req.done = True
        self._remove(req)
        self._push_sequence(req)
        req.out.put(("error", exc, None))

    def _push_sequence(self, req: Request) -> None:
        recorded = req.recorded_steps + (req.solo.recorded_steps if req.solo is not None else 0)
        if req.sink is None or not recorded:
            return
        try:
            req.sink.push_sequence(SequenceRecord(
                request_id=req.id, token_ids=self._seq(req)[: len(req.prompt) + req.stats.tokens],
                prompt_len=len(req.prompt), draft_version=req.stats.draft_version, timestamp=time.time(),
                source=req.source, meta={"log_mode": req.log_mode,
                                         "draft_versions": list(req.stats.draft_versions)},
                target=getattr(self.engine, "target_sha256", None) or ""))
        except Exception as exc:  # noqa: BLE001 - a sink must never take a request down
            log.warning("replay buffer push failed: %s", exc)

    @staticmethod
    def _seq(req: Request) -> list[int]:
        return req.solo.seq if req.solo is not None else req.seq

    # ------------------------------------------------------------------ modes that run alone
    def _solo_step(self, req: Request) -> None:
        eng, st, spec = self.engine, req.solo, req.spec
        gamma = spec.gamma if spec.mode != "target" else 0
        room = eng.max_context - len(st.seq)
        with eng._lock:
            try:
                if spec.mode == "target" or room <= gamma + 1:
                    new = st.target_step(req.sampling, req.gen, req.stats)
                elif spec.mode in ADAPTIVE_TREE_MODES:
                    new = self._solo_tree_step(req)
                else:    # spec_step counts the step under the version that proposed it
                    new = st.spec_step(req.sampling, spec, req.gen, req.stats, req.id, req.sink)
                eng._failures = 0
            except Exception as exc:  # noqa: BLE001
                eng._step_failed(exc)
                self._fail(req, exc)
                return
        self._emit(req, new)

    def _solo_tree_step(self, req: Request) -> list[int]:
        """One step of a tree mode the controller can steer (medusa): with a controller (adaptive), it picks the
        tree's depth (0: a plain step) and learns what was accepted. Either way a step that re-fed no context
        teaches the cost model what verifying its tree and drafting its depth cost (a one-token verification
        is the plain step's own cost, so plain and drafting steps price each other as in the batched path;
        the calibration's fixed-depth medusa request measures the heads for the seeded requests' profile)."""
        eng, st, stats, ctrl, spec = self.engine, req.solo, req.stats, req.controller, req.spec
        plan = None
        if ctrl is not None:
            ctrl.version = eng.version_of(spec.mode, req.arm)
            plan = ctrl.plan(0)
            st.depth = plan.k
        draft_s, target_s, drafted = stats.draft_time_s, stats.target_time_s, stats.draft_tokens
        with self._wide_threads(plan is None or plan.k > 0):
            new = st.spec_step(req.sampling, spec, req.gen, stats, req.id, req.sink, record_plain=ctrl is not None)
        proposed = stats.draft_tokens - drafted
        if plan is not None:
            if plan.k == 0:
                stats.zero_draft_steps += 1
            elif plan.probe:
                stats.probe_steps += 1
            # a depth the heads' doubt pruned (serving/decoding/medusa.py, node_floor) counts as not accepted, and
            # its nodes per depth price the next plans (serving/controller.py, "Trees of Medusa heads")
            ctrl.observe(plan, len(new) - 1, plan.k if proposed else 0, nodes=st.depth_nodes)
        if not st.refed:
            costs = self._costs_for([req])
            costs.observe_target(st.verified, stats.target_time_s - target_s)
            if proposed:
                costs.observe_draft(spec.mode, proposed, stats.draft_time_s - draft_s)
        return new

    # ------------------------------------------------------------------ the heads' trees, batched
    def _tree_row(self, req: Request) -> bool:
        """Whether `req` steps as a row of the tree batch (mode medusa, unless the engine turns that off:
        `Engine.batch_trees`, the A/B switch of scripts/bench_load.py) rather than alone."""
        return req.spec.mode in TREE_BATCHED_MODES and self.engine.batch_trees

    def _tree_step(self) -> None:
        """One step of every tree row in ONE target pass: each row proposes its tree (`_tree_block`), the rows'
        blocks are verified together under per-row tree masks (serving/kvcache.py `BatchKV.feed_tree`), each
        row's own rule and generator keep a path plus one target token (`_accept_tree`), and the cache keeps
        those paths only (`BatchKV.keep_new`)."""
        eng = self.engine
        with eng._lock:
            reqs, kv = list(self.trees), self.tree_kv
            try:
                steps = [self._tree_block(req, kv.lengths[i]) for i, req in enumerate(reqs)]
                keep = max(1 + len(st.tree) for st in steps)
                width = max(len(st.block) for st in steps)
                t1 = time.perf_counter()
                with self._wide_threads(keep > 1):
                    _, hidden = kv.feed_tree([st.block for st in steps], [st.mask for st in steps],
                                             [st.positions for st in steps], keep, logits=False)
                    if eng.target_device.type == "cuda":
                        torch.cuda.synchronize(eng.target_device)
                    t_target = [time.perf_counter() - t1]
                    hiddens = [hidden[i, keep - len(st.tree) - 1:] for i, st in enumerate(steps)]
                    verdicts = [self._tree_verdict(req, st, h, t_target) for req, st, h in zip(reqs, steps, hiddens)]
                keeps, results = [], []
                for req, st, h, (rows, res) in zip(reqs, steps, hiddens, verdicts):
                    kept, new = self._accept_tree(req, st, rows, h, res, t_target[0], alone=len(reqs) == 1)
                    pad = width - len(st.block)
                    keeps.append([pad + j for j in kept])
                    results.append(new)
                kv.keep_new(width, keeps)
                eng._failures = 0
            except Exception as exc:  # noqa: BLE001
                self.tree_kv = None
                self._fail_step(reqs, exc, "tree")
                return
        self._emit_step(reqs, results)

    def _tree_block(self, req: Request, cached: int) -> "_TreeStep":
        """A tree row's proposal: its controller's depth (0: a plain step; also for the last tokens before the
        context limit), the heads' tree from the hidden state its last pass (or its prompt's prefill) left, and
        its block: the context its cache (`cached` tokens) lacks, ending with the root, then the nodes, with
        the block's mask (causal context, each node over its ancestors) and position offsets (a node's depth)."""
        from serving.engine import grafted_nodes, medusa_tree

        eng, spec, sampling = self.engine, req.spec, req.sampling
        t0 = time.perf_counter()
        heads = eng.heads_for("medusa", req.arm)[0]
        version = eng.version_of(spec.mode, req.arm)
        plan = None
        depth = min(spec.gamma, heads.config.num_heads)
        if req.controller is not None:
            req.controller.version = version
            plan = req.controller.plan(0)
            depth = min(depth, plan.k)
        room = eng.max_context - len(req.seq)
        if depth > 0 and room <= 1 + tree_size(tree_branching(depth, spec.extra["width"], spec.extra["branch"])) \
                + grafted_nodes(spec, depth):
            depth = 0
        warp = _warper(sampling)
        hidden = req.hidden if req.hidden_for == len(req.seq) else None
        tree, node_logq = medusa_tree(heads, hidden, req.seq[-1], depth, spec, sampling, warp, context=req.seq,
                                      store=eng.store_for(sampling))
        context = req.seq[cached:]
        c = len(context)
        mask = torch.ones(c + len(tree), c + len(tree), dtype=torch.bool).tril()
        if len(tree):
            mask[c:, c:] = tree.ancestor_mask()
        positions = torch.cat([torch.arange(c), c - 1 + torch.tensor(tree.depth, dtype=torch.long)])
        return _TreeStep(plan, tree, node_logq, warp, version, context + list(tree.tokens), mask, positions, c,
                         time.perf_counter() - t0)

    def _tree_verdict(self, req: Request, st: "_TreeStep", hidden: torch.Tensor,
                      spent: list[float]) -> tuple[torch.Tensor, TreeVerifyResult]:
        """The row's rule on its slice of the pass (`hidden`: the root's, then each node's last hidden state),
        with the target's output layer run on the rows the rule and the record read (`verdict_on_demand`),
        its seconds added to spent[0]. Returns (logits [1 + nodes, vocab], the rule's result)."""
        from serving.engine import target_output_rows, tree_verdict

        return verdict_on_demand(st.tree, hidden, target_output_rows(self.engine, spent), lambda rows: tree_verdict(
            st.tree, rows, req.sampling, req.spec, st.warp, req.gen, st.node_logq), req.gen)

    def _accept_tree(self, req: Request, st: "_TreeStep", rows: torch.Tensor, hidden: torch.Tensor,
                     res: TreeVerifyResult, t_target: float, alone: bool) -> tuple[list[int], list[int]]:
        """The row's verdict (`_tree_verdict`; `rows`, `hidden`: the root's, then each node's), its
        statistics and record under the version that proposed, its controller's observation, and for a request
        stepping alone the cost model's. Returns the block slots to keep (the context, the root, the accepted
        path) and the emitted tokens."""
        from serving.engine import _RequestState, count_and_record, nodes_per_depth

        tree, stats = st.tree, req.stats
        req.hidden = hidden[res.path[-1] + 1 if res.path else 0]
        draft_tokens, record_rows, vres = _RequestState._tree_record(tree, rows, res)
        start = len(req.seq)
        new = draft_tokens[: vres.num_accepted] + [int(vres.next_token)]
        req.seq.extend(new)
        req.hidden_for = len(req.seq)
        stats.draft_time_s += st.draft_s
        stats.target_time_s += t_target
        req.recorded_steps += count_and_record(self.engine, stats, req.sink, req.id, req.spec.mode, st.version, start,
                                               draft_tokens, vres, record_rows, req.sampling,
                                               record_plain=st.plan is not None)
        if st.plan is not None:
            if st.plan.k == 0:
                stats.zero_draft_steps += 1
            elif st.plan.probe:
                stats.probe_steps += 1
            # a depth the heads' doubt pruned counts as not accepted (as a step alone)
            req.controller.observe(st.plan, len(new) - 1, st.plan.k if len(tree) else 0, nodes=nodes_per_depth(tree))
        if alone and st.context == 1:   # the cost model describes a request stepping alone
            costs = self._costs_for([req])
            costs.observe_target(1 + len(tree), t_target)
            if draft_tokens:
                costs.observe_draft(req.spec.mode, len(draft_tokens), st.draft_s)
        kept = list(range(st.context)) + [st.context + p for p in res.path]
        return kept, new

    # ------------------------------------------------------------------ the batched step
    def _plan(self, req: Request) -> _RowPlan:
        eng, spec, sampling = self.engine, req.spec, req.sampling
        room = eng.max_context - len(req.seq)
        if spec.mode == "target" or room <= spec.gamma + 1:
            return _RowPlan("none", 0)
        prop = proposer(spec, sampling)
        ctrl = req.controller
        if ctrl is not None:
            ctrl.version = eng.draft_for(req)[1]
            ngram, source = (eng.proposal(req.seq, spec.gamma, store=eng.store_for(req.sampling))
                             if ctrl.use_ngram else ([], "ngram"))
            plan = ctrl.plan(len(ngram), source)
            if plan.proposer == "ngram":
                return _RowPlan("ngram", plan.k, plan, ngram[: plan.k])
            if plan.proposer == "none" or plan.k == 0:
                return _RowPlan("none", 0, plan)
            return _RowPlan(prop, plan.k, plan)
        if prop == "ngram":
            toks = eng.ngram_tokens(req.seq, spec.gamma, spec.extra["max_ngram"], spec.extra["min_ngram"])
            return _RowPlan("ngram", len(toks), None, toks)
        return _RowPlan(prop, spec.gamma)

    def _plans(self, reqs: list[Request]) -> list[_RowPlan]:
        """Each row's proposal this step. Alone, a request's controller plans for itself; in a batch, the
        adaptive rows share one draft length chosen for the whole batch (controller.plan_batch: every row
        pays for the widest block), while fixed-gamma and seeded requests (whose output must not depend on
        other traffic) keep planning for themselves."""
        if len(reqs) == 1:
            return [self._plan(reqs[0])]
        eng = self.engine
        plans: list[_RowPlan | None] = [None] * len(reqs)
        shared, options, ngrams, sources = [], [], {}, {}
        for i, req in enumerate(reqs):
            ctrl, spec = req.controller, req.spec
            room = eng.max_context - len(req.seq)
            if ctrl is None or ctrl.costs is not eng.costs or room <= spec.gamma + 1:
                plans[i] = self._plan(req)
                continue
            ctrl.version = eng.draft_for(req)[1]
            ngram, source = (eng.proposal(req.seq, spec.gamma, store=eng.store_for(req.sampling))
                             if ctrl.use_ngram else ([], "ngram"))
            ngrams[i], sources[i] = ngram, source
            has_draft = spec.needs_draft and eng.draft_for(req)[0] is not None
            prop = proposer(spec, req.sampling)
            options.append(RowOption(
                alpha_draft=ctrl.curve("draft") if has_draft else None,
                draft_rows=spec.beams if prop == "beams" else 1,
                alpha_ngram=ctrl.curve(source) if ctrl.use_ngram else None,
                ngram_available=len(ngram), gamma=spec.gamma, ngram_source=source))
            shared.append(i)
        if shared:
            fixed = max((p.k for p in plans if p is not None), default=0)
            for i, plan in zip(shared, plan_batch(options, eng.costs, fixed_width=fixed)):
                req = reqs[i]
                plan = req.controller.take(plan, (len(ngrams[i]), sources[i]))
                if plan.proposer == "ngram":
                    plans[i] = _RowPlan("ngram", plan.k, plan, ngrams[i][: plan.k])
                elif plan.k == 0:
                    plans[i] = _RowPlan("none", 0, plan)
                else:
                    plans[i] = _RowPlan(proposer(req.spec, req.sampling), plan.k, plan)
        return plans

    def _costs_for(self, reqs: list[Request]):
        """The cost model a step over `reqs` teaches: a request stepping alone with its own (Engine.calibrate)
        teaches that one, every other step the replica's."""
        return reqs[0].costs if len(reqs) == 1 and reqs[0].costs is not None else self.engine.costs

    def _observe_batch_costs(self, reqs, blocks, proposals, keep: int, t_draft: float, t_target: float,
                             t_wall: float) -> None:
        """What this step's forwards cost, for the controller: the target pass by the tokens it verified
        (rows x block width), a draft forward by its rows, the rest of the step by batch size. Steps that
        also re-fed context (a prefill remainder, a draft rebuilt after a swap) teach nothing. A request
        stepping alone with its own cost model (Engine.calibrate) teaches that model instead."""
        costs = self._costs_for(reqs)
        steady_target = all(len(b) == len(p[0]) + 1 for b, p in zip(blocks, proposals))
        if not steady_target:
            return
        costs.observe_target(len(blocks) * keep, t_target)
        drafted = self._fork_rows > 0
        if drafted and self._steady_draft:
            for rows, forwards, seconds in self._groups:     # each draft group's own forwards
                costs.observe_draft_forward(rows, forwards, seconds)
        if not drafted or self._steady_draft:
            costs.observe_overhead(drafted, max(0.0, t_wall - t_draft - t_target), rows=len(blocks))

    def _batch_step(self) -> None:
        eng = self.engine
        with eng._lock:
            reqs = list(self.batch)
            try:
                wall0 = time.perf_counter()
                plans = self._plans(reqs)
                with self._wide_threads(any(p.k for p in plans)):
                    self._sync_draft_cache()
                    t0 = time.perf_counter()
                    proposals = self._propose(reqs, plans)
                    t_draft = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    blocks = [r.seq[self.tkv.lengths[i]:] + proposals[i][0] for i, r in enumerate(reqs)]
                    keep = max(len(p[0]) for p in proposals) + 1
                    logits = self.tkv.feed(blocks, keep)
                    logits = full_vocab_logits(logits, eng.target, eng.vocab_size)
                    if eng.target_device.type == "cuda":
                        torch.cuda.synchronize(eng.target_device)
                    t_target = time.perf_counter() - t1
                probs, record = self._warp_rows(reqs, logits)
                results = []
                for i, req in enumerate(reqs):
                    k = len(proposals[i][0])
                    rec = None if record is None else (record[0][i, keep - k - 1:], record[1][i, keep - k - 1:])
                    results.append(self._accept(i, req, plans[i], proposals[i], probs[i][keep - k - 1:], rec,
                                                self._row_draft_s[i], t_target, len(reqs)))
                self._observe_batch_costs(reqs, blocks, proposals, keep, t_draft, t_target, time.perf_counter() - wall0)
                eng._failures = 0
            except Exception as exc:  # noqa: BLE001
                self.tkv, self.dkvs = None, []
                self._fail_step(reqs, exc, "batched")
                return
        self._emit_step(reqs, results)

    def _fail_step(self, reqs: list[Request], exc: BaseException, what: str) -> None:
        """A shared forward failed: every request of that step gets the error (their caches are gone)."""
        self.engine._step_failed(exc)
        log.error("%s step over %d requests failed; failing them", what, len(reqs))
        for req in reqs:
            self._fail(req, exc)

    def _emit_step(self, reqs: list[Request], results: list[list[int]]) -> None:
        self.batch_sizes[len(reqs)] = self.batch_sizes.get(len(reqs), 0) + 1
        for req, new in zip(reqs, results):
            self._emit(req, new)

    def _propose(self, reqs: list[Request], plans: list[_RowPlan]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Every request's proposal: (tokens [k], draft rows [k, vocab] or None when k = 0); the drafting
        rows are grouped by the draft model that proposes for them (`Engine.draft_for`: champion or
        canary) and each group proposes on its own draft cache (`_propose_group`)."""
        eng = self.engine
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(reqs)
        for i, p in enumerate(plans):
            if p.proposer == "ngram" and p.ngram:
                out[i] = eng.ngram_rows(p.ngram)
        self._fork_rows = self._forwards = 0
        self._groups, self._row_draft_s = [], [0.0] * len(reqs)
        self._steady_draft = True
        groups: list[tuple[object, list[int]]] = []
        for i, p in enumerate(plans):
            if p.proposer in ("chain", "beams") and p.k > 0:
                loaded = eng.draft_for(reqs[i])[0]
                group = next((g for g in groups if g[0] is loaded), None)
                if group is None:
                    groups.append((loaded, [i]))
                else:
                    group[1].append(i)
        for loaded, drafting in groups:
            t0 = time.perf_counter()
            rows, forwards = self._propose_group(reqs, plans, drafting, loaded, out)
            seconds = time.perf_counter() - t0
            self._groups.append((rows, forwards, seconds))
            self._fork_rows += rows
            self._forwards += forwards
            for i in drafting:
                self._row_draft_s[i] = seconds
        return out

    def _propose_group(self, reqs: list[Request], plans: list[_RowPlan], drafting: list[int], loaded,
                       out: list) -> tuple[int, int]:
        """The proposals of the rows `drafting`, which all draft with the model `loaded`, into `out`;
        returns (fork rows, draft forwards after the catch-up).

        The draft's rows are warped and sampled in its own output space (its kept vocabulary rows:
        warping is exact there, every other token has probability 0), and only the proposal's k rows are
        scattered back to the full vocabulary for the rule. The chains and beam groups of all requests
        share one fork of the draft cache: a chain is one row, a beam group `beams` rows. Beams of a group
        share their prefix, so re-ordering beams after a beam step moves only the slots drafted so far."""
        eng = self.engine
        dkv = self._dkv_for(loaded)
        out_ids = loaded.output_token_ids             # kept rows -> token ids (None: the full vocabulary)
        to_token = (lambda j: int(out_ids[j])) if out_ids is not None else int
        space = (lambda lg: lg.float()) if out_ids is not None else \
            (lambda lg: full_vocab_logits(lg, loaded, eng.vocab_size))
        # one forward catches every row of this draft up (rows of other modes and of the other draft get nothing)
        catch_up = [r.seq[dkv.lengths[i]:] if r.spec.needs_draft and eng.draft_for(r)[0] is loaded else []
                    for i, r in enumerate(reqs)]
        # draft costs are learnt from ordinary steps only, not from a forward that re-fed a whole sequence
        longest = max(len(b) for b in catch_up)
        steady = longest <= max(r.spec.gamma for r in reqs) + 2
        self._steady_draft &= steady
        t0 = time.perf_counter()
        first = space(dkv.feed(catch_up, keep=1)[:, -1])
        if not steady:     # what catching up costs per skipped token prices the controller's probes (affordable_gap)
            if first.device.type == "cuda":
                torch.cuda.synchronize(first.device)
            self._costs_for(reqs).observe_catch_up(longest, time.perf_counter() - t0, rows=len(catch_up))
        warps = {i: _warper(reqs[i].sampling) for i in drafting}
        state = {}
        fork_rows: list[int] = []
        for i in drafting:
            lp = warps[i](first[i])
            if plans[i].proposer == "beams":
                parent, token, logq = beam_sample_step(torch.zeros(1, device=lp.device), lp[None],
                                                       reqs[i].spec.beams, reqs[i].gen)
                # the group gets `beams` fork rows; fewer may be live (a narrow support at the first token)
                state[i] = {"beam": True, "parents": [parent], "tokens": [token], "probs": [lp.exp()[None]],
                            "logq": logq, "live": len(token)}
                width = reqs[i].spec.beams
            else:
                p = lp.exp()
                state[i] = {"beam": False, "tokens": [int(sample(p, reqs[i].gen))], "probs": [p]}
                width = 1
            state[i]["offset"] = len(fork_rows)
            state[i]["k"] = plans[i].k
            fork_rows += [i] * width
        stops = {i: reqs[i].controller.stop_below for i in drafting
                 if not state[i]["beam"] and reqs[i].controller is not None and reqs[i].controller.stop_below > 0}
        for i in stops:
            _confidence_stop(state[i], first[i], stops[i], 0)
        K = max(state[i]["k"] for i in drafting)
        fork = dkv.fork(fork_rows, extra_slots=K, reuse=True) if K > 1 else None   # the last step's fork is done
        forwards = 1
        for step in range(1, K):
            if all(step >= state[i]["k"] for i in drafting):   # every chain stopped on its draft's doubt
                break
            forwards += 1
            blocks: list[list[int]] = [[] for _ in fork_rows]
            for i in drafting:
                s = state[i]
                if step >= s["k"]:
                    continue
                if s["beam"]:
                    toks = s["tokens"][-1]
                    for j in range(s["live"]):
                        blocks[s["offset"] + j] = [to_token(toks[j])]
                else:
                    blocks[s["offset"]] = [to_token(s["tokens"][-1])]
            logits = space(fork.feed(blocks, keep=1)[:, -1])
            perm = list(range(len(fork_rows)))
            for i in drafting:
                s = state[i]
                if step >= s["k"]:
                    continue
                o = s["offset"]
                if s["beam"]:
                    lp = warps[i](logits[o: o + s["live"]])                     # [live, space]
                    parent, token, s["logq"] = beam_sample_step(s["logq"], lp, reqs[i].spec.beams, reqs[i].gen)
                    s["parents"].append(parent)
                    s["tokens"].append(token)
                    s["probs"].append(lp.exp())
                    s["live"] = len(token)                                      # <= beams
                    for j in range(len(token)):
                        perm[o + j] = o + int(parent[j])
                else:
                    p = warps[i](logits[o]).exp()
                    s["tokens"].append(int(sample(p, reqs[i].gen)))
                    s["probs"].append(p)
                    if i in stops:
                        _confidence_stop(s, logits[o], stops[i], step)
            if step + 1 < K and perm != list(range(len(fork_rows))):
                fork.reorder_tail(perm, step)
        for i in drafting:
            s = state[i]
            tokens, rows = _best_beam(s) if s["beam"] else (s["tokens"], torch.stack(s["probs"]))
            tokens = [to_token(t) for t in tokens]
            if out_ids is not None:   # the k proposal rows back to the full vocabulary
                full = rows.new_zeros(rows.shape[0], eng.vocab_size)
                full[:, out_ids] = rows
                rows = full
            out[i] = (tokens, rows)
        return len(fork_rows), forwards

    def _warp_rows(self, reqs: list[Request], logits: torch.Tensor):
        """Every row's warped target distribution, one call per distinct (temperature, top-k, top-p) in the
        batch, and, when anything is recorded, the raw top-k log-probs of every position in one call:
        (probs per row [keep, vocab], (ids [rows, keep, k], logprobs [rows, keep, k]) or None)."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault((r.sampling.temperature, r.sampling.top_k, r.sampling.top_p), []).append(i)
        probs: list = [None] * len(reqs)
        for (t, k, p), rows in groups.items():
            warped = warp_logprobs(logits[rows], t, k, p).exp()
            for j, i in enumerate(rows):
                probs[i] = warped[j]
        record = None
        if any(r.sink is not None and r.spec.mode != "target" for r in reqs):
            vals, ids = torch.topk(torch.log_softmax(logits, dim=-1), self.engine.record_top_k, dim=-1)
            record = (ids.to(torch.int32).cpu().numpy(), vals.to(torch.float16).cpu().numpy())
        return probs, record

    def _accept(self, row: int, req: Request, plan: _RowPlan, proposal, target_probs: torch.Tensor, record,
                draft_s: float, target_s: float, batch: int) -> list[int]:
        """The request's own rule on its slice of the batch (`target_probs` [k + 1, vocab], warped;
        `record`: raw top-k ids and log-probs of those positions); rollback of its rejected slots."""
        eng, spec, sampling, stats = self.engine, req.spec, req.sampling, req.stats
        draft_tokens, draft_probs = proposal
        k = len(draft_tokens)
        start = len(req.seq)
        if k or (plan.proposer == "ngram" and plan.plan is None):
            # (mode ngram verifies even an empty lookup with its rule, as the unbatched engine did)
            if draft_probs is None:
                draft_probs = target_probs.new_zeros(0, target_probs.shape[-1])
            res = VERIFY_RULES[spec.mode](torch.tensor(draft_tokens, dtype=torch.long), draft_probs,
                                          target_probs, req.gen, spec)
        else:
            res = VerifyResult(num_accepted=0, next_token=int(sample(target_probs[0], req.gen)))
        n = res.num_accepted
        emitted = draft_tokens[:n] + [int(res.next_token)]
        req.seq.extend(emitted)
        self.tkv.drop_last(row, k - n)
        # statistics; the step's version is the draft that proposed it
        stats.draft_time_s += draft_s
        stats.target_time_s += target_s
        if spec.mode != "target":
            stats.steps += 1
            stats.draft_tokens += k
            stats.accepted_tokens += n
            for j in range(n):
                stats.accepted_per_position[j] += 1
        drafted_by_model = plan.proposer in ("chain", "beams") and k > 0
        version = eng.draft_for(req)[1] if drafted_by_model else "none"
        algorithm = spec.mode if drafted_by_model or spec.mode == "ngram" else ("ngram" if plan.proposer == "ngram"
                                                                            else "target")
        if spec.mode != "target":
            stats.count_version(version, k, n)
        if plan.plan is not None:
            if plan.proposer == "ngram":
                stats.ngram_steps += 1
                stats.store_steps += plan.plan.source == "store"
            elif k == 0:
                stats.zero_draft_steps += 1
            elif plan.plan.probe:
                stats.probe_steps += 1
            req.controller.observe(plan.plan, n, k)
        if batch == 1:   # the cost model describes a request stepping alone
            self._observe_costs(req, plan, k, draft_s, target_s)
        recorded = req.sink is not None and spec.mode != "target" and (k or req.controller is not None)
        if recorded:
            try:
                ids, lps = record
                req.sink.push_step(StepRecord(
                    request_id=req.id, position=start, draft_tokens=draft_tokens, num_accepted=n,
                    target_topk_ids=ids, target_topk_logprobs=lps, algorithm=algorithm, draft_version=version,
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    timestamp=time.time(), next_token=int(res.next_token)))
                req.recorded_steps += 1
            except Exception as exc:  # noqa: BLE001
                log.warning("replay buffer push failed: %s", exc)
        return emitted

    def _observe_costs(self, req: Request, plan: _RowPlan, k: int, draft_s: float, target_s: float) -> None:
        """A request alone: its proposer's draft time per token (the target and the rest of the step are
        observed for every batch size by _observe_batch_costs)."""
        if plan.proposer in ("chain", "beams") and k and self._steady_draft:
            key = req.controller.draft_key if req.controller is not None else plan.proposer
            (req.costs or self.engine.costs).observe_draft(key, k, draft_s)


def _confidence_stop(state: dict, logits: torch.Tensor, threshold: float, step: int) -> None:
    """End a chain after its token of this `step` when the draft doubts it: the largest probability of the
    draft's raw softmax (temperature 1, unwarped, in its own output space) below `threshold`
    (controller.STOP_CONFIDENCE): BiLD's fallback test (serving/decoding/bild.py). A rejected token ends a step anyway, so tokens drafted after a doubtful
    one are mostly wasted draft forwards and verified rows. The stop reads only the draft's own
    distribution, never the target's, so every rule verifies what is proposed exactly as before (the
    draft length is a stopping time of the draft's own draws: speculative sampling stays lossless)."""
    if bild_should_fallback(torch.softmax(logits.float(), dim=-1), threshold):
        state["k"] = min(state["k"], step + 1)


def _warper(sampling: SamplingParams):
    return lambda lg: warp_logprobs(lg, sampling.temperature, sampling.top_k, sampling.top_p)


def _best_beam(s: dict) -> tuple[list[int], torch.Tensor]:
    """Trace the best beam back through the parent pointers: its tokens and the warped draft rows along it."""
    row = int(beam_sample_finalize(s["logq"])[0])
    tokens, probs = [], []
    for i in range(len(s["tokens"]) - 1, -1, -1):
        tokens.append(int(s["tokens"][i][row]))
        parent = int(s["parents"][i][row])
        probs.append(s["probs"][i][parent])
        row = parent
    return tokens[::-1], torch.stack(probs[::-1])
