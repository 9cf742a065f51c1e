"""The target's hidden states of whole sequences, kept on disk between heads jobs and gates (issue 15).

A heads job (training/heads_job.py) and the heads' gate (deploy/heads.py) need the target's last hidden
state at every position of the requests they read, which the buffer does not store: each recomputes it
with one teacher-forced target pass per request (training/heads.py `target_hidden_states`). Scheduled jobs
read overlapping windows (the newest steps, the replayed older ones, the same held-out requests), so most
of a job's passes repeat the last job's: 40-75 s of a 170-200 s job beside serving (docs/benchmarks.md,
"The twenty-third session"). This cache keeps each sequence's states once computed.

    cache = hidden_cache_for(target_path, dtype)                # None when disabled
    cache.get(tokens) -> tensor [len(tokens), d] or None;  cache.put(tokens, states)

- **Key.** One file per sequence, named by the SHA-256 of its token ids, in a folder per target: its
  resolved path, its files' sizes and modification times, and the dtype the states were computed in (so
  the job and the gate on one machine share it, and a target rewritten in place starts a new folder). A sequence that grew
  since (a request still running when an earlier job read it) has other tokens, so another key.
- **Format.** safetensors (no pickle), the states in the dtype the model produced them in (bf16 or fp32),
  so a read gives exactly what the pass gave (`.float()` of it, as the uncached path returns).
- **Bound.** At most `max_bytes` (`DRAFTSMITH_HIDDEN_CACHE_MB`, default 512; 0 turns the cache off): after
  writes, the least recently used files go first. A read refreshes a file's time.
- **Faults.** A file that does not read back (truncated, corrupt, another shape) is deleted and counts as a
  miss; a write that fails (disk full, read-only) is logged and skipped. The cache never fails a job.
- **Where.** `DRAFTSMITH_HIDDEN_CACHE_DIR`, default `cache_dir()/hidden-states`, on the machine the job
  runs on (a Ray task on another node keeps its own).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_MB = 512
ENV_MAX_MB = "DRAFTSMITH_HIDDEN_CACHE_MB"
ENV_DIR = "DRAFTSMITH_HIDDEN_CACHE_DIR"
SUFFIX = ".safetensors"


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:40]


class HiddenStateCache:
    """Hidden states per token sequence under `root` (module docstring), at most `max_bytes` on disk."""

    def __init__(self, root: str | os.PathLike, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._written = 0

    def _path(self, tokens: Sequence[int]) -> Path:
        return self.root / (_digest(tokens) + SUFFIX)

    def get(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The states stored for exactly `tokens` ([len(tokens), d], their stored dtype), or None."""
        from safetensors.torch import load_file

        path = self._path(tokens)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            h = load_file(str(path))["h"]
            if h.dim() != 2 or h.shape[0] != len(tokens):
                raise ValueError(f"stored shape {tuple(h.shape)} for {len(tokens)} tokens")
            os.utime(path)                                   # least recently used goes first
        except Exception as e:                               # noqa: BLE001 - any unreadable file is a miss
            log.warning("hidden-state cache: dropping %s (%s)", path.name, e)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return h

    def put(self, tokens: Sequence[int], states: torch.Tensor) -> None:
        """Store `states` ([len(tokens), d]) for `tokens`, written whole or not at all; trims the folder to
        `max_bytes` once enough has been written since the last trim."""
        from safetensors.torch import save_file

        if states.dim() != 2 or states.shape[0] != len(tokens):
            raise ValueError(f"states of shape {tuple(states.shape)} for {len(tokens)} tokens")
        path = self._path(tokens)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            save_file({"h": states.detach().cpu().contiguous()}, str(tmp))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("hidden-state cache: cannot write %s (%s)", path.name, e)
            tmp.unlink(missing_ok=True)
            return
        self._written += states.numel() * states.element_size()
        if self._written > self.max_bytes // 8:
            self.trim()

    def trim(self) -> int:
        """Delete the least recently used files until the folder holds at most `max_bytes`; files removed."""
        self._written = 0
        try:
            files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.root.glob("*" + SUFFIX)]
        except OSError:
            return 0
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        # stale temporaries of a writer that died
        for t in self.root.glob("*.tmp"):
            try:
                if time.time() - t.stat().st_mtime > 3600:
                    t.unlink(missing_ok=True)
            except OSError:
                pass
        return removed


def max_bytes_from_env() -> int:
    """`DRAFTSMITH_HIDDEN_CACHE_MB` in bytes (default 512 MB; 0 = off). A bad value is a ValueError."""
    raw = os.environ.get(ENV_MAX_MB, "").strip()
    try:
        mb = float(raw) if raw else float(DEFAULT_MAX_MB)
    except ValueError:
        raise ValueError(f"{ENV_MAX_MB} must be a number of megabytes (0 turns the cache off), got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"{ENV_MAX_MB} must be >= 0, got {raw!r}")
    return int(mb * 1024 * 1024)


def target_key(target_path: str | os.PathLike, dtype: torch.dtype) -> str:
    """The cache folder's name for states of the target at `target_path` computed in `dtype` (module
    docstring, "Key")."""
    root = Path(target_path).resolve()
    h = hashlib.sha256(f"{dtype}|{root}".encode())
    for f in sorted(root.glob("*")) if root.is_dir() else [root]:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def hidden_cache_for(target_path: str | os.PathLike, dtype: torch.dtype, *,
                     root: str | os.PathLike | None = None) -> HiddenStateCache | None:
    """The cache of this target's states (under `root`, default `DRAFTSMITH_HIDDEN_CACHE_DIR` or
    `cache_dir()/hidden-states`), or None when `DRAFTSMITH_HIDDEN_CACHE_MB` is 0."""
    max_bytes = max_bytes_from_env()
    if max_bytes <= 0:
        return None
    if root is None:
        from buffer.paths import cache_dir

        root = os.environ.get(ENV_DIR) or cache_dir() / "hidden-states"
    return HiddenStateCache(Path(root) / target_key(target_path, dtype), max_bytes)
