"""The whole loop, end to end on one machine: serve, log, distill, promote, shift domain, roll back.

    .venv/bin/python scripts/demo_loop.py --draft data/drafts/bootstrap --phase 300 --out docs/results/loop

What it does, with every component real (Ray Serve, the embedded Redis, MLflow on SQLite, the
`draftsmith` CLI), in a data directory of its own (--data, default data/demo-loop, wiped first):
1. registers --draft as the first base version and promotes it (or, with no --draft, runs
   `draftsmith bootstrap`, ~14 min);
2. starts `draftsmith serve` and waits for /health;
3. starts the scheduler, `draftsmith distill --min-records N --poll 15s`, in the background;
4. sends chat requests from prompt source A (--source-a, default gsm8k) for --phase seconds with
   --clients concurrent clients, then from source B (default gpqa) for --phase seconds;
5. waits (B traffic going on, at most --wait-promotion s) until a distilled version is champion, runs
   `draftsmith rollback` once and keeps sending B traffic for --tail seconds;
6. writes responses.jsonl, summary.json, summary.md (a table per draft version) and acceptance.png
   (acceptance rate of each response over time, rolling mean, version changes marked) into --out.

Acceptance figures come from each response's `metrics.speculative_decoding` block, i.e. what the
replica that served it measured; the same figures go to MLflow (experiment `draftsmith-live`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.prompts import load_prompts  # noqa: E402


def log(msg: str) -> None:
    print(f"[loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deploy.cli", *args]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    log(f"$ draftsmith {' '.join(args)} -> {res.returncode}: {(res.stdout + res.stderr).strip()[-400:]}")
    if check and res.returncode != 0:
        raise SystemExit(f"draftsmith {' '.join(args)} failed")
    return res


class Traffic:
    """`clients` threads sending chat completions from the current prompt source; records every response."""

    def __init__(self, url: str, clients: int, max_tokens: int, mode: str, temperature: float, api_key: str | None):
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.mode, self.temperature = mode, temperature
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.source = "none"
        self.prompts: list[str] = []
        self.records: list[dict] = []
        self.errors: list[dict] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.t0 = time.time()

    def set_source(self, source: str) -> None:
        with self.lock:
            self.source, self.prompts = source, load_prompts(source, "train")
        log(f"traffic now from {source} ({len(self.prompts)} prompts)")

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=300) as http:
            model = http.get(f"{self.url}/v1/models", headers=self.headers).json()["data"][0]["id"]
            while not self.stop.is_set():
                with self.lock:
                    source, prompt = self.source, rng.choice(self.prompts)
                body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": self.max_tokens, "temperature": self.temperature,
                        "speculative": {"mode": self.mode}}
                t = time.time()
                try:
                    r = http.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
                except httpx.HTTPError as e:
                    self.errors.append({"t": t - self.t0, "error": repr(e)})
                    continue
                if r.status_code != 200:
                    self.errors.append({"t": t - self.t0, "status": r.status_code, "body": r.text[:300]})
                    time.sleep(1)
                    continue
                data = r.json()
                sd = data.get("metrics", {}).get("speculative_decoding", {})
                self.records.append({
                    "t": round(time.time() - self.t0, 2), "source": source, "latency_s": round(time.time() - t, 3),
                    "draft_version": str(sd.get("draft_version")), "acceptance_rate": sd.get("acceptance_rate"),
                    "mean_acceptance_length": sd.get("mean_acceptance_length"),
                    "draft_tokens": sd.get("draft_tokens"), "accepted_tokens": sd.get("accepted_tokens"),
                    "completion_tokens": data.get("usage", {}).get("completion_tokens")})

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for th in self.threads:
            th.start()

    def join(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(timeout=320)


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for v in sorted({r["draft_version"] for r in records}, key=lambda x: (len(x), x)):
        for source in sorted({r["source"] for r in records if r["draft_version"] == v}):
            rs = [r for r in records if r["draft_version"] == v and r["source"] == source]
            drafted = sum(r["draft_tokens"] or 0 for r in rs)
            acc = sum(r["accepted_tokens"] or 0 for r in rs)
            toks = sum(r["completion_tokens"] or 0 for r in rs)
            rows.append({"draft_version": v, "source": source, "requests": len(rs),
                         "acceptance_rate": acc / drafted if drafted else None,
                         "tokens_per_s_per_client": toks / sum(r["latency_s"] for r in rs) if rs else None,
                         "first_t": min(r["t"] for r in rs), "last_t": max(r["t"] for r in rs)})
    return rows


def plot(records: list[dict], events: list[tuple[float, str]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    versions = sorted({r["draft_version"] for r in records}, key=lambda x: (len(x), x))
    for i, v in enumerate(versions):
        rs = [r for r in records if r["draft_version"] == v and r["acceptance_rate"] is not None]
        ax.scatter([r["t"] for r in rs], [r["acceptance_rate"] for r in rs], s=10, color=f"C{i}",
                   label=f"draft v{v}", alpha=0.6)
    rs = sorted((r for r in records if r["acceptance_rate"] is not None), key=lambda r: r["t"])
    w = 10
    if len(rs) >= w:
        ax.plot([r["t"] for r in rs[w - 1:]],
                [statistics.mean(x["acceptance_rate"] for x in rs[i - w + 1: i + 1]) for i in range(w - 1, len(rs))],
                color="black", lw=1.5, label=f"rolling mean ({w} responses)")
    for t, label in events:
        ax.axvline(t, color="gray", ls="--", lw=1)
        ax.text(t, 1.0, label, rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("seconds since traffic started")
    ax.set_ylabel("acceptance rate per response")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Live acceptance over time: distillation, domain shift, rollback")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, default=None, help="base draft folder (default: run the bootstrap)")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "demo-loop")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "loop")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--phase", type=float, default=300.0, help="seconds of traffic per prompt source")
    ap.add_argument("--tail", type=float, default=90.0, help="seconds of traffic after the rollback")
    ap.add_argument("--wait-promotion", type=float, default=300.0,
                    help="after the second phase, keep its traffic up to this long until a distilled version "
                         "is champion, then roll back")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="speculative")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-records", type=int, default=300, help="scheduler: distill after this many new steps")
    ap.add_argument("--margin", type=float, default=0.01, help="gate margin on offline acceptance")
    ap.add_argument("--source-a", default="gsm8k")
    ap.add_argument("--source-b", default="gpqa")
    ap.add_argument("--distill-config", type=Path, default=None, help="YAML for training.job (e.g. steps)")
    args = ap.parse_args()

    shutil.rmtree(args.data, ignore_errors=True)
    args.data.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DRAFTSMITH_DATA": str(args.data.resolve()), "PYTHONUNBUFFERED": "1"}
    for k in ("REDIS_URL", "MLFLOW_TRACKING_URI", "DRAFTSMITH_API_KEY"):
        env.pop(k, None)

    if args.draft is not None:
        cli(env, "register", str(args.draft))
        cli(env, "promote", "1", "--force")
    else:
        cli(env, "bootstrap")
    procs: list[subprocess.Popen] = []
    serve_log = open(args.out / "serve.log", "w")
    procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(args.port)],
                                  env=env, cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT,
                                  start_new_session=True))
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline or procs[0].poll() is not None:
            raise SystemExit(f"the service did not come up; see {args.out / 'serve.log'}")
        time.sleep(3)
    log("service healthy")
    distill_log = open(args.out / "distill.log", "w")
    dargs = ["distill", "--min-records", str(args.min_records), "--poll", "15s", "--margin", str(args.margin)]
    if args.distill_config:
        dargs += ["--config", str(args.distill_config)]
    procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", *dargs], env=env, cwd=ROOT,
                                  stdout=distill_log, stderr=subprocess.STDOUT, start_new_session=True))
    traffic = Traffic(url, args.clients, args.max_tokens, args.mode, args.temperature, None)
    events: list[tuple[float, str]] = []
    try:
        traffic.set_source(args.source_a)
        traffic.start()
        time.sleep(args.phase)
        events.append((time.time() - traffic.t0, f"traffic -> {args.source_b}"))
        traffic.set_source(args.source_b)
        time.sleep(args.phase)
        deadline = time.time() + args.wait_promotion
        while time.time() < deadline and "champion" not in " ".join(
                line for line in cli(env, "versions", check=False).stdout.splitlines()[2:]
                if not line.split()[:1] == ["1"]):
            log("no distilled version promoted yet; more traffic from the second source")
            time.sleep(20)
        res = cli(env, "rollback", "--reason", "demo rollback", check=False)
        events.append((time.time() - traffic.t0, "rollback"))
        if res.returncode != 0:
            log("rollback refused (no previous version yet); continuing")
        time.sleep(args.tail)
    finally:
        traffic.join()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    # version changes as the responses saw them
    last = None
    for r in sorted(traffic.records, key=lambda r: r["t"]):
        if r["draft_version"] != last:
            if last is not None:
                events.append((r["t"], f"v{last} -> v{r['draft_version']}"))
            last = r["draft_version"]
    events.sort()
    rows = summarize(traffic.records)
    versions = cli(env, "versions", check=False).stdout
    with open(args.out / "responses.jsonl", "w") as f:
        for r in traffic.records:
            f.write(json.dumps(r) + "\n")
    (args.out / "summary.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows, "events": events, "errors": traffic.errors,
                                                       "versions": versions}, indent=1))
    lines = ["| draft version | source | requests | acceptance rate | tokens/s per client | seen from (s) | to (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        tps = "-" if r["tokens_per_s_per_client"] is None else f"{r['tokens_per_s_per_client']:.1f}"
        lines.append(f"| {r['draft_version']} | {r['source']} | {r['requests']} | {acc} | {tps} | "
                     f"{r['first_t']:.0f} | {r['last_t']:.0f} |")
    lines += ["", f"failed requests: {len(traffic.errors)}", "", "events: " +
              "; ".join(f"{t:.0f} s {e}" for t, e in events), "", "```", versions.strip(), "```"]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(traffic.records, events, args.out / "acceptance.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
