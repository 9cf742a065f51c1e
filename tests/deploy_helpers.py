"""Shared helpers for the deploy/ tests: a pre-initialised MLflow SQLite store (creating one costs
~6 s of schema migrations, copying it costs milliseconds), a tiny base draft folder and LoRA
candidates on it in the exact layout of docs/architecture.md ("Candidate folder")."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tiny_models import make_model, make_tokenizer

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


def lora_model(base_folder: Path, seed: int = 0, scale: float = 0.05):
    """A peft LoRA model over the base with random, non-zero A and B (so merging changes weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def make_candidate(folder: Path, base_folder: Path, *, parent_version: str | None = "1", seed: int = 0,
                   before: float = 0.40, after: float = 0.50, heldout: int = 64, target: str = "tiny-target",
                   last_id: str = "1700000000000-5") -> Path:
    folder = Path(folder)
    lora_model(base_folder, seed).save_pretrained(folder / "adapter")
    meta = {
        "parent_version": parent_version, "base_draft_path": str(base_folder), "target": target, "loss": "jsd",
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
