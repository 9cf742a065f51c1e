"""A draft version's artifacts on disk: manifests of hashes and their verification, target fingerprints
(buffer/fingerprint.py's, re-exported), output vocabularies (`vocabulary.json`, `draftsmith.json`), the
candidate folder's layout, and the peft merge of an adapter into its parent. No MLflow here: deploy/registry.py downloads, registers and
materialises versions with these.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from buffer.fingerprint import (TARGET_CONFIG_IGNORED, WEIGHT_INDEXES, WEIGHT_SUFFIXES,  # noqa: F401 - re-exported
                                _FINGERPRINTS, _canonical_json, _sha256, resolve_target_folder, target_fingerprint)
from deploy.errors import ArtifactError, RegistryError, UsageError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
VOCABULARY = "vocabulary.json"                  # a candidate's chosen output vocabulary (training/job.py)
MARKER = ".draftsmith-materialized.json"        # written last into a cached merged folder


# ---------------------------------------------------------------------------------- manifests
def file_manifest(root: Path) -> dict[str, dict]:
    """{relative posix path: {"sha256": hex, "size": bytes}} for every file under `root`."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[p.relative_to(root).as_posix()] = {"sha256": _sha256(p), "size": p.stat().st_size}
    return out


def verify_manifest(root: Path, manifest: dict[str, dict], what: str) -> None:
    """Raise ArtifactError naming the first missing, resized or altered file under `root`."""
    root = Path(root)
    for rel, entry in manifest.items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(f"{what}: artifact file {rel!r} is missing from the artifact store")
        if p.stat().st_size != entry["size"]:
            raise ArtifactError(f"{what}: artifact file {rel!r} is corrupt (size {p.stat().st_size} bytes, "
                                f"registered {entry['size']})")
        if _sha256(p) != entry["sha256"]:
            raise ArtifactError(f"{what}: artifact file {rel!r} is corrupt (sha256 differs from the registered one)")




def short_hash(sha: str | None) -> str:
    return "unknown" if not sha else sha[:12]


# ---------------------------------------------------------------------------------- vocabularies
def vocabulary_digest(ids: list[int] | None) -> str:
    """sha256 of a vocabulary (its ids in order; "full" for None): the `draftsmith.vocab_sha256` tag."""
    return "full" if ids is None else hashlib.sha256(_canonical_json([int(i) for i in ids]).encode()).hexdigest()


def _check_token_ids(ids: Any, what: str, error: type[RegistryError]) -> list[int] | None:
    """`output_token_ids` as stored: None (full vocabulary) or distinct non-negative integers."""
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise error(f"{what}: output_token_ids must be null (full vocabulary) or a non-empty list of "
                    "non-negative integer token ids")
    if len(set(ids)) != len(ids):
        raise error(f"{what}: output_token_ids lists a token id twice")
    return [int(i) for i in ids]


def read_vocabulary_file(path: Path, error: type[RegistryError] = ArtifactError) -> list[int] | None:
    """A candidate's `vocabulary.json` -> its ids (None: full vocabulary); `error` when malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or "output_token_ids" not in doc:
        raise error(f"{path} must hold a JSON object with output_token_ids")
    return _check_token_ids(doc["output_token_ids"], str(path), error)


def _folder_vocabulary(folder: Path, error: type[RegistryError]) -> list[int] | None:
    """`draftsmith.json` `output_token_ids` of a model folder, parsed as serving.models.read_output_token_ids
    does (not imported here: it imports torch)."""
    meta = Path(folder) / "draftsmith.json"
    if not meta.is_file():
        return None
    try:
        doc = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{meta} is not valid JSON: {e}") from None
    ids = doc.get("output_token_ids") if isinstance(doc, dict) else None
    return _check_token_ids(ids or None, str(meta), error)


def _write_folder_vocabulary(folder: Path, ids: list[int] | None, *, what: str) -> None:
    """Set `draftsmith.json` `output_token_ids` of a materialised folder (other keys kept; None: removed),
    after checking the ids against the folder's vocabulary size."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    rows = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    if ids is not None and isinstance(rows, int) and max(ids) >= rows:
        raise ArtifactError(f"{what}: its vocabulary reaches token id {max(ids)}, beyond the {rows} rows of "
                            "the draft's output layer")
    meta_path = folder / "draftsmith.json"
    meta: dict = {}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        if not isinstance(meta, dict):
            meta = {}
    meta.pop("output_token_ids", None)
    if ids is not None:
        meta["output_token_ids"] = list(ids)
    if meta or meta_path.exists():
        meta_path.write_text(json.dumps(meta))


def read_candidate(cdir: Path) -> dict:
    """Parse and check a candidate folder's layout (docs/architecture.md, "Candidate folder"); UsageError says what is wrong."""
    cdir = Path(cdir)
    if not cdir.is_dir():
        raise UsageError(f"candidate folder {cdir} does not exist")
    cj = cdir / "candidate.json"
    if not cj.is_file():
        raise UsageError(f"{cdir} has no candidate.json; a distillation candidate holds adapter/ and candidate.json")
    try:
        meta = json.loads(cj.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{cj} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{cj} must hold a JSON object")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (cdir / "adapter" / name).is_file():
            raise UsageError(f"{cdir / 'adapter' / name} is missing; the adapter must be a peft save_pretrained() folder")
    for key, typ in (("metrics", dict), ("train_config", dict), ("data_window", dict)):
        if meta.get(key) is not None and not isinstance(meta[key], typ):
            raise UsageError(f"{cj}: {key!r} must be a JSON object")
    if (cdir / VOCABULARY).exists():
        read_vocabulary_file(cdir / VOCABULARY, UsageError)
    return meta


def _merge_adapter(parent_dir: Path, adapter_dir: Path, out_dir: Path, *, what: str) -> None:
    """out_dir := merge_and_unload(parent + LoRA adapter), saved in the parent's dtype, plus the
    parent's non-weight files (tokenizer, draftsmith.json, ...)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        base = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any load failure means an unusable parent
        raise ArtifactError(f"{what}: its parent draft at {parent_dir} does not load: {e}") from None
    saved_dtype = _config_dtype(parent_dir)
    try:
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    except Exception as e:  # noqa: BLE001
        raise ArtifactError(f"{what}: its adapter does not apply to its parent draft: {e}") from None
    if saved_dtype is not None:
        merged = merged.to(saved_dtype)
    merged.save_pretrained(out_dir)
    written = {p.name for p in out_dir.iterdir()}
    for p in parent_dir.iterdir():
        if (p.is_file() and p.name not in written and p.name != MARKER
                and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in WEIGHT_INDEXES):
            shutil.copy2(p, out_dir / p.name)


def merge_candidate(parent_dir: Path, cdir: Path, out_dir: Path, *, what: str | None = None) -> None:
    """out_dir := a plain draft folder: the parent draft with candidate `cdir`'s adapter merged in and its
    vocabulary (if it has one) as the output rows. What a squash registers; also scripts that chain jobs."""
    what = what or f"candidate {cdir}"
    _merge_adapter(Path(parent_dir), Path(cdir) / "adapter", Path(out_dir), what=what)
    if (Path(cdir) / VOCABULARY).is_file():
        _write_folder_vocabulary(Path(out_dir), read_vocabulary_file(Path(cdir) / VOCABULARY, UsageError), what=what)


def _config_dtype(folder: Path):
    import torch

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dt = getattr(torch, str(name), None) if name else None
    return dt if isinstance(dt, torch.dtype) else None
