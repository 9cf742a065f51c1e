"""The smoke run of scripts/bench_controller_load.py (the controller through a load change, issue 15): tiny
models, real busy trainer processes, both load shares with and without depth probes, calibrated beside the
trainers; the figures it writes are checked, not its speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_controller_load_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_controller_load.py"), "--tiny", "--prompts", "1",
           "--max-tokens", "8", "--trainers", "1", "--load-shares", "0", "0.9", "--depth-probes", "on", "off",
           "--calibrate-loaded", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((out / "controller-load.json").read_text())
    rows = got["rows"]
    assert [(r["load_share"], r["depth_probes"], r["phase"]) for r in rows] == [
        (s, d, p) for s in (0.0, 0.9) for d in ("on", "off") for p in ("idle", "loaded", "idle again")]
    assert got["setting"]["calibrated"] == "beside the trainers"
    # T=0 and a lossless tree rule: every phase under either share emits the same tokens
    assert len({r["tokens"] for r in rows}) == 1 and rows[0]["tokens"] > 0
    for r in rows:
        assert r["steps"] >= 1 and 0.0 <= r["zero_draft_share"] <= 1.0 and r["load"] > 0
        assert r["relative_target_s"]["1"] == 1.0
    assert all(r["load"] == 1.0 for r in rows if r["load_share"] == 0.0)     # share 0: per-size means alone
    assert "| share 0.9, depth probes off | loaded |" in (out / "controller-load.md").read_text()
    assert (out / "controller-load.png").stat().st_size > 5_000
    bad = subprocess.run([*cmd[:2], "--load-shares", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--load-shares values must be in [0, 1)" in bad.stderr
