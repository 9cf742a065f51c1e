"""Replay-buffer write path benchmark: one ReplayBufferWriter into a (loopback) Redis.

    .venv/bin/python scripts/bench_buffer.py                    # $REDIS_URL or redis://127.0.0.1:6379/0
    .venv/bin/python scripts/bench_buffer.py --url embedded     # the embedded server under $DRAFTSMITH_DATA
    .venv/bin/python scripts/bench_buffer.py --steps 50000 --k 20 --gamma 4 --json out.json

Reports, for StepRecords at top-k `k` and `gamma` draft tokens:
- bytes/step: encoded record size, and Redis memory per stream entry (MEMORY USAGE / XLEN);
- encode cost (codec only); enqueue cost (`push_step`, what the decode loop pays) in a tight loop
  (where the pushing thread fights the writer thread for the GIL: rare multi-ms outliers) and paced
  one push per --pace-ms (closer to an engine, which pushes once per decode step);
- ingest rate: steps/s from the first push until `flush()` returns (queue large enough not to drop);
- writer-thread CPU per step, and paced enqueue + writer CPU as a share of one decode step (--decode-ms,
  default 30 ms, a CPU decode step of the default target).
Keys go under a unique prefix and are deleted at the end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.codec import encode_step  # noqa: E402
from buffer.embedded import ensure_embedded  # noqa: E402
from buffer.records import StepRecord  # noqa: E402
from buffer.redis_store import BufferConfig, ReplayBufferWriter, connect, redis_url_from_env  # noqa: E402


def make_records(n: int, k: int, gamma: int, seed: int = 0) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lps = np.sort(np.log(rng.dirichlet(np.ones(k), size=gamma + 1)), axis=1)[:, ::-1]
        out.append(StepRecord(
            request_id=uuid.UUID(int=int(rng.integers(0, 2**63))).hex, position=int(rng.integers(0, 2048)),
            draft_tokens=rng.integers(0, 49152, gamma), num_accepted=int(rng.integers(0, gamma + 1)),
            target_topk_ids=rng.integers(0, 49152, (gamma + 1, k)), target_topk_logprobs=lps.astype(np.float16),
            algorithm="mjsd", draft_version="12", temperature=0.7, top_k=20, top_p=0.9,
            timestamp=time.time(), next_token=int(rng.integers(0, 49152))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="Redis URL; 'embedded' for the embedded server "
                    "(default: $REDIS_URL, else redis://127.0.0.1:6379/0)")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--decode-ms", type=float, default=30.0, help="decode step time the overhead is compared to")
    ap.add_argument("--paced", type=int, default=2000, help="pushes in the paced run")
    ap.add_argument("--pace-ms", type=float, default=1.0, help="gap between pushes in the paced run")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.k < 1 or args.gamma < 0:
        ap.error("--steps and --k must be >= 1, --gamma >= 0")

    url = ensure_embedded() if args.url == "embedded" else (args.url or redis_url_from_env() or "redis://127.0.0.1:6379/0")
    client = connect(url)
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - a clear message instead of a trace
        print(f"cannot reach Redis at {url}: {exc}", file=sys.stderr)
        return 1
    server = client.info("server")["redis_version"]
    records = make_records(512, args.k, args.gamma)
    sizes = [len(encode_step(r)) for r in records]

    t0 = time.perf_counter()
    reps = max(1, 20_000 // len(records))
    for _ in range(reps):
        for r in records:
            encode_step(r)
    encode_us = (time.perf_counter() - t0) / (reps * len(records)) * 1e6

    cfg = BufferConfig(prefix=f"bench:{uuid.uuid4().hex[:8]}", max_steps=max(args.steps, 1000),
                       queue_size=args.steps + 1, batch_size=args.batch_size, max_age_s=None)
    writer = ReplayBufferWriter(client, cfg)
    push_ns = np.empty(args.steps, dtype=np.int64)
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for i in range(args.steps):
        rec = records[i % len(records)]
        a = clock()
        writer.push_step(rec)
        push_ns[i] = clock() - a
    pushed_s = time.perf_counter() - start
    flushed = writer.flush(timeout_s=120)
    elapsed = time.perf_counter() - start
    stats = writer.stats()
    writer.close()
    xlen = client.xlen(cfg.steps_key)
    mem = client.memory_usage(cfg.steps_key, samples=0) or 0
    client.delete(cfg.steps_key, cfg.seqs_key)

    # paced pushes, one per --pace-ms (an engine pushes one record per decode step, ~30 ms apart):
    # cold caches make each push dearer than in the tight loop, but there is no GIL fight
    writer = ReplayBufferWriter(client, cfg)
    paced_ns = np.empty(args.paced, dtype=np.int64)
    for i in range(args.paced):
        a = clock()
        writer.push_step(records[i % len(records)])
        paced_ns[i] = clock() - a
        time.sleep(args.pace_ms / 1e3)
    writer.flush(timeout_s=60)
    writer.close()
    client.delete(cfg.steps_key, cfg.seqs_key)
    paced_us = paced_ns / 1e3

    push_us = push_ns / 1e3
    cpu_us = stats["cpu_s"] / max(stats["written"], 1) * 1e6
    figures = {
        "redis": f"{server} at {url}", "steps": args.steps, "k": args.k, "gamma": args.gamma,
        "bytes_per_step_encoded": statistics.mean(sizes), "redis_bytes_per_entry": mem / max(xlen, 1),
        "encode_us": encode_us,
        "enqueue_us_median": float(np.median(push_us)), "enqueue_us_p99": float(np.percentile(push_us, 99)),
        "enqueue_us_max": float(push_us.max()), "enqueue_us_p999": float(np.percentile(push_us, 99.9)),
        "paced_enqueue_us_median": float(np.median(paced_us)), "paced_enqueue_us_p99": float(np.percentile(paced_us, 99)),
        "paced_enqueue_us_max": float(paced_us.max()), "push_loop_steps_per_s": args.steps / pushed_s,
        "ingest_steps_per_s": stats["written"] / elapsed, "written": stats["written"], "dropped": stats["dropped"],
        "flushed": flushed, "writer_cpu_us_per_step": cpu_us,
        "enqueue_share_of_decode_step_pct": float(np.median(paced_us)) / (args.decode_ms * 1e3) * 100,
        "enqueue_plus_writer_cpu_share_pct": (float(np.median(paced_us)) + cpu_us) / (args.decode_ms * 1e3) * 100,
    }
    rows = [
        ("Redis server", figures["redis"]),
        ("steps (k, gamma)", f"{args.steps} ({args.k}, {args.gamma})"),
        ("bytes/step encoded", f"{figures['bytes_per_step_encoded']:.0f}"),
        ("Redis bytes/entry (MEMORY USAGE)", f"{figures['redis_bytes_per_entry']:.0f}"),
        ("encode (codec only)", f"{encode_us:.1f} us"),
        ("enqueue, tight loop: median/p99/p99.9/max",
         f"{figures['enqueue_us_median']:.2f} / {figures['enqueue_us_p99']:.2f} / "
         f"{figures['enqueue_us_p999']:.1f} / {figures['enqueue_us_max']:.0f} us"),
        (f"enqueue, one per {args.pace_ms:g} ms: median/p99/max",
         f"{figures['paced_enqueue_us_median']:.2f} / {figures['paced_enqueue_us_p99']:.2f} / "
         f"{figures['paced_enqueue_us_max']:.0f} us"),
        ("ingest, push to flushed", f"{figures['ingest_steps_per_s']:,.0f} steps/s "
                                    f"({stats['written']} written, {stats['dropped']} dropped)"),
        ("writer thread CPU", f"{cpu_us:.1f} us/step"),
        (f"share of a {args.decode_ms:g} ms decode step",
         f"enqueue {figures['enqueue_share_of_decode_step_pct']:.4f} %, "
         f"enqueue + writer CPU {figures['enqueue_plus_writer_cpu_share_pct']:.3f} %"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if flushed and stats["dropped"] == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
