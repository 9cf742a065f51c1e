"""The decoding engine: owns the target and draft models, their KV caches, and the
propose -> verify -> accept loop. The decision rules themselves are pure functions in
`serving/decoding/`; this module only drives models and caches around them.

Cache invariants (batch 1, one request):
- the *target* cache holds `seq[:-1]`: every token except the last emitted one, which the next
  verification pass feeds first (algorithms.md 1.4 item 5);
- the *draft* cache holds some prefix of `seq` (length <= len(seq) - 1 after a step); before
  drafting, the missing tokens are fed in one forward, so a step never re-encodes the whole prefix.
After a verification the caches are cropped back to the accepted prefix (rollback).

Modes (SpecParams.mode; rules in serving/decoding/, knobs in SpecParams.extra, see config.MODE_KNOBS):
- target: target-only sampling (the baseline);
- speculative / mentored / typical: a chain of gamma draft tokens, one target pass, then the rule
  (lossless / lossy within a KL budget / Medusa's lossy typical acceptance);
- mjsd: beam-sampled draft, joint-likelihood verification (lossy); at T=0 or with one beam the
  beam sampler can only keep one beam, so the plain draft chain proposes instead (same proposal distribution);
- bild: the draft runs until its max probability < fallback_threshold (or gamma tokens), then the
  target verifies with the rollback threshold (lossy). The confidence is the warped draft row (the
  fork); at temperature 0 that row is one-hot, so there it is the raw softmax (the greedy original);
- spectr: k i.i.d. draft chains (draft cache repeated to k rows), ONE batched target pass over the
  distinct chains (target cache repeated to those rows), sequence-level K-SEQ (lossless); the caches
  then keep the chosen row only;
- ngram: prompt lookup drafts from the context, no draft model. Its proposal is deterministic, so it
  is verified by speculative sampling with a one-hot draft distribution: accept x w.p. target(x),
  else sample target restricted to tokens != x (lossless; at temperature 0 exactly the greedy
  token-match rule of HF prompt lookup);
- staged: staged speculation (Spector & Re 2023; paper 003): n-gram lookup proposes for the DRAFT
  model, which checks the proposal in one forward with the same one-hot speculative rule
  (`ngram.staged_accept`), so its gamma tokens are exact draft samples produced in fewer sequential
  draft forwards; the target then verifies them by speculative sampling (lossless).

Randomness: one torch.Generator per request, seeded from SamplingParams.seed, on the target's device
(CPU or CUDA), so every rule draws where its probability rows live; a seed reproduces a run on the
same device (CPU and CUDA streams differ). The adaptive controller (serving/controller.py) of a seeded
request decides from that request's own history only, so its plan, and with it the output, repeats
too. On CUDA `_Runner.feed` synchronises, so the draft/target
time split in the stats is real time, not kernel-launch time.

Concurrency: per-request state (sequence, caches, generator) lives in the `generate()` generator.
The engine lock is held for one *step* at a time, so concurrent requests interleave step by step
(round-robin time slicing) instead of queueing whole requests behind each other.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from buffer.records import RecordSink, SequenceRecord, StepRecord
from serving.config import ADAPTIVE_MODES, NGRAM_SWITCH_MODES, SamplingParams, SpecParams
from serving.controller import CostModel, Plan, ReplicaPriors, RequestController
from serving.decoding.bild import bild_should_fallback, bild_verify
from serving.decoding.mentored import mentored_verify
from serving.decoding.mjsd import beam_sample_finalize, beam_sample_step, mjsd_verify
from serving.decoding.ngram import ngram_propose, staged_accept
from serving.decoding.spectr import spectr_verify
from serving.decoding.speculative import speculative_verify
from serving.decoding.typical import typical_verify
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample, warp_logprobs
from serving.energy import EnergyMeter
from serving.models import (
    LoadedModel,
    ModelLoadError,
    check_same_tokenizer,
    load_causal_lm,
    load_tokenizer,
    read_output_token_ids,
    resolve_model_path,
)

log = logging.getLogger(__name__)

# Verification rules with the uniform signature of serving/decoding/types.py, by mode name ("spectr"
# verifies a tree of k chains and has its own path; "target" verifies nothing).
VERIFY_RULES = {
    "speculative": lambda d, dp, tp, g, spec: speculative_verify(d, dp, tp, g),
    "staged": lambda d, dp, tp, g, spec: speculative_verify(d, dp, tp, g),
    "ngram": lambda d, dp, tp, g, spec: speculative_verify(d, dp, tp, g),   # dp is one-hot
    "mjsd": lambda d, dp, tp, g, spec: mjsd_verify(d, dp, tp, g, tau=spec.tau),
    "typical": lambda d, dp, tp, g, spec: typical_verify(
        d, dp, tp, g, posterior_threshold=spec.extra["posterior_threshold"],
        posterior_alpha=spec.extra["posterior_alpha"]),
    "mentored": lambda d, dp, tp, g, spec: mentored_verify(d, dp, tp, g, kl_budget=spec.extra["kl_budget"]),
    "bild": lambda d, dp, tp, g, spec: bild_verify(d, dp, tp, g, rollback_threshold=spec.extra["rollback_threshold"]),
}


BROKEN_AFTER = 3   # consecutive failed decoding steps before the engine reports itself unhealthy


@dataclass
class GenerationStats:
    mode: str
    draft_version: str
    gamma: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    adaptive: bool = False
    zero_draft_steps: int = 0      # adaptive: steps that drafted nothing (a plain target step)
    ngram_steps: int = 0           # adaptive: steps whose proposal came from the n-gram lookup
    probe_steps: int = 0           # adaptive: one-token probes of a draft that had stopped paying
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    energy_j: float | None = None
    energy_reason: str | None = None

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verification step."""
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.draft_tokens / self.steps if self.steps else 0.0

    @property
    def overhead_time_s(self) -> float:
        return max(0.0, self.wall_time_s - self.draft_time_s - self.target_time_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rate=self.acceptance_rate,
            drafted_per_step=self.drafted_per_step,
            overhead_time_s=self.overhead_time_s,
            tokens_per_s=self.tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0,
        )
        return d


@dataclass
class StepOutput:
    token_ids: list[int]
    finish_reason: str | None
    stats: GenerationStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class _Runner:
    """One model + one KV cache for one sequence. `feed` appends tokens and returns logits."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.cache = None
        self.length = 0
        self.batch = 1
        self.device = next(self.model.parameters()).device

    def feed(self, tokens: list[int] | torch.Tensor, keep: int) -> torch.Tensor:
        """Append `tokens` ([n] or [batch, n]) to the cache; return fp32 logits of the last `keep`
        positions over the FULL vocabulary: [keep, vocab] (or [batch, keep, vocab])."""
        from transformers import DynamicCache

        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        batched = ids.dim() == 2
        if not batched:
            ids = ids[None]
        if self.cache is None:
            self.cache = DynamicCache()
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.cache = out.past_key_values
        self.length += ids.shape[1]
        logits = out.logits[:, -keep:].float()
        if self.device.type == "cuda":   # kernels run asynchronously: finish them so the caller's timer is honest
            torch.cuda.synchronize(self.device)
        out_ids = self.loaded.output_token_ids
        if out_ids is not None:  # reduced output layer: scatter back, other tokens impossible
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            full[..., out_ids] = logits
            logits = full
        elif logits.shape[-1] != self.vocab_size:  # padded embedding tables (e.g. vocab rounded up)
            logits = logits[..., : self.vocab_size]
        return logits if batched else logits[0]

    def truncate(self, length: int) -> None:
        if self.cache is not None and self.length > length:
            self.cache.crop(-(self.length - length))
            self.length = length

    def fork(self, batch: int) -> "_Runner":
        """A copy whose cache is repeated `batch` times (for beam sampling); self is unchanged."""
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        other.repeat(batch)
        return other

    def repeat(self, batch: int) -> None:
        """In place: a batch-1 cache becomes `batch` identical rows (no copy of self is kept)."""
        if self.batch != 1:
            raise RuntimeError(f"repeat needs a batch-1 cache, this one has {self.batch} rows")
        if self.cache is not None and batch > 1:
            self.cache.batch_repeat_interleave(batch)
        self.batch = batch

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` ([n] long), in that order."""
        if self.cache is not None:
            self.cache.batch_select_indices(rows.to(self.device))
        self.batch = len(rows)


def _bild_stop(threshold: float, sampling: SamplingParams):
    """BiLD's fallback test on the draft's confidence max_v q(v): on the warped q, as the fork's sampling
    BiLD; at temperature 0 the warped q is one-hot (max 1, never unsure), so there it is the raw softmax,
    as in the greedy original."""
    if sampling.temperature == 0:
        return lambda probs, logits: bild_should_fallback(torch.softmax(logits, dim=-1), threshold)
    return lambda probs, logits: bild_should_fallback(probs, threshold)


def _top_k_record(logits: torch.Tensor, k: int) -> tuple:
    """Raw (temperature 1, unwarped) target log-probs, top-k per row: ids [n, k], logprobs [n, k]."""
    logprobs = torch.log_softmax(logits, dim=-1)
    vals, ids = torch.topk(logprobs, k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), vals.to(torch.float16).cpu().numpy()


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        draft_version: str = "none",
        sink: RecordSink | None = None,
        device: str = "cpu",
        max_context: int | None = None,
        record_top_k: int = 20,
        target_name: str = "target",
    ) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.draft = draft
        self.draft_version = draft_version if draft is not None else "none"
        self.sink = sink
        self.device = device
        self.record_top_k = record_top_k
        self.target_name = target_name
        cfg_max = getattr(target.model.config, "max_position_embeddings", 2048) or 2048
        self.max_context = min(max_context or cfg_max, cfg_max)
        self.eos_token_ids = self._eos_ids()
        self._rng_device = next(target.model.parameters()).device
        self._lock = threading.Lock()
        self._energy = EnergyMeter(device)
        self.costs = CostModel()          # measured step costs of this replica (serving/controller.py)
        self.priors = ReplicaPriors()     # acceptance of recent traffic: each new request's prior
        self._broken: str | None = None
        self._failures = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_paths(
        cls,
        target: str | None = None,
        draft: str | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        sink: RecordSink | None = None,
        draft_version: str = "none",
        **kwargs,
    ) -> "Engine":
        target_path = resolve_model_path(target)
        tgt = LoadedModel(load_causal_lm(target_path, device, dtype), load_tokenizer(target_path), target_path)
        drf = cls._load_draft(draft, tgt, device, dtype) if draft else None
        kwargs.setdefault("target_name", "smollm2-135m-instruct" if target is None else str(target))
        return cls(tgt, drf, draft_version=draft_version if drf else "none", sink=sink, device=device, **kwargs)

    @staticmethod
    def _load_draft(draft: str | Path, target: LoadedModel, device: str, dtype) -> LoadedModel:
        path = resolve_model_path(draft)
        tok = load_tokenizer(path)
        check_same_tokenizer(target.tokenizer, tok)
        model = load_causal_lm(path, device, dtype)
        out_ids = read_output_token_ids(path)
        ids_t = None
        if out_ids:
            # Keep only the listed rows of the output layer (see serving/models.py).
            head = model.get_output_embeddings()
            ids_t = torch.tensor(out_ids, dtype=torch.long, device=device)
            small = torch.nn.Linear(head.weight.shape[1], len(out_ids), bias=False, device=device,
                                    dtype=head.weight.dtype)
            with torch.no_grad():
                small.weight.copy_(head.weight[ids_t])
            model.set_output_embeddings(small)
        return LoadedModel(model, tok, path, ids_t)

    def swap_draft(self, draft_path: str | Path, version: str) -> None:
        """Load a new draft and make it live between steps. On failure the old draft stays."""
        dtype = next(self.target.model.parameters()).dtype
        new = self._load_draft(draft_path, self.target, self.device, dtype)  # may raise ModelLoadError
        with self._lock:
            self.draft, self.draft_version = new, version
        log.info("draft swapped to version %s (%s)", version, draft_path)

    def healthy(self) -> tuple[bool, str]:
        if self._broken:
            return False, self._broken
        return True, "ok"

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.target.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(int(i) for i in gen_eos)
        return ids

    # ------------------------------------------------------------------ generation
    def generate_all(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams, **kw) -> GenerationResult:
        tokens: list[int] = []
        last = None
        for last in self.generate(prompt_ids, sampling, spec, **kw):
            tokens.extend(last.token_ids)
        assert last is not None
        return GenerationResult(tokens, last.finish_reason or "length", last.stats)

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        spec: SpecParams,
        *,
        request_id: str | None = None,
        cancel: threading.Event | None = None,
        log_mode: str = "full",
        source: str = "",
    ) -> Iterator[StepOutput]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context is {self.max_context}")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        mode = spec.mode
        if spec.needs_draft and self.draft is None:
            raise ValueError(f"mode {mode!r} needs a draft model and none is loaded; use mode 'target' or 'ngram'")
        request_id = request_id or uuid.uuid4().hex
        gen = torch.Generator(device=self._rng_device)   # on the model's device: rules sample where the rows are
        gen.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(uuid.uuid4().bytes[:6], "little"))
        stop_ids = self.eos_token_ids | set(sampling.stop_token_ids)
        gamma = spec.gamma if mode != "target" else 0
        adaptive = spec.adaptive and mode in ADAPTIVE_MODES
        stats = GenerationStats(mode=mode, draft_version=self.draft_version if spec.needs_draft else "none",
                                gamma=gamma, accepted_per_position=[0] * gamma, adaptive=adaptive)
        state = _RequestState(self, prompt)
        if adaptive:
            # A seeded request must reproduce its output, so its controller decides from its own history
            # only (prior costs, the default prior), never from the replica's timings or other traffic.
            seeded = sampling.seed is not None
            beams = mode == "mjsd" and sampling.temperature > 0 and spec.beams > 1
            state.controller = RequestController(
                gamma=spec.gamma, costs=CostModel() if seeded else self.costs,
                priors=ReplicaPriors() if seeded else self.priors, version=self.draft_version,
                greedy=sampling.greedy, draft_key="beams" if beams else "chain",
                use_ngram=mode in NGRAM_SWITCH_MODES)
        sink = self.sink if log_mode != "none" else None
        energy0 = self._energy.read_mj()
        t_start = time.perf_counter()
        finish = None
        try:
            while finish is None:
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    yield StepOutput([], finish, self._finish_stats(stats, t_start, energy0))
                    return
                remaining = sampling.max_tokens - stats.tokens
                room = self.max_context - len(state.seq)
                if remaining <= 0 or room <= 0:
                    finish = "length"
                    yield StepOutput([], finish, self._finish_stats(stats, t_start, energy0))
                    return
                with self._lock:
                    try:
                        if mode == "target" or room <= gamma + 1:
                            new = state.target_step(sampling, gen, stats)
                        else:
                            new = state.spec_step(sampling, spec, gen, stats, request_id, sink)
                    except Exception as exc:
                        self._step_failed(exc)
                        raise
                    self._failures = 0
                # stop tokens, then length
                out: list[int] = []
                for t in new:
                    out.append(t)
                    if t in stop_ids:
                        finish = "stop"
                        break
                if finish is None and stats.tokens + len(out) >= sampling.max_tokens:
                    out = out[: sampling.max_tokens - stats.tokens]
                    finish = "length"
                stats.tokens += len(out)
                if finish is not None:
                    self._finish_stats(stats, t_start, energy0)
                else:
                    stats.wall_time_s = time.perf_counter() - t_start
                yield StepOutput(out, finish, stats)
        finally:
            if sink is not None and state.recorded_steps:
                try:
                    ids = state.seq[: len(prompt) + stats.tokens]
                    sink.push_sequence(SequenceRecord(
                        request_id=request_id, token_ids=ids, prompt_len=len(prompt),
                        draft_version=stats.draft_version, timestamp=time.time(), source=source,
                        meta={"log_mode": log_mode}))
                except Exception as exc:  # a sink must never take a request down
                    log.warning("replay buffer push failed: %s", exc)

    def _step_failed(self, exc: Exception) -> None:
        """A decoding step raised (device error, out of memory, a corrupt model): after
        BROKEN_AFTER consecutive failures the engine reports itself unhealthy (/health -> 503, and Ray
        Serve's health check restarts the replica)."""
        self._failures += 1
        log.error("decoding step failed (%d in a row): %s: %s", self._failures, type(exc).__name__, exc)
        if self._failures >= BROKEN_AFTER:
            self._broken = f"{self._failures} consecutive decoding steps failed; last: {type(exc).__name__}: {exc}"

    def _finish_stats(self, stats: GenerationStats, t_start: float, energy0) -> GenerationStats:
        stats.wall_time_s = time.perf_counter() - t_start
        stats.energy_j = EnergyMeter.joules(energy0, self._energy.read_mj())
        stats.energy_reason = None if stats.energy_j is not None else self._energy.reason
        return stats


class _RequestState:
    """Sequence + caches of one request. All methods run under the engine lock."""

    def __init__(self, engine: Engine, prompt: list[int]) -> None:
        self.engine = engine
        self.seq = list(prompt)
        self.target = _Runner(engine.target, engine.vocab_size)
        self.draft_model = engine.draft
        self.draft = _Runner(engine.draft, engine.vocab_size) if engine.draft is not None else None
        self.recorded_steps = 0
        self.controller: RequestController | None = None
        self.ngram_proposal: list[int] = []

    # -- helpers -----------------------------------------------------------------
    def _sync_draft(self) -> None:
        """Follow a hot-swapped draft: a new model needs a fresh cache."""
        if self.engine.draft is not self.draft_model:
            self.draft_model = self.engine.draft
            self.draft = _Runner(self.draft_model, self.engine.vocab_size)

    def _draft_catch_up(self, stats: GenerationStats) -> torch.Tensor:
        """Feed the draft the tokens its cache lacks; return logits for the next token [vocab]."""
        t0 = time.perf_counter()
        missing = self.seq[self.draft.length:]
        logits = self.draft.feed(missing, keep=1)[-1]
        stats.draft_time_s += time.perf_counter() - t0
        return logits

    def _target_verify(self, draft_tokens: list[int], stats: GenerationStats) -> torch.Tensor:
        """One target pass over [missing..., last token, draft tokens]: logits [gamma + 1, vocab]."""
        t0 = time.perf_counter()
        feed = self.seq[self.target.length:] + draft_tokens
        logits = self.target.feed(feed, keep=len(draft_tokens) + 1)
        stats.target_time_s += time.perf_counter() - t0
        return logits

    # -- target-only ---------------------------------------------------------------
    def target_step(self, sampling: SamplingParams, gen: torch.Generator, stats: GenerationStats) -> list[int]:
        steady, t0 = len(self.seq) - self.target.length == 1, stats.target_time_s
        logits = self._target_verify([], stats)[-1]
        if steady:       # target-only traffic tells the controller what a plain step costs
            self.engine.costs.observe_target(1, stats.target_time_s - t0)
        probs = warp_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p).exp()
        tok = int(sample(probs, gen))
        self.seq.append(tok)
        return [tok]

    # -- every drafted mode --------------------------------------------------------------
    def spec_step(self, sampling: SamplingParams, spec: SpecParams, gen: torch.Generator,
                  stats: GenerationStats, request_id: str, sink: RecordSink | None) -> list[int]:
        """One propose -> verify -> accept step; returns the emitted tokens (accepted + 1)."""
        mode = spec.mode
        if spec.needs_draft:
            self._sync_draft()
        warp = lambda lg: warp_logprobs(lg, sampling.temperature, sampling.top_k, sampling.top_p)
        start = len(self.seq)
        ctrl = self.controller
        plan = self._plan(ctrl, spec) if ctrl is not None else None
        gamma = plan.k if plan is not None else spec.gamma
        draft_s0, target_s0, wall0 = stats.draft_time_s, stats.target_time_s, time.perf_counter()
        # costs are learnt from ordinary steps only: not from a pass that also prefilled the prompt
        steady_target = len(self.seq) - self.target.length == 1
        steady_draft = self.draft is not None and len(self.seq) - self.draft.length <= spec.gamma + 2
        version = self.engine.draft_version if spec.needs_draft else "none"
        algorithm = mode
        if plan is not None and plan.proposer != "draft":
            # the controller chose no draft model this step: a plain target step (k = 0), or the n-gram
            # lookup's proposal verified by this mode's own rule (one-hot draft rows, as mode "ngram")
            if plan.proposer == "ngram":
                draft_tokens, draft_probs = self._ngram_rows(self.ngram_proposal[:gamma])
                version, algorithm = "none", "ngram"
                stats.ngram_steps += 1
            else:
                draft_tokens, draft_probs = [], None
                version, algorithm = "none", "target"
                stats.zero_draft_steps += 1
            target_logits = self._target_verify(draft_tokens, stats)           # [k + 1, vocab]
            target_probs = warp(target_logits).exp()
            if draft_tokens:
                res = VERIFY_RULES[mode](torch.tensor(draft_tokens, dtype=torch.long), draft_probs, target_probs,
                                         gen, spec)
            else:   # every rule with nothing drafted: one token from the target
                res = VerifyResult(num_accepted=0, next_token=int(sample(target_probs[0], gen)))
        elif mode == "spectr":
            draft_tokens, target_logits, res = self._spectr_step(spec, warp, gen, stats)
        else:
            if mode == "mjsd" and (sampling.temperature == 0 or spec.beams == 1):
                # greedy (one-hot warp) or one beam: every beam but the first has no candidate, so beam
                # sampling is the plain draft chain; skip the forked beam caches
                draft_tokens, draft_probs = self._propose_chain(gamma, warp, gen, stats)
            elif mode == "mjsd":
                draft_tokens, draft_probs = self._propose_beams(spec, warp, gen, stats, gamma)
            elif mode == "ngram":
                draft_tokens, draft_probs = self._propose_ngram(spec)
            elif mode == "staged":
                draft_tokens, draft_probs = self._propose_staged(spec, warp, gen, stats)
            elif mode == "bild":
                draft_tokens, draft_probs = self._propose_chain(
                    spec.gamma, warp, gen, stats, stop=_bild_stop(spec.extra["fallback_threshold"], sampling))
            else:
                draft_tokens, draft_probs = self._propose_chain(gamma, warp, gen, stats)
            if plan is not None and plan.probe:
                stats.probe_steps += 1
            target_logits = self._target_verify(draft_tokens, stats)           # [g + 1, vocab]
            target_probs = warp(target_logits).exp()
            res = VERIFY_RULES[mode](torch.tensor(draft_tokens, dtype=torch.long), draft_probs, target_probs, gen, spec)
        n = res.num_accepted
        emitted = draft_tokens[:n] + [int(res.next_token)]
        self.seq.extend(emitted)
        # rollback: target keeps seq[:-1]; draft keeps at most that
        self.target.truncate(len(self.seq) - 1)
        if self.draft is not None:
            self.draft.truncate(min(self.draft.length, len(self.seq) - 1))
        stats.steps += 1
        stats.draft_tokens += len(draft_tokens)
        stats.accepted_tokens += n
        for i in range(n):
            stats.accepted_per_position[i] += 1
        if ctrl is not None:
            ctrl.observe(plan, n)
            if draft_tokens and plan.proposer == "draft" and steady_draft:
                self.engine.costs.observe_draft(ctrl.draft_key, len(draft_tokens), stats.draft_time_s - draft_s0)
            if steady_target:
                self.engine.costs.observe_target(len(draft_tokens) + 1, stats.target_time_s - target_s0)
                if steady_draft or not draft_tokens:
                    forwards = stats.target_time_s - target_s0 + stats.draft_time_s - draft_s0
                    self.engine.costs.observe_overhead(bool(draft_tokens), time.perf_counter() - wall0 - forwards)
        # every verified step is recorded, also one that drafted nothing: distillation then learns exactly
        # the traffic on which the draft is weak (the target's top-k of each emitted token)
        if sink is not None and (draft_tokens or ctrl is not None):
            try:
                ids, lps = _top_k_record(target_logits, self.engine.record_top_k)
                sink.push_step(StepRecord(
                    request_id=request_id, position=start, draft_tokens=draft_tokens, num_accepted=n,
                    target_topk_ids=ids, target_topk_logprobs=lps, algorithm=algorithm,
                    draft_version=version,
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    timestamp=time.time(), next_token=int(res.next_token)))
                self.recorded_steps += 1
            except Exception as exc:
                log.warning("replay buffer push failed: %s", exc)
        return emitted

    def _draft_feed(self, tokens, keep: int, stats: GenerationStats) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.draft.feed(tokens, keep=keep)
        stats.draft_time_s += time.perf_counter() - t0
        return logits

    def _propose_chain(self, gamma: int, warp, gen, stats, stop=None) -> tuple[list[int], torch.Tensor]:
        """Autoregressive draft: up to gamma tokens, each sampled from the warped draft distribution;
        `stop(probs [vocab], logits [vocab]) -> bool`, checked after each token, ends the chain early
        (BiLD's fallback; the token that triggered it is kept). Returns tokens [g] and their
        distributions [g, vocab]."""
        logits = self._draft_catch_up(stats)
        tokens, probs = [], []
        for i in range(gamma):
            p = warp(logits).exp()
            tok = int(sample(p, gen))
            tokens.append(tok)
            probs.append(p)
            if i + 1 == gamma or (stop is not None and stop(p, logits)):
                break
            logits = self._draft_feed([tok], 1, stats)[-1]
        return tokens, torch.stack(probs)

    def _plan(self, ctrl: RequestController, spec: SpecParams) -> Plan:
        """The controller's choice for this step (serving/controller.py); the n-gram lookup is offered
        only in NGRAM_SWITCH_MODES (its proposal is kept in `ngram_proposal` for the step)."""
        ctrl.version = self.engine.draft_version
        self.ngram_proposal = self._ngram_tokens(spec.gamma) if ctrl.use_ngram else []
        return ctrl.plan(len(self.ngram_proposal))

    # the controller's n-gram proposer: suffixes of 2..3 tokens (a one-token match is mostly noise)
    CONTROLLER_NGRAM = (3, 2)

    def _ngram_tokens(self, gamma: int, max_ngram: int | None = None, min_ngram: int | None = None) -> list[int]:
        """Prompt lookup over seq: up to gamma tokens, cut after a stop token."""
        tokens = ngram_propose(self.seq, max_ngram or self.CONTROLLER_NGRAM[0], gamma,
                               min_ngram or self.CONTROLLER_NGRAM[1])
        for i, tok in enumerate(tokens):
            if tok in self.engine.eos_token_ids:
                return tokens[: i + 1]
        return tokens

    def _propose_ngram(self, spec: SpecParams) -> tuple[list[int], torch.Tensor]:
        """Prompt lookup over seq: up to gamma tokens (cut after a stop token), one-hot 'draft' rows."""
        return self._ngram_rows(self._ngram_tokens(spec.gamma, spec.extra["max_ngram"], spec.extra["min_ngram"]))

    def _ngram_rows(self, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
        """A deterministic proposal as draft rows: one-hot [len, vocab]."""
        onehot = torch.zeros(len(tokens), self.engine.vocab_size, device=self.target.device)
        onehot[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
        return tokens, onehot

    def _propose_staged(self, spec: SpecParams, warp, gen, stats) -> tuple[list[int], torch.Tensor]:
        """Staged speculation: gamma exact draft samples, in fewer sequential draft forwards.

        Each inner step looks up an n-gram continuation of seq + drafted tokens (at most the room
        left minus one), feeds [unfed tokens, proposal] to the draft in ONE forward, and
        `staged_accept` keeps n proposal tokens plus one draft-sampled token; the draft cache is
        cropped back to the kept tokens. As in the chain, the last drafted token is left unfed.
        """
        gamma, max_ngram, min_ngram = spec.gamma, spec.extra["max_ngram"], spec.extra["min_ngram"]
        pending = self.seq[self.draft.length:]                               # >= 1 token (cache <= seq[:-1])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while len(tokens) < gamma:
            room = gamma - len(tokens) - 1
            proposal = ngram_propose(self.seq + tokens, max_ngram, room, min_ngram) if room else []
            rows = warp(self._draft_feed(pending + proposal, len(proposal) + 1, stats)).exp()   # [m + 1, vocab]
            n, nxt = staged_accept(proposal, rows, gen)
            self.draft.truncate(self.draft.length - (len(proposal) - n))
            tokens += proposal[:n] + [nxt]
            probs.append(rows[: n + 1])
            pending = [nxt]
        return tokens, torch.cat(probs)

    def _spectr_step(self, spec: SpecParams, warp, gen, stats) -> tuple[list[int], torch.Tensor, VerifyResult]:
        """SpecTr: k i.i.d. draft chains, one batched target pass, K-SEQ over the tree.

        The draft and target caches are repeated to k (resp. #distinct chains) rows in place; after
        verification both keep only the row of the chosen chain. Returns that chain's tokens, its
        target logits [gamma + 1, vocab] (for the record) and the rule's result.
        """
        k, gamma = spec.extra["num_drafts"], spec.gamma
        logits = self._draft_catch_up(stats)                                  # [vocab]
        probs = warp(logits).exp().expand(k, -1)                              # [k, vocab]
        tokens_hist, probs_hist = [], []
        for i in range(gamma):
            tok = sample(probs, gen)                                          # [k]
            tokens_hist.append(tok)
            probs_hist.append(probs)
            if i + 1 == gamma:
                break
            if i == 0:
                self.draft.repeat(k)
            probs = warp(self._draft_feed(tok[:, None], 1, stats)[:, -1]).exp()   # [k, vocab]
        chains = torch.stack(tokens_hist, dim=1)                              # [k, gamma]
        draft_probs = torch.stack(probs_hist, dim=1)                          # [k, gamma, vocab]
        # Identical chains need one target row: verify the distinct ones, index back.
        distinct, inverse = torch.unique(chains, dim=0, return_inverse=True)  # [u, gamma], [k]
        t0 = time.perf_counter()
        missing = torch.tensor(self.seq[self.target.length:], dtype=torch.long, device=distinct.device)
        self.target.repeat(len(distinct))
        feed = torch.cat([missing.expand(len(distinct), -1), distinct], dim=1)
        target_logits = self.target.feed(feed, keep=gamma + 1)                # [u, gamma + 1, vocab]
        stats.target_time_s += time.perf_counter() - t0
        target_probs = warp(target_logits).exp()[inverse]                     # [k, gamma + 1, vocab]
        row, res = spectr_verify(chains, draft_probs, target_probs, gen)
        self.target.select(inverse[row: row + 1])
        if self.draft.batch > 1:
            self.draft.select(torch.tensor([row]))
        return chains[row].tolist(), target_logits[int(inverse[row])], res

    def _propose_beams(self, spec: SpecParams, warp, gen, stats, gamma: int) -> tuple[list[int], torch.Tensor]:
        """MJSD draft: beam *sampling* of gamma tokens; returns the top beam and the warped draft
        distributions along it. The batch-1 draft cache is not touched by the beams (they run on a
        forked cache), so it stays a prefix of seq."""
        logits = self._draft_catch_up(stats)                               # [vocab]
        t0 = time.perf_counter()
        step_logprobs = warp(logits)[None]                                 # [1, vocab]
        beam_logq = torch.zeros(1, device=logits.device)
        parents_hist, tokens_hist, probs_hist = [], [], []
        runner = None
        for i in range(gamma):
            parent, token, beam_logq = beam_sample_step(beam_logq, step_logprobs, spec.beams, gen)
            parents_hist.append(parent)
            tokens_hist.append(token)
            probs_hist.append(step_logprobs.exp())
            if i + 1 == gamma:
                break
            if runner is None:
                runner = self.draft.fork(len(token))
            else:
                runner.select(parent)
            step_logprobs = warp(runner.feed(token[:, None], keep=1)[:, -1])  # [B, vocab]
        stats.draft_time_s += time.perf_counter() - t0
        # trace the best beam back through the parent pointers
        row = int(beam_sample_finalize(beam_logq)[0])
        tokens, probs = [], []
        for i in range(gamma - 1, -1, -1):
            tokens.append(int(tokens_hist[i][row]))
            parent = int(parents_hist[i][row])
            probs.append(probs_hist[i][parent])
            row = parent
        return tokens[::-1], torch.stack(probs[::-1])
