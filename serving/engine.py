"""The decoding engine: owns the target and draft models, their KV caches, and the
propose -> verify -> accept loop. The decision rules themselves are pure functions in
`serving/decoding/`; this module only drives models and caches around them.

Cache invariants (batch 1, one request):
- the *target* cache holds `seq[:-1]`: every token except the last emitted one, which the next
  verification pass feeds first (so a step's bonus or resampled token is scored with the next proposal);
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
- staged: staged speculation (Spector & Re 2023, "Accelerating LLM Inference with Staged Speculative
  Decoding"): n-gram lookup proposes for the DRAFT model, which checks the proposal in one forward with
  the same one-hot speculative rule (`ngram.staged_accept`), so its gamma tokens are exact draft samples
  produced in fewer sequential draft forwards; the target then verifies them by speculative sampling (lossless).
- tree: the draft grows a top-k tree, ONE target pass scores every node under a tree attention mask
  (serving/decoding/tree.py, Medusa's tree attention), greedy at T=0 or the lossless rule for deterministic
  children keeps the longest accepted path plus one target token; the caches keep that path only. Knob
  `rule` "typical" / "mjsd" picks a lossy rule at T > 0 instead (mjsd reads the proposer's warped log q).
- medusa: the same tree verification, the tree read off the replica's Medusa heads
  (serving/decoding/medusa.py) from the target's hidden state that the previous verification pass left: no
  draft model and no draft forward. Needs heads (`Engine(heads=...)`, `--medusa-heads`). Adaptive (the
  default): before each step the controller picks the tree's depth 0..min(gamma, heads) from the heads'
  acceptance and the measured cost of verifying that tree's nodes (0: a plain target step, recorded as one).
- eagle: the same tree verification, the tree grown by the replica's EAGLE-style head
  (serving/decoding/eagle.py): one decoder layer at the target's feature level, fed the target's true features
  from the verification pass it already runs (no extra target forward) and its own predicted features
  deeper in the tree. Needs a head (`Engine(eagle=...)`, `--eagle-head`).

Randomness: one torch.Generator per request, seeded from SamplingParams.seed, on the target's device
(CPU or CUDA), so every rule draws where its probability rows live; a seed reproduces a run on the
same device (CPU and CUDA streams differ). The adaptive controller (serving/controller.py) of a seeded
request decides from that request's own history only, so its plan, and with it the output, repeats
too. On CUDA `SequenceRunner.feed` and `BatchKV.feed` synchronise, so the draft/target
time split in the stats is real time, not kernel-launch time.

Concurrency: per-request state (sequence, caches, generator) lives in the `generate()` generator.
The engine lock is held for one *step* at a time, so concurrent requests interleave step by step
(round-robin time slicing) instead of queueing whole requests behind each other.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from buffer.records import RecordSink, StepRecord
from serving.config import (ADAPTIVE_MODES, ADAPTIVE_TREE_MODES, HEADS_MODES, NGRAM_SWITCH_MODES, TREE_MODES,
                            SamplingParams, SpecParams)
from serving.controller import STOP_CONFIDENCE, CostModel, ReplicaPriors, RequestController, cost_profile
from serving.decoding.bild import bild_should_fallback
from serving.decoding.eagle import EagleDrafter, EagleHead
from serving.decoding.ngram import ngram_propose, staged_accept
from serving.decoding.spectr import spectr_verify
from serving.decoding.suffix import SuffixStore, suffix_store_enabled
from serving.decoding.tree import (DraftTree, TreeDrafter, TreeVerifyResult, feed_masked_hidden, keep_path,
                                   tree_branching, tree_forward_hidden, tree_node_logq, tree_size, verdict_on_demand,
                                   verify_deterministic, verify_greedy, verify_mjsd, verify_typical)
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample, warp_logprobs
from serving.energy import EnergyMeter
from serving.modes import MODE_TABLE, VERIFY_RULES
from serving.models import (
    DEFAULT_TARGET,
    LoadedModel,
    ModelLoadError,
    check_same_tokenizer,
    load_causal_lm,
    load_tokenizer,
    read_output_token_ids,
    release_openmp_threads,
    resolve_model_path,
    skinny_policy,
    use_skinny_linears,
    wants_skinny_linears,
)
from serving.kvcache import BatchKV
from serving.runner import SequenceRunner, full_vocab_logits
from serving.scheduler import SCHEDULER_THREAD, BatchScheduler, Request

log = logging.getLogger(__name__)

MEDUSA_NEEDS_HEADS = ("mode 'medusa' needs Medusa heads and this replica has none; start it with --medusa-heads "
                      "PATH (heads built by `python -m training.heads`), or register and promote heads "
                      "(`draftsmith register PATH`, `draftsmith promote --kind medusa V`)")

EAGLE_NEEDS_HEAD = ("mode 'eagle' needs an EAGLE-style head and this replica has none; start it with --eagle-head "
                    "PATH (a head built by `python -m training.heads --kind eagle`)")

# KV tokens a replica's running requests may reserve together (prompt + max_tokens + gamma, times the rows
# a request fans out to: MJSD beams, SpecTr drafts). A request alone above it is refused (400); below it,
# requests wait until enough running ones finish.
DEFAULT_MAX_BATCH_TOKENS = 65536
BROKEN_AFTER = 3   # consecutive failed decoding steps before the engine reports itself unhealthy
# Engine.calibrate: the fixed prompt and length of the requests that measure the seeded requests' cost profile
CALIBRATION_TEXT = ("A short note on calibration: before a replica takes seeded requests, it times a few plain "
                    "target steps, a draft chain and a beam search on this text, and keeps what each one costs.")
CALIBRATION_TOKENS = 16
# ... and the target passes of 1..CALIBRATION_SIZES tokens (a step verifying up to 8 draft tokens), each timed
# directly: the cost is far from a line through two sizes on a CPU (docs/benchmarks.md, the twelfth session)
CALIBRATION_SIZES = 9
CALIBRATION_REPEATS = 3
# ... and a draft forward over this many tokens against a one-token one: what the draft's catch-up after plain
# steps costs per skipped token (the controller prices a probe with it)
CALIBRATION_CATCH_UP = 32
CANARY_SALT = "draftsmith-canary:"


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def canary_bucket(request_id: str) -> float:
    """A request's place in [0, 1) for canary routing: sha256 of the SALTED request id. The salt matters:
    the held-out split of training/data.py hashes the bare id, so without it the canary's traffic would be
    exactly the held-out requests (or exactly not)."""
    h = hashlib.sha256((CANARY_SALT + str(request_id)).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def routes_to_canary(request_id: str, share: float) -> bool:
    """Whether a request goes to the canary draft: deterministic per request id, `share` of ids."""
    return share > 0 and canary_bucket(request_id) < share


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
    ngram_steps: int = 0           # adaptive: steps whose proposal came from the n-gram lookup or the suffix store
    store_steps: int = 0           # adaptive: of those, the steps the suffix store proposed (Engine.proposal)
    probe_steps: int = 0           # adaptive: one-token probes of a draft that had stopped paying
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    # batched serving: the part of wall_time_s this request waited while the replica stepped requests that were
    # not in its pass (the other drafter kind's batch, a mode that steps alone); serving/mode_choice.py leaves it out
    other_steps_s: float = 0.0
    # batched serving: the part of wall_time_s the replica ran on fewer threads because jobs beside serving held
    # cores (serving/contention.py); serving/mode_choice.py keeps figures of such requests apart
    beside_jobs_s: float = 0.0
    # batched serving: the steps this request took in a pass shared with other requests' rows (its own kind's
    # batch), and the time of those passes; serving/mode_choice.py compares drafters on steps taken alone
    shared_steps: int = 0
    shared_steps_s: float = 0.0
    own_steps_s: float = 0.0       # the time of every pass it stepped in (alone or shared)
    energy_j: float | None = None
    energy_reason: str | None = None
    # a seeded sampled adaptive request: the digest of the cost profile it planned with (Engine.calibrate;
    # "prior": none could be measured); empty otherwise
    cost_profile: str = ""
    # per draft version that proposed steps ("none": steps without a draft model): steps, draft_tokens,
    # accepted_tokens; a request that spans a hot-swap lists both versions
    draft_versions: dict = field(default_factory=dict)

    def count_version(self, version: str, drafted: int = 0, accepted: int = 0) -> None:
        v = self.draft_versions.setdefault(version, {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0})
        v["steps"] += 1
        v["draft_tokens"] += drafted
        v["accepted_tokens"] += accepted
        if version != "none":
            self.draft_version = version      # the newest version that drafted for this request

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


def _gives_back_openmp_threads(fn):
    """Run `fn`, then release the OpenMP workers its forwards created in the calling thread
    (serving/models.py `release_openmp_threads`), unless that thread is the batch scheduler's, which computes
    on. Model loading, swaps and calibration run outside the scheduler; left alive, their pools push libgomp
    into waking a sleeping worker for every parallel region of every decoding step."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if threading.current_thread().name != SCHEDULER_THREAD:
                release_openmp_threads()
    return wrapper


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
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        prefill_chunk: int = 512,
        heads=None,
        heads_version: str = "none",
        eagle: EagleHead | None = None,
        eagle_version: str = "none",
    ) -> None:
        self.target = target
        # Medusa heads (mode "medusa", serving/decoding/medusa.py): a folder ("medusa:<folder>" in statistics
        # and records) or the heads registry's champion ("medusa-v<N>"), hot-swapped by load_heads
        self.heads = heads
        self.heads_version = heads_version if heads is not None else "none"
        # the EAGLE-style head (mode "eagle", serving/decoding/eagle.py): a folder ("eagle:<folder>"), load_eagle
        self.eagle = eagle
        self.eagle_version = eagle_version if eagle is not None else "none"
        # a canary per heads kind (set_heads_canary): {"medusa" | "eagle": (module, version name, share, path)}
        self.heads_canary: dict[str, tuple] = {}
        # medusa requests step together, one target pass over all their trees (serving/scheduler.py
        # `_tree_step`); False: each steps alone (`_solo_tree_step`), the A/B arm of scripts/bench_load.py
        self.batch_trees = True
        self.tokenizer = target.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.draft = draft
        self.draft_version = draft_version if draft is not None else "none"
        # the canary (issue 17): a second draft that `canary_share` of new requests use (set_canary)
        self.canary: LoadedModel | None = None
        self.canary_version = "none"
        self.canary_share = 0.0
        self.sink = sink
        self.device = device
        self.record_top_k = record_top_k
        self.target_name = target_name
        cfg_max = getattr(target.model.config, "max_position_embeddings", 2048) or 2048
        self.max_context = min(max_context or cfg_max, cfg_max)
        self.eos_token_ids = self._eos_ids()
        self._rng_device = next(target.model.parameters()).device
        self.target_device = self._rng_device
        if self.target_device.type == "cpu":
            # transformers' SDPA path repeats the key/value heads of a GQA model (SmolLM2: 3 -> 9) whenever
            # a mask is given and more than one query is fed, i.e. on every batched verification; torch's CPU
            # SDPA takes the grouped heads directly (enable_gqa): +8-9% tokens/s at 8 in-process clients in
            # two 30 s runs each way; within noise in bench_load (docs/benchmarks.md). Not on CUDA, where a
            # mask with enable_gqa falls back to the math kernel. Process-wide; set
            # TRANSFORMERS_SDPA_FORCE_GQA=0 to opt out.
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        self.scheduler = BatchScheduler(self, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk)
        self._lock = threading.Lock()
        self._energy = EnergyMeter(device)
        self.costs = CostModel()          # measured step costs of this replica (serving/controller.py)
        self.priors = ReplicaPriors()     # acceptance of recent traffic: each new request's prior
        # adaptive chains end after a token the draft doubts (serving/controller.py STOP_CONFIDENCE)
        self.stop_confidence = STOP_CONFIDENCE
        # the suffix store's proposals priced apart from the prompt lookup's (`proposal`; False: as one, for an A/B)
        self.store_apart = True
        # the frozen cost profile of seeded sampled requests (calibrate), and the draft it was measured with
        self.seeded_profile: dict | None = None
        self.seeded_prior = 0.5           # the acceptance a seeded sampled request assumes before its own steps
        # where measured profiles are kept across restarts and shared by the replicas of one machine (None: not
        # kept); Service sets it from ServiceSettings.profile_dir
        self.profile_dir: str | Path | None = None
        self._profile_for: tuple | None = None
        self._calibration_lock = threading.Lock()
        self._broken: str | None = None
        self._failures = 0
        # earlier answers, proposing across requests (serving/decoding/suffix.py; mode medusa's knob `suffix`):
        # every finished answer joins it (`learn_answer`; not a request with log_mode "none", which the
        # replay buffer keeps nothing of either) unless `suffix_learn` is off (benchmarks that replay one prompt
        # turn it off); None where DRAFTSMITH_SUFFIX_STORE=0
        self.suffix_store: SuffixStore | None = SuffixStore() if suffix_store_enabled() else None
        self.suffix_learn = True

    # ------------------------------------------------------------------ construction
    @classmethod
    @_gives_back_openmp_threads
    def from_paths(
        cls,
        target: str | None = None,
        draft: str | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        sink: RecordSink | None = None,
        draft_version: str = "none",
        heads: str | Path | None = None,
        eagle: str | Path | None = None,
        **kwargs,
    ) -> "Engine":
        target_path = resolve_model_path(target)
        tgt = LoadedModel(load_causal_lm(target_path, device, dtype), load_tokenizer(target_path), target_path)
        drf = cls._load_draft(draft, tgt, device, dtype) if draft else None
        kwargs.setdefault("target_name", DEFAULT_TARGET if target is None else str(target))
        engine = cls(tgt, drf, draft_version=draft_version if drf else "none", sink=sink, device=device, **kwargs)
        if heads:
            engine.load_heads(heads)
        if eagle:
            engine.load_eagle(eagle)
        return engine

    def seed_suffix_store(self, path: str | Path) -> int:
        """Seed the suffix store with a teacher-data file's answers (serving/decoding/suffix.py); returns how
        many. Data written for another vocabulary (a token id this target lacks) is refused and logged."""
        return 0 if self.suffix_store is None else self.suffix_store.seed(path, self.vocab_size)

    def store_for(self, sampling: SamplingParams) -> SuffixStore | None:
        """The suffix store a request's trees read: none for a seeded sampled request, whose output must not
        depend on what other requests taught the store in between (the tree's shape steers which random draws
        its rule makes); greedy output is the target's argmax whatever the tree holds."""
        if sampling.seed is not None and sampling.temperature > 0:
            return None
        return self.suffix_store

    def learn_answer(self, prompt: list[int], answer: list[int], key: str | None = None) -> None:
        """A finished answer joins the suffix store (a no-op without one or with `suffix_learn` off). `key`, the
        request id, keeps the answer from being added again when it comes back through the replay buffer
        (serving/decoding/suffix.py `BufferFollower`)."""
        if self.suffix_store is not None and self.suffix_learn and answer:
            self.suffix_store.add(prompt, answer, key=key)

    @_gives_back_openmp_threads
    def load_eagle(self, path: str | Path, version: str | None = None) -> str:
        """Load (or hot-swap) an EAGLE-style head for mode "eagle", bound to this target's rows; returns its
        version name (`version`, or "eagle:<folder>"). A request whose head changes between steps rebuilds the
        head's cache from the target's features at its next step. ModelLoadError saying what is wrong (the old
        head, if any, stays)."""
        head = self._load_kind("eagle", path, version)
        with self._lock:
            self.eagle, self.eagle_version = head, version or f"eagle:{Path(path).name}"
        log.info("EAGLE head loaded from %s (%d kept tokens)", path, len(head.output_token_ids))
        return self.eagle_version

    def version_of(self, mode: str, arm: str = "champion") -> str:
        """The version name a step of `mode` is proposed by: the heads' or the EAGLE head's for those modes
        (their canary's for a request on the canary arm), the champion draft's otherwise."""
        if mode in HEADS_MODES:
            return self.heads_for(mode, arm)[1]
        return self.draft_version

    def heads_for(self, kind: str, arm: str = "champion") -> tuple[object | None, str]:
        """(module, version name) of `kind` ("medusa", "eagle") that proposes for a request on `arm`: the
        kind's canary while one is loaded for a request routed to it, else the champion."""
        c = self.heads_canary.get(kind) if arm == "canary" else None
        if c is not None:
            return c[0], c[1]
        return (self.heads, self.heads_version) if kind == "medusa" else (self.eagle, self.eagle_version)

    def set_heads_canary(self, kind: str, path: str | Path | None, version: str = "none", share: float = 0.0) -> None:
        """Serve `kind` heads from `path` (version name `version`, e.g. "medusa-v3") to `share` of new
        requests of that mode, chosen by `routes_to_canary(request id)` as the draft's canary is; `path=None`
        ends it. Requests on a canary that goes away continue on the champion at their next step (the
        drafter re-reads their sequence: lossless). ModelLoadError / ValueError leave the previous state."""
        if kind not in HEADS_MODES:
            raise ValueError(f"kind must be one of {HEADS_MODES}, got {kind!r}")
        if path is None:
            with self._lock:
                self.heads_canary.pop(kind, None)
            return
        if not (0.0 < float(share) < 1.0):
            raise ValueError(f"canary share must be in (0, 1), got {share!r}")
        module = self._load_kind(kind, path, version)             # the same version: only the share changes
        with self._lock:
            self.heads_canary[kind] = (module, str(version), float(share), path)
        log.info("canary %s version %s (%s) takes %.0f%% of new %s requests", kind, version, path, 100 * share, kind)

    @_gives_back_openmp_threads
    def load_heads(self, path: str | Path, version: str | None = None) -> str:
        """Load (or hot-swap) Medusa heads for mode "medusa", bound to this target's rows; returns their
        version name: `version` (a registry version, "medusa-v<N>", serving/service.py's heads watcher) or
        "medusa:<folder>". A request mid-step keeps the heads it started the step with; the next step uses
        the new ones. ModelLoadError saying what is wrong (the old heads, if any, stay)."""
        heads = self._load_kind("medusa", path, version)
        with self._lock:
            self.heads, self.heads_version = heads, version or f"medusa:{Path(path).name}"
        log.info("Medusa heads loaded from %s (%d heads)", path, heads.config.num_heads)
        return self.heads_version

    def _load_kind(self, kind: str, path: str | Path, version: str | None):
        """The `kind` module ("medusa", "eagle") for `path`: the loaded canary's when it is `version` (a
        promoted canary, or a canary whose share changes: no second load), else loaded bound to the target.
        Both run in the target's dtype (on a bf16 CPU the EAGLE head's fp32 layer and kept-vocabulary rows
        took 26 of its 32 ms per step, docs/benchmarks.md); their proposals' log-probabilities are fp32."""
        with self._lock:
            c = self.heads_canary.get(kind)
        if c is not None and version is not None and c[1] == version:
            return c[0]
        if kind == "medusa":
            from serving.decoding.medusa import MedusaHeads

            return self._load_bound(MedusaHeads, path, "Medusa heads")
        return self._load_bound(EagleHead, path, "an EAGLE head")

    def _load_bound(self, cls, path: str | Path, what: str):
        """`cls.load(path, target)` (Medusa heads, an EAGLE head: modules bound to the target's rows) on the
        target's device and in its dtype, its kept token ids checked against the tokenizer; ModelLoadError
        naming `what`."""
        try:
            module = cls.load(path, self.target.model).to(self.target_device,
                                                          next(self.target.model.parameters()).dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as e:   # not such a folder, other target, corrupt
            raise ModelLoadError(f"cannot load {what} from {path}: {e}") from e
        if max(module.output_token_ids) >= self.vocab_size:
            raise ModelLoadError(f"{what} from {path} would propose token ids outside the target's tokenizer")
        return module

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
            if wants_skinny_linears(device, small.weight.dtype):
                use_skinny_linears(small)
            model.set_output_embeddings(small)
        return LoadedModel(model, tok, path, ids_t)

    @_gives_back_openmp_threads
    def swap_draft(self, draft_path: str | Path, version: str) -> None:
        """Load a new draft and make it live between steps. On failure the old draft stays. The canary's
        version becoming champion takes the loaded canary model over (no second load; its draft cache
        carries on)."""
        with self._lock:
            reuse = self.canary if self.canary is not None and self.canary_version == version else None
        if reuse is None:
            dtype = next(self.target.model.parameters()).dtype
            reuse = self._load_draft(draft_path, self.target, self.device, dtype)  # may raise ModelLoadError
        with self._lock:
            self.draft, self.draft_version = reuse, version
        log.info("draft swapped to version %s (%s)", version, draft_path)

    @_gives_back_openmp_threads
    def set_canary(self, draft_path: str | Path | None, version: str = "none", share: float = 0.0) -> None:
        """Serve draft `draft_path` (registry version `version`) to `share` of new requests, chosen by
        `routes_to_canary(request id)`; `draft_path=None` ends the canary. Requests on the canary whose
        canary goes away continue on the champion draft at their next step (lossless: the champion's
        draft cache re-reads their sequence). On a load failure the previous state stays."""
        if draft_path is None:
            with self._lock:
                self.canary, self.canary_version, self.canary_share = None, "none", 0.0
            return
        if not (0.0 < float(share) < 1.0):
            raise ValueError(f"canary share must be in (0, 1), got {share!r}")
        with self._lock:
            same = self.canary if self.canary is not None and self.canary_version == version else None
            if same is None and self.draft is not None and self.draft_version == version:
                same = self.draft
        if same is None:
            dtype = next(self.target.model.parameters()).dtype
            same = self._load_draft(draft_path, self.target, self.device, dtype)
        with self._lock:
            self.canary, self.canary_version, self.canary_share = same, str(version), float(share)
        log.info("canary draft version %s (%s) takes %.0f%% of new requests", version, draft_path, 100 * share)

    def draft_for(self, req) -> tuple[LoadedModel | None, str]:
        """(draft model, version) that proposes for a request's next step: the canary for requests routed
        to it while it is loaded, else the champion draft."""
        if getattr(req, "arm", "champion") == "canary" and self.canary is not None:
            return self.canary, self.canary_version
        return self.draft, self.draft_version

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

    # ------------------------------------------------------------------ n-gram proposals
    # the controller's n-gram proposer: suffixes of 2..3 tokens (a one-token match is mostly noise)
    CONTROLLER_NGRAM = (3, 2)

    def ngram_tokens(self, seq: list[int], gamma: int, max_ngram: int | None = None,
                     min_ngram: int | None = None, store: SuffixStore | None = None) -> list[int]:
        """Prompt lookup over seq: up to gamma tokens, cut after a stop token. With a `store` (the controller's
        deterministic proposer in the chain modes: `store_for(sampling)`), where the context proposes nothing
        the suffix store's continuation from earlier answers is proposed instead (`proposal`)."""
        return self.proposal(seq, gamma, max_ngram, min_ngram, store)[0]

    def proposal(self, seq: list[int], gamma: int, max_ngram: int | None = None, min_ngram: int | None = None,
                 store: SuffixStore | None = None) -> tuple[list[int], str]:
        """`ngram_tokens` and the source that proposed them: "ngram" (the prompt lookup, or nothing proposed) or
        "store" (the suffix store), which the controller prices apart (serving/controller.py `Plan.source`)."""
        tokens, source = ngram_propose(seq, max_ngram or self.CONTROLLER_NGRAM[0], gamma,
                                       min_ngram or self.CONTROLLER_NGRAM[1]), "ngram"
        if not tokens and store is not None:
            tokens = store.propose(seq, gamma)
            source = "store" if tokens and self.store_apart else "ngram"
        for i, tok in enumerate(tokens):
            if tok in self.eos_token_ids:
                return tokens[: i + 1], source
        return tokens, source

    def ngram_rows(self, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
        """A deterministic proposal as draft rows: one-hot [len, vocab]."""
        onehot = torch.zeros(len(tokens), self.vocab_size, device=self.target_device)
        onehot[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
        return tokens, onehot

    # ------------------------------------------------------------------ generation
    def generate_all(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams, **kw) -> GenerationResult:
        tokens: list[int] = []
        last = None
        for last in self.generate(prompt_ids, sampling, spec, **kw):
            tokens.extend(last.token_ids)
        assert last is not None
        return GenerationResult(tokens, last.finish_reason or "length", last.stats)

    def footprint(self, prompt_len: int, sampling: SamplingParams, spec: SpecParams) -> int:
        """The KV tokens a request may reserve: its context at most, times the rows it fans out to."""
        context = min(self.max_context, prompt_len + sampling.max_tokens + spec.gamma + 1)
        fan = 1
        if spec.mode == "mjsd" and sampling.temperature > 0:
            fan = spec.beams
        elif spec.mode == "spectr":
            fan = spec.extra["num_drafts"]
        elif spec.mode in TREE_MODES:      # the tree's nodes, and the grafted branches as deep (medusa_tree)
            return context + tree_size(tree_branching(spec.gamma, spec.extra["width"], spec.extra["branch"])) \
                + grafted_nodes(spec, spec.gamma)
        return context * fan

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
        costs: CostModel | None = None,
    ) -> Iterator[StepOutput]:
        """Decode one request; yields the tokens of each step as the batch scheduler (serving/scheduler.py)
        produces them. Closing the generator (or setting `cancel`) takes the request out of the batch.
        `costs`: where the request's step costs go while it steps alone (calibrate; default the replica's)."""
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
        if mode == "medusa" and self.heads is None:
            raise ValueError(MEDUSA_NEEDS_HEADS)
        if mode == "eagle" and self.eagle is None:
            raise ValueError(EAGLE_NEEDS_HEAD)
        footprint = self.footprint(len(prompt), sampling, spec)
        if footprint > self.max_batch_tokens:
            raise ValueError(
                f"this request may hold {footprint} KV tokens (prompt + max_tokens + gamma, times beams or drafts), "
                f"more than this replica's budget of {self.max_batch_tokens}; lower max_tokens, beams or num_drafts")
        request_id = request_id or uuid.uuid4().hex
        gen = torch.Generator(device=self._rng_device)   # on the model's device: rules sample where the rows are
        gen.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(uuid.uuid4().bytes[:6], "little"))
        gamma = spec.gamma if mode != "target" else 0
        adaptive = spec.adaptive and (mode in ADAPTIVE_MODES or mode in ADAPTIVE_TREE_MODES)
        # canary routing: only batched draft modes (the modes that run alone keep the champion draft)
        arm = "canary" if (self.canary is not None and spec.needs_draft and MODE_TABLE[mode].batched
                           and routes_to_canary(request_id, self.canary_share)) else "champion"
        version = self.canary_version if arm == "canary" else self.draft_version
        if mode in HEADS_MODES:
            c = self.heads_canary.get(mode)
            arm = "canary" if c is not None and routes_to_canary(request_id, c[2]) else "champion"
            version = self.version_of(mode, arm)
        stats = GenerationStats(mode=mode, draft_version=version if spec.needs_draft or mode in ("medusa", "eagle")
                                else "none",
                                gamma=gamma, accepted_per_position=[0] * gamma, adaptive=adaptive)
        req = Request(id=request_id, prompt=prompt, sampling=sampling, spec=spec, gen=gen, stats=stats,
                      stop_ids=self.eos_token_ids | set(sampling.stop_token_ids), footprint=footprint,
                      sink=self.sink if log_mode != "none" else None, log_mode=log_mode, source=source,
                      cancel=cancel, arm=arm, costs=costs)
        if adaptive:
            # A seeded request must reproduce its output, so its controller decides from its own history
            # (the default prior) and the replica's frozen cost profile (calibrate: measured once, rounded),
            # never from the replica's live timings or other traffic; except when its output cannot depend
            # on the plan: greedy, in a mode that then emits exactly the target's greedy tokens (all but
            # mentored, whose KL budget may keep a draft token at T=0), so a seeded greedy request gets the
            # replica's measured costs like any other.
            seeded = sampling.seed is not None and not (sampling.greedy and mode != "mentored")
            beams = mode == "mjsd" and sampling.temperature > 0 and spec.beams > 1
            costs, priors = self.costs, self.priors
            if seeded:
                profile = self.calibrate()
                stats.cost_profile = profile["digest"] if profile is not None else "prior"
                costs = CostModel.frozen(profile) if profile is not None else CostModel()
                priors = ReplicaPriors(prior=self.seeded_prior)
            if mode in ADAPTIVE_TREE_MODES:
                req.controller = self._tree_controller(spec, sampling, costs, priors, version, source or "")
            else:
                req.controller = RequestController(
                    gamma=spec.gamma, costs=costs, priors=priors, version=version, category=source or "",
                    greedy=sampling.greedy, draft_key="beams" if beams else "chain", max_tokens=sampling.max_tokens,
                    use_ngram=mode in NGRAM_SWITCH_MODES, stop_below=0.0 if beams else self.stop_confidence)
        self.scheduler.submit(req)
        try:
            while True:
                kind, payload, finish = req.out.get()
                if kind == "error":
                    raise payload
                yield StepOutput(payload, finish, stats)
                if finish is not None:
                    return
        finally:
            req.closed.set()      # a consumer that stops reading leaves the batch at the next round

    def _tree_controller(self, spec: SpecParams, sampling: SamplingParams, costs: CostModel, priors: ReplicaPriors,
                         version: str, category: str = "") -> RequestController:
        """The controller of an adaptive medusa request: before each step it picks the tree's depth k in
        0..min(gamma, heads) (0: a plain target step, which still leaves the hidden state the heads read next)
        from the heads' acceptance per depth and the measured cost of verifying that tree (its shape's nodes
        plus the root, `verify_tokens`), as it picks a chain's length; the width and branch knobs keep the
        tree's shape at every depth."""
        width, branch = spec.extra["width"], spec.extra["branch"]
        depth = max(1, min(spec.gamma, self.heads.config.num_heads))
        return RequestController(
            gamma=depth, costs=costs, priors=priors, version=version, greedy=sampling.greedy,
            draft_key=spec.mode, category=category, max_tokens=sampling.max_tokens, catches_up=False,
            verify_tokens=lambda k: 1 + tree_size(tree_branching(k, width, branch)))

    # ------------------------------------------------------------------ the seeded requests' cost profile
    def _draft_signature(self) -> tuple:
        """What the draft's cost depends on: its architecture and its output rows (not its weights), so that a
        hot-swapped draft of the same shape keeps the profile."""
        heads = () if self.heads is None else ("medusa", self.heads.config.num_heads, self.heads.config.num_layers)
        if self.draft is None:
            return ("none",) + heads
        cfg = self.draft.model.config
        rows = self.draft.output_token_ids
        return (type(self.draft.model).__name__, getattr(cfg, "num_hidden_layers", None),
                getattr(cfg, "hidden_size", None), self.vocab_size if rows is None else len(rows)) + heads

    @_gives_back_openmp_threads
    def calibrate(self, force: bool = False, cancel: threading.Event | None = None) -> dict | None:
        """The cost profile of seeded sampled requests (controller.cost_profile): this replica's one-request
        step costs, measured once on a fixed prompt (plain target steps, a speculative chain and MJSD's beams
        at gamma 4, after one warm-up pass; then target passes of 1..CALIBRATION_SIZES tokens timed directly, and
        the draft's catch-up over CALIBRATION_CATCH_UP tokens),
        relative to a one-token target step, rounded to a coarse grid.
        Measured again only when a draft of another shape is loaded, or with `force`. A seeded request's plan
        then follows this replica's costs (a CPU where verification is dear, a GPU where 8 beams cost more
        than the prior) while its output still does not depend on the timing of its own steps; the
        profile's digest is in the request's statistics and the response's `system_fingerprint`, which, as
        in OpenAI's API, names the backend configuration that a seed reproduces on. None when the
        measurement failed or was cancelled (`cancel` set: the replica is closing; the prior costs then apply)."""
        sig = self._draft_signature()
        with self._calibration_lock:
            if self.seeded_profile is not None and self._profile_for == sig and not force:
                return self.seeded_profile
            kept = self._kept_profile(sig) if not force else None
            if kept is not None:
                self.seeded_profile, self._profile_for = kept, sig
                log.info("cost profile %s read from %s", kept["digest"], self.profile_dir)
                return kept
            t0 = time.perf_counter()
            ids = self.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
            prompt = [int(t) % self.vocab_size for t in ids][: max(1, self.max_context // 4)] or [0]
            sampling = SamplingParams(temperature=0.7, max_tokens=CALIBRATION_TOKENS, seed=0)
            specs = [SpecParams(mode="target")]
            if self.draft is not None:
                specs += [SpecParams(mode="speculative", adaptive=False), SpecParams(mode="mjsd", adaptive=False)]
            if self.heads is not None:          # the heads' tree at full depth: what a depth costs to draft
                specs += [SpecParams(mode="medusa", adaptive=False)]
            measured = CostModel(weight=0.3)
            try:
                for costs in (CostModel(), measured):        # a warm-up pass, then the measured one
                    for spec in specs:
                        if cancel is not None and cancel.is_set():
                            return self.seeded_profile
                        room = self.max_context - len(prompt) - CALIBRATION_TOKENS - 2
                        spec = SpecParams(mode=spec.mode, adaptive=False, gamma=max(1, min(spec.gamma, room)))
                        self.generate_all(prompt, sampling, spec, log_mode="none", costs=costs, cancel=cancel,
                                          request_id=f"calibration-{uuid.uuid4().hex[:8]}")
                if cancel is not None and cancel.is_set():
                    return self.seeded_profile
                sizes = self._time_target_sizes(prompt, cancel)
                if cancel is not None and cancel.is_set():
                    return self.seeded_profile
                for n, seconds in sizes.items():
                    measured.set_target(n, seconds)
                    self.costs.observe_target_if_unmeasured(n, seconds)   # the live model starts from them too
                catch_up = self._time_draft_catch_up(prompt, cancel)
                if catch_up is not None:
                    measured.set_catch_up(catch_up)
                    self.costs.set_catch_up(catch_up, if_unmeasured=True)
            except Exception as exc:  # noqa: BLE001 - a failed measurement leaves seeded requests on the prior
                log.warning("cost calibration failed (%s: %s); seeded requests plan from prior costs",
                            type(exc).__name__, exc)
                return self.seeded_profile
            self.seeded_profile, self._profile_for = self._keep_profile(sig, cost_profile(measured)), sig
            log.info("cost profile %s measured in %.1f s: %s", (self.seeded_profile or {}).get("digest"),
                     time.perf_counter() - t0, self.seeded_profile)
            return self.seeded_profile

    def _time_feeds(self, model, prompt: list[int], sizes: list[int], keep_all: bool,
                    cancel: threading.Event | None = None) -> dict[int, float]:
        """Seconds of a lone request's forward of `model` over n new tokens after `prompt` for each n in `sizes`,
        as the batch scheduler runs it (a BatchKV row; logits of all n tokens with `keep_all`, as a verification
        keeps them, else of the last, as a draft's catch-up): the median of CALIBRATION_REPEATS rounds over all
        sizes, after one warm-up round. Each pass holds the engine lock, so no decoding step runs beside it.
        Empty when cancelled."""
        kv = BatchKV(model, self.target_device)
        kv.add_row(None, 0)
        with self._lock:
            kv.feed([prompt], keep=1)
        top = max(sizes)
        tokens = (prompt * (top // len(prompt) + 1))[:top]
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(CALIBRATION_REPEATS + 1):
            for n in times:
                if cancel is not None and cancel.is_set():
                    return {}
                with self._lock:
                    t0 = time.perf_counter()
                    kv.feed([tokens[:n]], keep=n if keep_all else 1)
                    if self.target_device.type == "cuda":
                        torch.cuda.synchronize(self.target_device)
                    times[n].append(time.perf_counter() - t0)
                    kv.drop_last(0, n)
        return {n: sorted(v[1:])[len(v[1:]) // 2] for n, v in times.items()}

    def _time_target_sizes(self, prompt: list[int], cancel: threading.Event | None = None) -> dict[int, float]:
        """Seconds of a lone request's target pass over n = 1..CALIBRATION_SIZES new tokens after `prompt`
        (`_time_feeds`)."""
        top = min(CALIBRATION_SIZES, self.max_context - len(prompt) - 1)
        if top < 1:
            return {}
        return self._time_feeds(self.target.model, prompt, list(range(1, top + 1)), True, cancel)

    def _time_draft_catch_up(self, prompt: list[int], cancel: threading.Event | None = None) -> float | None:
        """Seconds per token that the champion draft's catch-up over skipped tokens costs beyond a one-token
        forward: a CALIBRATION_CATCH_UP-token against a one-token draft forward after `prompt` (`_time_feeds`).
        None without a draft, without room in the context, or when cancelled."""
        n = min(CALIBRATION_CATCH_UP, self.max_context - len(prompt) - 1)
        if self.draft is None or n < 2:
            return None
        med = self._time_feeds(self.draft.model, prompt, [1, n], False, cancel)
        return max(0.0, med[n] - med[1]) / (n - 1) if med else None

    def _profile_path(self, sig: tuple) -> Path | None:
        """The file of the profile for this machine, target, draft shape, device, dtype, thread counts (the
        drafting steps' `wide_threads` where set) and, in fp32 on a CPU, SkinnyLinear's policy (`skinny_policy`)."""
        if not self.profile_dir:
            return None
        if self.target_device.type == "cuda":
            hw = torch.cuda.get_device_name(self.target_device)
        else:
            hw = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                       if line.startswith("model name")), os.uname().machine)
        cfg = self.target.model.config
        dtype = next(self.target.model.parameters()).dtype
        # the few-row products' policy, where it applies: a profile measured under another does not hold
        products = [skinny_policy()] if wants_skinny_linears(self.target_device, dtype) else []
        key = json.dumps([self.target_name, type(self.target.model).__name__, getattr(cfg, "num_hidden_layers", None),
                          getattr(cfg, "hidden_size", None), str(dtype), list(sig), self.target_device.type, hw,
                          torch.get_num_threads()] + products
                         + ([f"wide={self.scheduler.wide_threads}"] if getattr(self.scheduler, "wide_threads", None)
                            else []))
        return Path(self.profile_dir) / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def _kept_profile(self, sig: tuple) -> dict | None:
        path = self._profile_path(sig)
        if path is None or not path.exists():
            return None
        try:
            prof = json.loads(path.read_text())
            if not (isinstance(prof, dict) and {"target", "draft", "overhead", "digest"} <= set(prof)
                    and "1" in prof["target"]):
                raise ValueError("not a cost profile")
            return prof
        except Exception as exc:  # noqa: BLE001 - a damaged file is measured again and replaced
            log.warning("ignoring the cost profile file %s (%s); measuring again", path, exc)
            return None

    def _keep_profile(self, sig: tuple, prof: dict | None) -> dict | None:
        """Write a measured profile for the next start and the other replicas: the first writer wins (a
        replica that measured at the same time takes the kept one), so every replica of a machine plans
        seeded requests alike."""
        path = self._profile_path(sig)
        if path is None or prof is None:
            return prof
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(json.dumps(prof, sort_keys=True))
            try:
                os.link(tmp, path)                      # atomic, and fails where another replica was first
            except FileExistsError:
                kept = self._kept_profile(sig)
                if kept is not None:
                    prof = kept
                else:
                    os.replace(tmp, path)               # the existing file was damaged: ours replaces it
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot keep the cost profile in %s: %s", path.parent, exc)
        return prof

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
    """Sequence + caches of one request of a mode that runs alone (serving/modes.py: staged, bild,
    spectr). The batch scheduler calls one step at a time, under the engine lock."""

    def __init__(self, engine: Engine, prompt: list[int], arm: str = "champion") -> None:
        self.engine = engine
        self.arm = arm                             # medusa / eagle: the heads' canary or champion (heads_for)
        self.seq = list(prompt)
        self.target = SequenceRunner(engine.target, engine.vocab_size)
        self.draft_model = engine.draft
        self.draft = SequenceRunner(engine.draft, engine.vocab_size) if engine.draft is not None else None
        self.recorded_steps = 0
        self.tree_drafter: TreeDrafter | None = None
        self.hidden: torch.Tensor | None = None    # medusa: the target's hidden state at seq[-2]
        self.hidden_for = -1                       # ... valid while len(seq) equals this
        self.eagle_drafter: EagleDrafter | None = None   # eagle: the head's cache, in step with seq[:-1]
        self.depth: int | None = None              # medusa, adaptive: the controller's depth for the next step
        self.verified = 0                          # tokens the last tree pass verified (its root included)
        self.depth_nodes: list[int] = []           # ... and its nodes per depth 1..the depth it reached
        self.refed = False                         # ... and whether that step also re-fed context first

    # -- helpers -----------------------------------------------------------------
    def _sync_draft(self) -> None:
        """Follow a hot-swapped draft: a new model needs a fresh cache."""
        if self.engine.draft is not self.draft_model:
            self.draft_model = self.engine.draft
            self.draft = SequenceRunner(self.draft_model, self.engine.vocab_size)

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

    # -- target-only (the last tokens before the context limit) -----------------------------
    def target_step(self, sampling: SamplingParams, gen: torch.Generator, stats: GenerationStats) -> list[int]:
        logits = self._target_verify([], stats)[-1]
        probs = warp_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p).exp()
        tok = int(sample(probs, gen))
        self.seq.append(tok)
        return [tok]

    # -- one step of staged / bild / spectr ------------------------------------------------
    def spec_step(self, sampling: SamplingParams, spec: SpecParams, gen: torch.Generator,
                  stats: GenerationStats, request_id: str, sink: RecordSink | None,
                  record_plain: bool = False) -> list[int]:
        """One propose -> verify -> accept step; returns the emitted tokens (accepted + 1). `record_plain`: a
        step that proposed nothing (an adaptive medusa step at depth 0) still records the target's top-k, so
        distillation learns the traffic on which the proposer is weak (as the batched steps do)."""
        mode = spec.mode
        self._sync_draft()
        warp = lambda lg: warp_logprobs(lg, sampling.temperature, sampling.top_k, sampling.top_p)
        start = len(self.seq)
        version = self.engine.version_of(mode, self.arm)
        if mode == "spectr":
            draft_tokens, target_logits, res = self._spectr_step(spec, warp, gen, stats)
        elif mode == "tree":
            draft_tokens, target_logits, res = self._tree_step(spec, sampling, warp, gen, stats)
        elif mode == "medusa":
            draft_tokens, target_logits, res = self._medusa_step(spec, sampling, warp, gen, stats)
        elif mode == "eagle":
            draft_tokens, target_logits, res = self._eagle_step(spec, sampling, warp, gen, stats)
        else:
            if mode == "staged":
                draft_tokens, draft_probs = self._propose_staged(spec, warp, gen, stats)
            elif mode == "bild":
                draft_tokens, draft_probs = self._propose_chain(
                    spec.gamma, warp, gen, stats, stop=_bild_stop(spec.extra["fallback_threshold"], sampling))
            else:
                raise ValueError(f"mode {mode!r} runs in the batch scheduler, not alone")
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
        self.recorded_steps += count_and_record(self.engine, stats, sink, request_id, mode, version, start,
                                                draft_tokens, res, target_logits, sampling, record_plain)
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

    def _tree_step(self, spec: SpecParams, sampling: SamplingParams, warp, gen,
                   stats) -> tuple[list[int], torch.Tensor, VerifyResult]:
        """Tree verification (serving/decoding/tree.py, Medusa's tree attention): the draft grows a top-k tree
        (`width` children of the root, `branch` of each depth-1 node, one child deeper, depth gamma) in its
        own cache, ONE target pass scores every node under the tree mask, greedy (T=0) or the lossless rule
        for deterministic children keeps a path plus one target token, and the target cache keeps that path
        only. For the record (and the acceptance statistics) the step is the chain of the accepted path
        continued through first children to a leaf, with the target's rows for it."""
        eng = self.engine
        draft = eng.draft
        branching = tree_branching(spec.gamma, spec.extra["width"], spec.extra["branch"])
        if self.tree_drafter is None or self.tree_drafter.model is not draft.model:
            self.tree_drafter = TreeDrafter(draft.model, branching,
                                            lambda x: full_vocab_logits(x, draft, eng.vocab_size))
        t0 = time.perf_counter()
        tree, rows = self.tree_drafter.propose(self.seq)
        # rule mjsd: the draft's warped log q of each node at its parent's row (as the target rows are warped)
        node_logq = tree_node_logq(tree, warp(rows)) if self._tree_mjsd(spec, sampling) else None
        t1 = time.perf_counter()
        stats.draft_time_s += t1 - t0
        prefix = len(self.seq) - 1
        if self.target.length < prefix:                                       # the prompt, on the first step
            self.target.feed(self.seq[self.target.length: prefix], keep=1)
        logits, _, res = self._verify_tree_hidden(tree, prefix, sampling, spec, warp, gen, node_logq, stats,
                                                  extra_s=time.perf_counter() - t1)
        self.tree_drafter.accept(res.path)
        return self._tree_record(tree, logits, res)

    @staticmethod
    def _tree_mjsd(spec: SpecParams, sampling: SamplingParams) -> bool:
        """Whether this tree step runs rule mjsd (which needs the proposer's node_logq): T > 0 only."""
        return sampling.temperature != 0 and spec.extra["rule"] == "mjsd"

    @staticmethod
    def _tree_record(tree: DraftTree, logits: torch.Tensor,
                     res: TreeVerifyResult) -> tuple[list[int], torch.Tensor, VerifyResult]:
        """For the record (and the acceptance statistics) a tree step is the chain of the accepted path
        continued through first children to a leaf, with the target's rows for it."""
        chain = tree.chain_from(res.path)
        rows = logits[[0] + [1 + i for i in chain]]
        return [tree.tokens[i] for i in chain], rows, VerifyResult(len(res.path), res.next_token)

    def _verify_tree_hidden(self, tree: DraftTree, prefix: int, sampling: SamplingParams, spec: SpecParams, warp,
                            gen, node_logq, stats, extra_s: float = 0.0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   TreeVerifyResult]:
        """Modes tree, medusa and eagle: one target pass over `tree` under seq[-1] that also returns the hidden
        rows the heads read next, then the tree rule on the output layer's rows it reads (`verdict_on_demand`);
        the target cache keeps the accepted path. Returns logits over the full vocabulary [N + 1, vocab] (real
        at the rows the rule and the step's record read), hidden rows [N + 1, d] and the rule's result; the
        pass and its output rows, plus `extra_s` of target work done before drafting, count as target time."""
        eng = self.engine
        t0 = time.perf_counter()
        _, hid, self.target.cache = tree_forward_hidden(eng.target.model, tree, self.seq[-1], self.target.cache,
                                                        prefix, logits=False)
        t_rows = [time.perf_counter() - t0]
        logits, res = verdict_on_demand(tree, hid, target_output_rows(eng, t_rows),
                                        lambda rows: tree_verdict(tree, rows, sampling, spec, warp, gen, node_logq),
                                        gen)
        stats.target_time_s += t_rows[0] + extra_s
        keep_path(self.target.cache, prefix, res.path)
        self.target.length = prefix + 1 + len(res.path)
        return logits, hid, res


    def _medusa_step(self, spec: SpecParams, sampling: SamplingParams, warp, gen,
                     stats) -> tuple[list[int], torch.Tensor, VerifyResult]:
        """Medusa heads (serving/decoding/medusa.py): the heads read the target's hidden state at seq[-2]
        (left by the previous verification pass; recomputed with the prompt's prefill, or by re-feeding one
        token when another step left none) and propose a tree under seq[-1] (`width`, `branch`, depth
        min(gamma, heads)); then as `_tree_step`: one target pass with the tree mask, the rule, the path kept."""
        eng = self.engine
        heads = eng.heads_for("medusa", self.arm)[0]
        prefix = len(self.seq) - 1
        t0 = time.perf_counter()
        self.refed = self.hidden_for != len(self.seq) and prefix >= 1
        if self.refed:
            keep = min(self.target.length, prefix - 1)               # re-feed at least seq[prefix - 1]
            self.target.truncate(keep)
            feed = self.seq[keep:prefix]
            mask = torch.ones(len(feed), keep + len(feed), dtype=torch.bool).tril(keep)
            _, hid, self.target.cache = feed_masked_hidden(eng.target.model, feed, mask,
                                                           torch.arange(keep, prefix), self.target.cache)
            self.target.length = prefix
            self.hidden, self.hidden_for = hid[-1], len(self.seq)
        t1 = time.perf_counter()
        depth = min(spec.gamma, heads.config.num_heads)
        if self.depth is not None:                                    # the adaptive controller's choice
            depth = min(depth, self.depth)
        tree, node_logq = medusa_tree(heads, self.hidden if self.hidden_for == len(self.seq) else None,
                                      self.seq[-1], depth, spec, sampling, warp, context=self.seq,
                                      store=eng.store_for(sampling))
        self.verified = 1 + len(tree.tokens)
        self.depth_nodes = nodes_per_depth(tree)
        stats.draft_time_s += time.perf_counter() - t1
        logits, hid, res = self._verify_tree_hidden(tree, prefix, sampling, spec, warp, gen, node_logq, stats,
                                                    extra_s=t1 - t0)
        self.hidden = hid[res.path[-1] + 1 if res.path else 0]
        self.hidden_for = prefix + 2 + len(res.path)                        # len(seq) once the step is emitted
        return self._tree_record(tree, logits, res)

    def _eagle_step(self, spec: SpecParams, sampling: SamplingParams, warp, gen,
                    stats) -> tuple[list[int], torch.Tensor, VerifyResult]:
        """The EAGLE-style head (serving/decoding/eagle.py): its cache holds the inputs (f_t, x_{t+1}) of the
        committed sequence, the true features coming from the verification passes; it grows a tree under
        seq[-1] (`width`, `branch`, depth gamma: one head forward per depth), then as `_tree_step`: one target
        pass with the tree mask, the rule, the path kept, and the pass's features of the root and the accepted
        path queued for the head. Where the head lacks inputs (the first step, a swapped head, plain target
        steps taken near the context end) one target pass over the missing positions gives their features (on
        the first step that pass is the prompt's prefill)."""
        eng = self.engine
        head = eng.heads_for("eagle", self.arm)[0]
        prefix = len(self.seq) - 1
        t0 = time.perf_counter()
        drafter = self.eagle_drafter
        if drafter is None or drafter.head is not head:
            drafter = self.eagle_drafter = EagleDrafter(
                head, tree_branching(spec.gamma, spec.extra["width"], spec.extra["branch"]))
        have = drafter.committed + len(drafter.pending_tokens)     # inputs (f_t, x_t+1) the head has, t < have
        if have < prefix:          # the first step, a swapped head, or plain target steps (near the context end)
            self.target.truncate(min(self.target.length, have))
            keep = self.target.length
            mask = torch.ones(prefix - keep, prefix, dtype=torch.bool).tril(keep)
            _, hid, self.target.cache = feed_masked_hidden(eng.target.model, self.seq[keep:prefix], mask,
                                                           torch.arange(keep, prefix), self.target.cache)
            drafter.push(hid[have - keep:], self.seq[have + 1:prefix + 1])
            self.target.length = prefix
        t1 = time.perf_counter()
        node_logq = None
        if drafter.committed or drafter.pending_tokens:
            if self._tree_mjsd(spec, sampling):                       # the head's warped log q of every node
                tree, node_logq = drafter.propose_with_logq(warp)
            else:
                tree = drafter.propose()
        else:
            tree = DraftTree((), ())                                  # a one-token prompt: no feature yet
            node_logq = torch.zeros(0)
        stats.draft_time_s += time.perf_counter() - t1
        logits, hid, res = self._verify_tree_hidden(tree, prefix, sampling, spec, warp, gen, node_logq, stats,
                                                    extra_s=t1 - t0)
        drafter.accept(hid[[0] + [1 + i for i in res.path]], [tree.tokens[i] for i in res.path] + [int(res.next_token)])
        return self._tree_record(tree, logits, res)

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


def target_output_rows(engine: "Engine", spent: list[float]):
    """`verdict_on_demand`'s logits_of for the engine's target: its output layer on hidden rows [m, d], fp32
    logits over the full vocabulary [m, vocab], the seconds it takes added to spent[0] (target time)."""
    head = engine.target.model.get_output_embeddings()

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = full_vocab_logits(head(h), engine.target, engine.vocab_size)
        spent[0] += time.perf_counter() - t0
        return out
    return logits_of


def tree_verdict(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, spec: SpecParams, warp, gen,
                 node_logq: torch.Tensor | None = None) -> TreeVerifyResult:
    """The tree rule of a tree step (`logits` [N + 1, vocab], row 0 the root's): greedy at T=0; otherwise the
    lossless deterministic-children rule, Medusa's typical acceptance with `rule` "typical", or MJSD's joint
    test with `rule` "mjsd" on the proposer's warped `node_logq`."""
    if sampling.temperature == 0:
        return verify_greedy(tree, logits)
    if spec.extra["rule"] == "typical":
        return verify_typical(tree, warp(logits).exp(), spec.extra["posterior_threshold"],
                              spec.extra["posterior_alpha"])
    if spec.extra["rule"] == "mjsd":
        return verify_mjsd(tree, warp(logits).exp(), node_logq, spec.extra["tau"], gen)
    return verify_deterministic(tree, warp(logits).exp(), gen)


def medusa_tree(heads, hidden: torch.Tensor | None, root: int, depth: int, spec: SpecParams,
                sampling: SamplingParams, warp, context: list[int] | None = None,
                store: SuffixStore | None = None) -> tuple[DraftTree, torch.Tensor | None]:
    """The heads' tree under `root` from the target's hidden state before it (`width`, `branch`, `depth`,
    pruned by `node_floor`), and for rule mjsd at T > 0 the heads' warped log q of every node (else None).
    No hidden state (a one-token prompt, a request's first step in the batch) or depth 0: the empty tree,
    a plain target step. With knob `lookup_ngram` n > 0 and the request's `context` (ending with `root`), the
    prompt lookup's continuation of the context's longest earlier suffix n-gram (the controller's longest,
    Engine.CONTROLLER_NGRAM[0], down to n tokens), cut to `depth`, joins the tree as one more branch
    (`DraftTree.graft`). The greedy and deterministic-children rules stay exact on any tree whose nodes are
    fixed before the pass: the heads' are, and the lookup's depend on the context alone. With knob `suffix` 1 and
    a `store` (the replica's SuffixStore), the continuation its earlier answers propose for the context joins
    the tree the same way, and stays exact for the same reason (the store changes between requests, never
    during a pass). For MJSD's joint test a grafted node's log q is 0: both are deterministic proposers, q a
    point mass on its token, so such a node passes where the target's joint probability of its path (times the
    heads' q of the ancestors it shares with their tree) exceeds tau."""
    if hidden is None or depth <= 0:
        return DraftTree((), ()), torch.zeros(0)
    branching = tree_branching(depth, spec.extra["width"], spec.extra["branch"])
    floor = spec.extra["node_floor"]                            # the heads' doubt prunes the tree
    node_logq = None
    if _RequestState._tree_mjsd(spec, sampling):               # the heads' warped log q of every node
        tree, node_logq = heads.propose_with_logq(hidden, root, branching, warp, floor)
    else:
        tree = heads.propose(hidden, root, branching, floor)
    n = spec.extra.get("lookup_ngram", 0)
    paths = [ngram_propose(context, max(n, Engine.CONTROLLER_NGRAM[0]), depth, n) if n and context else []]
    if store is not None and spec.extra.get("suffix") and context:
        paths.append(store.propose(context, depth))
    for path in paths:
        if not path:
            continue
        grown = tree.graft(path)
        if node_logq is not None and len(grown) > len(tree):
            node_logq = torch.cat([node_logq, node_logq.new_zeros(len(grown) - len(tree))])
        tree = grown
    return tree, node_logq


def grafted_nodes(spec: SpecParams, depth: int) -> int:
    """The most nodes `medusa_tree` grafts beside the heads' tree of `depth`: a branch as deep per proposer on."""
    return depth * ((1 if spec.extra.get("lookup_ngram") else 0) + (1 if spec.extra.get("suffix") else 0))


def nodes_per_depth(tree: DraftTree) -> list[int]:
    """The tree's nodes at depths 1..its deepest (shallower than planned where the heads' doubt pruned it)."""
    out = [0] * max(tree.depth, default=0)
    for d in tree.depth:
        out[d - 1] += 1
    return out


def count_and_record(engine: "Engine", stats: GenerationStats, sink: RecordSink | None, request_id: str, mode: str,
                     version: str, start: int, draft_tokens: list[int], res, target_logits: torch.Tensor,
                     sampling: SamplingParams, record_plain: bool = False) -> int:
    """A step's statistics, counted under the version that proposed it (a step that drafted nothing is a
    target step, credited to no draft), and its record for the replay buffer (`record_plain`: a step that
    proposed nothing is recorded too, so distillation learns the traffic on which the proposer is weak).
    Returns the records pushed (0 or 1); a failed push is logged, never raised."""
    n = res.num_accepted
    stats.steps += 1
    stats.draft_tokens += len(draft_tokens)
    stats.accepted_tokens += n
    for i in range(n):
        stats.accepted_per_position[i] += 1
    plain = not draft_tokens
    if plain:
        version = "none"
    stats.count_version(version, len(draft_tokens), n)
    if sink is None or not (draft_tokens or record_plain):
        return 0
    try:
        ids, lps = _top_k_record(target_logits, engine.record_top_k)
        sink.push_step(StepRecord(
            request_id=request_id, position=start, draft_tokens=draft_tokens, num_accepted=n,
            target_topk_ids=ids, target_topk_logprobs=lps, algorithm="target" if plain else mode,
            draft_version=version, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, timestamp=time.time(), next_token=int(res.next_token)))
        return 1
    except Exception as exc:  # noqa: BLE001 - a sink must never take a request down
        log.warning("replay buffer push failed: %s", exc)
        return 0
