"""The draft model registry: deploy's door to MLflow (the client, versions, aliases, promotion policy).
deploy/live_stats.py logs live serving statistics through it (`Registry.experiment_id`, `Registry.client`);
what a version's files must be (manifests, fingerprints, vocabularies, the candidate layout, the adapter
merge) is deploy/artifacts.py, the errors deploy/errors.py.

One MLflow registered model per target (`draftsmith-<target>-draft`); each version is one draft:
- version 1 (and any later `register_base`) is a *base* draft, a full Hugging Face model folder,
  logged as the artifacts `draft/...` of its own run;
- every distillation candidate (docs/architecture.md, "Candidate folder") is an *adapter* version: `adapter/...` and
  `candidate.json` as artifacts, the parent version as a tag, the training config and data window as
  run params, the offline acceptance before/after (and every other numeric figure) as run metrics.

Every version also carries `manifest.json` (sha256 and size of each artifact file), whose own sha256
is a version tag, so a missing, truncated or edited artifact is detected before it is served.

**Vocabulary.** A version's draft output vocabulary (the rows its tied output layer computes,
`draftsmith.json` `output_token_ids`, read everywhere by `serving.models.read_output_token_ids`) is
stored with the version: a base's inside `draft/draftsmith.json`, a candidate's as the artifact
`vocabulary.json` (the job's re-chosen ids; `null` = the full vocabulary), both covered by the
manifest. A candidate without `vocabulary.json` (older jobs) keeps its parent's vocabulary.
`materialize` writes the version's vocabulary into the merged folder's `draftsmith.json`, so the
engine, the trainer and the gate load version N with version N's rows. Tags `draftsmith.vocab_size`
("full" or the count) and `draftsmith.vocab_sha256` (`vocabulary_digest`) name it; the gate checks
the materialised folder against them.

Roles are MLflow *aliases* (stages are not used): `champion` (served), `previous` (the champion
before the last promotion), `candidate` (the newest registered candidate not yet promoted), `canary`
(a gate-passed version serving a share of requests, `draftsmith.canary_share`, beside the champion until
the canary judge in deploy/scheduler.py promotes or drops it: `start_canary`, `end_canary`). Every
alias move is written to the registered model's tags as `draftsmith.history.<time_ns>` (JSON).

`materialize(version)` resolves the parent chain down to a base folder, applies each adapter with
peft `merge_and_unload()`, and caches the merged plain folder under
`<DRAFTSMITH_CACHE>/drafts/<model name>/<version>-<run id>/` (the run id makes the path unique per
store, so two registries that both have a "version 3" never share a cache entry). Serving loads
that folder with plain transformers; peft is only needed here.

**Bounded history.** A version's chain (it, its adapter ancestors, their base) holds at most
`max_chain_depth` (K, `$DRAFTSMITH_MAX_CHAIN_DEPTH`, default 4) adapters: a candidate that would be
deeper is registered *squashed*, merged with its parent into a new base version (tags
`draftsmith.squashed_from` / `squashed_chain`, otherwise tagged like an adapter), so a cold replica
materialises any version from at most K+1 stored versions. `verify` re-hashes a version's own artifacts
every time but an ancestor only once per cache (recorded in `<cache>/<model>/.verified.json` by version,
run and manifest sha256). Retention (`gc`, `draftsmith gc`, also run after every registration,
promotion and rollback, never failing them) deletes cached merged folders and registered candidate
folders of versions that are neither aliased (champion, previous, candidate, canary...) nor among the
newest `keep_last` (N, `$DRAFTSMITH_KEEP_VERSIONS`, default 3), sparing anything used in the last
10 minutes. Artifacts in the MLflow store are never deleted.

**Faults.** Reads tell "not there" from "cannot read": a registered model or version that does not
exist is `{}` / None / UsageError, while any other failure (server down, database unreadable) raises
`RegistryUnavailable`, so an outage never reads as "no champion" or "not paused". Callers keep what
they have (replicas keep serving their draft) and fail closed (no promotion).

**Alias moves are serialised across processes** by an exclusive `fcntl.flock` on a lock file
(`AliasLock`): next to the SQLite file for a local store, under `<DRAFTSMITH_DATA>/locks/` for a
tracking server. Every promote, rollback, candidate-alias move and pause/resume takes it, re-reads the
aliases under it, and only then writes. MLflow has no conditional (compare-and-set) alias update, so an
MLflow-side CAS would be a read-then-write race again; the file lock covers every process that shares
the store's data folder (the deployment model here: one machine or one shared volume). The rollback
pause is enforced here too: `promote` refuses while promotions are paused (`PromotionsPaused`), and a
pause that cannot be read refuses as well.

**Targets.** Every version records the fingerprint of the target it was built for
(`draftsmith.target_sha256`, `target_fingerprint`: sha256 over the target folder's config and weight
files, computed once per folder and cached by file size and mtime). The gate refuses a candidate for
another target and replicas refuse to load one (serving/service.py).

**Draft kinds.** Medusa heads (serving/decoding/medusa.py) and the EAGLE-style head
(serving/decoding/eagle.py, issue 19) are versioned the same way, each kind in its own registered model,
`<draft model name>-medusa` and `<draft model name>-eagle` (`heads_registry(target, kind)`), so every alias,
promotion, canary, rollback, pause, lock and retention rule above applies to them unchanged, and a rollback
of one kind never moves another kind's aliases. A heads version is kind `heads` (tag `heads_kind`: medusa
or eagle): the folder's config + safetensors (`HEADS_KINDS`) as the artifacts `heads/...` (full weights:
about 1M parameters for Medusa's heads, 2.4M for the EAGLE layer at the default target, so an online update
stores the whole weights rather than an adapter, and the chain is always one version deep);
`parent_version` records the weights it was trained from. `register` tells the kinds apart by their files.

Default store: `sqlite:///<DRAFTSMITH_DATA>/mlflow.db` with artifacts in `<DRAFTSMITH_DATA>/mlartifacts`
(`DRAFTSMITH_DATA` defaults to `./data`), created on first use; `MLFLOW_TRACKING_URI` (or the
`tracking_uri` argument) selects a tracking server instead, whose own artifact store is then used.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.paths import (DEFAULT_TARGET, cache_dir, data_dir, default_tracking_uri, is_default_target,  # noqa: F401
                          write_json_atomic)
from deploy.artifacts import (MANIFEST, MARKER, TARGET_CONFIG_IGNORED, VOCABULARY, WEIGHT_INDEXES,  # noqa: F401
                              WEIGHT_SUFFIXES, _canonical_json, _folder_vocabulary, _merge_adapter, _sha256,
                              _write_folder_vocabulary, file_manifest, merge_candidate, read_candidate,
                              read_vocabulary_file, resolve_target_folder, short_hash, target_fingerprint,
                              verify_manifest, vocabulary_digest)
from deploy.errors import (ArtifactError, PromotionsPaused, RegistryError, RegistryUnavailable,  # noqa: F401
                           UsageError)

log = logging.getLogger(__name__)

CHAMPION, PREVIOUS, CANDIDATE, CANARY = "champion", "previous", "candidate", "canary"
ALIASES = (CHAMPION, PREVIOUS, CANDIDATE, CANARY)
REGISTRY_EXPERIMENT = "draftsmith-drafts"
LIVE_EXPERIMENT = "draftsmith-live"
TAG = "draftsmith."                             # prefix of every tag this module writes
PAUSE_TAG = TAG + "promotions_paused"           # registered-model tag: scheduled distillation paused
TARGET_HASH_TAG = TAG + "target_sha256"         # version tag: fingerprint of the target the draft was built for
SINCE_TAG = TAG + "champion_since_ms"           # version tag: when it last became the champion (epoch ms)
CANARY_SHARE_TAG = TAG + "canary_share"         # registered-model tag: share of requests the canary serves
CANARY_SINCE_TAG = TAG + "canary_since_ms"      # registered-model tag: when the current canary started (epoch ms)
DEFAULT_CANARY_SHARE = 0.25
SQUASHED_FROM_TAG = TAG + "squashed_from"       # version tag of a squashed base: the version its adapter was on
SQUASHED_CHAIN_TAG = TAG + "squashed_chain"     # ... JSON list of the versions merged into it, newest first
CANDIDATE_PATH_TAG = TAG + "candidate_path"     # version tag: the candidate folder it was registered from
MAX_CHAIN_DEPTH_ENV = "DRAFTSMITH_MAX_CHAIN_DEPTH"
KEEP_VERSIONS_ENV = "DRAFTSMITH_KEEP_VERSIONS"
DEFAULT_MAX_CHAIN_DEPTH = 4                     # K: adapter versions between any version and its base
DEFAULT_KEEP_VERSIONS = 3                       # N: newest versions whose folders retention keeps
DEFAULT_GC_GRACE_S = 600.0                      # folders used (materialised, loaded) this recently are kept
STALE_STAGING_S = 6 * 3600.0                    # a '.'-staging folder this old was left by a crash
VERIFIED = ".verified.json"                     # beside the cache: (version, run, manifest) already verified
NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"


@dataclass(frozen=True)
class HeadsKind:
    """A draft kind served from the target's hidden states (module docstring, "Draft kinds")."""

    name: str                       # the kind, the serving mode and the registered model's suffix
    label: str                      # for messages: "Medusa heads", "EAGLE head"
    files: tuple[str, str]          # (config JSON, weights) of its folder
    build: str                      # the command that builds a folder of this kind
    folder: str                     # for messages: "a Medusa heads folder"

    @property
    def suffix(self) -> str:
        return "-" + self.name


HEADS_KINDS = {   # serving/decoding/medusa.py and eagle.py CONFIG_FILE / WEIGHTS_FILE
    "medusa": HeadsKind("medusa", "Medusa heads", ("medusa_heads.json", "medusa_heads.safetensors"),
                        "python -m training.heads", "a Medusa heads folder"),
    "eagle": HeadsKind("eagle", "EAGLE head", ("eagle_head.json", "eagle_head.safetensors"),
                       "python -m training.heads --kind eagle", "an EAGLE head folder"),
}
HEADS_SUFFIX = HEADS_KINDS["medusa"].suffix     # registered model of a target's Medusa heads: <draft model>-medusa
HEADS_FILES = HEADS_KINDS["medusa"].files


def _not_found(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) == NOT_FOUND


def _unavailable(exc: BaseException, what: str) -> RegistryUnavailable:
    return RegistryUnavailable(f"MLflow unavailable: cannot {what} ({type(exc).__name__}: {str(exc)[:300]})")


# ---------------------------------------------------------------------------------- locations
# MLflow's HTTP client retries a failed request 7 times with a doubling backoff (about 4 minutes, for a rate-limited
# hosted store) and waits 120 s for each answer: against a tracking server that is down, `draftsmith rollback`
# would sit silent for minutes before saying so. Draftsmith's commands and replicas retry on their own schedule
# (the watcher's backoff, the scheduler's next tick), so they ask MLflow for about 3 s of retries and a 60-s
# answer instead, unless the environment sets these variables (which then win: a rate-limited store wants them).
MLFLOW_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


def fail_fast_mlflow_client(environ=None) -> dict[str, str]:
    """Set MLFLOW_CLIENT_DEFAULTS in `environ` (os.environ) where it sets none of them; returns those set.
    Called by the CLI before any MLflow call (its child processes, Ray's workers among them, inherit them)."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in MLFLOW_CLIENT_DEFAULTS.items() if not environ.get(k)}
    environ.update(added)
    return added


def _is_local_store(uri: str) -> bool:
    return uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri


def heads_kind_of(path: str | os.PathLike) -> str | None:
    """The heads kind whose files the folder holds (`MedusaHeads.save` / `EagleHead.save`), else None."""
    return next((k for k, hk in HEADS_KINDS.items() if all((Path(path) / f).is_file() for f in hk.files)), None)


def is_heads_folder(path: str | os.PathLike) -> bool:
    """A folder of any heads kind (Medusa heads, an EAGLE head)."""
    return heads_kind_of(path) is not None


def heads_kind_of_model(name: str) -> str | None:
    """The heads kind a registered model holds, by its name's suffix; None for a draft model."""
    return next((k for k, hk in HEADS_KINDS.items() if name.endswith(hk.suffix)), None)


def heads_registry(target: str | os.PathLike | None = None, kind: str = "medusa", **kw) -> "Registry":
    """The registry of `target`'s heads of `kind` (module docstring, "Draft kinds"); keyword arguments as
    `Registry` (a `name` names the draft's registered model, the heads' is it + "-<kind>")."""
    if kind not in HEADS_KINDS:
        raise UsageError(f"unknown heads kind {kind!r}; known: {', '.join(HEADS_KINDS)}")
    suffix = HEADS_KINDS[kind].suffix
    name = kw.pop("name", None) or model_name_for(target)
    other = heads_kind_of_model(name)
    if other is not None:                               # the draft's name is wanted; strip another kind's suffix
        name = name[: -len(HEADS_KINDS[other].suffix)]
    return Registry(target, name=name + suffix, **kw)


def target_slug(target: str | os.PathLike | None) -> str:
    """A registered-model-safe short name for a target: the folder/model name, lower-case, [a-z0-9._-]."""
    raw = DEFAULT_TARGET if is_default_target(target) else str(target)
    base = Path(raw.rstrip("/\\")).name or raw
    slug = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-.")
    if not slug:
        raise UsageError(f"cannot derive a model name from target {raw!r}; pass an explicit model name")
    return slug


def model_name_for(target: str | os.PathLike | None) -> str:
    """`draftsmith-<target slug>-draft`: one registered model per target/draft pair."""
    return f"draftsmith-{target_slug(target)}-draft"


_VERIFIED_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------- the alias lock
class AliasLock:
    """Serialises alias moves (and pause/resume) of one registered model across threads and processes:
    an exclusive `fcntl.flock` on `path`, waited for up to `timeout_s` seconds (RegistryError after).
    Re-entrant within one thread of one Registry (rollback pauses while holding it). The kernel drops
    the lock when its holder dies, so a killed process never leaves it taken."""

    def __init__(self, path: str | os.PathLike, timeout_s: float = 120.0) -> None:
        self.path = Path(path)
        self.timeout_s = float(timeout_s)
        self._local = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def _take(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RegistryError(f"another process has held the alias lock {self.path} for more than "
                                        f"{self.timeout_s:g} s; nothing was changed, try again") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.time()}).encode(), 0)
        return fd

    def __enter__(self) -> "AliasLock":
        if not self._local.acquire(timeout=self.timeout_s):
            raise RegistryError(f"alias lock {self.path}: another thread held it for more than {self.timeout_s:g} s")
        try:
            if self._depth == 0:
                self._fd = self._take()
            self._depth += 1
        except BaseException:
            self._local.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._depth -= 1
            if self._depth == 0 and self._fd is not None:
                fd, self._fd = self._fd, None
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._local.release()


def _vocab_tags(ids: list[int] | None) -> dict[str, str]:
    return {TAG + "vocab_size": "full" if ids is None else str(len(ids)), TAG + "vocab_sha256": vocabulary_digest(ids)}



# ---------------------------------------------------------------------------------- small helpers
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def _key(k: str) -> str:
    return _KEY_BAD.sub("_", str(k))[:250]


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> dict[str, str]:
    """Nested dicts -> {"prefix.a.b": str(value)}; lists and other leaves JSON-encoded, 6000 chars max."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        s = obj if isinstance(obj, str) else json.dumps(obj, default=str)
        out[_key(prefix)] = s[:6000]
    return out


def _numeric(metrics: dict | None) -> dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[_key(k)] = float(v)
    return out


def _version_str(version: Any) -> str:
    s = str(version).strip()
    if s.lower().startswith("v"):
        s = s[1:]
    if not s.isdigit() or int(s) < 1:
        raise UsageError(f"version must be a positive integer such as 3 (or v3), got {version!r}")
    return str(int(s))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"${name} must be a whole number >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise UsageError(f"${name} must be a whole number >= {minimum}, got {raw!r}")
    return value


def _last_used(folder: Path) -> float:
    """When a folder was last written or used: the newest mtime of the folder and its marker ("now" when it
    cannot be read, e.g. removed meanwhile: never a reason to delete)."""
    try:
        stamps = [folder.stat().st_mtime]
    except OSError:
        return time.time()
    try:
        stamps.append((folder / MARKER).stat().st_mtime)
    except OSError:
        pass
    return max(stamps)


def _tree_size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


@dataclass
class PruneReport:
    """What one retention pass did under `root` (`Registry.prune_cache` / `prune_candidates`): folder names
    deleted (or, with `dry_run`, that would be), kept (with why), and left alone (with why)."""

    what: str                                   # "cache" | "candidates"
    root: Path
    dry_run: bool = False
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    freed_bytes: int = 0

    def remove(self, entry: Path) -> None:
        """Delete a folder: renamed to a '.trash-' name first (atomic, so the cached path vanishes at once and
        a reader materialises it again), then removed."""
        size = _tree_size(entry)
        if not self.dry_run:
            trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.time_ns()}")
            try:
                os.rename(entry, trash)
            except OSError as e:
                self.skipped.append((entry.name, f"not deleted: {e}"))
                return
            shutil.rmtree(trash, ignore_errors=True)
        self.deleted.append(entry.name)
        self.freed_bytes += size


@dataclass(frozen=True)
class VersionInfo:
    """One registered draft version as the CLI and the gate see it."""

    version: str
    kind: str                       # "base" (full model folder), "adapter" (LoRA on parent_version) or "heads"
    parent_version: str | None
    aliases: tuple[str, ...]
    run_id: str
    source: str
    created_ms: int
    tags: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    @property
    def target_sha256(self) -> str | None:
        """Fingerprint of the target this draft was built for (None: not recorded, an older version)."""
        return self.tags.get(TARGET_HASH_TAG) or None

    @property
    def squashed_from(self) -> str | None:
        """For a squashed base (a candidate merged into a new base to bound the chain): the version its
        adapter was trained on; None otherwise."""
        return self.tags.get(SQUASHED_FROM_TAG) or None

    @property
    def squashed_chain(self) -> list[str]:
        """For a squashed base: the versions merged into it, newest first (its parent down to a base)."""
        try:
            chain = json.loads(self.tags.get(SQUASHED_CHAIN_TAG) or "[]")
        except json.JSONDecodeError:
            return []
        return [str(v) for v in chain] if isinstance(chain, list) else []

    @property
    def distilled(self) -> bool:
        """A distillation candidate: an adapter version, one squashed into a base, or heads trained online."""
        return self.kind == "adapter" or self.squashed_from is not None or (
            self.kind == "heads" and self.parent_version is not None)

    @property
    def offline_acceptance(self) -> float | None:
        """Held-out acceptance of this draft as measured when it was built (None when unknown)."""
        for k in ("offline_acceptance_after", "heldout_top1_agreement_after", "offline_acceptance"):
            if k in self.metrics:
                return self.metrics[k]
        return None


@dataclass(frozen=True)
class AliasMove:
    """What a promote/rollback did. `changed` is False for a no-op (already in that state)."""

    action: str                     # "promote" | "rollback"
    champion: str                   # champion after the move
    old_champion: str | None
    previous: str | None            # `previous` alias after the move
    changed: bool
    message: str


# ---------------------------------------------------------------------------------- the registry
class Registry:
    """Draft versions of one target in MLflow (see the module docstring for the layout).

    Args:
        target: target model id or folder; decides the registered model name when `name` is None.
        name: explicit registered model name.
        tracking_uri: MLflow tracking URI (default: `MLFLOW_TRACKING_URI` or the local SQLite store).
        artifact_root: artifact folder for a local store (default `<DRAFTSMITH_DATA>/mlartifacts`).
        cache_root: where merged drafts are cached (default `<DRAFTSMITH_CACHE>/drafts`).
        lock_path: the alias lock file (default: next to a SQLite store, else under
            `<DRAFTSMITH_DATA>/locks/`); every process that moves this model's aliases must use the same one.
        max_chain_depth: K, the most adapter versions between any version and its base (default
            `$DRAFTSMITH_MAX_CHAIN_DEPTH` or 4); a candidate that would be deeper is registered squashed
            (merged into a new base version, see `register_candidate`).
        keep_last: N, the newest versions whose cached and candidate folders retention keeps besides the
            aliased ones (default `$DRAFTSMITH_KEEP_VERSIONS` or 3); see `gc`.
        candidates_root: where distillation jobs write candidate folders (default `<DRAFTSMITH_DATA>/candidates`,
            as training/job.py); only folders under it are ever deleted by retention.
        gc_grace_s: folders written or used this recently are never deleted (default 600 s).
        auto_gc: run `gc` after every registration, promotion and rollback (failures are logged only).
    """

    def __init__(self, target: str | os.PathLike | None = None, *, name: str | None = None,
                 tracking_uri: str | None = None, artifact_root: str | os.PathLike | None = None,
                 cache_root: str | os.PathLike | None = None, lock_path: str | os.PathLike | None = None,
                 lock_timeout_s: float = 120.0, max_chain_depth: int | None = None, keep_last: int | None = None,
                 candidates_root: str | os.PathLike | None = None, gc_grace_s: float = DEFAULT_GC_GRACE_S,
                 auto_gc: bool = True) -> None:
        self.target = str(target) if target not in (None, "") else DEFAULT_TARGET
        self.name = name or model_name_for(self.target)
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self._artifact_root = Path(artifact_root).resolve() if artifact_root else None
        self._cache_root = Path(cache_root) if cache_root else None
        self.max_chain_depth = (_env_int(MAX_CHAIN_DEPTH_ENV, DEFAULT_MAX_CHAIN_DEPTH, 0) if max_chain_depth is None
                                else int(max_chain_depth))
        self.keep_last = _env_int(KEEP_VERSIONS_ENV, DEFAULT_KEEP_VERSIONS, 0) if keep_last is None else int(keep_last)
        if self.max_chain_depth < 0 or self.keep_last < 0:
            raise UsageError(f"max_chain_depth and keep_last must be >= 0, got {max_chain_depth!r}, {keep_last!r}")
        self.candidates_root = Path(candidates_root) if candidates_root else data_dir() / "candidates"
        self.gc_grace_s = float(gc_grace_s)
        self.auto_gc = bool(auto_gc)
        self._client = None
        self._experiment_id: str | None = None
        self.alias_lock = AliasLock(lock_path or self._default_lock_path(), timeout_s=lock_timeout_s)

    def _default_lock_path(self) -> Path:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", self.name)
        if self.tracking_uri.startswith("sqlite:///"):
            db = Path(self.tracking_uri[len("sqlite:///"):]).resolve()
            return db.parent / f".{db.name}.{slug}.aliases.lock"
        uri_id = hashlib.sha256(self.tracking_uri.encode()).hexdigest()[:12]
        return data_dir() / "locks" / f"{slug}-{uri_id}.aliases.lock"

    @property
    def heads_kind(self) -> str | None:
        """The heads kind this registered model holds ("medusa", "eagle"), None for drafts."""
        return heads_kind_of_model(self.name)

    # ------------------------------------------------------------------ plumbing
    @property
    def client(self):
        """The MlflowClient (created on first use; a local SQLite store is created then too)."""
        if self._client is None:
            os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
            from mlflow.tracking import MlflowClient

            if self.tracking_uri.startswith("sqlite:///"):
                Path(self.tracking_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            registry_uri = os.environ.get("MLFLOW_REGISTRY_URI") or self.tracking_uri
            self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=registry_uri)
        return self._client

    @property
    def artifact_root(self) -> Path | None:
        """Local artifact folder (None for a tracking server, which stores artifacts itself)."""
        if self._artifact_root is None and _is_local_store(self.tracking_uri):
            if self.tracking_uri.startswith("sqlite:///"):
                db = Path(self.tracking_uri[len("sqlite:///"):])
                self._artifact_root = db.parent.resolve() / "mlartifacts"
            else:
                self._artifact_root = data_dir() / "mlartifacts"
        return self._artifact_root

    @property
    def cache_root(self) -> Path:
        if self._cache_root is None:
            self._cache_root = cache_dir() / "drafts"
        return self._cache_root

    def experiment_id(self, name: str = REGISTRY_EXPERIMENT) -> str:
        """The id of MLflow experiment `name`, created on first use (artifacts beside a local store): the one
        place experiments are created (the registry's, the live statistics' in deploy/live_stats.py)."""
        if name == REGISTRY_EXPERIMENT and self._experiment_id is not None:
            return self._experiment_id
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            location = None
            if self.artifact_root is not None:
                self.artifact_root.mkdir(parents=True, exist_ok=True)
                location = (self.artifact_root / name).as_uri()
            try:
                exp_id = self.client.create_experiment(name, artifact_location=location)
            except Exception:  # created concurrently by another process
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        if name == REGISTRY_EXPERIMENT:
            self._experiment_id = exp_id
        return exp_id

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except Exception as e:  # noqa: BLE001 - only "does not exist" means create it
            if not _not_found(e):
                raise _unavailable(e, f"read the registered model {self.name}") from None
            try:
                self.client.create_registered_model(
                    self.name, tags={TAG + "target": self.target},
                    description=f"Draft models for target {self.target} (Draftsmith). Aliases: "
                                "champion = served, previous = champion before the last promotion, "
                                "candidate = newest unpromoted candidate.")
            except MlflowException:
                self.client.get_registered_model(self.name)  # created concurrently; re-raise if truly failing

    def _registered_model(self):
        """The registered model, or None when it does not exist yet; RegistryUnavailable when MLflow
        cannot be read (an outage never reads as "nothing registered")."""
        try:
            return self.client.get_registered_model(self.name)
        except Exception as e:  # noqa: BLE001 - classified below
            if _not_found(e):
                return None
            raise _unavailable(e, f"read the registered model {self.name}") from None

    def exists(self) -> bool:
        return self._registered_model() is not None

    # ------------------------------------------------------------------ queries
    def aliases(self) -> dict[str, str]:
        """{alias: version} of the registered model ({} when nothing is registered yet).
        RegistryUnavailable when MLflow cannot be read."""
        rm = self._registered_model()
        if rm is None:
            return {}
        return {a: str(v) for a, v in (rm.aliases or {}).items()}

    def alias(self, alias: str) -> str | None:
        return self.aliases().get(alias)

    @staticmethod
    def target_fingerprint(target: str | os.PathLike | None) -> str | None:
        """`target_fingerprint(target)`: what replicas compare a version's pin with (serving/sources.py)."""
        return target_fingerprint(target)

    def champion(self) -> str | None:
        return self.alias(CHAMPION)

    def _model_version(self, version: Any):
        from mlflow.exceptions import MlflowException

        v = _version_str(version)
        try:
            return self.client.get_model_version(self.name, v)
        except MlflowException as e:
            if not _not_found(e):
                raise _unavailable(e, f"read version {v} of {self.name}") from None
            known = ", ".join(i.version for i in self.versions()) or "none"
            raise UsageError(f"version {v} is not registered in {self.name} (registered versions: {known}); "
                             "see `draftsmith versions`") from None

    def _info(self, mv, aliases_by_version: dict[str, list[str]]) -> VersionInfo:
        tags = dict(mv.tags or {})
        metrics, params = {}, {}
        if mv.run_id:
            try:
                run = self.client.get_run(mv.run_id)
            except Exception as e:  # noqa: BLE001
                raise _unavailable(e, f"read the run of version {mv.version}") from None
            metrics, params = dict(run.data.metrics), dict(run.data.params)
        parent = tags.get(TAG + "parent_version") or None
        return VersionInfo(
            version=str(mv.version), kind=tags.get(TAG + "kind", "unknown"), parent_version=parent,
            aliases=tuple(sorted(aliases_by_version.get(str(mv.version), []))), run_id=mv.run_id or "",
            source=mv.source or "", created_ms=int(mv.creation_timestamp or 0), tags=tags, metrics=metrics,
            params=params)

    def _aliases_by_version(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for a, v in self.aliases().items():
            out.setdefault(v, []).append(a)
        return out

    def get(self, version: Any) -> VersionInfo:
        """One version (UsageError when it is not registered)."""
        return self._info(self._model_version(version), self._aliases_by_version())

    def versions(self) -> list[VersionInfo]:
        """All versions, oldest first (empty before the first registration)."""
        if not self.exists():
            return []
        try:
            mvs = self.client.search_model_versions(f"name='{self.name}'")
        except Exception as e:  # noqa: BLE001
            raise _unavailable(e, f"list the versions of {self.name}") from None
        by_v = self._aliases_by_version()
        return sorted((self._info(mv, by_v) for mv in mvs), key=lambda i: int(i.version))

    def last_data_window(self) -> dict | None:
        """The data window of the newest registered candidate (its `last_id` is the buffer cursor:
        records after it have not been used by any registered candidate). None before the first one."""
        for info in reversed(self.versions()):
            if info.distilled:                 # an adapter, or a candidate squashed into a base
                try:
                    return json.loads(info.tags.get(TAG + "data_window") or "{}")
                except json.JSONDecodeError:
                    return {}
        return None

    def history(self) -> list[dict]:
        """Alias moves and gate verdicts, oldest first."""
        rm = self._registered_model()
        if rm is None:
            return []
        items = [(k, v) for k, v in (rm.tags or {}).items() if k.startswith(TAG + "history.")]
        out = []
        for _, v in sorted(items, key=lambda kv: int(kv[0].rsplit(".", 1)[1])):
            try:
                out.append(json.loads(v))
            except json.JSONDecodeError:
                out.append({"action": "unreadable", "raw": v})
        return out

    def champion_since_ms(self, info: "VersionInfo") -> int | None:
        """When `info`'s version last became the champion (promotion or restoring rollback), epoch ms."""
        raw = info.tags.get(SINCE_TAG)
        if raw and str(raw).isdigit():
            return int(raw)
        for key in (TAG + "restored_at", TAG + "promoted_at"):
            if info.tags.get(key):
                try:
                    return int(time.mktime(time.strptime(info.tags[key], "%Y-%m-%dT%H:%M:%S%z")) * 1000)
                except ValueError:
                    continue
        return None

    def live_intervals(self, version: Any, *, since_ms: int | None = None, until_ms: int | None = None,
                       experiment: str = LIVE_EXPERIMENT) -> list[dict]:
        """The live serving intervals LiveStatsLogger logged for draft `version` (every run tagged with it;
        a heads registry's version N is served as "<kind>-vN"), oldest first, logged in [since_ms, until_ms):
        one dict per flush with `time_ms`, `acceptance_rate`, and, where logged, `draft_tokens`,
        `accepted_tokens`, `requests`, `tokens`. RegistryUnavailable when MLflow cannot be read."""
        v = f"{self.heads_kind}-v{version}" if self.heads_kind else str(version)
        try:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                return []
            runs = self.client.search_runs([exp.experiment_id],
                                           filter_string=f"tags.`{TAG}draft_version` = '{v}'", max_results=50)
            out: dict[tuple[str, int], dict] = {}
            for run in runs:
                for key in ("acceptance_rate", "draft_tokens", "accepted_tokens", "requests", "tokens",
                            "tokens_per_s"):
                    for m in self.client.get_metric_history(run.info.run_id, key):
                        if since_ms is not None and m.timestamp < since_ms:
                            continue
                        if until_ms is not None and m.timestamp >= until_ms:
                            continue
                        out.setdefault((run.info.run_id, m.timestamp), {"time_ms": m.timestamp})[key] = m.value
        except RegistryError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _unavailable(e, f"read the live statistics of draft version {v}") from None
        return sorted((d for d in out.values() if "acceptance_rate" in d), key=lambda d: d["time_ms"])

    def _record_history(self, entry: dict) -> None:
        entry = {"time": time.time(), **entry}
        self.client.set_registered_model_tag(self.name, f"{TAG}history.{time.time_ns()}", json.dumps(entry))

    # ------------------------------------------------------------------ registration
    def _create_version(self, *, kind: str, files: dict[str, Path], run_name: str, params: dict[str, str],
                        metrics: dict[str, float], tags: dict[str, str], description: str) -> str:
        """Log `files` ({artifact dir: local folder or file}) + manifest in a new run; register it."""
        from mlflow.entities import Metric, Param

        self._ensure_model()
        exp = self.experiment_id()
        with tempfile.TemporaryDirectory(prefix="draftsmith-reg-") as tmp:
            staging = Path(tmp) / "artifacts"
            staging.mkdir()
            for dest, src in files.items():
                src = Path(src)
                if src.is_dir():
                    shutil.copytree(src, staging / dest)
                else:
                    shutil.copy2(src, staging / dest)
            manifest = file_manifest(staging)
            if not manifest:
                raise UsageError(f"nothing to register: {list(files.values())} hold no files")
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            manifest_sha = _sha256(staging / MANIFEST)
            run = self.client.create_run(exp, run_name=run_name,
                                         tags={TAG + "kind": kind, TAG + "model": self.name, **tags})
            run_id = run.info.run_id
            try:
                items = list(params.items())
                for i in range(0, len(items), 100):
                    self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
                now = _now_ms()
                mitems = list(metrics.items())
                for i in range(0, len(mitems), 500):
                    self.client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in mitems[i:i + 500]])
                self.client.log_artifacts(run_id, str(staging))
                self.client.set_terminated(run_id)
            except Exception:
                self.client.set_terminated(run_id, status="FAILED")
                raise
        mv = self.client.create_model_version(
            self.name, source=run.info.artifact_uri, run_id=run_id, description=description,
            tags={TAG + "kind": kind, TAG + "manifest_sha256": manifest_sha, **tags})
        version = str(mv.version)
        self.client.set_tag(run_id, TAG + "version", version)
        self.client.set_tag(run_id, "mlflow.runName", f"{self.name}-v{version}")
        log.info("registered %s version %s (%s)", self.name, version, kind)
        return version

    def register_base(self, folder: str | os.PathLike, *, metrics: dict | None = None,
                      params: dict | None = None, description: str = "base draft",
                      set_champion_if_none: bool = False, target_sha256: str | None = None) -> str:
        """Register a full draft model folder (config.json + weights + tokenizer) as a new base version.

        Numeric fields of the folder's `draftsmith.json` (except `output_token_ids`) and `metrics`
        become run metrics, its other fields and `params` run params. `target_sha256`: the fingerprint
        of the target it was built for (`target_fingerprint`); default: this registry's target's, when
        that target has a local folder.
        """
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise UsageError(f"{folder} is not a model folder (no config.json); a base draft must be a folder "
                             "written by save_pretrained() with the target's tokenizer files")
        if not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
            raise UsageError(f"{folder} holds no weight files (*.safetensors); save the draft with save_pretrained()")
        meta = {}
        if (folder / "draftsmith.json").is_file():
            try:
                meta = json.loads((folder / "draftsmith.json").read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"{folder / 'draftsmith.json'} is not valid JSON: {e}") from None
        vocab = _folder_vocabulary(folder, UsageError)
        meta = {k: v for k, v in meta.items() if k != "output_token_ids"}
        all_metrics = {**_numeric(meta), **_numeric(metrics)}
        all_params = _flatten("", {k: v for k, v in meta.items() if _key(k) not in all_metrics}, {})
        all_params.update(_flatten("", params or {}, {}))
        target_sha = target_sha256 or target_fingerprint(self.target)
        version = self._create_version(
            kind="base", files={"draft": folder}, run_name=f"{self.name}-base", params=all_params,
            metrics=all_metrics, tags={TAG + "source_path": str(folder.resolve())[:5000], **_vocab_tags(vocab),
                                       **({TARGET_HASH_TAG: target_sha} if target_sha else {})},
            description=description)
        if set_champion_if_none and self.champion() is None:
            self.promote(version, reason="first base draft")
        self._auto_gc()
        return version

    def register_candidate(self, candidate_dir: str | os.PathLike, *, target_sha256: str | None = None,
                           tags: dict[str, str] | None = None) -> str:
        """Register a distillation candidate folder (docs/architecture.md, "Candidate folder") and point the
        `candidate` alias at it. Its target fingerprint: candidate.json `target_sha256` (the job writes the
        one the scheduler gave it), else `target_sha256`, else its parent version's.

        **Squash.** When the new adapter would put more than `max_chain_depth` (K) adapter versions between
        it and its base, the candidate is registered merged instead: parent chain + adapter as a new *base*
        version (`draft/` plus the candidate's own `adapter/`, `candidate.json` and `vocabulary.json` for
        the record), with the same tags (parent_version, data window, vocabulary, target pin), params and
        metrics, and `draftsmith.squashed_from` (the parent) / `draftsmith.squashed_chain` (the versions
        merged in, newest first). Every version's chain therefore stays <= K deep, and a cold replica
        materialises any version from at most K+1 stored versions. The returned version is the candidate
        either way (the gate, the scheduler and `candidate` alias do not need to know)."""
        cdir = Path(candidate_dir)
        meta = read_candidate(cdir)
        parent = meta.get("parent_version")
        if parent in (None, ""):
            raise UsageError(
                f"{cdir / 'candidate.json'} has no parent_version, so the adapter cannot be tied to a "
                f"registered draft: register its base draft {meta.get('base_draft_path')!r} first "
                "(`draftsmith register <model folder>`) and train from that version")
        parent = _version_str(parent)
        self._model_version(parent)  # UsageError when unknown
        cand_target = self._check_trained_for(meta.get("target"), "candidate")
        metrics = _numeric(meta.get("metrics"))
        params = _flatten("train", meta.get("train_config") or {}, {})
        params.update(_flatten("data", meta.get("data_window") or {}, {}))
        if meta.get("loss"):
            params["loss"] = str(meta["loss"])
        window = meta.get("data_window") or {}
        files = {"adapter": cdir / "adapter", "candidate.json": cdir / "candidate.json"}
        vocab_tags: dict[str, str] = {}
        if (cdir / VOCABULARY).is_file():                      # the job's re-chosen vocabulary
            vocab_tags = _vocab_tags(read_vocabulary_file(cdir / VOCABULARY, UsageError))
            files[VOCABULARY] = cdir / VOCABULARY
        else:                                                  # an older candidate: the parent's vocabulary
            ptags = self._model_version(parent).tags or {}
            vocab_tags = {k: ptags[k] for k in (TAG + "vocab_size", TAG + "vocab_sha256") if k in ptags}
        target_sha = (meta.get("target_sha256") or target_sha256
                      or (self._model_version(parent).tags or {}).get(TARGET_HASH_TAG))
        tags = {
            TAG + "parent_version": parent,
            TAG + "base_draft_path": str(meta.get("base_draft_path") or "")[:5000],
            TAG + "target": str(cand_target or self.target)[:5000],
            TAG + "loss": str(meta.get("loss") or ""),
            TAG + "data_window": _canonical_json(window)[:5000],
            **vocab_tags,
            **({TARGET_HASH_TAG: str(target_sha)} if target_sha else {}),
            **{_key(k): str(v)[:5000] for k, v in (tags or {}).items()},
        }
        tags[CANDIDATE_PATH_TAG] = str(cdir.resolve())[:5000]
        depth = self.chain_depth(parent) + 1
        if depth > self.max_chain_depth:
            version = self._register_squashed(cdir, parent, depth, files=files, params=params, metrics=metrics,
                                              tags=tags, loss=str(meta.get("loss") or "unknown"))
        else:
            version = self._create_version(
                kind="adapter", files=files,
                run_name=f"{self.name}-candidate", params=params, metrics=metrics, tags=tags,
                description=f"LoRA adapter on version {parent} ({meta.get('loss') or 'unknown'} loss)")
        with self.alias_lock:
            self.client.set_registered_model_alias(self.name, CANDIDATE, version)
            self._record_history({"action": "register", "version": version, "parent_version": parent,
                                  **({"squashed": True} if depth > self.max_chain_depth else {})})
        self._auto_gc()
        return version

    def _register_squashed(self, cdir: Path, parent: str, depth: int, *, files: dict[str, Path], params: dict,
                           metrics: dict, tags: dict[str, str], loss: str) -> str:
        """The candidate as a new base version: its parent (verified, materialised) + its adapter, merged."""
        chain = self.chain(parent)
        parent_dir = self.materialize(parent, verify=True)
        with tempfile.TemporaryDirectory(prefix="draftsmith-squash-") as tmp:
            merged = Path(tmp) / "draft"
            merged.mkdir()
            merge_candidate(parent_dir, cdir, merged)
            tags = {**tags, **_vocab_tags(_folder_vocabulary(merged, ArtifactError)), SQUASHED_FROM_TAG: parent,
                    SQUASHED_CHAIN_TAG: json.dumps(chain)}
            version = self._create_version(
                kind="base", files={"draft": merged, **files}, run_name=f"{self.name}-candidate-squashed",
                params=params, metrics=metrics, tags=tags,
                description=(f"LoRA adapter on version {parent} ({loss} loss), squashed: merged with its chain "
                             f"{'->'.join(chain)} into a base (depth {depth} > {self.max_chain_depth})"))
        log.info("candidate %s squashed into base version %s (chain %s)", cdir, version, chain)
        return version

    def _check_trained_for(self, cand_target: str | None, what: str) -> str | None:
        """A candidate's recorded target, when it is this registry's (UsageError naming the fix otherwise)."""
        if cand_target and target_slug(cand_target) != target_slug(self.target):
            raise UsageError(f"the {what} was trained for target {cand_target!r}, but this registry holds "
                             f"versions for {self.target!r} ({self.name}); pass --target {cand_target}")
        return cand_target

    def register(self, path: str | os.PathLike) -> str:
        """A candidate folder (has candidate.json) or a full model folder (has config.json)."""
        p = Path(path)
        if not p.is_dir():
            raise UsageError(f"{p} is not a folder; pass a candidate folder (with candidate.json) or a model folder")
        folder_kind, own_kind = heads_kind_of(p), self.heads_kind
        if folder_kind is not None:
            if folder_kind != own_kind:
                raise UsageError(f"{p} holds {HEADS_KINDS[folder_kind].label}; register it in the {folder_kind} heads "
                                 f"registry (`draftsmith register {p}` picks it by the files), not in {self.name}")
            return self.register_heads(p, candidate=(p / "candidate.json").exists())
        if own_kind is not None:
            hk = HEADS_KINDS[own_kind]
            raise UsageError(f"{p} is not {hk.folder} (no {hk.files[0]} / {hk.files[1]}); build one with "
                             f"`{hk.build}` or `draftsmith distill --kind {own_kind}`")
        if (p / "candidate.json").exists():
            return self.register_candidate(p)
        if (p / "config.json").exists():
            return self.register_base(p)
        raise UsageError(f"{p} is neither a distillation candidate (no candidate.json) nor a model folder "
                         "(no config.json)")

    def register_heads(self, folder: str | os.PathLike, *, candidate: bool = False, metrics: dict | None = None,
                       params: dict | None = None, set_champion_if_none: bool = False,
                       target_sha256: str | None = None, description: str = "") -> str:
        """Register a heads folder of this registry's kind (kind `heads`, module docstring "Draft kinds"). Its
        `candidate.json`, when present (`draftsmith distill --kind medusa|eagle` writes one), gives the parent
        version, the target pin, the data window and the job's figures, and the version gets the `candidate`
        alias (also with `candidate=True`). Numeric fields of the folder's config become run metrics. The
        target pin: candidate.json `target_sha256`, else `target_sha256`, else this registry's target's."""
        folder = Path(folder)
        own = self.heads_kind
        if own is None:
            raise UsageError(f"{self.name} holds drafts, not heads; use heads_registry(target, kind)")
        hk = HEADS_KINDS[own]
        if heads_kind_of(folder) != own:
            raise UsageError(f"{folder} is not {hk.folder} (needs {' and '.join(hk.files)})")
        try:
            cfg = json.loads((folder / hk.files[0]).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{folder / hk.files[0]} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise UsageError(f"{folder / hk.files[0]} must hold a JSON object")
        meta = {}
        if (folder / "candidate.json").exists():
            try:
                meta = json.loads((folder / "candidate.json").read_text())
            except (OSError, ValueError) as e:
                raise UsageError(f"{folder / 'candidate.json'} is not valid JSON: {e}") from None
            if not isinstance(meta, dict):
                raise UsageError(f"{folder / 'candidate.json'} must hold a JSON object")
        parent = meta.get("parent_version")
        if parent not in (None, ""):
            parent = _version_str(parent)
            self._model_version(parent)                       # UsageError when unknown
        cand_target = self._check_trained_for(meta.get("target"), "heads")
        ids = cfg.get("output_token_ids") if isinstance(cfg, dict) else None
        all_metrics = {**_numeric({k: v for k, v in cfg.items() if k != "output_token_ids"}),
                       **_numeric(meta.get("metrics")), **_numeric(metrics)}
        all_params = _flatten("train", meta.get("train_config") or {}, {})
        all_params.update(_flatten("data", meta.get("data_window") or {}, {}))
        all_params.update(_flatten("", params or {}, {}))
        layer = cfg.get("layer_config") if isinstance(cfg.get("layer_config"), dict) else {}
        for k in ("num_heads", "num_layers", "use_token", "hidden_size"):
            if k in cfg or k in layer:
                all_params[k] = str(cfg.get(k, layer.get(k)))
        target_sha = meta.get("target_sha256") or target_sha256 or target_fingerprint(self.target)
        files = {"heads": folder}
        tags = {TAG + "source_path": str(folder.resolve())[:5000], TAG + "heads_kind": own,
                **_vocab_tags(ids if ids else None),
                **({TARGET_HASH_TAG: str(target_sha)} if target_sha else {}),
                **({TAG + "parent_version": parent} if parent not in (None, "") else {}),
                **({TAG + "data_window": _canonical_json(meta.get("data_window") or {})[:5000]} if meta else {}),
                **({CANDIDATE_PATH_TAG: str(folder.resolve())[:5000]} if meta else {})}
        version = self._create_version(
            kind="heads", files=files, run_name=f"{self.name}-heads", params=all_params, metrics=all_metrics,
            tags=tags, description=description or (f"{hk.label} trained from version {parent}" if parent
                                                   else hk.label))
        if candidate or meta:
            with self.alias_lock:
                self.client.set_registered_model_alias(self.name, CANDIDATE, version)
                self._record_history({"action": "register", "version": version, "parent_version": parent})
        if set_champion_if_none and self.champion() is None:
            self.promote(version, reason="first heads")
        self._auto_gc()
        return version

    # ------------------------------------------------------------------ recording on versions
    def set_version_tags(self, version: Any, tags: dict[str, Any]) -> None:
        v = _version_str(version)
        for k, val in tags.items():
            self.client.set_model_version_tag(self.name, v, _key(k), str(val)[:5000])

    def log_version_metrics(self, version: Any, metrics: dict[str, Any]) -> None:
        """Log numeric figures on the version's run (non-numeric and non-finite values are skipped)."""
        from mlflow.entities import Metric

        mv = self._model_version(version)
        nums = _numeric(metrics)
        if nums and mv.run_id:
            now = _now_ms()
            self.client.log_batch(mv.run_id, metrics=[Metric(k, v, now, 0) for k, v in nums.items()])

    def record_event(self, entry: dict) -> None:
        """Append a free-form entry to the registered model's history (e.g. a gate verdict)."""
        self._record_history(entry)

    # ------------------------------------------------------------------ artifacts
    def _local_artifacts(self, mv) -> tuple[Path, Path | None]:
        """(folder holding the version's artifacts, temp folder to delete afterwards or None).

        A local file store is read in place; anything else is downloaded to a temporary folder.
        """
        from mlflow.exceptions import MlflowException

        from urllib.parse import unquote, urlparse

        run = self.client.get_run(mv.run_id)
        uri = run.info.artifact_uri
        scheme = urlparse(uri).scheme
        if scheme in ("", "file"):
            path = Path(unquote(urlparse(uri).path)) if scheme == "file" else Path(uri)
            if not path.is_dir():
                raise ArtifactError(f"version {mv.version}: its artifact folder {path} is missing")
            return path, None
        self.cache_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=self.cache_root))
        try:
            self.client.download_artifacts(mv.run_id, "", str(tmp))
        except (MlflowException, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ArtifactError(f"version {mv.version}: could not download its artifacts from "
                                f"{uri}: {e}") from None
        return tmp, tmp

    def _verified_artifacts(self, mv) -> tuple[Path, Path | None, dict]:
        """Fetch a version's artifacts and check them against its manifest; raise ArtifactError."""
        what = f"version {mv.version} of {self.name}"
        root, tmp = self._local_artifacts(mv)
        try:
            mpath = root / MANIFEST
            if not mpath.is_file():
                raise ArtifactError(f"{what}: {MANIFEST} is missing from the artifact store")
            want = (mv.tags or {}).get(TAG + "manifest_sha256")
            if want and _sha256(mpath) != want:
                raise ArtifactError(f"{what}: {MANIFEST} is corrupt (sha256 differs from the registered one)")
            try:
                manifest = json.loads(mpath.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ArtifactError(f"{what}: {MANIFEST} is unreadable: {e}") from None
            verify_manifest(root, manifest, what)
        except Exception:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._mark_verified(mv)
        return root, tmp, manifest

    def verify(self, version: Any, *, full: bool = False) -> list[str]:
        """Check a version's stored artifacts against its manifest, and those of its chain down to its
        base (ArtifactError naming the first bad file). The version itself is always re-hashed; an
        ancestor that this cache has already verified with the same run and manifest sha256 (recorded in
        `<cache>/<model>/.verified.json`) is not, unless `full`: a promotion or a replica's swap costs one
        version's hashing, not its whole ancestry's. A version not yet verified here is always hashed, and
        every artifact read to build a folder is hashed as it is read (`_materialize`). Returns the
        versions hashed, newest first."""
        hashed = []
        for i, mv in enumerate(self._chain_mvs(version)):
            if i > 0 and not full and self._is_verified(mv):
                continue
            _, tmp, _ = self._verified_artifacts(mv)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            hashed.append(str(mv.version))
        return hashed

    # ------------------------------------------------------------------ the verified record
    def _verified_key(self, mv) -> str | None:
        sha = (mv.tags or {}).get(TAG + "manifest_sha256")
        return f"{mv.version}:{mv.run_id}:{sha}" if sha and mv.run_id else None

    def _read_verified(self) -> dict:
        try:
            doc = json.loads((self.cache_root / self.name / VERIFIED).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _is_verified(self, mv) -> bool:
        key = self._verified_key(mv)
        return key is not None and key in self._read_verified()

    def _mark_verified(self, mv) -> None:
        """Record that `mv`'s stored artifacts matched its manifest (best effort: a lost entry only means
        hashing it again). At most 2000 entries, newest kept."""
        key = self._verified_key(mv)
        if key is None:
            return
        path = self.cache_root / self.name / VERIFIED
        with _VERIFIED_LOCK:
            doc = self._read_verified()
            doc[key] = time.time()
            if len(doc) > 2000:
                doc = dict(sorted(doc.items(), key=lambda kv: kv[1])[-2000:])
            try:
                write_json_atomic(path, doc)
            except OSError as e:
                log.debug("verified record not written: %s", e)

    # ------------------------------------------------------------------ bounded history
    def _chain_mvs(self, version: Any) -> list:
        """The model versions from `version` down to its nearest base (a squashed base ends the chain;
        its lineage tags are history, not something to load)."""
        mv = self._model_version(version)
        out, seen = [mv], {str(mv.version)}
        while (mv.tags or {}).get(TAG + "kind") == "adapter":
            parent = (mv.tags or {}).get(TAG + "parent_version")
            if not parent:
                break
            if _version_str(parent) in seen or len(out) > 64:
                raise ArtifactError(f"version {version}: its parent chain loops at version {parent}")
            mv = self._model_version(parent)
            out.append(mv)
            seen.add(str(mv.version))
        return out

    def chain(self, version: Any) -> list[str]:
        """The versions a cold materialisation of `version` reads: it, its adapter ancestors, its base."""
        return [str(mv.version) for mv in self._chain_mvs(version)]

    def chain_depth(self, version: Any) -> int:
        """Adapter versions from `version` down to its nearest base (0 for a base): kept <= max_chain_depth
        by squashing at registration."""
        return sum(1 for mv in self._chain_mvs(version) if (mv.tags or {}).get(TAG + "kind") == "adapter")

    def _cache_path(self, mv) -> Path:
        return self.cache_root / self.name / f"{mv.version}-{(mv.run_id or 'norun')[:12]}"

    def _cached(self, mv) -> Path | None:
        out = self._cache_path(mv)
        try:
            marker = json.loads((out / MARKER).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        ok = (marker.get("run_id") == mv.run_id
              and marker.get("manifest_sha256") == (mv.tags or {}).get(TAG + "manifest_sha256"))
        if ok:
            try:
                os.utime(out)          # "used now": retention (gc) keeps recently used folders
            except OSError:
                pass
        return out if ok else None

    def materialize(self, version: Any, *, verify: bool = False) -> Path:
        """A plain HF model folder for `version` (merged adapters, cached); ArtifactError if it can't be built.

        With `verify=True` the stored artifacts are checked against their manifests even when a cached
        folder exists (promotion and rollback do this, because other machines will materialise from the
        store, not from this cache): the version's own always, its ancestors' once per cache (`verify`).
        """
        mv = self._model_version(version)
        if verify:
            self.verify(mv.version)
        return self._materialize(mv, depth=0)

    def _materialize(self, mv, depth: int) -> Path:
        if depth > 64:
            raise ArtifactError(f"version {mv.version}: parent chain deeper than 64 (a loop?)")
        cached = self._cached(mv)
        if cached is not None:
            return cached
        kind = (mv.tags or {}).get(TAG + "kind")
        out = self._cache_path(mv)
        out.parent.mkdir(parents=True, exist_ok=True)
        root, tmp, manifest = self._verified_artifacts(mv)
        staging = Path(tempfile.mkdtemp(prefix=f".{mv.version}-", dir=out.parent))
        try:
            if kind == "base":
                shutil.copytree(root / "draft", staging, dirs_exist_ok=True)
            elif kind == "heads":
                shutil.copytree(root / "heads", staging, dirs_exist_ok=True)
            elif kind == "adapter":
                parent = (mv.tags or {}).get(TAG + "parent_version")
                if not parent:
                    raise ArtifactError(f"version {mv.version} is an adapter without a parent_version tag")
                parent_dir = self._materialize(self._model_version(parent), depth + 1)
                _merge_adapter(parent_dir, root / "adapter", staging, what=f"version {mv.version}")
                if (root / VOCABULARY).is_file():             # its own vocabulary, else the parent's (copied)
                    _write_folder_vocabulary(staging, read_vocabulary_file(root / VOCABULARY),
                                             what=f"version {mv.version}")
            else:
                raise ArtifactError(f"version {mv.version} has unknown kind {kind!r} (not registered by Draftsmith?)")
            (staging / MARKER).write_text(json.dumps({
                "model": self.name, "version": str(mv.version), "run_id": mv.run_id,
                "manifest_sha256": (mv.tags or {}).get(TAG + "manifest_sha256"), "time": time.time()}))
            if out.exists():  # a stale entry (other run id) or a concurrent materialisation
                if self._cached(mv) is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                    return out
                shutil.rmtree(out, ignore_errors=True)
            os.replace(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("materialised %s version %s at %s", self.name, mv.version, out)
        return out

    # ------------------------------------------------------------------ retention
    def _version_mvs(self) -> dict[str, Any]:
        """{version: model version} in one search (no run reads); RegistryUnavailable when unreadable."""
        if self._registered_model() is None:
            return {}
        try:
            return {str(mv.version): mv for mv in self.client.search_model_versions(f"name='{self.name}'")}
        except Exception as e:  # noqa: BLE001
            raise _unavailable(e, f"list the versions of {self.name}") from None

    def retained_versions(self, keep_last: int | None = None) -> dict[str, list[str]]:
        """{version: why kept}: every aliased version (champion, previous, candidate, canary, any alias)
        and the newest `keep_last` (default `self.keep_last`) versions. RegistryUnavailable when MLflow
        cannot be read: retention never guesses what to keep."""
        keep_last = self.keep_last if keep_last is None else int(keep_last)
        out: dict[str, list[str]] = {}
        for alias, v in sorted(self.aliases().items()):
            out.setdefault(str(v), []).append(alias)
        if keep_last > 0:
            for v in sorted(self._version_mvs(), key=int)[-keep_last:]:
                out.setdefault(v, []).append("recent")
        return out

    def prune_cache(self, keep_last: int | None = None, *, grace_s: float | None = None,
                    dry_run: bool = False) -> PruneReport:
        """Delete the materialised folders under `<cache>/<model>/` of versions not retained
        (`retained_versions`). Left alone: folders written or used (materialised, or found in the cache)
        less than `grace_s` ago (default `gc_grace_s`), so a replica loading one keeps it; entries of
        another store sharing the cache (version/run id unknown here); '.'-folders (staging of a
        materialisation in progress) unless they are '.trash-' or older than 6 h. Deleting a cached folder
        only costs a re-materialisation later."""
        grace = self.gc_grace_s if grace_s is None else float(grace_s)
        root = self.cache_root / self.name
        report = PruneReport("cache", root, dry_run=dry_run)
        if not root.is_dir():
            return report
        keep = self.retained_versions(keep_last)
        mvs = self._version_mvs()
        now = time.time()
        for entry in sorted(root.iterdir()):
            if not entry.is_dir() or entry.is_symlink():
                continue
            if entry.name.startswith("."):
                if entry.name.startswith(".trash-") or now - _last_used(entry) > STALE_STAGING_S:
                    report.remove(entry)
                continue
            m = re.fullmatch(r"(\d+)-(.+)", entry.name)
            mv = mvs.get(m.group(1)) if m else None
            if mv is None or (mv.run_id or "norun")[:12] != m.group(2):
                report.skipped.append((entry.name, "not a version of this store"))
            elif str(mv.version) in keep:
                report.kept.append(f"{entry.name} ({', '.join(keep[str(mv.version)])})")
            elif now - _last_used(entry) < grace:
                report.skipped.append((entry.name, f"used {now - _last_used(entry):.0f} s ago (grace {grace:g} s)"))
            else:
                report.remove(entry)
        return report

    def prune_candidates(self, keep_last: int | None = None, *, grace_s: float | None = None,
                         unregistered_older_than_s: float | None = None, dry_run: bool = False) -> PruneReport:
        """Delete candidate folders under `candidates_root` that were registered as versions of this model
        (`draftsmith.candidate_path`) that are not retained and were not written in the last `grace_s`.
        A folder no version of this store was registered from (a job still writing it, a failed
        registration, an operator's candidate waiting for `draftsmith register`, another model's) is left
        alone unless `unregistered_older_than_s` is given and it is older than that."""
        grace = self.gc_grace_s if grace_s is None else float(grace_s)
        root = self.candidates_root
        report = PruneReport("candidates", root, dry_run=dry_run)
        if not root.is_dir():
            return report
        keep = self.retained_versions(keep_last)
        mine = {}
        for v, mv in self._version_mvs().items():
            if (mv.tags or {}).get(CANDIDATE_PATH_TAG):
                mine[mv.tags[CANDIDATE_PATH_TAG]] = v
        try:                                    # folders registered to other models of the same store
            others = {mv.tags.get(CANDIDATE_PATH_TAG) for mv in self.client.search_model_versions()
                      if mv.name != self.name and (mv.tags or {}).get(CANDIDATE_PATH_TAG)}
        except Exception as e:  # noqa: BLE001
            raise _unavailable(e, "list the registered versions") from None
        now = time.time()
        for entry in sorted(root.iterdir()):
            if not entry.is_dir() or entry.is_symlink():
                continue
            age = now - _last_used(entry)
            if entry.name.startswith("."):      # a job's staging folder, or a deletion interrupted
                if entry.name.startswith(".trash-") or age > STALE_STAGING_S:
                    report.remove(entry)
                continue
            key = str(entry.resolve())
            v = mine.get(key)
            if v is None:
                if key in others:
                    report.skipped.append((entry.name, "registered to another model"))
                elif unregistered_older_than_s is not None and age > unregistered_older_than_s:
                    report.remove(entry)
                else:
                    report.skipped.append((entry.name, "not registered"))
            elif v in keep:
                report.kept.append(f"{entry.name} (version {v}: {', '.join(keep[v])})")
            elif age < grace:
                report.skipped.append((entry.name, f"written {age:.0f} s ago (grace {grace:g} s)"))
            else:
                report.remove(entry)
        return report

    def gc(self, keep_last: int | None = None, *, grace_s: float | None = None,
           unregistered_older_than_s: float | None = None, dry_run: bool = False) -> dict[str, PruneReport]:
        """The retention policy (`draftsmith gc`): `prune_cache` and `prune_candidates`."""
        return {"cache": self.prune_cache(keep_last, grace_s=grace_s, dry_run=dry_run),
                "candidates": self.prune_candidates(keep_last, grace_s=grace_s, dry_run=dry_run,
                                                    unregistered_older_than_s=unregistered_older_than_s)}

    def _auto_gc(self) -> None:
        """`gc` after a registration or an alias move; a failure is logged, never raised."""
        if not self.auto_gc:
            return
        try:
            for report in self.gc().values():
                if report.deleted:
                    log.info("retention: deleted %d %s folder(s) under %s (%.1f MB)", len(report.deleted),
                             report.what, report.root, report.freed_bytes / 1e6)
        except Exception as e:  # noqa: BLE001 - retention must never fail the operation
            log.warning("retention (gc) of %s skipped: %s: %s", self.name, type(e).__name__, e)

    # ------------------------------------------------------------------ alias moves
    def set_alias(self, alias: str, version: Any) -> None:
        if alias not in ALIASES:
            raise UsageError(f"unknown alias {alias!r}; Draftsmith uses {', '.join(ALIASES)}")
        with self.alias_lock:
            self.client.set_registered_model_alias(self.name, alias, str(self._model_version(version).version))

    def _delete_alias(self, alias: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as e:
            if not _not_found(e):
                raise _unavailable(e, f"delete the {alias} alias of {self.name}") from None

    def promote(self, version: Any, *, reason: str = "", gate: dict | None = None,
                ignore_pause: bool = False) -> AliasMove:
        """Make `version` the champion; the old champion becomes `previous`. Idempotent.

        Under the alias lock (module docstring): refuses with PromotionsPaused while promotions are paused
        (unless `ignore_pause`, an operator's explicit override), and with RegistryUnavailable when the
        pause or the aliases cannot be read (fail closed). The version (and its parent chain) is verified
        and materialised first; if that fails an ArtifactError is raised and no alias moves. Policy (the
        gate) is the caller's: see deploy/gate.py.
        """
        with self.alias_lock:
            v = str(self._model_version(version).version)
            old = self.champion()
            if old == v:
                return AliasMove("promote", v, old, self.alias(PREVIOUS), False, f"version {v} is already the champion")
            paused = self.promotions_paused()
            if paused and not ignore_pause:
                raise PromotionsPaused(
                    f"promotions of {self.name} are paused since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(paused.get('time', 0)))} "
                    f"({paused.get('reason')}); version {v} was not promoted. `draftsmith resume` lifts the pause")
            self.materialize(v, verify=True)
            if old is not None:
                self.client.set_registered_model_alias(self.name, PREVIOUS, old)
            self.client.set_registered_model_alias(self.name, CHAMPION, v)
            if self.alias(CANDIDATE) == v:
                self._delete_alias(CANDIDATE)
            if self.alias(CANARY) == v:           # a canary promoted (by the judge or an operator) ends as one
                self._clear_canary()
            now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self.set_version_tags(v, {TAG + "promoted_at": now, TAG + "promote_reason": reason or "-",
                                      SINCE_TAG: str(_now_ms())})
            if old is not None:
                self.set_version_tags(old, {TAG + "demoted_at": now})
            self._record_history({"action": "promote", "version": v, "from": old, "reason": reason,
                                  **({"gate": gate} if gate else {})})
            prev = old if old is not None else self.alias(PREVIOUS)
            msg = f"version {v} is now the champion" + (f" (previous: {old})" if old else "")
            self._auto_gc()
            return AliasMove("promote", v, old, prev, True, msg)

    # ------------------------------------------------------------------ canary
    def canary(self) -> dict | None:
        """The running canary: {"version", "share", "since_ms"}, or None. RegistryUnavailable when MLflow
        cannot be read. A share tag that does not read as a number in [0, 1) gives share 0 (no traffic:
        the safe reading) and a warning."""
        rm = self._registered_model()
        v = None if rm is None else (rm.aliases or {}).get(CANARY)
        if v is None:
            return None
        tags = rm.tags or {}
        raw = tags.get(CANARY_SHARE_TAG, str(DEFAULT_CANARY_SHARE))
        try:
            share = float(raw)
            if not (0.0 <= share < 1.0):
                raise ValueError(raw)
        except ValueError:
            log.warning("%s: canary share tag %r is not a number in [0, 1); routing no traffic to the canary",
                        self.name, raw)
            share = 0.0
        since = tags.get(CANARY_SINCE_TAG)
        return {"version": str(v), "share": share,
                "since_ms": int(since) if since and str(since).isdigit() else None}

    def _clear_canary(self) -> None:
        """Delete the canary alias and its registered-model tags (under the alias lock)."""
        self._delete_alias(CANARY)
        for key in (CANARY_SHARE_TAG, CANARY_SINCE_TAG):
            try:
                self.client.delete_registered_model_tag(self.name, key)
            except Exception as e:  # noqa: BLE001 - a tag that is not there is fine
                if not _not_found(e):
                    log.debug("could not delete tag %s: %s", key, e)

    def start_canary(self, version: Any, share: float = DEFAULT_CANARY_SHARE, *, reason: str = "",
                     gate: dict | None = None, ignore_pause: bool = False) -> AliasMove:
        """Make `version` the canary: replicas serve it to `share` of new requests beside the champion,
        until `end_canary` promotes or drops it. Under the alias lock; refuses while promotions are paused
        (PromotionsPaused, like `promote`) and when MLflow cannot be read; the version is verified and
        materialised first (ArtifactError: nothing moves). A canary already running for another version is
        dropped first (reason recorded). Needs a champion to compare with (UsageError otherwise)."""
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0.0 < share < 1.0):
            raise UsageError(f"canary share must be a number in (0, 1), got {share!r}; 0 means promote directly")
        with self.alias_lock:
            v = str(self._model_version(version).version)
            champ = self.champion()
            if champ is None:
                raise UsageError(f"no champion to compare canary version {v} with; promote it directly")
            if champ == v:
                return AliasMove("canary", champ, champ, self.alias(PREVIOUS), False,
                                 f"version {v} is already the champion")
            paused = self.promotions_paused()
            if paused and not ignore_pause:
                raise PromotionsPaused(f"promotions of {self.name} are paused ({paused.get('reason')}); version {v} "
                                       "did not start a canary. `draftsmith resume` lifts the pause")
            current = self.canary()
            if current is not None and current["version"] != v:
                self.end_canary(current["version"], promote=False, reason=f"replaced by version {v}")
            self.materialize(v, verify=True)
            since = _now_ms()
            self.client.set_registered_model_alias(self.name, CANARY, v)
            self.client.set_registered_model_tag(self.name, CANARY_SHARE_TAG, repr(float(share)))
            if current is None or current["version"] != v:
                self.client.set_registered_model_tag(self.name, CANARY_SINCE_TAG, str(since))
            if self.alias(CANDIDATE) == v:
                self._delete_alias(CANDIDATE)
            self.set_version_tags(v, {TAG + "canary_status": "running", TAG + "canary_share": repr(float(share)),
                                      TAG + "canary_started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                      TAG + "canary_reason": reason or "-"})
            self._record_history({"action": "canary", "version": v, "champion": champ, "share": float(share),
                                  "reason": reason, **({"gate": gate} if gate else {})})
            return AliasMove("canary", champ, champ, self.alias(PREVIOUS), True,
                             f"version {v} is the canary on {share:.0%} of requests (champion: {champ})")

    def end_canary(self, version: Any, *, promote: bool, reason: str = "", details: dict | None = None) -> AliasMove:
        """End canary `version`: `promote` makes it the champion through `promote` (old champion ->
        previous; refused with PromotionsPaused while paused, the canary then keeps running), else drops it
        (alias deleted, the champion untouched). The decision, reason and figures (`details`) are recorded
        on the version (`draftsmith.canary_status` promoted/dropped, `draftsmith.canary_decision_reason`,
        `draftsmith.canary_details`, numeric details as `canary_*` metrics) and in the history. A no-op
        when `version` is not the canary (any more)."""
        with self.alias_lock:
            v = str(self._model_version(version).version)
            current = self.canary()
            if current is None or current["version"] != v:
                champ = self.champion()
                return AliasMove("canary", champ or "-", champ, self.alias(PREVIOUS), False,
                                 f"version {v} is not the canary (canary: {current['version'] if current else 'none'})")
            started = current.get("since_ms")
            if promote:
                move = self.promote(v, reason=f"canary: {reason}" if reason else "canary passed")
            else:
                self._clear_canary()
                champ = self.champion()
                move = AliasMove("canary", champ or "-", champ, self.alias(PREVIOUS), True,
                                 f"canary version {v} dropped; version {champ} stays the champion")
            status = "promoted" if promote else "dropped"
            self.set_version_tags(v, {TAG + "canary_status": status,
                                      TAG + "canary_decided_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                      TAG + "canary_decision_reason": reason or "-",
                                      **({TAG + "canary_details": json.dumps(details, default=str)} if details else {})})
            if details:
                try:
                    self.log_version_metrics(v, {f"canary_{k}": val for k, val in details.items()})
                except RegistryError as e:
                    log.warning("canary figures of version %s not logged: %s", v, e)
            self._record_history({"action": f"canary {status}", "version": v, "reason": reason,
                                  "started_ms": started, **({"details": details} if details else {})})
            return move

    # ------------------------------------------------------------------ automatic promotion pause
    def pause_promotions(self, reason: str) -> None:
        """Stop scheduled distillation from promoting (and running) until `resume_promotions`.
        Stored as a registered-model tag, so every scheduler sharing this registry sees it."""
        self._ensure_model()
        entry = {"time": time.time(), "reason": reason}
        with self.alias_lock:
            self.client.set_registered_model_tag(self.name, PAUSE_TAG, json.dumps(entry))
            self._record_history({"action": "pause", "reason": reason})

    def resume_promotions(self) -> bool:
        """Clear the pause; False when there was none."""
        with self.alias_lock:
            if self.promotions_paused() is None:
                return False
            self.client.delete_registered_model_tag(self.name, PAUSE_TAG)
            self._record_history({"action": "resume"})
            return True

    def promotions_paused(self) -> dict | None:
        """{"time", "reason"} while promotion is paused, else None (also before anything is registered).
        RegistryUnavailable when MLflow cannot be read: an outage never reads as "not paused"."""
        rm = self._registered_model()
        raw = None if rm is None else (rm.tags or {}).get(PAUSE_TAG)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"time": 0, "reason": raw}

    def rollback(self, to: Any | None = None, *, reason: str = "", pause: bool = True,
                 details: dict | None = None) -> AliasMove:
        """Move `champion` back to `previous` (or to version `to`). Idempotent.

        `reason` is recorded on the rolled-back version (`draftsmith.rollback_reason`), in the history
        and in the pause; `details` (e.g. the watchdog's figures) go to the history entry and, as JSON, to
        the version tag `draftsmith.rollback_details`.

        After a rollback `previous` is cleared and the rolled-back version is tagged
        `draftsmith.rolled_back_at`, so repeating the command is a no-op. The target version is
        verified and materialised before any alias moves (ArtifactError leaves everything as it was).
        With `pause` (the default) a rollback that moved the champion also pauses scheduled
        distillation (`pause_promotions`), so the scheduler does not promote the next candidate
        behind the operator's back; `draftsmith resume` lifts it.
        """
        with self.alias_lock:
            champ = self.champion()
            prev = self.alias(PREVIOUS)
            if to is None:
                if prev is None or prev == champ:
                    last = next((h for h in reversed(self.history()) if h.get("action") == "rollback"), None)
                    if champ is not None and last is not None and str(last.get("to")) == champ:
                        return AliasMove("rollback", champ, champ, prev, False,
                                         f"already rolled back: version {champ} is the champion "
                                         f"(rolled back from {last.get('from')})")
                    raise UsageError(
                        "nothing to roll back to: no `previous` version is recorded "
                        f"(champion: {champ or 'none'}); pass --to VERSION (see `draftsmith versions`)")
                target = prev
            else:
                target = str(self._model_version(to).version)
            if target == champ:
                return AliasMove("rollback", target, champ, prev, False, f"version {target} is already the champion")
            self.materialize(target, verify=True)
            self.client.set_registered_model_alias(self.name, CHAMPION, target)
            self._delete_alias(PREVIOUS)
            now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            if champ is not None:
                self.set_version_tags(champ, {TAG + "rolled_back_at": now, TAG + "rolled_back_to": target,
                                              TAG + "rollback_reason": reason or "-",
                                              **({TAG + "rollback_details": json.dumps(details, default=str)}
                                                 if details else {})})
            self.set_version_tags(target, {TAG + "restored_at": now, SINCE_TAG: str(_now_ms())})
            self._record_history({"action": "rollback", "from": champ, "to": target, "reason": reason,
                                  **({"details": details} if details else {})})
            if pause:
                self.pause_promotions(f"rollback from version {champ} to {target}: {reason or 'no reason given'}")
            self._auto_gc()
            return AliasMove("rollback", target, champ, None, True,
                             f"rolled back: version {target} is now the champion"
                             + (f" (was {champ})" if champ else "")
                             + ("; scheduled distillation paused until `draftsmith resume`" if pause else ""))
