"""Soak test: N streaming clients against the service for a long time; 5xx count and replica memory.

    .venv/bin/python scripts/soak.py [--url http://127.0.0.1:8000] [--clients 4] [--minutes 30]
        [--max-tokens 64] [--warmup-minutes 3] [--out docs/results/soak]

Without --url it starts `draftsmith serve` on a free port (champion draft, README defaults) and stops it at
the end. Every client sends streaming chat requests back to back (everyday, code and maths prompts from
scripts/traffic_prompts.py, temperature 0.7, the default mode). Every 15 s it samples the resident memory
(RSS) of the serving processes (the Ray Serve replica found by its process title, and the whole process
tree) and the rolling tokens/s. Reported: requests, 5xx and other failures, tokens/s, RSS after warm-up and
at the end (growth in %), in soak.json, soak.md and soak.png under --out, with log lines while it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def tree_rss(pid: int | None) -> tuple[float, float]:
    """(replica RSS, whole tree RSS) in MiB; the replica is the process whose title names ServeReplica."""
    import psutil

    procs = []
    if pid is not None:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
    else:   # an external server: every process of this user that is a Serve replica
        procs = [p for p in psutil.process_iter(["cmdline"]) if "ServeReplica" in " ".join(p.info["cmdline"] or [])]
    replica, total = 0.0, 0.0
    for p in procs:
        try:
            rss = p.memory_info().rss / 2**20
            total += rss
            if "ServeReplica" in " ".join(p.cmdline()):
                replica += rss
        except psutil.Error:
            continue
    return replica, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--warmup-minutes", type=float, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "soak")
    args = p.parse_args()
    import httpx

    from bench_load import start_server
    from traffic_prompts import messages, traffic_prompts

    prompts = [messages(pr) for cat in traffic_prompts().values() for pr in cat]
    proc, url = None, args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(f"[soak] starting draftsmith serve on port {port}", flush=True)
        proc = start_server(port)
        url = f"http://127.0.0.1:{port}"
    stop, lock = threading.Event(), threading.Lock()
    results: list[dict] = []

    def client(cid: int) -> None:
        k = 0
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                body = {"messages": prompts[(cid * 31 + k) % len(prompts)], "max_tokens": args.max_tokens, "temperature": 0.7, "stream": True,
                        "stream_options": {"include_usage": True}}
                k += 1
                t0, status, err, tokens = time.perf_counter(), None, None, 0
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        status = r.status_code
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                err = ev["error"]["message"]
                            elif ev.get("usage"):
                                tokens = ev["usage"]["completion_tokens"]
                except Exception as e:  # noqa: BLE001 - counted as a failure
                    err = f"{type(e).__name__}: {e}"
                with lock:
                    results.append({"t": time.perf_counter(), "status": status, "error": err, "tokens": tokens,
                                    "latency": time.perf_counter() - t0})

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    samples = []
    try:
        while time.perf_counter() - t_start < args.minutes * 60:
            time.sleep(15)
            now = time.perf_counter()
            rep, tot = tree_rss(proc.pid if proc else None)
            with lock:
                recent = [r for r in results if r["t"] > now - 60]
                n5 = sum(1 for r in results if r["status"] and r["status"] >= 500)
                nfail = sum(1 for r in results if r["error"] or r["status"] != 200)
                done = len(results)
            tps = sum(r["tokens"] for r in recent) / min(60.0, now - t_start)
            samples.append({"t_s": now - t_start, "replica_rss_mib": rep, "tree_rss_mib": tot, "tokens_per_s_60s": tps,
                            "requests": done, "status_5xx": n5, "failed": nfail})
            print(f"[soak] {(now - t_start) / 60:5.1f} min: {done} requests, {n5} 5xx, {nfail} failed, "
                  f"{tps:.1f} tok/s (last 60 s), replica RSS {rep:.0f} MiB, tree {tot:.0f} MiB", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
        if proc is not None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                os.killpg(proc.pid, signal.SIGKILL)
    warm = [s for s in samples if s["t_s"] >= args.warmup_minutes * 60]
    first, last = (warm[0], warm[-1]) if warm else (samples[0], samples[-1])
    key = "replica_rss_mib" if first["replica_rss_mib"] > 0 else "tree_rss_mib"
    growth = (last[key] - first[key]) / first[key] if first[key] else None
    ok = [r for r in results if r["status"] == 200 and not r["error"]]
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "requests": len(results), "ok": len(ok),
              "status_5xx": sum(1 for r in results if r["status"] and r["status"] >= 500),
              "failed": len(results) - len(ok),
              "errors": sorted({r["error"] for r in results if r["error"]})[:5],
              "tokens_per_s": sum(r["tokens"] for r in ok) / max(1e-9, time.perf_counter() - t_start),
              "rss_key": key, "rss_after_warmup_mib": first[key], "rss_end_mib": last[key],
              "rss_growth_after_warmup": growth, "samples": samples}
    table = "\n".join([
        "| clients | minutes | requests ok/all | 5xx | tokens/s | RSS after warm-up (MiB) | RSS at end (MiB) | growth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {args.clients} | {args.minutes:g} | {report['ok']}/{report['requests']} | {report['status_5xx']} "
        f"| {report['tokens_per_s']:.1f} | {first[key]:.0f} | {last[key]:.0f} | "
        f"{'-' if growth is None else f'{100 * growth:+.1f}%'} |",
        f"\nRSS of the {'Ray Serve replica process' if key == 'replica_rss_mib' else 'whole process tree'}; "
        f"warm-up: the first {args.warmup_minutes:g} minutes."])
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    (args.out / "soak.md").write_text(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ts = [s["t_s"] / 60 for s in samples]
    ax[0].plot(ts, [s[key] for s in samples], label=key.replace("_", " "))
    ax[0].axvline(args.warmup_minutes, color="gray", ls=":", label="end of warm-up")
    ax[0].set_xlabel("minutes")
    ax[0].set_ylabel("MiB")
    ax[0].legend()
    ax[1].plot(ts, [s["tokens_per_s_60s"] for s in samples])
    ax[1].set_xlabel("minutes")
    ax[1].set_ylabel("output tokens/s (last 60 s)")
    fig.tight_layout()
    fig.savefig(args.out / "soak.png", dpi=110)
    print(f"wrote {args.out}/soak.json, soak.md, soak.png")
    return 0 if report["status_5xx"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
