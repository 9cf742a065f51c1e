"""Typed request-level configuration shared by the engine, the HTTP layer and the buffer.

`SamplingParams` is what the *user* asks for (the warp applied to the target and, identically, to
the draft). `SpecParams` selects the decoding rule and its knobs. Both validate in `__post_init__`
and raise `ValueError` with a message that names the field, so the HTTP layer can turn it into a 400.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Decoding modes the engine understands. "target" is plain target-only decoding (the baseline);
# "target", "ngram", "medusa" and "eagle" need no draft model (DRAFT_FREE_MODES); "medusa" needs the replica's
# Medusa heads instead (serving/decoding/medusa.py, ServiceSettings.medusa_heads), "eagle" its EAGLE-style head
# (serving/decoding/eagle.py, ServiceSettings.eagle_head).
MODES = ("mjsd", "speculative", "target", "typical", "mentored", "spectr", "bild", "ngram", "staged", "tree",
         "medusa", "eagle")
DRAFT_FREE_MODES = ("target", "ngram", "medusa", "eagle")
# Modes whose draft length the adaptive controller chooses per step (the others keep gamma fixed: bild
# has its own confidence stop, spectr / staged / ngram their own proposal structure).
ADAPTIVE_MODES = ("mjsd", "speculative", "typical", "mentored")
# Tree modes whose depth the controller chooses per step (0..min(gamma, heads): the heads' tree, or a plain step).
ADAPTIVE_TREE_MODES = ("medusa",)
# tree modes whose requests step together, one target pass over every request's tree (serving/scheduler.py)
TREE_BATCHED_MODES = ("medusa",)
# Modes where the controller may switch a step to n-gram proposals, verified by the mode's own rule.
NGRAM_SWITCH_MODES = ("mjsd", "speculative")
DEFAULT_MODE = "mjsd"

# The deployment's default for requests that name no mode (ServiceSettings.default_mode, `draftsmith serve
# --default-mode`, `served_mode`): "auto" drafts with the replica's Medusa heads where it has them (adaptive: the
# controller picks the tree's depth, 0 included, per step from measured costs), else MJSD with the draft model,
# else the target alone; a replica with both heads and a draft routes each unseeded request to whichever of the two
# ran faster on its recent requests (serving/mode_choice.py, ServiceSettings.auto_choice). A deployment may name any
# mode instead.
AUTO_MODE = "auto"
DEPLOYMENT_MODES = MODES + (AUTO_MODE,)


def served_mode(configured: str, *, has_draft: bool, has_heads: bool, has_eagle: bool) -> str:
    """The mode a request that names none decodes with: the deployment's `configured` mode ("auto": medusa with
    heads, else mjsd) while what it needs is loaded (the draft model, the Medusa heads, the EAGLE head), else
    mjsd with a draft, else the target alone."""
    if configured == AUTO_MODE:
        configured = "medusa" if has_heads else DEFAULT_MODE
    if configured == "medusa":
        ready = has_heads
    elif configured == "eagle":
        ready = has_eagle
    else:
        ready = configured in DRAFT_FREE_MODES or has_draft
    if ready:
        return configured
    return DEFAULT_MODE if has_draft else "target"


def served_knobs(mode: str) -> dict:
    """The knobs a request that names no mode gets with `mode` (its `served_mode`): on a tree (medusa, eagle,
    tree) the product's default rule, MJSD's joint test at T > 0 (greedy at T = 0), where the mode itself
    defaults to the lossless rule for requests that name it."""
    return {"rule": "mjsd"} if mode in TREE_MODES else {}


# Per-mode knobs, carried in SpecParams.extra, with their defaults (sources in serving/decoding/*):
#   typical   posterior_threshold eps = 0.09, posterior_alpha delta = 0.3 (Medusa's defaults);
#             accept x iff P(x) > min(eps, delta exp(-H(P)))
#   mentored  kl_budget D >= 0 nats (inf allowed): KL(target || output) <= D per position; 0 = speculative
#   spectr    num_drafts k: i.i.d. draft chains verified with K-SEQ (k = 1 is speculative sampling)
#   bild      fallback_threshold: the draft hands over once its max probability < this (or after gamma
#             tokens); rollback_threshold: roll back the first token with -log target(x) > this (fork
#             defaults (0.9, 3) for llama)
#   ngram     max_ngram >= min_ngram >= 1: prompt-lookup suffix lengths tried, longest first
#   staged    the same n-gram knobs, for the proposer that feeds the draft model
#   tree      width: top-k children of the root, branch: top-k children of each depth-1 node, one child
#             deeper, depth gamma; verified in one target pass with a tree mask (serving/decoding/tree.py)
#   medusa    the same width / branch, the tree read off the Medusa heads (depth min(gamma, heads)); node_floor
#             in [0, 1): a node whose path probability under the heads is below it is left out of the tree, with
#             its subtree (the root's first child always stays; 0: the full shape; serving/decoding/medusa.py);
#             lookup_ngram n >= 0: the prompt lookup's continuation (of the longest suffix n-gram of 3 down to n
#             tokens that occurred earlier in the context, as mode ngram) joins the tree as one more branch from
#             the root, as deep as the tree (0: off; under rule mjsd its nodes' log q is 0, a point mass;
#             serving/engine.py `medusa_tree`); suffix 0 / 1: the continuation the replica's store of earlier
#             answers proposes for the context (serving/decoding/suffix.py) joins the tree as a branch too (lookup's
#             log q under rule mjsd; nothing where the replica keeps no store, DRAFTSMITH_SUFFIX_STORE=0)
#   eagle     the same width / branch, the tree grown by the EAGLE-style head (depth gamma: one head forward
#             per depth, each depth reading the features the head predicted for the depth above)
#   tree, medusa, eagle also: rule "exact" (greedy at T=0, the lossless deterministic-children rule otherwise) or
#             "typical" (Medusa's typical acceptance on the tree at T > 0, lossy; posterior_threshold /
#             posterior_alpha as for mode typical) or "mjsd" (MJSD's joint test on every tree path at T > 0,
#             lossy: the deepest node with min(1, p/q) > tau, knob tau as mode mjsd's, default DEFAULT_TAU)
DEFAULT_TAU = 0.1   # MJSD's joint-ratio threshold (the paper's tau): mode mjsd's SpecParams.tau, rule mjsd's tau
# Mode medusa's node_floor: 0 keeps the full (width, branch) shape; the served value is measured by
# scripts/bench_tree_floor.py (docs/benchmarks.md, the twenty-fourth session)
MEDUSA_NODE_FLOOR = 0.05
# Mode medusa's lookup_ngram: the shortest context n-gram whose earlier continuation joins the heads' tree (0: off);
# the served value is measured by scripts/bench_traffic.py's rows default+lookup=N (docs/benchmarks.md, the
# thirty-second session)
MEDUSA_LOOKUP_NGRAM = 2
# Mode medusa's suffix: 1 grafts the cross-request store's continuation onto the heads' tree (measured by
# scripts/bench_suffix.py offline and bench_traffic.py's rows default+suffix=N; docs/benchmarks.md, the thirty-third
# session)
MEDUSA_SUFFIX = 1
MODE_KNOBS: dict[str, dict[str, float | int | str]] = {
    "typical": {"posterior_threshold": 0.09, "posterior_alpha": 0.3},
    "mentored": {"kl_budget": 0.1},
    "spectr": {"num_drafts": 4},
    "bild": {"fallback_threshold": 0.9, "rollback_threshold": 3.0},
    "ngram": {"max_ngram": 3, "min_ngram": 1},
    "staged": {"max_ngram": 3, "min_ngram": 1},
    "tree": {"width": 2, "branch": 1, "rule": "exact", "posterior_threshold": 0.09, "posterior_alpha": 0.3,
             "tau": DEFAULT_TAU},
    "medusa": {"width": 2, "branch": 1, "rule": "exact", "posterior_threshold": 0.09, "posterior_alpha": 0.3,
               "tau": DEFAULT_TAU, "node_floor": MEDUSA_NODE_FLOOR, "lookup_ngram": MEDUSA_LOOKUP_NGRAM,
               "suffix": MEDUSA_SUFFIX},
    "eagle": {"width": 2, "branch": 1, "rule": "exact", "posterior_threshold": 0.09, "posterior_alpha": 0.3,
              "tau": DEFAULT_TAU},
}
TREE_MODES = ("tree", "medusa", "eagle")   # modes verified as a tree in one target pass (serving/decoding/tree.py)
HEADS_MODES = ("medusa", "eagle")          # modes drafted by heads on the target's features (own registries)
TREE_RULES = ("exact", "typical", "mjsd")
MAX_TREE_WIDTH = 8
MAX_NUM_DRAFTS = 16
MAX_NGRAM = 16


def _non_negative(name: str, value) -> float:
    """A number >= 0 (inf allowed: 'never' / 'no bound'); ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def _finite(name: str, value) -> float:
    """Any finite number; ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _int_in(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value

# MJSD paper (Qin et al. 2024, "Multi-Token Joint Speculative Decoding for Accelerating Large Language Model
# Inference"), Appendix D: top-k 20 then top-p 0.9, gamma 4, 8 beams, tau 0.1.
DEFAULT_TOP_K = 20
DEFAULT_TOP_P = 0.9


@dataclass
class SamplingParams:
    """The target distribution the user wants: temperature, then top-k, then top-p.

    temperature == 0 means greedy (argmax); top_k == 0 disables top-k; top_p == 1 disables top-p.
    """

    temperature: float = 1.0
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class SpecParams:
    """Which decoding rule runs and its parameters.

    gamma: draft tokens proposed per step (ngram: the longest lookup continuation; bild: the most
    draft tokens before the target must verify); with `adaptive` (the default) and a mode in
    ADAPTIVE_MODES it is an upper bound: the controller (serving/controller.py) drafts 0..gamma tokens per
    step from the acceptance and costs it measures, and may propose from the n-gram lookup instead
    (speculative, mjsd); in ADAPTIVE_TREE_MODES (medusa) it chooses the heads' tree depth, 0..min(gamma, heads). `adaptive=False` keeps a fixed gamma (experiments, the paper's tables);
    beams: MJSD beam-sampling width; tau: MJSD joint-ratio
    threshold (accept the longest prefix with min(1, p/q) > tau; tau <= 0 accepts every draft token).
    extra: the mode's knobs (MODE_KNOBS); missing ones get their defaults, so after construction
    `extra` holds every knob of the mode and nothing else (an unknown key is a ValueError).
    """

    mode: str = DEFAULT_MODE
    gamma: int = 4
    beams: int = 8
    tau: float = DEFAULT_TAU
    extra: dict = field(default_factory=dict)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or not (1 <= self.gamma <= 16):
            raise ValueError(f"gamma must be an integer in [1, 16], got {self.gamma!r}")
        if not isinstance(self.beams, int) or isinstance(self.beams, bool) or not (1 <= self.beams <= 32):
            raise ValueError(f"beams must be an integer in [1, 32], got {self.beams!r}")
        if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool):
            raise ValueError(f"tau must be a number, got {self.tau!r}")
        self.tau = float(self.tau)
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict of the mode's parameters, got {type(self.extra).__name__}")
        known = MODE_KNOBS.get(self.mode, {})
        unknown = sorted(set(self.extra) - set(known))
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))} for mode {self.mode!r}; "
                             f"it takes {', '.join(known) or 'none'}")
        knobs = {**known, **self.extra}
        for name in ("posterior_threshold", "posterior_alpha", "kl_budget", "fallback_threshold",
                     "rollback_threshold"):
            if name in knobs:
                knobs[name] = _non_negative(name, knobs[name])
        if "num_drafts" in knobs:
            _int_in("num_drafts", knobs["num_drafts"], 1, MAX_NUM_DRAFTS)
        if "width" in knobs:
            _int_in("width", knobs["width"], 1, MAX_TREE_WIDTH)
            _int_in("branch", knobs["branch"], 1, MAX_TREE_WIDTH)
            if knobs["rule"] not in TREE_RULES:
                raise ValueError(f"rule must be one of {', '.join(TREE_RULES)}, got {knobs['rule']!r}")
            knobs["tau"] = _finite("tau", knobs["tau"])
        if "node_floor" in knobs:
            v = knobs["node_floor"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise ValueError(f"node_floor must be a number in [0, 1), got {v!r}")
            knobs["node_floor"] = float(v)
        if "lookup_ngram" in knobs:
            _int_in("lookup_ngram", knobs["lookup_ngram"], 0, MAX_NGRAM)
        if "suffix" in knobs:
            _int_in("suffix", knobs["suffix"], 0, 1)
        if "max_ngram" in knobs:
            _int_in("max_ngram", knobs["max_ngram"], 1, MAX_NGRAM)
            _int_in("min_ngram", knobs["min_ngram"], 1, knobs["max_ngram"])
        self.extra = knobs

    @property
    def needs_draft(self) -> bool:
        """Whether the mode drafts with the draft model (every mode but DRAFT_FREE_MODES)."""
        return self.mode not in DRAFT_FREE_MODES

    def to_dict(self) -> dict:
        return asdict(self)
