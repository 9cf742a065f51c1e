"""Bounded history (issue 15, item 3): cold materialisation time of the champion after a chain of N promoted
versions, with squashing (every chain <= K adapters) and without (one adapter per version on version 1).

Two real MLflow SQLite stores in a temporary folder hold the same history: a base draft (version 1, random
weights, a small Llama: --hidden/--layers/--vocab) and N-1 LoRA candidates (rank 8 on q/k/v/o, random
non-zero weights), each registered on the one before and promoted, in both registries: one with
`max_chain_depth=K`, one with squashing off (K = 10**6). Then, --repeats times, the draft cache is emptied
and `Registry.materialize(champion)` timed (a replica starting cold); `verify` of the champion is timed with
the verified record (a swap) and with `full=True`; registration and promotion times and the artifact store
size are reported too, since squashing moves work to registration and stores a full draft every K+1
versions. The drafts are tiny random models: the figures show how the costs scale with the chain, not what
a real draft costs. Output: a JSON summary and a table (stdout, and --out/raw.txt + results.json).

    .venv/bin/python scripts/bench_history.py --versions 12 --k 4 --out docs/results/history
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_base(folder: Path, hidden: int, layers: int, vocab: int, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "draftsmith.json").write_text(json.dumps({"output_token_ids": None, "built_by": "bench_history"}))
    return folder


def make_candidate(folder: Path, base: Path, parent: str, seed: int, rank: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(folder / "adapter")
    (folder / "candidate.json").write_text(json.dumps({
        "parent_version": parent, "base_draft_path": str(base), "target": "bench-target", "loss": "jsd",
        "train_config": {"lora": {"r": rank}}, "data_window": {"last_id": f"1700000000000-{seed}"},
        "metrics": {"offline_acceptance_before": 0.4, "offline_acceptance_after": 0.5}}))
    return folder


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=12, help="versions in the history, the base included")
    ap.add_argument("--k", type=int, default=4, help="max adapter chain depth with squashing")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from deploy.registry import Registry

    work = Path(tempfile.mkdtemp(prefix="bench-history-"))
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    try:
        base = make_base(work / "base", args.hidden, args.layers, args.vocab, seed=1)
        say(f"draft: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
            f"{tree_bytes(base) / 1e6:.1f} MB; LoRA rank {args.rank} on q/k/v/o; {args.versions} versions; "
            f"torch threads {args.threads}; {torch.__version__}")
        regs = {}
        for label, k in (("squash", args.k), ("no squash", 10 ** 6)):
            root = work / label.replace(" ", "-")
            regs[label] = Registry("bench-target", tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                   cache_root=root / "cache", candidates_root=root / "candidates",
                                   max_chain_depth=k, auto_gc=False)
        timing = {label: {"register_s": [], "promote_s": []} for label in regs}
        for label, reg in regs.items():
            assert reg.register_base(base, target_sha256="0" * 64) == "1"
            reg.promote("1")
        for i in range(2, args.versions + 1):
            cand = make_candidate(work / "cands" / f"c{i}", base, str(i - 1), seed=i, rank=args.rank)
            for label, reg in regs.items():
                t = time.perf_counter()
                v = reg.register_candidate(cand)
                timing[label]["register_s"].append(time.perf_counter() - t)
                t = time.perf_counter()
                reg.promote(v)
                timing[label]["promote_s"].append(time.perf_counter() - t)
                assert v == str(i)
        results = {"config": vars(args) | {"out": str(args.out) if args.out else None},
                   "load_average_before": os.getloadavg(), "registries": {}}
        cold: dict[str, list[float]] = {label: [] for label in regs}
        for _ in range(args.repeats):                    # interleaved, so CPU contention hits both alike
            for label, reg in regs.items():
                shutil.rmtree(reg.cache_root, ignore_errors=True)
                t = time.perf_counter()
                reg.materialize(reg.champion())
                cold[label].append(time.perf_counter() - t)
        deepest = {label: max((v.version for v in reg.versions()), key=lambda v, reg=reg: (reg.chain_depth(v), int(v)))
                   for label, reg in regs.items()}
        cold_deep: dict[str, list[float]] = {label: [] for label in regs}
        for _ in range(args.repeats):                    # the worst case: a version at the deepest chain (K)
            for label, reg in regs.items():
                shutil.rmtree(reg.cache_root, ignore_errors=True)
                t = time.perf_counter()
                reg.materialize(deepest[label])
                cold_deep[label].append(time.perf_counter() - t)
        results["load_average_after"] = os.getloadavg()
        for label, reg in regs.items():
            champ = reg.champion()
            chain = reg.chain(champ)
            depths = [reg.chain_depth(v.version) for v in reg.versions()]
            reg.materialize(champ, verify=True)          # every version of the chain now in the verified record
            swap, full = [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                hashed = reg.verify(champ)
                swap.append(time.perf_counter() - t)
                t = time.perf_counter()
                hashed_full = reg.verify(champ, full=True)
                full.append(time.perf_counter() - t)
            store = tree_bytes(reg.artifact_root)
            r = {"champion": champ, "chain": chain, "versions_read_cold": len(chain), "max_depth": max(depths),
                 "squashed_versions": [v.version for v in reg.versions() if v.squashed_from],
                 "cold_materialize_s": [round(x, 3) for x in cold[label]],
                 "cold_materialize_median_s": round(statistics.median(cold[label]), 3),
                 "cold_materialize_min_s": round(min(cold[label]), 3),
                 "deepest_version": deepest[label], "deepest_chain": reg.chain(deepest[label]),
                 "deepest_cold_median_s": round(statistics.median(cold_deep[label]), 3),
                 "verify_swap_s": round(statistics.median(swap), 4), "verify_swap_hashed": hashed,
                 "verify_full_s": round(statistics.median(full), 4), "verify_full_hashed": len(hashed_full),
                 "register_s_mean": round(statistics.mean(timing[label]["register_s"]), 3),
                 "register_s_max": round(max(timing[label]["register_s"]), 3),
                 "promote_s_mean": round(statistics.mean(timing[label]["promote_s"]), 3),
                 "artifact_store_mb": round(store / 1e6, 1)}
            results["registries"][label] = r
        say(f"load average (1/5/15 min) before / after the timed runs: "
            f"{'/'.join(f'{x:.1f}' for x in results['load_average_before'])} / "
            f"{'/'.join(f'{x:.1f}' for x in results['load_average_after'])} on {os.cpu_count()} CPUs")
        say("")
        say(f"{'':10} {'versions read':>13} {'max depth':>9} {'cold s median':>13} {'cold s min':>10} "
            f"{'verify swap s':>13} {'verify full s':>13} {'register s mean/max':>19} {'store MB':>8}")
        for label, r in results["registries"].items():
            say(f"{label:10} {r['versions_read_cold']:>13} {r['max_depth']:>9} {r['cold_materialize_median_s']:>13.3f} "
                f"{r['cold_materialize_min_s']:>10.3f} {r['verify_swap_s']:>13.4f} {r['verify_full_s']:>13.4f} "
                f"{r['register_s_mean']:>9.3f}/{r['register_s_max']:<9.3f} {r['artifact_store_mb']:>8.1f}")
        for label, r in results["registries"].items():
            say(f"{label}: cold runs (s) {', '.join(f'{x:.3f}' for x in r['cold_materialize_s'])}; the deepest "
                f"version {r['deepest_version']} ({len(r['deepest_chain'])} versions read) cold: "
                f"{r['deepest_cold_median_s']:.3f} s median")
        sq, flat = results["registries"]["squash"], results["registries"]["no squash"]
        say(f"\nsquashed versions: {', '.join(sq['squashed_versions']) or 'none'}; champion chain with squash "
            f"{' -> '.join(sq['chain'])}, without {' -> '.join(flat['chain'])}")
        say(f"cold materialisation (median): {flat['cold_materialize_median_s']:.3f} s -> "
            f"{sq['cold_materialize_median_s']:.3f} s ({flat['cold_materialize_median_s'] / sq['cold_materialize_median_s']:.1f}x "
            f"faster with squash; min {flat['cold_materialize_min_s']:.3f} s -> {sq['cold_materialize_min_s']:.3f} s)")
        print(json.dumps(results, indent=1))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "raw.txt").write_text("\n".join(lines) + "\n")
            (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
