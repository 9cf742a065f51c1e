"""The identity of a target model: the fingerprint that draft versions are pinned to and buffer records name.

    target_fingerprint(target) -> sha256 hex | None     # None: no local folder
    resolve_target_folder(target) -> Path | None

sha256 over a target folder's config.json (without `transformers_version` / `_name_or_path`, which a re-save
changes), its weight files and tokenizer.json. Two places need it: the registry pins each draft version to the
target it was built for (deploy/registry.py, `draftsmith.target_sha256`), and a replica names its target in
every SequenceRecord it writes (buffer/records.py `target`), so a job reads only the opinions of the target it
distils for (buffer/redis_store.py `ReplayBufferReader(target=...)`). It lives in `buffer/` because serving
imports nothing from deploy/ (docs/architecture.md, "Package dependencies"); stdlib only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from buffer.paths import DEFAULT_TARGET, cache_dir, is_default_target, write_json_atomic

log = logging.getLogger(__name__)

TARGET_CONFIG_IGNORED = ("transformers_version", "_name_or_path")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


_FINGERPRINTS: dict[str, tuple[tuple, str]] = {}
_FINGERPRINT_LOCK = threading.Lock()


def resolve_target_folder(target: str | os.PathLike | None) -> Path | None:
    """The local folder of a target: the converted default target under the cache (only if it has been
    converted already; nothing is converted here), or a folder holding config.json; None otherwise."""
    if is_default_target(target):
        folder = cache_dir() / "models" / DEFAULT_TARGET
    else:
        folder = Path(str(target)).expanduser()
    return folder.resolve() if (folder / "config.json").is_file() else None


def _target_files(folder: Path) -> list[Path]:
    files = [folder / "config.json"]
    files += sorted(p for p in folder.iterdir() if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES)
                                                                    or p.name in WEIGHT_INDEXES))
    if (folder / "tokenizer.json").is_file():
        files.append(folder / "tokenizer.json")
    return files


def target_fingerprint(target: str | os.PathLike | None) -> str | None:
    """sha256 over a target folder's config.json (without `transformers_version` / `_name_or_path`), weight
    files and tokenizer.json: what a draft version is pinned to (`draftsmith.target_sha256`). None when the
    target has no local folder. Computed once per folder: cached in memory and in
    `<DRAFTSMITH_CACHE>/target-fingerprints.json`, keyed by each file's size and mtime, so a later call
    costs a few stat() calls."""
    folder = resolve_target_folder(target)
    if folder is None:
        return None
    files = _target_files(folder)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = str(folder)
    with _FINGERPRINT_LOCK:
        hit = _FINGERPRINTS.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        store = cache_dir() / "target-fingerprints.json"
        try:
            disk = json.loads(store.read_text())
        except (OSError, json.JSONDecodeError):
            disk = {}
        entry = disk.get(key) if isinstance(disk, dict) else None
        if isinstance(entry, dict) and entry.get("stamp") == [list(x) for x in stamp] and entry.get("sha256"):
            _FINGERPRINTS[key] = (stamp, entry["sha256"])
            return entry["sha256"]
        h = hashlib.sha256()
        for p in files:
            if p.name == "config.json":
                try:
                    cfg = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError):
                    cfg = {}
                if isinstance(cfg, dict):
                    cfg = {k: v for k, v in cfg.items() if k not in TARGET_CONFIG_IGNORED}
                digest = hashlib.sha256(_canonical_json(cfg).encode()).hexdigest()
            else:
                digest = _sha256(p)
            h.update(f"{p.name}\0{digest}\n".encode())
        sha = h.hexdigest()
        _FINGERPRINTS[key] = (stamp, sha)
        if isinstance(disk, dict):
            disk[key] = {"stamp": [list(x) for x in stamp], "sha256": sha}
            try:
                write_json_atomic(store, disk)
            except OSError as e:
                log.debug("target fingerprint cache not written: %s", e)
        return sha
