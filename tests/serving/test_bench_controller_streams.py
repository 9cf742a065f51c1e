"""scripts/bench_controller_streams.py: the controller replayed on synthetic acceptance streams (no model)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_streams_smoke_writes_its_table_and_drafts_where_drafting_pays(tmp_path):
    out = tmp_path / "streams"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_controller_streams.py"), "--requests", "6",
                           "--seeds", "1", "--strengths", "4", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "streams.json").read_text())
    rows = {(r["strength"], r["stream"]): r for r in data["rows"]}
    assert len(rows) == 2 * 6
    for s in (4.0, 8.0):
        good, hopeless = rows[(s, "steady 0.45 then 0.30")], rows[(s, "hopeless 0.03")]
        assert good["plain_share"] < 0.1 and good["ratio_to_target"] > 1.2
        assert hopeless["plain_share"] > 0.8 and 0.95 < hopeless["ratio_to_target"] < 1.01
    assert "| steady 0.30 then 0.10 |" in (out / "streams.md").read_text()
    # two categories, at the served strength: priors pooled and per category
    cats = {(r["stream"], r["priors"]): r for r in data["category_rows"]}
    assert len(cats) == 4
    for priors in ("pooled", "per category"):
        row = cats[("deep 0.60/0.50 and hopeless 0.03", priors)]
        assert row["category_0_ratio"] > 1.2            # the deep category drafts either way
    # with its own prior, the hopeless category is not dragged into drafting by the deep one: near plain speed
    assert cats[("deep 0.60/0.50 and hopeless 0.03", "per category")]["category_1_ratio"] > 0.95
    assert "| per category |" in (out / "streams.md").read_text()
    assert (out / "streams.png").stat().st_size > 0


def test_streams_rejects_a_bad_strength(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_controller_streams.py"), "--strengths", "0",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--strengths must be > 0" in proc.stderr
