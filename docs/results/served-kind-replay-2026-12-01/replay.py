"""Replay `distill --every` (no --kind)'s choice of drafter kind over a saved online run's requests.

The run's responses.jsonl holds each request's end time (`t`, seconds since traffic started), draft version and
answer tokens: what deploy/heads.py `drafting_kind` reads from the buffer's newest sequence records. This replays
the first decision (deploy/cli.py `_served_kind`: CLEAR_SHARE of at least MIN_SERVED_TOKENS, looked at every
--poll) and then the watcher (`follow_served_kind`) at two cadences: once per --every interval (before the
forty-fourth session) and every WATCH_S. It stops at the first switch: after it the run's traffic would differ.

    .venv/bin/python docs/results/served-kind-replay-2026-12-01/replay.py \
        docs/results/online-2026-12-01-fortythird-drift/responses.jsonl --every 900 --poll 15
"""
import argparse
import collections
import json

from deploy.heads import CLEAR_SHARE, DRAFTING_REQUESTS, MIN_SERVED_TOKENS, WATCH_S, kind_of_version


def look(rows, t, share):
    done = [r for r in rows if r["t"] <= t][-DRAFTING_REQUESTS:]
    counts = collections.Counter()
    for r in done:
        kind = kind_of_version(r["draft_version"])
        if kind is not None:
            counts[kind] += r["completion_tokens"]
    total = sum(counts.values())
    if total < MIN_SERVED_TOKENS:
        return None, counts
    kind = max(sorted(counts), key=lambda k: counts[k])
    return (kind if counts[kind] >= share * total else None), counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("responses")
    ap.add_argument("--every", type=float, required=True)
    ap.add_argument("--poll", type=float, default=15.0)
    args = ap.parse_args()
    rows = sorted((json.loads(line) for line in open(args.responses)), key=lambda r: r["t"])
    end = rows[-1]["t"]
    t = 0.0
    while True:
        t += args.poll
        kind, counts = look(rows, t, CLEAR_SHARE)
        if kind is not None or t >= args.every:
            kind = kind or look(rows, t, 0.0)[0]
            break
    print(f"first decision at {t:.0f} s: {kind} ({dict(counts)})")
    for name, step in (("once per --every", args.every), (f"every WATCH_S ({WATCH_S:.0f} s)", min(args.every, WATCH_S))):
        at, seen = t + step, None
        shares = []
        while at <= end:
            now, counts = look(rows, at, CLEAR_SHARE)
            total = sum(counts.values()) or 1
            shares.append(f"{at:.0f} s: {', '.join(f'{k} {v / total:.2f}' for k, v in sorted(counts.items()))}")
            if now is not None and now != kind:
                seen = (at, now)
                break
            at += step
        print(f"\nwatcher {name}: {len(shares)} looks")
        for line in shares:
            print("  " + line)
        print(f"  -> {'switches to ' + seen[1] + f' at {seen[0]:.0f} s' if seen else 'never switches'}")


if __name__ == "__main__":
    main()
