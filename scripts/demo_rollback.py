"""A draft degraded after promotion is rolled back automatically under load (issue 17).

    .venv/bin/python scripts/demo_rollback.py --draft data/bootstrap-draft --out docs/results/rollback
    .venv/bin/python scripts/demo_rollback.py --tiny --out /tmp/rollback     # tiny models: checks the plumbing

Every component is real (Ray Serve via `draftsmith serve`, the embedded Redis, MLflow on SQLite, the
`draftsmith` CLI), in a data directory of its own (--data, default data/demo-rollback, wiped first):
1. registers --draft as version 1 and promotes it (`draftsmith register`, `promote --force`);
2. starts `draftsmith serve` (live acceptance logged to MLflow every --live-interval s, the draft watcher
   polling every --watch-interval s) and `draftsmith watch` (the live watchdog alone, with the windows and
   evidence minimums given below: the defaults of 15 min / 2000 tokens are for production, not a demo);
3. sends requests from --clients concurrent clients for --warmup s on the good champion;
4. degrades it: materialises version 1, adds Gaussian noise (--noise x each weight tensor's std) to every
   weight matrix of a copy, registers the copy as version 2 and promotes it over the alias with
   `draftsmith promote 2 --force` (the gate is skipped, as an operator or a bad pipeline could);
5. keeps the clients going until the watchdog has moved the champion back (at most --timeout s), then
   --tail s more;
6. writes responses.jsonl (every response: time, draft version, acceptance, latency), live.jsonl (the
   MLflow live intervals the watchdog judged), events.json, summary.md (settings, the time from the
   degradation to the rollback, to the first response served by the restored draft, failed requests, a
   table per draft version, `draftsmith status`) and acceptance.png (acceptance per response over time,
   rolling mean, degradation and rollback marked) into --out, plus serve.log and watch.log.

The times come from the registry's history (when `promote` and the watchdog's `rollback` moved the alias)
and from the responses (which draft version produced each one).
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

FALLBACK_PROMPTS = [
    "What is 17 times 23? Explain step by step.", "Write a short poem about the sea.",
    "Explain what a hash table is.", "Name three causes of the French Revolution.",
    "Write a Python function that reverses a string.", "What is the capital of Australia and why?",
    "Summarise the water cycle in three sentences.", "How does photosynthesis work?",
]


def log(msg: str) -> None:
    print(f"[rollback {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "deploy.cli", *args], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    log(f"$ draftsmith {' '.join(args)} -> {res.returncode}: {(res.stdout + res.stderr).strip()[-300:]}")
    if check and res.returncode != 0:
        raise SystemExit(f"draftsmith {' '.join(args)} failed")
    return res


class Traffic:
    """`clients` threads sending chat completions; every response and every failure is recorded."""

    def __init__(self, url: str, clients: int, max_tokens: int, mode: str, temperature: float, prompts: list[str]):
        self.url, self.clients, self.max_tokens, self.mode, self.temperature = url, clients, max_tokens, mode, temperature
        self.prompts = prompts
        self.records: list[dict] = []
        self.errors: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.time()

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=600) as http:
            model = http.get(f"{self.url}/v1/models").json()["data"][0]["id"]
            while not self.stop.is_set():
                body = {"model": model, "messages": [{"role": "user", "content": rng.choice(self.prompts)}],
                        "max_tokens": self.max_tokens, "temperature": self.temperature,
                        "speculative": {"mode": self.mode}}
                t = time.time()
                try:
                    r = http.post(f"{self.url}/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    self.errors.append({"t": round(t - self.t0, 2), "client": i, "error": repr(e)})
                    continue
                if r.status_code != 200:
                    self.errors.append({"t": round(t - self.t0, 2), "client": i, "status": r.status_code,
                                        "body": r.text[:300]})
                    continue
                data = r.json()
                sd = data.get("metrics", {}).get("speculative_decoding", {})
                self.records.append({
                    "t_start": round(t - self.t0, 2), "t": round(time.time() - self.t0, 2), "client": i,
                    "latency_s": round(time.time() - t, 3), "draft_version": str(sd.get("draft_version")),
                    "draft_versions": sd.get("draft_versions"), "acceptance_rate": sd.get("acceptance_rate"),
                    "draft_tokens": sd.get("draft_tokens"), "accepted_tokens": sd.get("accepted_tokens"),
                    "completion_tokens": data.get("usage", {}).get("completion_tokens")})

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for th in self.threads:
            th.start()

    def join(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(timeout=600)


def degrade(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """A copy of draft folder `src` whose weight matrices (every floating tensor with 2+ dims) get Gaussian
    noise of `noise` x the tensor's own std: same architecture and vocabulary, poor proposals."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".draftsmith-materialized.json"))
    gen = torch.Generator().manual_seed(seed)
    files = sorted(dst.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{src} holds no .safetensors weights to perturb")
    for f in files:
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point() and t.dim() >= 2:
                x = t.float()
                tensors[name] = (x + noise * x.std() * torch.randn(x.shape, generator=gen)).to(t.dtype).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """A tiny target and a draft that is its copy (acceptance ~1), from tests/tiny_models.py."""
    from tests import tiny_models

    target = root / "tiny-target"
    tiny_models.make_model(0, layers=2, sharp=8.0).save_pretrained(target)
    tiny_models.make_tokenizer().save_pretrained(target)
    draft = root / "tiny-draft"
    shutil.copytree(target, draft)
    return target, draft


def history_time(reg, action: str, after: float) -> float | None:
    for h in reg.history():
        if h.get("action") == action and h.get("time", 0) >= after:
            return float(h["time"])
    return None


def plot(records: list[dict], events: list[tuple[float, str]], path: Path, title: str) -> None:
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
    w = 8
    if len(rs) >= w:
        ax.plot([r["t"] for r in rs[w - 1:]],
                [statistics.mean(x["acceptance_rate"] for x in rs[i - w + 1: i + 1]) for i in range(w - 1, len(rs))],
                color="black", lw=1.5, label=f"rolling mean ({w} responses)")
    for t, label in events:
        ax.axvline(t, color="red" if "degrad" in label else "green", ls="--", lw=1)
        ax.text(t, 1.0, label, rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("seconds since traffic started (response finish time)")
    ax.set_ylabel("acceptance rate per response")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, default=ROOT / "data" / "bootstrap-draft",
                    help="the good draft folder (default data/bootstrap-draft)")
    ap.add_argument("--target", default=None, help="target folder (default: the default target)")
    ap.add_argument("--tiny", action="store_true", help="tiny target and draft built here (checks the plumbing)")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "demo-rollback")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "rollback")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--mode", default="speculative")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--source", default="gsm8k", help="prompt source (training.prompts), else built-in prompts")
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds of traffic on the good champion")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up waiting for the rollback after this")
    ap.add_argument("--tail", type=float, default=45.0, help="seconds of traffic after the rollback")
    ap.add_argument("--noise", type=float, default=1.0, help="noise std relative to each weight tensor's std")
    ap.add_argument("--live-interval", type=float, default=5.0, help="s between MLflow live-stat points (serve)")
    ap.add_argument("--watch-interval", type=float, default=1.0, help="s between the replicas' alias polls")
    ap.add_argument("--watch-poll", type=float, default=2.0, help="s between watchdog looks")
    ap.add_argument("--watch-window", type=float, default=60.0, help="watchdog window, s (production: 900)")
    ap.add_argument("--watch-min-tokens", type=int, default=500, help="watchdog evidence, drafted tokens (prod: 2000)")
    ap.add_argument("--watch-min-intervals", type=int, default=3, help="watchdog evidence, live intervals")
    ap.add_argument("--rollback-tolerance", type=float, default=0.10)
    args = ap.parse_args()

    shutil.rmtree(args.data, ignore_errors=True)
    args.data.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        target, draft = tiny_pair(args.data)
        args.target, args.draft = str(target), draft
    if not Path(args.draft).is_dir():
        raise SystemExit(f"--draft {args.draft} is not a folder (build one with `draftsmith bootstrap --out ...`, "
                         "or pass --tiny to check the plumbing)")
    env = {**os.environ, "DRAFTSMITH_DATA": str(args.data.resolve()), "PYTHONUNBUFFERED": "1",
           "DRAFTSMITH_LIVE_INTERVAL_S": str(args.live_interval), "DRAFTSMITH_WATCH_INTERVAL_S": str(args.watch_interval)}
    for k in ("REDIS_URL", "MLFLOW_TRACKING_URI", "DRAFTSMITH_API_KEY", "RAY_ADDRESS"):
        env.pop(k, None)
    tgt = ["--target", str(args.target)] if args.target else []
    os.environ["DRAFTSMITH_DATA"] = env["DRAFTSMITH_DATA"]
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from deploy.registry import Registry

    reg = Registry(args.target)
    cli(env, "register", str(args.draft), *tgt)
    cli(env, "promote", "1", "--force", *tgt)

    procs: list[subprocess.Popen] = []
    serve_log = open(args.out / "serve.log", "w")
    procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(args.port),
                                   "--no-bootstrap", *tgt], env=env, cwd=ROOT, stdout=serve_log,
                                  stderr=subprocess.STDOUT, start_new_session=True))
    url = f"http://127.0.0.1:{args.port}"
    watch = ["watch", "--poll", f"{args.watch_poll}s", "--watch-window", f"{args.watch_window}s",
             "--watch-min-tokens", str(args.watch_min_tokens), "--watch-min-intervals", str(args.watch_min_intervals),
             "--rollback-tolerance", str(args.rollback_tolerance), *tgt]
    traffic = None
    events: list[tuple[float, str]] = []
    t_degraded = t_rollback = None
    try:
        deadline = time.time() + 900
        while True:
            try:
                h = httpx.get(f"{url}/health", timeout=5)
                if h.status_code == 200 and h.json().get("draft_version") == "1":
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or procs[0].poll() is not None:
                raise SystemExit(f"the service did not come up with draft version 1; see {args.out / 'serve.log'}")
            time.sleep(3)
        log("service healthy, serving draft version 1")
        procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", *watch], env=env, cwd=ROOT,
                                      stdout=open(args.out / "watch.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        try:
            from training.prompts import load_prompts

            prompts = load_prompts(args.source, "train") if not args.tiny else FALLBACK_PROMPTS
        except Exception as e:  # noqa: BLE001 - the demo is about the rollback, not the prompts
            log(f"prompt source {args.source} unavailable ({e}); built-in prompts")
            prompts = FALLBACK_PROMPTS
        traffic = Traffic(url, args.clients, args.max_tokens, args.mode, args.temperature, prompts)
        traffic.start()
        log(f"{args.clients} clients on the good champion for {args.warmup:.0f} s")
        time.sleep(args.warmup)

        good = reg.materialize("1")
        bad = degrade(good, args.data / "degraded-draft", args.noise)
        cli(env, "register", str(bad), *tgt)
        t_before = time.time()
        cli(env, "promote", "2", "--force", *tgt)
        t_degraded = history_time(reg, "promote", t_before - 1) or time.time()
        events.append((t_degraded - traffic.t0, "degraded v2 promoted"))
        log("degraded version 2 is the champion; waiting for the watchdog")
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            if reg.champion() == "1":
                t_rollback = history_time(reg, "rollback", t_degraded) or time.time()
                break
            time.sleep(0.5)
        if t_rollback is None:
            log(f"no rollback within {args.timeout:.0f} s")
        else:
            events.append((t_rollback - traffic.t0, "automatic rollback"))
            log(f"rolled back {t_rollback - t_degraded:.1f} s after the degradation; {args.tail:.0f} s more traffic")
            time.sleep(args.tail)
    finally:
        if traffic is not None:
            traffic.join()
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    if traffic is None:
        return
    records = sorted(traffic.records, key=lambda r: r["t"])
    # the first response started after the rollback that the restored draft produced alone
    first_restored = next((r for r in records if t_rollback and r["t_start"] >= t_rollback - traffic.t0
                           and set(r.get("draft_versions") or {r["draft_version"]: 1}) - {"none"} == {"1"}), None)
    status = cli(env, "status", *tgt, check=False).stdout
    info2 = reg.get("2")
    live = {v: reg.live_intervals(v) for v in ("1", "2")}
    with open(args.out / "responses.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    with open(args.out / "live.jsonl", "w") as f:
        for v, its in live.items():
            for it in its:
                f.write(json.dumps({"version": v, **it, "t": round(it["time_ms"] / 1000 - traffic.t0, 2)}) + "\n")
    settings = {k: str(v) for k, v in vars(args).items()}
    result = {
        "degradation_to_rollback_s": None if t_rollback is None else round(t_rollback - t_degraded, 2),
        "degradation_to_first_restored_response_s": None if first_restored is None else
        round(first_restored["t"] - (t_degraded - traffic.t0), 2),
        "requests_ok": len(records), "failed_requests": len(traffic.errors),
        "rollback_reason": info2.tags.get("draftsmith.rollback_reason"),
        "rollback_details": json.loads(info2.tags.get("draftsmith.rollback_details") or "null"),
    }
    (args.out / "events.json").write_text(json.dumps({"settings": settings, "result": result, "events": events,
                                                      "errors": traffic.errors}, indent=1))
    rows = ["| draft version | responses | acceptance rate | tokens/s per client |", "|---|---|---|---|"]
    for v in sorted({r["draft_version"] for r in records}, key=lambda x: (len(x), x)):
        rs = [r for r in records if r["draft_version"] == v]
        drafted = sum(r["draft_tokens"] or 0 for r in rs)
        acc = sum(r["accepted_tokens"] or 0 for r in rs)
        tps = sum(r["completion_tokens"] or 0 for r in rs) / max(1e-9, sum(r["latency_s"] for r in rs))
        rows.append(f"| {v} | {len(rs)} | {acc / drafted if drafted else float('nan'):.3f} | {tps:.1f} |")
    fmt = lambda x: "-" if x is None else f"{x:.1f} s"  # noqa: E731
    lines = [
        "# Automatic rollback of a degraded draft under load", "",
        f"- degradation -> rollback (alias moved back by the watchdog): **{fmt(result['degradation_to_rollback_s'])}**",
        f"- degradation -> first response started after the rollback and drafted by version 1 only: "
        f"{fmt(result['degradation_to_first_restored_response_s'])}",
        f"- requests: {len(records)} ok, **{len(traffic.errors)} failed**, {args.clients} clients",
        f"- rollback reason: {result['rollback_reason']}", "",
        "Settings: " + ", ".join(f"{k}={settings[k]}" for k in (
            "draft", "target", "tiny", "clients", "max_tokens", "mode", "temperature", "warmup", "noise",
            "live_interval", "watch_interval", "watch_poll", "watch_window", "watch_min_tokens",
            "watch_min_intervals", "rollback_tolerance")), "",
        *rows, "", "```", status.strip(), "```"]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(records, events, args.out / "acceptance.png",
         f"Degraded draft rolled back automatically after {fmt(result['degradation_to_rollback_s'])} "
         f"({args.clients} clients, {len(traffic.errors)} failed requests)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
