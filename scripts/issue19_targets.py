"""Issue 19's targets re-read over every saved run, one row per run: where each speed target stands across hosts.

    .venv/bin/python scripts/issue19_targets.py --out docs/results/issue19-targets
    .venv/bin/python scripts/issue19_targets.py --results /tmp/some-results --out /tmp/t19   # any folder of runs

Each session measured on whatever host it drew (bf16 or fp32, AMX or not, 8-39 target tok/s), so one session's
figures say little about the targets; this table reads every saved result folder under --results:

- GSM8K held-out (`scripts/bench_decode.py` JSON: folders named `*gsm8k*`): per run and temperature, the speed-up
  over target-only of each drafter kind the served default chooses between (mode medusa: the heads; mode mjsd: the
  draft) and their per-token acceptance (accepted / proposed per drafted token, the speed-up formula's alpha).
  Targets: the better kind >= 2.2x at T=0, MJSD >= 1.8x at T=1, per-token acceptance >= 0.7 at T=0.
- The traffic mix (`scripts/bench_traffic.py`: `results.json` in process, `http_results.json` through HTTP):
  the served default's geometric mean over the six categories at T=0 (target >= 1.6x) and its worst category
  (floor 0.97x).
- Tree verification cost (`scripts/bench_tree.py --cost-only`: folders named `tree-cost*`): one verification pass of
  16 and of 32 tree nodes over a one-token step, as served where the run measured it (target <= 1.3x).

Writes targets.md, targets.json and targets.png (GSM8K and traffic ratios per run against their targets) into --out.
A run missing a figure shows "-"; nothing is averaged across hosts.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

GSM8K_T0, MJSD_T1, ACCEPTANCE, TRAFFIC, FLOOR, TREE = 2.2, 1.8, 0.7, 1.6, 0.97, 1.3
KINDS = ("medusa", "mjsd")


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def gsm8k_rows(results: Path) -> list[dict]:
    """One row per (run folder, temperature): speed-up and per-token acceptance of each drafter kind."""
    rows = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and "gsm8k" in p.name):
        for path in sorted(folder.glob("*.json")):
            data = _load(path)
            if not data or not isinstance(data.get("rows"), list):
                continue
            m = re.search(r"\bT=([\d.]+)", str(data.get("setup", "")))
            if not m:
                continue
            modes = {r.get("mode"): r for r in data["rows"] if isinstance(r, dict)}
            row = {"run": folder.name, "temperature": float(m.group(1)),
                   "target_tokens_per_s": (modes.get("target") or {}).get("tokens_per_s")}
            for kind in KINDS:
                if kind in modes:
                    row[f"{kind}_speedup"] = modes[kind].get("speedup")
                    row[f"{kind}_token_acceptance"] = modes[kind].get("token_acceptance")
            if any(f"{k}_speedup" in row for k in KINDS):
                rows.append(row)
    return rows


def traffic_rows(results: Path) -> list[dict]:
    """One row per traffic-mix run at T=0: the served default's geometric mean and worst category over target-only."""
    rows = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and p.name.startswith("traffic")):
        for name, http in (("results.json", False), ("http_results.json", True)):
            data = _load(folder / name)
            if not data or not isinstance(data.get("summary"), list):
                continue
            ratios = {}
            for s in data["summary"]:
                if not isinstance(s, dict) or s.get("mode") != "default" or s.get("ratio_to_target") is None:
                    continue
                temp = s.get("temperature", (data.get("args") or {}).get("temperatures", [None])[0] if http else None)
                if temp is not None and float(temp) == 0.0:
                    ratios[s.get("category")] = float(s["ratio_to_target"])
            if ratios:
                geo = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
                worst = min(ratios, key=ratios.get)
                rows.append({"run": folder.name, "http": http, "categories": len(ratios), "geomean": geo,
                             "worst_category": worst, "worst_ratio": ratios[worst]})
    return rows


def tree_rows(results: Path) -> list[dict]:
    """One row per tree-cost run: a pass of 16 and of 32 nodes over a one-token step (as served where measured)."""
    rows = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and p.name.startswith("tree-cost")):
        data = _load(folder / "results.json")
        if not data or not isinstance(data.get("verify_cost"), list):
            continue
        by_nodes = {c.get("nodes"): c for c in data["verify_cost"] if isinstance(c, dict)}
        row = {"run": folder.name}
        for n in (16, 32):
            c = by_nodes.get(n)
            if c:
                row[f"nodes_{n}"] = c.get("served_ratio", c.get("ratio"))
        if len(row) > 1:
            rows.append(row)
    return rows


def _f(v, digits=2, suffix="x") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def _met(v, target, at_most=False) -> str:
    if v is None:
        return ""
    return " (met)" if (v <= target if at_most else v >= target) else ""


def render(g: list[dict], t: list[dict], tr: list[dict]) -> str:
    lines = ["# Issue 19's targets over every saved run", "",
             "One row per saved run; each ran on the host its session drew, so compare rows with care.", "",
             f"## GSM8K held-out (`scripts/bench_decode.py`): better kind >= {GSM8K_T0}x at T=0, MJSD >= {MJSD_T1}x "
             f"at T=1, per-token acceptance >= {ACCEPTANCE} at T=0", "",
             "| run | T | target tok/s | heads (medusa) | draft (mjsd) | per-token acceptance heads / draft |",
             "|---|---:|---:|---:|---:|---|"]
    for r in g:
        best = max((r.get(f"{k}_speedup") or 0.0) for k in KINDS)
        target = GSM8K_T0 if r["temperature"] == 0 else None
        cells = []
        for k in KINDS:
            v = r.get(f"{k}_speedup")
            mark = _met(v, MJSD_T1) if (k == "mjsd" and r["temperature"] == 1.0) else (
                _met(v, target) if target and v == best else "")
            cells.append(_f(v) + mark)
        acc = " / ".join(_f(r.get(f"{k}_token_acceptance"), 3, "") for k in KINDS)
        tps = r.get("target_tokens_per_s")
        lines.append(f"| {r['run']} | {r['temperature']:g} | {_f(tps, 1, '')} | {cells[0]} | {cells[1]} | {acc} |")
    t0 = [r for r in g if r["temperature"] == 0]
    t1 = [r for r in g if r["temperature"] == 1.0 and r.get("mjsd_speedup") is not None]
    best0 = max((max((r.get(f"{k}_speedup") or 0.0) for k in KINDS) for r in t0), default=None)
    best_acc = max((max((r.get(f"{k}_token_acceptance") or 0.0) for k in KINDS) for r in t0), default=None)
    lines += ["", f"Runs at T=0: {len(t0)}, better kind met {GSM8K_T0}x in "
              f"{sum(max((r.get(f'{k}_speedup') or 0) for k in KINDS) >= GSM8K_T0 for r in t0)} (best {_f(best0)}); "
              f"per-token acceptance met {ACCEPTANCE} in "
              f"{sum(max((r.get(f'{k}_token_acceptance') or 0) for k in KINDS) >= ACCEPTANCE for r in t0)} "
              f"(best {_f(best_acc, 3, '')}). Runs at T=1: {len(t1)}, MJSD met {MJSD_T1}x in "
              f"{sum(r['mjsd_speedup'] >= MJSD_T1 for r in t1)} "
              f"(best {_f(max((r['mjsd_speedup'] for r in t1), default=None))}).", "",
              f"## The traffic mix at T=0 (`scripts/bench_traffic.py`): the served default's geometric mean >= "
              f"{TRAFFIC}x, every category >= {FLOOR}x", "",
              "| run | through | categories | geometric mean | worst category |", "|---|---|---:|---:|---|"]
    for r in t:
        lines.append(f"| {r['run']} | {'HTTP' if r['http'] else 'in process'} | {r['categories']} | "
                     f"{_f(r['geomean'])}{_met(r['geomean'], TRAFFIC)} | {r['worst_category']} "
                     f"{_f(r['worst_ratio'])}{'' if r['worst_ratio'] >= FLOOR else ' (below the floor)'} |")
    both = [r for r in t if r["geomean"] >= TRAFFIC and r["worst_ratio"] >= FLOOR]
    lines += ["", f"Runs: {len(t)}; geometric mean and floor both met in {len(both)}; the floor held in "
              f"{sum(r['worst_ratio'] >= FLOOR for r in t)}.", "",
              f"## Tree verification (`scripts/bench_tree.py --cost-only`): 16-32 nodes <= {TREE}x a one-token step",
              "", "| run | 16 nodes | 32 nodes |", "|---|---:|---:|"]
    for r in tr:
        lines.append(f"| {r['run']} | {_f(r.get('nodes_16'))}{_met(r.get('nodes_16'), TREE, True)} | "
                     f"{_f(r.get('nodes_32'))}{_met(r.get('nodes_32'), TREE, True)} |")
    return "\n".join(lines) + "\n"


def plot(g: list[dict], t: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    t0 = [r for r in g if r["temperature"] == 0]
    t1 = [r for r in g if r["temperature"] == 1.0]
    ax = axes[0]
    ax.plot(range(len(t0)), [max((r.get(f"{k}_speedup") or 0) for k in KINDS) for r in t0], "o", label="better kind, T=0")
    ax.plot(range(len(t1)), [r.get("mjsd_speedup") or float("nan") for r in t1], "s", label="MJSD, T=1")
    ax.axhline(GSM8K_T0, color="C0", ls="--", lw=0.8)
    ax.axhline(MJSD_T1, color="C1", ls="--", lw=0.8)
    ax.set_title("GSM8K held-out, x target-only (dashed: targets)")
    ax.set_xlabel("saved run (name order)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(range(len(t)), [r["geomean"] for r in t], "o", label="geometric mean")
    ax.plot(range(len(t)), [r["worst_ratio"] for r in t], "v", label="worst category")
    ax.axhline(TRAFFIC, color="C0", ls="--", lw=0.8)
    ax.axhline(FLOOR, color="C1", ls="--", lw=0.8)
    ax.set_title("Traffic mix at T=0, served default x target-only")
    ax.set_xlabel("saved run (name order)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"),
                    help="the folder of saved runs (default: docs/results)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        ap.error(f"--results {results} is not a folder of saved runs")
    g, t, tr = gsm8k_rows(results), traffic_rows(results), tree_rows(results)
    if not (g or t or tr):
        ap.error(f"no GSM8K, traffic-mix or tree-cost results under {results}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "targets.json").write_text(json.dumps({"gsm8k": g, "traffic": t, "tree": tr}, indent=1))
    text = render(g, t, tr)
    (out / "targets.md").write_text(text)
    plotted = plot(g, t, out / "targets.png")
    print(text)
    print(f"[targets] {len(g)} GSM8K, {len(t)} traffic-mix and {len(tr)} tree-cost runs; wrote {out}/targets.md, "
          f"targets.json{', targets.png' if plotted else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
