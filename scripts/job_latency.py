"""Request latency while distillation jobs run beside serving, against between jobs, from an online run's logs.

    .venv/bin/python scripts/job_latency.py docs/results/online-2026-11-30-thirtyeighth-autochoice
    .venv/bin/python scripts/job_latency.py --serve-log S.log --distill-log D.log

Reads the replica's access lines (`POST /v1/chat/completions 200 <ms>ms`, Ray Serve's log format, stamped when
the request ended) from serve.log and each job's start (the `YYYYMMDD-HHMMSS` in its submitted id) and length
(`succeeded in N s` / `failed`) from distill.log, both as scripts/bench_online.py writes them into its --out. A
request counts as "during a job" when it ended while one ran or within --grace seconds after (a request that
ended then mostly ran during it). The first --skip requests (cold start) are left out. Prints a markdown table:
requests, median and p90 latency during jobs and between them, the jobs' count and median length.
"""
from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
import sys
from pathlib import Path

ACCESS = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ .*POST /v1/chat/completions 200 ([\d.]+)ms")
SUBMIT = re.compile(r"submitting job \S+?-(\d{8}-\d{6})-\w+ ")
ENDED = re.compile(r"job \S+?-(\d{8}-\d{6})-\w+ (?:succeeded|failed)\D+(\d+) s")


def requests(text: str) -> list[tuple[dt.datetime, float]]:
    """(end time, latency s) of each successful chat request."""
    return [(dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"), float(m.group(2)) / 1e3)
            for m in ACCESS.finditer(text)]


def jobs(text: str) -> list[tuple[dt.datetime, dt.datetime]]:
    """(start, end) of each job that ended; a job still running at the end of the log runs to its end."""
    started = {m.group(1): dt.datetime.strptime(m.group(1), "%Y%m%d-%H%M%S") for m in SUBMIT.finditer(text)}
    out = []
    for m in ENDED.finditer(text):
        t0 = started.get(m.group(1))
        if t0 is not None:
            out.append((t0, t0 + dt.timedelta(seconds=int(m.group(2)))))
    return out


def split(reqs, spans, grace_s: float, skip: int) -> tuple[list[float], list[float]]:
    during, between = [], []
    grace = dt.timedelta(seconds=grace_s)
    for end, lat in reqs[skip:]:
        (during if any(a <= end <= b + grace for a, b in spans) else between).append(lat)
    return during, between


def _p(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(serve_text: str, distill_text: str, grace_s: float = 5.0, skip: int = 6) -> str:
    reqs, spans = requests(serve_text), jobs(distill_text)
    during, between = split(reqs, spans, grace_s, skip)

    def cell(x):
        return "-" if x is None else f"{x:.1f}"

    lines = ["| requests | n | median s | p90 s |", "|---|---:|---:|---:|"]
    for name, xs in (("during a job", during), ("between jobs", between)):
        lines.append(f"| {name} | {len(xs)} | {cell(statistics.median(xs) if xs else None)} | {cell(_p(xs, 0.9))} |")
    lengths = [(b - a).total_seconds() for a, b in spans]
    lines.append("")
    lines.append(f"{len(spans)} jobs, median {cell(statistics.median(lengths) if lengths else None)} s each")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", type=Path, help="an online run's --out folder (serve.log, distill.log)")
    ap.add_argument("--serve-log", type=Path)
    ap.add_argument("--distill-log", type=Path)
    ap.add_argument("--grace", type=float, default=5.0, help="seconds after a job still counted as during it")
    ap.add_argument("--skip", type=int, default=6, help="first requests left out (cold start)")
    args = ap.parse_args(argv)
    serve = args.serve_log or (args.run / "serve.log" if args.run else None)
    distill = args.distill_log or (args.run / "distill.log" if args.run else None)
    if serve is None or distill is None:
        ap.error("give an online run's folder, or --serve-log and --distill-log")
    for p in (serve, distill):
        if not p.is_file():
            ap.error(f"{p} is not a file")
    print(report(serve.read_text(errors="replace"), distill.read_text(errors="replace"), args.grace, args.skip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
