"""Typed request-level configuration shared by the engine, the HTTP layer and the buffer.

`SamplingParams` is what the *user* asks for (the warp applied to the target and, identically, to
the draft). `SpecParams` selects the decoding rule and its knobs. Both validate in `__post_init__`
and raise `ValueError` with a message that names the field, so the HTTP layer can turn it into a 400.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Decoding modes the engine understands. "target" is plain target-only decoding (the baseline).
MODES = ("mjsd", "speculative", "target")
DEFAULT_MODE = "mjsd"

# MJSD paper, Appendix D: top-k 20 then top-p 0.9, gamma 4, 8 beams, tau 0.1.
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

    gamma: draft tokens proposed per step; beams: MJSD beam-sampling width; tau: MJSD joint-ratio
    threshold (accept the longest prefix with min(1, p/q) > tau; tau <= 0 accepts every draft token).
    """

    mode: str = DEFAULT_MODE
    gamma: int = 4
    beams: int = 8
    tau: float = 0.1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or not (1 <= self.gamma <= 16):
            raise ValueError(f"gamma must be an integer in [1, 16], got {self.gamma!r}")
        if not isinstance(self.beams, int) or isinstance(self.beams, bool) or not (1 <= self.beams <= 32):
            raise ValueError(f"beams must be an integer in [1, 32], got {self.beams!r}")
        if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool):
            raise ValueError(f"tau must be a number, got {self.tau!r}")
        self.tau = float(self.tau)

    def to_dict(self) -> dict:
        return asdict(self)
