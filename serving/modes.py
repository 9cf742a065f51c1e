"""The decoding modes as a table: a mode is its proposer, its verification rule and its knobs.

The engine and the batch scheduler look a mode up here instead of branching on its name:
- `proposer`: who proposes the tokens the target verifies
  - "none": nothing (target-only decoding);
  - "chain": the draft model, one token after another (gamma tokens);
  - "beams": MJSD's beam sampling with the draft model (at temperature 0 or with one beam, the chain:
    beam sampling can then keep only one beam, so the proposal distribution is the same);
  - "ngram": prompt lookup over the request's own context (no model);
  - "staged" / "bild" / "spectr" / "tree": the draft model in the mode's own pattern (see serving/engine.py);
  - "medusa": the replica's Medusa heads, a tree read off the target's own hidden state (no draft model);
  - "eagle": the replica's EAGLE-style head, a tree grown at the target's feature level (no draft model);
- `rule`: the verification rule, a pure function of serving/decoding/ with the uniform signature
  (draft tokens, draft rows, target rows, generator, SpecParams) -> VerifyResult; "spectr" verifies a
  tree of chains and has its own path, as have "tree", "medusa" and "eagle" (serving/decoding/tree.py); "target" verifies nothing;
- `knobs`: the mode's extra parameters with defaults (serving/config.py MODE_KNOBS);
- `batched`: whether the batch scheduler (serving/scheduler.py) runs it together with other requests in
  one forward per model. The others (staged, bild, spectr, tree, medusa, eagle: their proposals need per-request control
  flow, a tree of rows or a tree mask) do not share that batch: medusa's requests step together in a batch of
  their own, one target pass over all their trees (serving/config.py TREE_BATCHED_MODES), and the rest run
  alone, one step per scheduler round, between the batched steps, so they never block the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from serving.config import MODE_KNOBS, MODES
from serving.decoding.bild import bild_verify
from serving.decoding.mentored import mentored_verify
from serving.decoding.mjsd import mjsd_verify
from serving.decoding.speculative import speculative_verify
from serving.decoding.typical import typical_verify

# Verification rules with the uniform signature of serving/decoding/types.py, by mode name. A mutable
# dict on purpose: tests patch a rule to check the engine calls it.
VERIFY_RULES: dict[str, Callable] = {
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


@dataclass(frozen=True)
class Mode:
    name: str
    proposer: str
    batched: bool
    knobs: dict = field(default_factory=dict)

    @property
    def rule(self) -> Callable | None:
        return VERIFY_RULES.get(self.name)


_PROPOSERS = {"target": "none", "speculative": "chain", "mentored": "chain", "typical": "chain",
              "mjsd": "beams", "ngram": "ngram", "staged": "staged", "bild": "bild", "spectr": "spectr",
              "tree": "tree", "medusa": "medusa", "eagle": "eagle"}
BATCHED_PROPOSERS = ("none", "chain", "beams", "ngram")

MODE_TABLE: dict[str, Mode] = {
    name: Mode(name, _PROPOSERS[name], _PROPOSERS[name] in BATCHED_PROPOSERS, dict(MODE_KNOBS.get(name, {})))
    for name in MODES
}
UNBATCHED_MODES = tuple(m.name for m in MODE_TABLE.values() if not m.batched)


def proposer(spec, sampling) -> str:
    """The proposer a request of this mode uses: MJSD's beams collapse to the chain at temperature 0
    or with one beam (see the module docstring)."""
    p = MODE_TABLE[spec.mode].proposer
    if p == "beams" and (sampling.temperature == 0 or spec.beams == 1):
        return "chain"
    return p
