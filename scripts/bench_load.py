"""HTTP load benchmark: concurrent streaming clients against the Ray Serve app.

    .venv/bin/python scripts/bench_load.py [--url http://127.0.0.1:8000] [--clients 1 4 8] [--seconds 60]
        [--max-tokens 64] [--mode mjsd] [--engine-seconds 60] [--requests N] [--out docs/results/load]
    .venv/bin/python scripts/bench_load.py --no-http --device cuda --draft data/bootstrap-draft \
        --engine-clients 1 4 8 --engine-seconds 20       # in-process only, e.g. on a GPU (scripts/bench_gpu.sh)

Without --url it starts `draftsmith serve --port <free>` (the champion draft from the registry) and stops
it at the end. Each level runs N client threads for --seconds; each client sends streaming chat requests
(prompts from the gsm8k train split, temperature 0.7, `stream_options.include_usage`) back to back.
Reported per level: completed requests, output tokens/s (sum over clients), per-request latency and
time-to-first-token p50/p99, 5xx and other failures. Before the server starts, --engine-seconds of the
same requests run in-process through Engine (same draft, same settings, one at a time): HTTP + Ray
overhead at 1 client = 1 - (HTTP tokens/s / in-process tokens/s).

`--paired N` measures that overhead on matched work instead: with the server up and the in-process engine
(on --engine-threads, default the replica's 1 thread, recording into --engine-buffer when given) loaded
beside it, request k (prompt k, seed k, T=0.7, OpenAI's default warps) is sent in-process and over HTTP
back to back, the order alternating, so drift of the host (which moved the in-process figure by 20% between
runs of the same code) falls on both sides alike. Reported: tokens/s both ways over the same N requests,
the overhead, the median and spread of the per-pair time ratios, and how many pairs produced the same text.
Writes bench_load.json and bench_load.png to --out and prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def engine_baseline(prompts: list[str], args, threads: int | None = None, clients: int = 1) -> dict:
    """In-process tokens/s over the same requests (no HTTP, no Ray): `clients` threads send requests back to
    back to one Engine (its batch scheduler batches them), torch on `threads` threads (default: every core)."""
    import torch

    from deploy.registry import Registry
    from serving.config import SamplingParams
    from serving.engine import Engine
    from serving.protocol import OPENAI_TOP_K, OPENAI_TOP_P
    from training.prompts import chat_prompt_ids

    threads = threads or os.cpu_count() or 2
    torch.set_num_threads(threads)
    eng, version = _ENGINES.get(threads, (None, None))
    if eng is None:
        if args.draft is not None:          # a draft folder given: no registry (e.g. on a lent GPU machine)
            version, draft = "local", str(args.draft)
        else:
            reg = Registry(None)
            version = reg.champion()
            draft = str(reg.materialize(version)) if version else None
        sink = None
        if args.engine_buffer:   # record every step into a Redis buffer, as the replica does
            from buffer.redis_store import BufferConfig, ReplayBufferWriter

            sink = ReplayBufferWriter(args.engine_buffer, BufferConfig(prefix=BENCH_BUFFER_PREFIX))
        eng = Engine.from_paths(None, draft, draft_version=version or "none", device=args.device, sink=sink)
        if args.medusa_heads is not None:      # the served default drafts with them where they pay
            eng.load_heads(args.medusa_heads, version="local")
        eng.batch_trees = not args.solo_trees
        # clients cycle 200 prompts, so a store that learned the run's answers would replay a prompt's own
        # earlier answer at the next level: the store stays empty (heads and prompt lookup only)
        eng.suffix_learn = False
        _ENGINES[threads] = (eng, version)
    spec = _spec(eng, args)
    for j in range(2):   # warm-up (first calls pay for kernel selection and allocations)
        eng.generate_all(chat_prompt_ids(eng.tokenizer, prompts[-1 - j]), SamplingParams(max_tokens=8, seed=j), spec)
    lock, stop = threading.Lock(), threading.Event()
    results: list[dict] = []
    limit = args.requests if clients == 1 else None   # a fixed list of requests: the same ones as over HTTP

    def client(cid: int) -> None:
        k = 0
        while not stop.is_set() and (limit is None or k < limit):
            ids = chat_prompt_ids(eng.tokenizer, prompts[(cid * 997 + k) % len(prompts)])
            t0, ttft, n = time.perf_counter(), None, 0
            # what the HTTP clients below send: T=0.7 and no top_k / top_p, i.e. OpenAI's defaults (no top-k,
            # top_p 1), not SamplingParams' own MJSD-paper warp (top-k 20, top-p 0.9), which is sharper and
            # accepts more draft tokens
            sp = SamplingParams(temperature=0.7, top_k=OPENAI_TOP_K, top_p=OPENAI_TOP_P, max_tokens=args.max_tokens)
            for out in eng.generate(ids, sp, spec):
                if out.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(out.token_ids)
            with lock:
                results.append({"start": t0, "end": time.perf_counter(), "ttft": ttft, "tokens": n})
            k += 1

    eng.scheduler.batch_sizes.clear()
    workers = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    if limit is None:
        time.sleep(args.engine_seconds)
        stop.set()
    for w in workers:
        w.join(timeout=None if limit else 300)
    dt = max(r["end"] for r in results) - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    sizes = dict(eng.scheduler.batch_sizes)
    mean_batch = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
    print(f"[engine] {threads} threads, {clients} clients: {len(results)} requests, {tokens} tokens in {dt:.1f} s: "
          f"{tokens / dt:.1f} tok/s, TTFT p50 {pct(ttft, 0.5)}, mean batch {mean_batch:.2f} (draft {version})", flush=True)
    torch.set_num_threads(os.cpu_count() or 2)
    return {"requests": len(results), "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
            "draft_version": version, "threads": threads, "clients": clients, "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "mean_batch_rows": mean_batch,
            "latency_p50_s": pct([r["end"] - r["start"] for r in results], 0.5)}


def _spec(eng, args):
    """The SpecParams of --mode on `eng`: 'default' is what the service serves a request that names no mode
    (serving/config.py `served_mode`: medusa with --medusa-heads, else mjsd); target-only without a draft."""
    from serving.config import AUTO_MODE, SpecParams, served_knobs, served_mode

    mode, knobs = args.mode, {}
    if mode == "default":
        mode = served_mode(AUTO_MODE, has_draft=eng.draft is not None, has_heads=args.medusa_heads is not None,
                           has_eagle=False)
        knobs = served_knobs(mode)
    return SpecParams(mode=mode if eng.draft is not None else "target", extra=knobs)


_ENGINES: dict = {}
BENCH_BUFFER_PREFIX = "draftsmith-bench-load"   # --engine-buffer: the in-process engines' records, deleted at the end


def drop_engines(args) -> None:
    """Close the in-process engines' buffer writers, forget the engines, and delete their --engine-buffer records."""
    for eng, _ in _ENGINES.values():
        if eng.sink is not None:
            eng.sink.close()
    _ENGINES.clear()
    if args.engine_buffer:
        from buffer.redis_store import delete_prefix

        delete_prefix(args.engine_buffer, BENCH_BUFFER_PREFIX)


def run_level(url: str, n: int, prompts: list[str], args) -> dict:
    import httpx

    results, stop = [], threading.Event()
    lock = threading.Lock()

    limit = args.requests if n == 1 else None   # a fixed list of requests: the same ones as in-process

    def client(cid: int):
        k = 0
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set() and (limit is None or k < limit):
                body = {"messages": [{"role": "user", "content": prompts[(cid * 997 + k) % len(prompts)]}],
                        "max_tokens": args.max_tokens, "temperature": 0.7, "stream": True,
                        "stream_options": {"include_usage": True}, **speculative_field(args.mode)}
                k += 1
                t0 = time.perf_counter()
                ttft, tokens, status, err, version = None, 0, None, None, None
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        status = r.status_code
                        if status != 200:       # an OpenAI-style error body, not a stream
                            err = f"HTTP {status}: {r.read().decode(errors='replace')[:200]}"
                        for line in r.iter_lines() if status == 200 else ():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                err = ev["error"]["message"]
                                continue
                            if ev.get("choices") and ev["choices"][0]["delta"].get("content") and ttft is None:
                                ttft = time.perf_counter() - t0
                            if ev.get("usage"):
                                tokens = ev["usage"]["completion_tokens"]
                                version = ev["metrics"]["speculative_decoding"]["draft_version"]
                except Exception as e:  # noqa: BLE001 - counted as a failure
                    err = f"{type(e).__name__}: {e}"
                end = time.perf_counter()
                with lock:
                    results.append({"start": t0, "end": end, "ttft": ttft, "tokens": tokens, "status": status,
                                    "error": err, "draft_version": version})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    if limit is None:
        time.sleep(args.seconds)
        stop.set()
    for t in threads:
        t.join(timeout=None if limit else 300)
    t_end = max([r["end"] for r in results] + ([] if limit else [t_start + args.seconds]))
    ok = [r for r in results if r["status"] == 200 and r["error"] is None]
    lat = [r["end"] - r["start"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    out = {"clients": n, "requests": len(results), "ok": len(ok),
           "status_5xx": sum(1 for r in results if r["status"] and r["status"] >= 500),
           "failed": len(results) - len(ok), "tokens": sum(r["tokens"] for r in ok),
           "seconds": t_end - t_start, "latency_p50_s": pct(lat, 0.5), "latency_p99_s": pct(lat, 0.99),
           "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
           "errors": sorted({r["error"] for r in results if r["error"]})[:5]}
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    print(f"[load] {n} clients: {out['ok']}/{out['requests']} ok, {out['tokens_per_s']:.1f} tok/s, "
          f"latency p50 {out['latency_p50_s']}, ttft p50 {out['ttft_p50_s']}", flush=True)
    return out


def paired_overhead(url: str, prompts: list[str], args) -> dict:
    """HTTP + Ray overhead at one client on matched, interleaved work (see the module docstring)."""
    import httpx
    import torch

    threads = (args.engine_threads or [1])[0]
    engine_baseline(prompts[:2], _warm_args(args), threads)   # loads the engine on `threads` and warms it
    torch.set_num_threads(threads)
    eng, _ = _ENGINES[threads]
    from serving.config import SamplingParams
    from serving.protocol import OPENAI_TOP_K, OPENAI_TOP_P
    from training.prompts import chat_prompt_ids

    spec = _spec(eng, args)

    def in_process(k: int) -> tuple[float, int, str]:
        ids = chat_prompt_ids(eng.tokenizer, prompts[k % len(prompts)])
        sp = SamplingParams(temperature=0.7, top_k=OPENAI_TOP_K, top_p=OPENAI_TOP_P, max_tokens=args.max_tokens,
                            seed=k)
        t0, out = time.perf_counter(), []
        for o in eng.generate(ids, sp, spec):
            out.extend(o.token_ids)
        return time.perf_counter() - t0, len(out), eng.tokenizer.decode(out, skip_special_tokens=True)

    def over_http(c, k: int) -> tuple[float, int, str]:
        body = {"messages": [{"role": "user", "content": prompts[k % len(prompts)]}], "max_tokens": args.max_tokens,
                "temperature": 0.7, "seed": k, "stream": True, "stream_options": {"include_usage": True},
                **speculative_field(args.mode)}
        t0, text, tokens = time.perf_counter(), [], 0
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(ev["error"]["message"])
                if ev.get("choices"):
                    text.append(ev["choices"][0]["delta"].get("content") or "")
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
        return time.perf_counter() - t0, tokens, "".join(text)

    pairs = []
    with httpx.Client(base_url=url, timeout=300) as c:
        for k in range(-2, args.paired):   # two unmeasured pairs first: the replica's first requests warm it
            kk = k % len(prompts)
            if k % 2 == 0:
                a = in_process(kk)
                b = over_http(c, kk)
            else:
                b = over_http(c, kk)
                a = in_process(kk)
            if k < 0:
                continue
            pairs.append({"k": k, "in_process_s": a[0], "in_process_tokens": a[1], "http_s": b[0],
                          "http_tokens": b[1], "same_text": a[2].strip() == b[2].strip()})
            if (k + 1) % 8 == 0:
                print(f"[paired] {k + 1}/{args.paired} pairs", flush=True)
    torch.set_num_threads(os.cpu_count() or 2)
    ti = sum(p["in_process_tokens"] for p in pairs) / sum(p["in_process_s"] for p in pairs)
    th = sum(p["http_tokens"] for p in pairs) / sum(p["http_s"] for p in pairs)
    # per pair: HTTP seconds per token over in-process seconds per token (1.0 = no overhead)
    ratios = sorted((p["http_s"] / max(1, p["http_tokens"])) / (p["in_process_s"] / max(1, p["in_process_tokens"]))
                    for p in pairs)
    out = {"pairs": pairs, "threads": threads, "in_process_tokens_per_s": ti, "http_tokens_per_s": th,
           "overhead": 1 - th / ti, "pair_ratio_p25": pct(ratios, 0.25), "pair_ratio_median": pct(ratios, 0.5),
           "pair_ratio_p75": pct(ratios, 0.75), "same_text": sum(p["same_text"] for p in pairs),
           "buffer": bool(args.engine_buffer)}
    print(f"[paired] {len(pairs)} pairs: in-process {ti:.1f} tok/s, HTTP {th:.1f} tok/s, overhead "
          f"{100 * out['overhead']:.1f}%; per-pair time ratio median {out['pair_ratio_median']:.3f} "
          f"(p25 {out['pair_ratio_p25']:.3f}, p75 {out['pair_ratio_p75']:.3f}); same text in {out['same_text']}",
          flush=True)
    return out


def _warm_args(args):
    """args for engine_baseline as a loader: two requests, no timed level."""
    a = argparse.Namespace(**vars(args))
    a.requests, a.engine_seconds = 2, 0
    return a


def speculative_field(mode: str) -> dict:
    """The request's `speculative` field for --mode: none for 'default' (what the service serves a request that
    names no mode), else that mode."""
    return {} if mode == "default" else {"speculative": {"mode": mode}}


def start_server(port: int) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "draftsmith"), "serve", "--port", str(port), "--no-bootstrap"],
                            stdout=open("/tmp/bench_load_serve.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("draftsmith serve exited; see /tmp/bench_load_serve.log")
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if h.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit("the server did not become healthy in 300 s")


@contextlib.contextmanager
def served(args):
    """The service's URL: --url, else a `draftsmith serve` started here and stopped on exit."""
    if args.url is not None:
        yield args.url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"[load] starting draftsmith serve on port {port}", flush=True)
    proc = start_server(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_paired(prompts: list[str], args, report: dict) -> int:
    """--paired: the overhead on matched, interleaved requests; writes bench_load_paired.json and a PNG."""
    with served(args) as url:
        try:
            report["paired"] = paired_overhead(url, prompts, args)
        finally:
            drop_engines(args)
    r = report["paired"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_load_paired.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [q["k"] for q in r["pairs"]]
    ax.plot(ks, [q["in_process_tokens"] / q["in_process_s"] for q in r["pairs"]], "o-", label="in-process engine")
    ax.plot(ks, [q["http_tokens"] / q["http_s"] for q in r["pairs"]], "s-", label="HTTP (Ray Serve replica)")
    ax.set_xlabel("request (same prompt and seed both ways)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"overhead {100 * r['overhead']:.1f}% on {len(ks)} pairs, {r['threads']} torch thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "bench_load_paired.png", dpi=110)
    print(f"wrote {args.out}/bench_load_paired.json, bench_load_paired.png")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="mjsd",
                   help="a decoding mode, or 'default': the served default for what is loaded (medusa with "
                        "--medusa-heads, else mjsd)")
    p.add_argument("--engine-seconds", type=float, default=60)
    p.add_argument("--engine-threads", type=int, nargs="+", default=None,
                   help="also measure the in-process engine at these torch thread counts (e.g. the replica's "
                        "1 on a 2-core machine), to separate HTTP + Ray cost from the core left to the proxy")
    p.add_argument("--engine-clients", type=int, nargs="+", default=None,
                   help="also run the in-process engine with this many concurrent clients (its batch scheduler)")
    p.add_argument("--requests", type=int, default=None,
                   help="1-client levels (in-process and HTTP) send exactly this many requests, the same prompts in "
                        "the same order, instead of running for a time: the HTTP overhead compares the same work")
    p.add_argument("--engine-buffer", default=None, metavar="REDIS_URL",
                   help="the in-process engines record every step into a replay buffer at this Redis (under "
                        f"{BENCH_BUFFER_PREFIX}:*, deleted at the end), as the replica records into its own")
    p.add_argument("--paired", type=int, default=None, metavar="N",
                   help="only the HTTP overhead at one client, on N matched requests sent in-process and over HTTP "
                        "in alternation (same prompt and seed); the in-process engine runs on the first "
                        "--engine-threads (default 1, the replica's on a 2-core machine)")
    p.add_argument("--no-http", action="store_true", help="in-process levels only, no server")
    p.add_argument("--device", default="cpu", help="in-process levels: the engine's device (cuda on a GPU)")
    p.add_argument("--draft", type=Path, default=None,
                   help="in-process levels: this draft folder instead of the registry's champion")
    p.add_argument("--medusa-heads", type=Path, default=None,
                   help="in-process levels: load these Medusa heads next to the draft (mode default then drafts "
                        "with them where they pay, as a replica with a heads champion does)")
    p.add_argument("--solo-trees", action="store_true",
                   help="in-process levels: medusa requests step alone, one target pass each (the scheduler before "
                        "tree batching), instead of sharing one pass over all their trees: the A/B arm")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "load")
    args = p.parse_args()
    from training.prompts import load_prompts

    prompts = load_prompts("gsm8k", "train", 200)
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if args.paired:
        return run_paired(prompts, args, report)
    if args.engine_seconds > 0:
        report["engine"] = engine_baseline(prompts, args)
        for c in args.engine_clients or []:
            report.setdefault("engine_levels", []).append(engine_baseline(prompts, args, clients=c))
        for t in args.engine_threads or []:
            report.setdefault("engine_at_threads", []).append(engine_baseline(prompts, args, t))
        drop_engines(args)
        import gc

        gc.collect()
    if args.no_http:
        report["levels"] = []
    if not args.no_http:
        with served(args) as url:
            report["levels"] = [run_level(url, n, prompts, args) for n in args.clients]
    eng = report.get("engine", {}).get("tokens_per_s")
    lines = ["| clients | requests ok/all | 5xx | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) |",
             "|---:|---:|---:|---:|---:|---:|"]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for lv in report["levels"]:
        lines.append(f"| {lv['clients']} | {lv['ok']}/{lv['requests']} | {lv['status_5xx']} | {lv['tokens_per_s']:.1f} "
                     f"| {f(lv['latency_p50_s'])} / {f(lv['latency_p99_s'])} | {f(lv['ttft_p50_s'])} / {f(lv['ttft_p99_s'])} |")
    if eng:
        one = next((lv for lv in report["levels"] if lv["clients"] == 1), None)
        if one:
            report["http_overhead_at_1_client"] = 1 - one["tokens_per_s"] / eng
            lines.append(f"\nIn-process engine: {eng:.1f} tok/s; HTTP + Ray at 1 client: {one['tokens_per_s']:.1f} tok/s "
                         f"(overhead {100 * report['http_overhead_at_1_client']:.1f}%)")
            for e in report.get("engine_at_threads", []):
                e["http_overhead_at_1_client"] = 1 - one["tokens_per_s"] / e["tokens_per_s"]
                lines.append(f"In-process engine on {e['threads']} thread(s): {e['tokens_per_s']:.1f} tok/s "
                             f"(HTTP + Ray overhead against it {100 * e['http_overhead_at_1_client']:.1f}%)")
    if report.get("engine_levels"):
        lines += ["", "In-process engine (batch scheduler), concurrent clients:", "",
                  "| clients | requests | tokens/s | x 1 client | mean batch rows | TTFT p50 / p99 (s) | latency p50 (s) |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        levels = report["engine_levels"]
        if report.get("engine") and not any(e["clients"] == 1 for e in levels):
            levels = [report["engine"], *levels]          # the 1-client baseline run first
        base = next((e["tokens_per_s"] for e in levels if e["clients"] == 1), None)
        for e in levels:
            ratio = f"{e['tokens_per_s'] / base:.2f}" if base else "-"
            lines.append(f"| {e['clients']} | {e['requests']} | {e['tokens_per_s']:.1f} | {ratio} | {e['mean_batch_rows']:.2f} "
                         f"| {f(e['ttft_p50_s'])} / {f(e['ttft_p99_s'])} | {f(e['latency_p50_s'])} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_load.json").write_text(json.dumps(report, indent=2))
    (args.out / "bench_load.md").write_text(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    xs = [lv["clients"] for lv in report["levels"]]
    ax[0].plot(xs, [lv["tokens_per_s"] for lv in report["levels"]], "o-", label="HTTP (Ray Serve)")
    if report.get("engine_levels"):
        ex = [e["clients"] for e in report["engine_levels"]]
        ax[0].plot(ex, [e["tokens_per_s"] for e in report["engine_levels"]], "s-", label="in-process engine (batched)")
        ax[1].plot(ex, [e["ttft_p50_s"] or 0 for e in report["engine_levels"]], "s--", label="TTFT p50, in-process")
    elif eng:
        ax[0].axhline(eng, color="gray", ls="--", label="in-process engine, 1 request")
    ax[0].set_xlabel("concurrent streaming clients")
    ax[0].set_ylabel("output tokens/s")
    ax[0].legend()
    for key, lab in (("latency_p50_s", "latency p50"), ("latency_p99_s", "latency p99"), ("ttft_p50_s", "TTFT p50"),
                     ("ttft_p99_s", "TTFT p99")):
        ax[1].plot(xs, [lv[key] or 0 for lv in report["levels"]], "o-", label=lab)
    ax[1].set_xlabel("concurrent streaming clients")
    ax[1].set_ylabel("seconds")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(args.out / "bench_load.png", dpi=110)
    print(f"wrote {args.out}/bench_load.json, bench_load.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
