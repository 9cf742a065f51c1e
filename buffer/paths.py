"""The project's paths and defaults, in one place: data folder, cache folder, MLflow tracking URI, default target.

    data_dir()              $DRAFTSMITH_DATA, default ./data, made absolute (an empty value counts as unset)
    cache_dir()             $DRAFTSMITH_CACHE, default ~/.cache/draftsmith (an empty value counts as unset)
    default_tracking_uri()  $MLFLOW_TRACKING_URI, else sqlite:///<data dir>/mlflow.db
    DEFAULT_TARGET          the name of the packaged default target model
    is_default_target(t)    whether a target argument means the default target (None, "", "default", its name)
    write_json_atomic(p, o) a small JSON cache file replaced whole (a temporary file, then os.replace)

Why this module lives in `buffer/`: every package needs these values (the embedded Redis keeps its files
in the data folder, serving caches converted models, training and deploy find the MLflow store), and the
allowed import directions (docs/architecture.md, "Package dependencies") make `buffer/` the one package
that all others may import while it imports none of ours. A separate fifth package would need a rule of
its own; this stdlib-only module does not, and it holds no Redis logic.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_TARGET_ALIASES = (None, "", "default", DEFAULT_TARGET)


def data_dir() -> Path:
    """`$DRAFTSMITH_DATA` (default ./data), made absolute; an empty value means the default."""
    return Path(os.environ.get("DRAFTSMITH_DATA") or "data").expanduser().resolve()


def cache_dir() -> Path:
    """`$DRAFTSMITH_CACHE` (default ~/.cache/draftsmith): converted models, merged drafts, fingerprints."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith").expanduser()


def default_tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI` if set, else the local SQLite file `<data dir>/mlflow.db`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_dir() / 'mlflow.db'}"


def is_default_target(target: str | os.PathLike | None) -> bool:
    """True for the spellings of "the default target": None, "", "default" and its name."""
    return target is None or str(target) in ("", "default", DEFAULT_TARGET)


def pid_alive(pid) -> bool:
    """Whether a process with this pid runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    return True


def write_json_atomic(path: Path, obj) -> None:
    """Write `obj` as JSON to `path` through a temporary file and `os.replace`, so a reader never sees half
    of it (the parent folder is made); OSError when it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
