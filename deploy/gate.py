"""Promotion gate: plain policy code over the registry (no MLflow import here).

A candidate version becomes the champion only if both hold:

1. **Offline acceptance beats the champion by the margin.** Both figures are measured by the
   distillation job on the same held-out recent records (candidate.json metrics):
   `champion_acceptance = offline_acceptance_before` (the parent draft, which must be the current
   champion) and `candidate_acceptance = offline_acceptance_after`. With
   `delta = candidate_acceptance - champion_acceptance` the check passes iff
   `delta >= margin - 1e-9 and delta > 0` (so margin 0 still asks for a strict improvement; the 1e-9
   absorbs float rounding such as 0.41 - 0.40 = 0.00999...). A candidate
   trained from a parent that is no longer the champion is rejected: its "before" figure is not the
   champion's. With no champion yet, the acceptance check passes.
2. **Lossless smoke decode.** `smoke_check(draft_path) -> (ok, detail)` on the materialised
   candidate; the real one (`engine_smoke_check`) decodes a few prompts at temperature 0 with
   lossless speculative sampling and with the target alone (fp32) and demands identical tokens.

**Vocabulary.** The candidate is judged on its own output vocabulary: the job measured
`offline_acceptance_after` on the rows it chose (training/job.py) and `offline_acceptance_before` on the
parent's rows as served; the smoke decode loads the materialised folder, whose `draftsmith.json` holds
the version's vocabulary (deploy/registry.py), through `serving.models.read_output_token_ids`, the
reader the engine and the trainer use. Before the smoke decode the gate reads the materialised
folder's vocabulary through that same function and checks it against the version's registered
`draftsmith.vocab_sha256` tag (when the version has one): a mismatch is a rejection. The size it found
is recorded (`draftsmith.gate.vocabulary`).

The verdict and its figures are recorded on the version either way: tags `draftsmith.gate.*` and
metrics `gate_candidate_acceptance`, `gate_champion_acceptance`, `gate_delta`, `gate_accepted`, plus
a history entry on the registered model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from deploy.registry import TAG, ArtifactError, Registry, VersionInfo, vocabulary_digest

log = logging.getLogger(__name__)

SmokeCheck = Callable[[Path], "tuple[bool, str]"]

FLOAT_SLACK = 1e-9
DEFAULT_SMOKE_PROMPTS = (
    "What is 12 * 7?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
)


@dataclass
class GatePolicy:
    """margin: absolute offline-acceptance improvement the candidate needs over the champion.
    min_heldout_records: refuse candidates whose held-out set was smaller than this.
    require_smoke: run the lossless smoke decode (only an operator's --force skips the gate)."""

    margin: float = 0.01
    min_heldout_records: int = 1
    require_smoke: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not (0.0 <= self.margin < 1.0):
            raise ValueError(f"gate margin must be a number in [0, 1), got {self.margin!r}")
        if isinstance(self.min_heldout_records, bool) or not isinstance(self.min_heldout_records, int) \
                or self.min_heldout_records < 0:
            raise ValueError(f"min_heldout_records must be an integer >= 0, got {self.min_heldout_records!r}")
        self.margin = float(self.margin)


@dataclass
class GateVerdict:
    accepted: bool
    reason: str
    candidate_version: str
    champion_version: str | None
    candidate_acceptance: float | None
    champion_acceptance: float | None
    margin: float
    smoke_ok: bool | None = None        # None: not run (acceptance already failed, or no smoke required)
    smoke_detail: str = ""
    promoted: bool = False
    vocabulary: str = ""                # output vocabulary of the materialised candidate ("N rows" / "full")

    @property
    def delta(self) -> float | None:
        if self.candidate_acceptance is None or self.champion_acceptance is None:
            return None
        return self.candidate_acceptance - self.champion_acceptance

    def tags(self) -> dict[str, str]:
        return {
            "draftsmith.gate.verdict": "accepted" if self.accepted else "rejected",
            "draftsmith.gate.reason": self.reason,
            "draftsmith.gate.champion_version": self.champion_version or "none",
            "draftsmith.gate.margin": f"{self.margin:g}",
            "draftsmith.gate.smoke": {None: "not run", True: "passed", False: "failed"}[self.smoke_ok],
            "draftsmith.gate.smoke_detail": self.smoke_detail or "-",
            "draftsmith.gate.vocabulary": self.vocabulary or "not read",
            "draftsmith.gate.time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def metrics(self) -> dict[str, float]:
        out = {"gate_accepted": 1.0 if self.accepted else 0.0, "gate_margin": self.margin}
        if self.candidate_acceptance is not None:
            out["gate_candidate_acceptance"] = self.candidate_acceptance
        if self.champion_acceptance is not None:
            out["gate_champion_acceptance"] = self.champion_acceptance
        if self.delta is not None:
            out["gate_delta"] = self.delta
        if self.smoke_ok is not None:
            out["gate_smoke_ok"] = 1.0 if self.smoke_ok else 0.0
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "delta": self.delta}


def judge_acceptance(candidate: VersionInfo, champion_version: str | None,
                     policy: GatePolicy) -> tuple[bool, str, float | None, float | None]:
    """The offline-acceptance half of the gate (pure): (ok, reason, candidate_acc, champion_acc)."""
    m = candidate.metrics
    cand = m.get("offline_acceptance_after")
    if candidate.kind != "adapter":
        return False, (f"version {candidate.version} is a {candidate.kind} draft, not a distillation candidate; "
                       "the gate compares candidates with their parent (promote a base draft with --force)"), None, None
    if cand is None:
        return False, "the candidate has no offline_acceptance_after metric (candidate.json metrics)", None, None
    heldout = m.get("heldout_records")
    if policy.min_heldout_records and (heldout is None or heldout < policy.min_heldout_records):
        return False, (f"held-out set too small: {0 if heldout is None else int(heldout)} records, "
                       f"the gate needs at least {policy.min_heldout_records}"), cand, None
    if champion_version is None:
        return True, "no champion yet", cand, None
    if candidate.parent_version != champion_version:
        return False, (f"stale candidate: trained from version {candidate.parent_version}, but the champion is "
                       f"version {champion_version}, so its held-out comparison is not against the champion; "
                       "distill again from the champion"), cand, None
    champ = m.get("offline_acceptance_before")
    if champ is None:
        return False, "the candidate has no offline_acceptance_before metric (the champion's figure)", cand, None
    delta = cand - champ
    if delta > 0 and delta >= policy.margin - FLOAT_SLACK:
        return True, f"offline acceptance {cand:.4f} vs champion {champ:.4f} (+{delta:.4f} >= margin {policy.margin:g})", \
            cand, champ
    return False, (f"offline acceptance {cand:.4f} vs champion {champ:.4f}: delta {delta:+.4f} does not beat "
                   f"the margin {policy.margin:g}"), cand, champ


def run_gate(registry: Registry, version: str, smoke_check: SmokeCheck | None, *,
             policy: GatePolicy | None = None, promote: bool = True) -> GateVerdict:
    """Judge `version`, record the verdict on it, and (when accepted and `promote`) make it champion.

    The smoke check runs only when the acceptance check passed. Artifacts are verified and the
    version materialised before the smoke check; an ArtifactError becomes a rejection (recorded).
    """
    policy = policy or GatePolicy()
    info = registry.get(version)
    champion = registry.champion()
    if info.version == champion:
        return GateVerdict(True, f"version {info.version} is already the champion", info.version, champion,
                           info.metrics.get("offline_acceptance_after"), None, policy.margin)
    ok, reason, cand, champ = judge_acceptance(info, champion, policy)
    verdict = GateVerdict(ok, reason, info.version, champion, cand, champ, policy.margin)
    if ok and policy.require_smoke:
        if smoke_check is None:
            verdict.accepted, verdict.reason = False, "no smoke check configured (the gate requires one)"
        else:
            try:
                path = registry.materialize(info.version, verify=True)
                verdict.vocabulary = check_vocabulary(info, path)
                try:
                    s_ok, detail = smoke_check(path)
                except Exception as e:  # noqa: BLE001 - a crashing check is a failed check
                    s_ok, detail = False, f"smoke check raised {type(e).__name__}: {e}"
                verdict.smoke_ok, verdict.smoke_detail = bool(s_ok), str(detail)
                if not s_ok:
                    verdict.accepted = False
                    verdict.reason = f"smoke decode failed: {detail}"
            except ArtifactError as e:
                verdict.accepted, verdict.reason = False, f"artifacts unusable: {e}"
    record_verdict(registry, verdict)
    if verdict.accepted and promote:
        registry.promote(info.version, reason=f"gate: {verdict.reason}",
                         gate={k: v for k, v in verdict.to_dict().items() if k != "promoted"})
        verdict.promoted = True
    log.info("gate %s version %s: %s", "accepted" if verdict.accepted else "rejected", info.version, verdict.reason)
    return verdict


def check_vocabulary(info: VersionInfo, path: Path) -> str:
    """The materialised folder's output vocabulary, read through `serving.models.read_output_token_ids`
    (the engine's and the trainer's reader), checked against the version's `draftsmith.vocab_sha256` tag
    when it has one; returns "N rows" or "full"; ArtifactError when it is unreadable or differs."""
    from serving.models import ModelLoadError, read_output_token_ids

    try:
        ids = read_output_token_ids(Path(path))
    except ModelLoadError as e:
        raise ArtifactError(f"version {info.version}: materialised vocabulary unreadable: {e}") from None
    want = info.tags.get(TAG + "vocab_sha256")
    if want and vocabulary_digest(ids) != want:
        raise ArtifactError(f"version {info.version}: the materialised folder {path} has a different output "
                            f"vocabulary ({'full' if ids is None else len(ids)} rows) from the registered one "
                            f"({info.tags.get(TAG + 'vocab_size', '?')} rows)")
    return "full" if ids is None else f"{len(ids)} rows"


def record_verdict(registry: Registry, verdict: GateVerdict) -> None:
    """Tags + metrics on the version and an entry in the registered model's history."""
    registry.set_version_tags(verdict.candidate_version, verdict.tags())
    registry.log_version_metrics(verdict.candidate_version, verdict.metrics())
    registry.record_event({"action": "gate", "version": verdict.candidate_version,
                           "verdict": "accepted" if verdict.accepted else "rejected", "reason": verdict.reason})


def force_promote(registry: Registry, version: str, *, reason: str = "operator --force"):
    """Promote without the gate (artifacts are still verified first); recorded as such on the version."""
    move = registry.promote(version, reason=reason)
    if move.changed:
        registry.set_version_tags(move.champion, {"draftsmith.gate.verdict": "skipped (--force)",
                                                  "draftsmith.gate.reason": reason})
    return move


def engine_smoke_check(target: str | None, *, prompts: tuple[str, ...] = DEFAULT_SMOKE_PROMPTS,
                       max_tokens: int = 24, gamma: int = 4, device: str = "cpu") -> SmokeCheck:
    """The real smoke check: for each prompt, greedy (temperature 0) decoding with lossless
    speculative sampling must emit exactly the target-only greedy tokens. fp32, so rounding
    differences between one-token and (gamma+1)-token target passes cannot flip an argmax in practice.
    """
    if max_tokens < 1 or not prompts:
        raise ValueError("the smoke check needs at least one prompt and max_tokens >= 1")

    def check(draft_path: Path) -> tuple[bool, str]:
        import torch

        from serving.config import SamplingParams, SpecParams
        from serving.engine import Engine
        from serving.models import ModelLoadError

        try:
            engine = Engine.from_paths(target, str(draft_path), device=device, dtype=torch.float32,
                                       draft_version="smoke")
        except ModelLoadError as e:
            return False, f"draft does not load next to the target: {e}"
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        accepted = drafted = 0
        for i, text in enumerate(prompts):
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = [int(t) for t in ids]
            spec = engine.generate_all(ids, sampling, SpecParams(mode="speculative", gamma=gamma), log_mode="none")
            ref = engine.generate_all(ids, sampling, SpecParams(mode="target"), log_mode="none")
            if spec.token_ids != ref.token_ids:
                pos = next((j for j, (a, b) in enumerate(zip(spec.token_ids, ref.token_ids)) if a != b),
                           min(len(spec.token_ids), len(ref.token_ids)))
                return False, (f"prompt {i} ({text!r}): speculative output differs from target greedy at token "
                               f"{pos} ({spec.token_ids[pos:pos + 3]} vs {ref.token_ids[pos:pos + 3]})")
            accepted += spec.stats.accepted_tokens
            drafted += spec.stats.draft_tokens
        rate = accepted / drafted if drafted else 0.0
        rows = engine.draft.output_token_ids
        return True, (f"{len(prompts)} prompts x <= {max_tokens} tokens identical to target greedy; "
                      f"greedy acceptance {rate:.3f}; draft output vocabulary "
                      f"{'full' if rows is None else f'{len(rows)} rows'}")

    return check
