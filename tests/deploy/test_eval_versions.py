"""scripts/eval_versions.py: registered heads versions decoded side by side on the same prompts at a fixed tree
(the online experiment's forgetting check, issue 15), against a real MLflow registry in a data dir of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests import tiny_models
from tests.deploy.test_heads_registry import make_heads

ROOT = Path(__file__).resolve().parents[2]


def test_eval_versions_decodes_each_version_on_the_same_prompts(tmp_path):
    from serving.engine import Engine

    target, _ = tiny_models.save_pair(tmp_path / "models", draft_layers=1)
    model = Engine.from_paths(str(target), None, dtype=torch.float32).target.model
    h1 = make_heads(model, tmp_path / "h1", seed=1, scale=0.05)
    h2 = make_heads(model, tmp_path / "h2", seed=2, scale=0.05)
    data = tmp_path / "data"
    env = {**os.environ, "DRAFTSMITH_DATA": str(data), "DRAFTSMITH_CACHE": str(tmp_path / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)

    def cli(*a):
        r = subprocess.run([sys.executable, "-m", "deploy.cli", *a, "--target", str(target)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    cli("register", str(h1))
    cli("register", str(h2))
    cli("promote", "2", "--kind", "medusa", "--force")

    out = tmp_path / "eval.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "eval_versions.py"), "--data", str(data), "--target", str(target),
           "--versions", "1,champion", "--categories", "sql,json", "--prompts", "2", "--max-tokens", "6", "--out", str(out)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["setting"]["adaptive"] is False and got["setting"]["mode"] == "medusa"
    rows = got["rows"]
    assert [(r["version"], r["category"]) for r in rows] == [("1", "sql"), ("1", "json"), ("2", "sql"), ("2", "json")]
    assert rows[2]["label"] == "v2 (champion)"
    for r in rows:
        assert r["prompts"] == 2 and r["steps"] >= 1
        # each step emits its accepted tokens plus the target's one (the last step may be cut by max_tokens)
        acc = r["accepted_per_step"] * r["steps"]
        assert r["steps"] <= r["tokens"] <= acc + r["steps"] + 1e-6, r
        assert 0.0 <= r["accepted_per_step"] <= got["setting"]["gamma"]
    assert "| v2 (champion) | json |" in res.stdout
    # a version the registry does not have: a clear error, no traceback
    bad = subprocess.run([*cmd[:6], "--versions", "previous"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "no version with alias 'previous'" in bad.stderr and "Traceback" not in bad.stderr
