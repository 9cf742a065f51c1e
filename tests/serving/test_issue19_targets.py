"""scripts/issue19_targets.py: issue 19's targets re-read over saved result folders (no model runs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _decode(folder: Path, temperature: float, medusa: float, mjsd: float, acc: float) -> None:
    folder.mkdir(parents=True)
    rows = [{"mode": "target", "tokens_per_s": 20.0, "speedup": 1.0, "token_acceptance": None},
            {"mode": "medusa", "tokens_per_s": 20.0 * medusa, "speedup": medusa, "token_acceptance": acc},
            {"mode": "mjsd", "tokens_per_s": 20.0 * mjsd, "speedup": mjsd, "token_acceptance": acc - 0.1}]
    (folder / f"decode_gsm8k_T{temperature}_cpu.json").write_text(
        json.dumps({"setup": f"target=t draft=d prompts=gsm8k-heldout x10 T={temperature} top_k=20", "rows": rows}))


def _traffic(folder: Path, ratios: dict, http: bool) -> None:
    folder.mkdir(parents=True)
    summary = []
    for cat, r in ratios.items():
        summary.append({"category": cat, "mode": "default", "ratio_to_target": r, **({} if http else {"temperature": 0.0})})
        summary.append({"category": cat, "mode": "target", "ratio_to_target": 1.0,
                        **({} if http else {"temperature": 0.0})})
    if not http:   # a T=1 row of the same run must not enter the T=0 reading
        summary.append({"category": "maths", "mode": "default", "ratio_to_target": 9.0, "temperature": 1.0})
    name = "http_results.json" if http else "results.json"
    (folder / name).write_text(json.dumps({"args": {"temperatures": [0.0]}, "summary": summary}))


def test_targets_table_reads_each_kind_of_saved_run_and_marks_what_is_met(tmp_path):
    res = tmp_path / "results"
    _decode(res / "gsm8k-a-t0", 0.0, medusa=2.3, mjsd=1.5, acc=0.72)
    _decode(res / "gsm8k-a-t1", 1.0, medusa=1.1, mjsd=1.9, acc=0.4)
    _decode(res / "gsm8k-b-t0", 0.0, medusa=1.4, mjsd=1.6, acc=0.5)
    six = ("maths", "science", "code", "everyday", "writing", "multiturn")
    _traffic(res / "traffic-a", dict.fromkeys(six, 1.7), http=True)
    _traffic(res / "traffic-b", {**dict.fromkeys(six, 1.8), "science": 0.9}, http=False)
    (res / "tree-cost-a").mkdir(parents=True)
    (res / "tree-cost-a" / "results.json").write_text(json.dumps({"verify_cost": [
        {"nodes": 16, "ratio": 1.4, "served_ratio": 1.25}, {"nodes": 32, "ratio": 1.9}]}))
    (res / "traffic-broken").mkdir()
    (res / "traffic-broken" / "results.json").write_text("{not json")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "issue19_targets.py"), "--results", str(res),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "targets.json").read_text())
    assert len(data["gsm8k"]) == 3 and len(data["traffic"]) == 2 and len(data["tree"]) == 1
    traffic = {r["run"]: r for r in data["traffic"]}
    assert abs(traffic["traffic-a"]["geomean"] - 1.7) < 1e-9 and traffic["traffic-a"]["http"]
    assert traffic["traffic-b"]["worst_category"] == "science" and traffic["traffic-b"]["worst_ratio"] == 0.9
    assert abs(traffic["traffic-b"]["geomean"] - (1.8 ** 5 * 0.9) ** (1 / 6)) < 1e-9   # its T=1 row left out
    assert data["tree"][0] == {"run": "tree-cost-a", "nodes_16": 1.25, "nodes_32": 1.9}   # as served where measured
    md = (out / "targets.md").read_text()
    assert "| gsm8k-a-t0 | 0 | 20.0 | 2.30x (met) | 1.50x | 0.720 / 0.620 |" in md
    assert "| gsm8k-a-t1 | 1 | 20.0 | 1.10x | 1.90x (met) |" in md
    assert "| gsm8k-b-t0 | 0 | 20.0 | 1.40x | 1.60x |" in md      # neither kind reaches 2.2x: nothing marked
    assert "better kind met 2.2x in 1 (best 2.30x); per-token acceptance met 0.7 in 1" in md
    assert "MJSD met 1.8x in 1" in md
    assert "| traffic-a | HTTP | 6 | 1.70x (met) | maths 1.70x |" in md
    assert "science 0.90x (below the floor)" in md and "both met in 1; the floor held in 1" in md
    assert "| tree-cost-a | 1.25x (met) | 1.90x |" in md
    assert (out / "targets.png").stat().st_size > 0


def test_targets_table_says_what_to_fix_when_there_is_nothing_to_read(tmp_path):
    script = str(ROOT / "scripts" / "issue19_targets.py")
    proc = subprocess.run([sys.executable, script, "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a folder of saved runs" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, script, "--results", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no GSM8K, traffic-mix or tree-cost results" in proc.stderr
