"""Hot-swap benchmark: draft promotions and a rollback under continuous load, on a real local Ray.

    .venv/bin/python scripts/bench_hotswap.py [--seconds 60] [--clients 4] [--swaps 3] [--replicas 2]
        [--target DIR --base-draft DIR] [--out docs/results/hotswap]

Starts the Ray Serve app (deploy/app.py) with --replicas replicas in a fresh data directory (its own
MLflow SQLite store), registers --base-draft as version 1 and promotes it, then runs --clients clients
(streaming and non-streaming completions, MJSD and speculative) for --seconds. During the load it
registers --swaps LoRA candidates (random small adapters on the base: the swap mechanics, not their
quality, are measured) and promotes them one by one, then rolls back once through
`POST /v1/admin/rollback`. For each alias move it records how long until every replica's /health
reports the new version. Default models: the tiny test models (seconds to load); pass the default
target and data/drafts/bootstrap for the real pair.
Reports: requests, failures (any non-200 or error event), versions seen in responses, swap lags.
Writes bench_hotswap.json / .md / .png into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_lora_candidate(folder: Path, base: Path, parent: str, target: str, seed: int) -> Path:
    """A candidate folder (docs/architecture.md layout) with a random small LoRA adapter on `base`."""
    from tests.deploy_helpers import make_candidate

    return make_candidate(folder, base, parent_version=parent, seed=seed, target=target)


def replica_versions(url: str, tries: int = 12) -> dict[str, str]:
    import httpx

    seen: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(tries):
            h = c.get("/health").json()
            seen[h["replica"]] = h["draft_version"]
    return seen


def wait_all_on(url: str, version: str, replicas: int, timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        seen = replica_versions(url)
        if len(seen) >= replicas and set(seen.values()) == {version}:
            return time.monotonic() - t0
        time.sleep(0.2)
    return float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--target", default=None, help="target folder (default: a tiny test model)")
    ap.add_argument("--base-draft", type=Path, default=None, help="base draft folder (default: a tiny test draft)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "hotswap")
    args = ap.parse_args()

    import httpx
    import ray
    from ray import serve

    from tests import deploy_helpers as dh
    from tests import tiny_models
    from tests.api_helpers import free_port

    work = Path(tempfile.mkdtemp(prefix="hotswap-"))
    os.environ["DRAFTSMITH_DATA"] = str(work / "data")
    os.environ["DRAFTSMITH_CACHE"] = str(work / "cache")
    from deploy.registry import Registry
    from deploy.app import APP_NAME, build, start_hub
    from serving.metrics import HUB_NAMESPACE
    from serving.service import ServiceSettings

    if args.target is None:
        target, _ = tiny_models.save_pair(work / "models")
        base = dh.make_base_draft(work / "base")
    else:
        target, base = Path(args.target), args.base_draft
    uri = dh.fresh_store(dh.template_db(work), work / "data")
    reg = Registry(str(target), name="hotswap-drafts", tracking_uri=uri)
    v1 = reg.register_base(base, description="hotswap base")
    reg.promote(v1, reason="bench")
    settings = ServiceSettings(target=str(target), registry_model="hotswap-drafts", tracking_uri=uri,
                               redis_url="redis://127.0.0.1:6379/0", buffer_prefix=f"bench:hotswap:{os.getpid()}",
                               served_model_name="m", watch_interval_s=0.5, torch_threads=1)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), namespace=HUB_NAMESPACE, include_dashboard=False,
             log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start_hub(settings)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(settings, replicas=args.replicas, num_cpus=0.5), name=APP_NAME, route_prefix="/")
    print(f"[hotswap] {args.replicas} replicas up at {url}; waiting for version {v1}", flush=True)
    wait_all_on(url, v1, args.replicas, 120)

    results, stop, t_zero = [], threading.Event(), time.monotonic()
    lock = threading.Lock()

    def client(i: int):
        n = 0
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                n += 1
                body = {"prompt": f"client {i} request {n}", "max_tokens": args.max_tokens, "temperature": 0.7,
                        "speculative": {"mode": "mjsd" if n % 2 else "speculative"}}
                version, ok, t = None, False, time.monotonic() - t_zero
                try:
                    if n % 3 == 0:
                        r = c.post("/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}})
                        evs = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                        ok = r.status_code == 200 and evs and not any("error" in e for e in evs)
                        version = evs[-1]["metrics"]["speculative_decoding"]["draft_version"] if ok else None
                    else:
                        r = c.post("/v1/completions", json=body)
                        ok = r.status_code == 200
                        version = r.json()["metrics"]["speculative_decoding"]["draft_version"] if ok else None
                    status = r.status_code
                except Exception as e:  # noqa: BLE001 - a failure, counted
                    status = f"{type(e).__name__}"
                with lock:
                    results.append({"t": t, "ok": bool(ok), "status": status, "version": version})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for th in threads:
        th.start()
    moves = []
    gap = args.seconds / (args.swaps + 2)
    for j in range(args.swaps):
        time.sleep(gap)
        cand = reg.register_candidate(make_lora_candidate(work / f"cand{j}", base, v1, str(reg.target), j))
        t = time.monotonic() - t_zero
        reg.promote(cand, reason="bench swap")
        lag = wait_all_on(url, cand, args.replicas)
        moves.append({"action": "promote", "version": cand, "t": t, "lag_s": lag})
        print(f"[hotswap] promoted {cand}: all replicas on it after {lag:.1f} s", flush=True)
    time.sleep(gap / 2)
    t = time.monotonic() - t_zero
    r = httpx.post(url + "/v1/admin/rollback", json={"reason": "bench rollback"}, timeout=60).json()
    lag = wait_all_on(url, r["champion"], args.replicas)
    moves.append({"action": "rollback", "version": r["champion"], "t": t, "lag_s": lag})
    print(f"[hotswap] rolled back to {r['champion']}: all replicas on it after {lag:.1f} s", flush=True)
    time.sleep(max(0.0, args.seconds - (time.monotonic() - t_zero)))
    stop.set()
    for th in threads:
        th.join(timeout=120)
    serve.shutdown()
    ray.shutdown()

    failed = [x for x in results if not x["ok"]]
    by_version: dict[str, int] = {}
    for x in results:
        if x["version"]:
            by_version[x["version"]] = by_version.get(x["version"], 0) + 1
    report = {"seconds": time.monotonic() - t_zero, "clients": args.clients, "replicas": args.replicas,
              "requests": len(results), "failed": len(failed), "failures": failed[:10],
              "responses_per_version": by_version, "moves": moves,
              "max_lag_s": max(m["lag_s"] for m in moves)}
    lines = [f"{report['requests']} requests from {args.clients} clients over {report['seconds']:.0f} s on "
             f"{args.replicas} replicas: **{report['failed']} failed**.", "",
             "| move | version | at (s) | all replicas on it after (s) |", "|---|---|---:|---:|"]
    lines += [f"| {m['action']} | {m['version']} | {m['t']:.1f} | {m['lag_s']:.2f} |" for m in moves]
    lines += ["", "Responses per draft version: " + ", ".join(f"v{k}: {v}" for k, v in sorted(by_version.items()))]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_hotswap.json").write_text(json.dumps(report, indent=2))
    (args.out / "bench_hotswap.md").write_text(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    versions = sorted(by_version, key=lambda v: int(v) if v.isdigit() else 0)
    ax.scatter([x["t"] for x in results if x["ok"]],
               [versions.index(x["version"]) for x in results if x["ok"]], s=8, label="response (draft version)")
    if failed:
        ax.scatter([x["t"] for x in failed], [-0.5] * len(failed), color="red", marker="x", label="failed")
    for m in moves:
        ax.axvline(m["t"], color="gray", ls="--", lw=0.8)
        ax.text(m["t"], len(versions) - 0.6, f"{m['action']} v{m['version']}", fontsize=7, rotation=90)
    ax.set_yticks(range(len(versions)), [f"v{v}" for v in versions])
    ax.set_xlabel("seconds")
    ax.set_title("draft version of each response under load (dashed: alias moves)")
    fig.tight_layout()
    fig.savefig(args.out / "bench_hotswap.png", dpi=110)
    print(f"wrote {args.out}/bench_hotswap.json, .md, .png")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
