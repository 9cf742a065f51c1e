"""Shared helpers for the deploy/ tests: a pre-initialised MLflow SQLite store (creating one costs
~6 s of schema migrations, copying it costs milliseconds), a tiny base draft folder and LoRA
candidates on it in the exact layout of docs/architecture.md ("Candidate folder"), a draft that is a
copy of the target (acceptance ~1), held-out records made by really serving into real Redis, and a
real `mlflow server` that a test can stop and restart."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tests.tiny_models import make_model, make_tokenizer

_TEMPLATE: dict[str, Path] = {}


def template_db(root: Path) -> Path:
    """An empty, fully migrated MLflow SQLite file (made once per test session under `root`)."""
    if "db" not in _TEMPLATE:
        from mlflow.tracking import MlflowClient

        db = Path(root) / "template-mlflow.db"
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
        _TEMPLATE["db"] = db
    return _TEMPLATE["db"]


def fresh_store(template: Path, data: Path) -> str:
    """Copy the template into `data/mlflow.db`; return its tracking URI."""
    data.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, data / "mlflow.db")
    return f"sqlite:///{data / 'mlflow.db'}"


def make_base_draft(folder: Path, seed: int = 1, layers: int = 1) -> Path:
    """A tiny full draft folder: weights, the shared byte tokenizer, draftsmith.json."""
    folder = Path(folder)
    make_model(seed, layers=layers, sharp=8.0).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    (folder / "draftsmith.json").write_text(json.dumps({"output_token_ids": list(range(259)),
                                                       "heldout_top1_agreement_after": 0.42,
                                                       "built_by": "tests"}))
    return folder


def make_target_clone(folder: Path, target: Path) -> Path:
    """A "draft" that is the target itself (same weights and tokenizer): it accepts ~everything."""
    shutil.copytree(target, folder)
    (Path(folder) / "draftsmith.json").write_text(json.dumps({"output_token_ids": list(range(259))}))
    return Path(folder)


def make_degraded_draft(folder: Path, target: Path, seed: int = 5, scale: float = 0.6) -> Path:
    """The target with a large low-rank perturbation merged into its q/v projections: a poor draft that
    `make_candidate(..., base_folder=<it>, seed=seed, scale=scale, sign=-1)` repairs exactly (that
    candidate's merged weights are the target's): a genuinely better candidate for real gate tests."""
    clone = make_target_clone(Path(str(folder) + ".clone"), target)
    lora_model(clone, seed, scale).merge_and_unload().save_pretrained(folder)
    for p in clone.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy2(p, Path(folder) / p.name)
    shutil.rmtree(clone)
    return Path(folder)


def lora_model(base_folder: Path, seed: int = 0, scale: float = 0.05, sign: float = 1.0):
    """A peft LoRA model over the base with random, non-zero A and B (so merging changes weights);
    `sign` -1 negates B, so the adapter undoes the one with the same seed and scale."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale * (sign if "lora_B" in name else 1.0))
    return model.eval()


def make_candidate(folder: Path, base_folder: Path, *, parent_version: str | None = "1", seed: int = 0,
                   before: float = 0.40, after: float = 0.50, heldout: int = 64, target: str = "tiny-target",
                   last_id: str = "1700000000000-5", scale: float = 0.05, target_sha256: str | None = None,
                   sign: float = 1.0) -> Path:
    folder = Path(folder)
    lora_model(base_folder, seed, scale, sign).save_pretrained(folder / "adapter")
    meta = {
        "parent_version": parent_version, "base_draft_path": str(base_folder), "target": target, "loss": "jsd",
        **({"target_sha256": target_sha256} if target_sha256 else {}),
        "train_config": {"lr": 1e-3, "lora": {"r": 4, "alpha": 8}, "steps": 10},
        "data_window": {"stream": "ds:steps", "first_id": "1700000000000-0", "last_id": last_id,
                        "num_records": 6, "sources": ["gsm8k"]},
        "metrics": {"offline_acceptance_before": before, "offline_acceptance_after": after,
                    "expected_accepted_length_before": 1.1, "expected_accepted_length_after": 1.4,
                    "heldout_records": heldout, "train_tokens_per_s": 1234.5, "peak_rss_mb": 900.0},
    }
    (folder / "candidate.json").write_text(json.dumps(meta))
    return folder


def artifact_dir(registry, version: str) -> Path:
    """The local artifact folder of a version's run (file store)."""
    from urllib.parse import unquote, urlparse

    mv = registry.client.get_model_version(registry.name, version)
    return Path(unquote(urlparse(registry.client.get_run(mv.run_id).info.artifact_uri).path))


# ----------------------------------------------------------------------------- served records
def pick_request_id(i: int, heldout: bool, fraction: float, tag: str = "req") -> str:
    """A request id whose held-out membership (training.data.is_heldout) is `heldout`."""
    from training.data import is_heldout

    return next(rid for salt in range(100_000)
                if is_heldout(rid := f"{tag}-{i}-{salt}", fraction) == heldout)


def serve_records(target: Path, draft: Path, redis_url: str, prefix: str, *, requests: int = 24,
                  heldout_fraction: float = 0.25, heldout: bool = True, sources: tuple[str, ...] = ("chat", "code"),
                  max_tokens: int = 24, tag: str = "req") -> list[str]:
    """Serve `requests` real requests (Engine + ReplayBufferWriter, speculative sampling, gamma 4) into the
    buffer under `prefix`, alternating `sources` (the first at temperature 1, the others greedy); every
    request id is held out (or not) under `heldout_fraction`. Returns the request ids."""
    from buffer.redis_store import BufferConfig, ReplayBufferWriter
    from serving.config import SamplingParams, SpecParams
    from serving.engine import Engine

    writer = ReplayBufferWriter(redis_url, BufferConfig(prefix=prefix, flush_interval_s=0.002))
    engine = Engine.from_paths(str(target), str(draft), sink=writer, draft_version="serve", dtype=torch.float32)
    ids = []
    for i in range(requests):
        source = sources[i % len(sources)]
        rid = pick_request_id(i, heldout, heldout_fraction, tag)
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{source} request {i}: {'add' if i % 2 else 'list'} {i} and {3 * i}"}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        engine.generate_all([int(t) for t in prompt],
                            SamplingParams(temperature=1.0 if source == sources[0] else 0.0, max_tokens=max_tokens,
                                           seed=i),
                            SpecParams(mode="speculative", gamma=4, adaptive=False), request_id=rid, source=source)
        ids.append(rid)
    writer.close()
    return ids


def drop_prefix(redis_url: str, prefix: str) -> None:
    from buffer.redis_store import delete_prefix

    delete_prefix(redis_url, prefix)


# ----------------------------------------------------------------------------- a real MLflow server
# `mlflow server` also starts a job runner (a second Python process importing MLflow, for server-side jobs
# this project never submits): off, each start takes a few seconds less of the 2 cores
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class MlflowServer:
    """`mlflow server` on a SQLite file with proxied artifacts, on a fixed port, that a test can stop
    (the tracking URI then points at a dead server) and start again on the same port and store."""

    def __init__(self, root: Path, template: Path) -> None:
        import socket

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.copy(template, self.root / "server.db")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout_s: float = 120.0) -> "MlflowServer":
        import subprocess
        import sys
        import time
        import urllib.request

        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, env=SERVER_ENV)
        deadline = time.time() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("mlflow server did not come up: "
                                   + (self.root / "server.log").read_text()[-2000:])
            time.sleep(0.3)

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        self.proc = None


# ----------------------------------------------------------------------------- gate evidence stand-in
def synthetic_evidence(delta: float, n: int = 40, seed: int = 0):
    """A callable gate evidence source (champion folder, candidate folder) -> PairedEvidence in which every
    request gains `delta` (plus small noise): a stand-in for the scoring where a test is about something
    else (scheduling, recording). The real scoring is tested in tests/deploy/test_gate.py."""
    import numpy as np

    from deploy.gate import PairedEvidence

    rng = np.random.default_rng(seed)
    champ = rng.uniform(0.3, 0.5, n)
    cand = champ + delta + rng.normal(0, 0.005, n)
    calls = []

    def collect(champion_path, candidate_path):
        calls.append((champion_path, candidate_path))
        return PairedEvidence([f"r{i}" for i in range(n)], ["chat"] * n, [8.0] * n, champ.tolist(), cand.tolist(),
                              champ.tolist(), cand.tolist(), records=4 * n)

    collect.calls = calls
    return collect


class LoadClients:
    """`n` threads calling `call()` until stopped, keeping each result and every exception (a hot-swap or a
    rollback under load must not fail one request): `with LoadClients(fn) as load: ...; load.stop()`."""

    def __init__(self, call, n: int = 3) -> None:
        import threading

        self.call, self.results, self.errors = call, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(self.call())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)

    def __enter__(self) -> "LoadClients":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def __exit__(self, *exc) -> None:
        self.stop()
