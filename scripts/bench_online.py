"""Does the service get faster the longer it serves? The online-learning experiment (issue 15).

    .venv/bin/python scripts/bench_online.py --draft data/bootstrap-draft --duration 1800 --out docs/results/online
    .venv/bin/python scripts/bench_online.py --resummarize docs/results/online   # redo the analysis of a run
    .venv/bin/python scripts/bench_online.py --rescore docs/results/online-rescored/targets.md docs/results/online*

Everything real, started as an operator would, in a data directory of its own (--data, wiped first):
1. registers --draft (default: $DRAFTSMITH_DATA/bootstrap-draft) as version 1 and makes it champion, and
   the Medusa heads --medusa-heads (default: the folder `medusa-heads` beside the draft's, where `draftsmith
   bootstrap` leaves them, when it is there; --no-heads: none) as version 1 of the heads registry, as the bootstrap does;
2. starts `draftsmith serve` on the README's defaults (embedded Redis, MLflow on SQLite, the default
   target unless --target) and waits for /health; the served default then drafts with the heads (mode
   `auto`), or with the draft where there are none. The replicas' measured choice between heads and draft
   (serving/mode_choice.py) is off here unless --auto-choice: this run measures how one kind's loop learns, and a
   curve that mixed the two drafters' acceptance would not say that;
3. starts the scheduler as an operator would, `draftsmith distill --every E --min-records N`, which
   distills the kind the served default drafts with (`--kind auto`: the heads' job when they are
   registered, else the draft's; with --auto-choice, the kind that served most of the buffer's newest
   requests by the first interval, deploy/cli.py `_served_kind`), gates and promotes by itself (and its watchdog may
   roll back);
4. drives --clients concurrent clients for --duration seconds with traffic the bootstrap never saw
   (scripts/online_traffic.py): phase 1 is mostly SQL requests plus a share of the earlier, known
   traffic (GSM8K / HumanEval), and at --shift-at the traffic shifts again, mostly to JSON extraction,
   keeping shares of SQL and known traffic so forgetting is measured on the same clock;
5. records per request: time, category, the draft version(s) that drafted it, drafted / accepted
   tokens, completion tokens, latency; writes into --out:
   responses.jsonl, summary.json, summary.md (a table per draft version and category, the issue's
   targets computed; serving beside a distillation job against without one, from the scheduler's job state
   polled once a second), online.png (rolling live acceptance and tokens/s per category over time, with
   promotions and rollbacks marked and jobs shaded), serve.log and distill.log;
6. with --eval-prompts N, after the service stops: version 1, the champion at the shift and the final champion
   decode the same N held-out prompts per category at a fixed draft shape (scripts/eval_versions.py), which
   separates what a version learned or forgot from the controller's choices and the machine's load.

Acceptance is accepted / proposed draft tokens (n-gram proposals of the adaptive controller included,
as the response reports it; for the heads, tree depth proposed per step), rolling over the last --window
requests of a category. tokens/s is a request's completion tokens over its latency as the client saw it
(queueing included). The default request is the served default (mode `auto`: the heads' adaptive tree at
T = 0, or mjsd where there are no heads); temperature --temperature (0 unless given). "draft version" in
the output is the version of the kind that drafted (heads or draft).

CI runs a one-minute smoke of this script on tiny models (tests/deploy/test_bench_online.py). The real run
takes --duration plus about 2 minutes of start-up on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.online_traffic import CATEGORIES, PromptStream  # noqa: E402


def log(msg: str) -> None:
    print(f"[online {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_mix(text: str) -> dict[str, float]:
    """"sql=0.75,known=0.25" -> {"sql": 0.75, "known": 0.25} (weights need not sum to 1)."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, w = part.strip().partition("=")
        if name not in CATEGORIES:
            raise argparse.ArgumentTypeError(f"unknown category {name!r} in {text!r}; use {', '.join(CATEGORIES)}")
        try:
            mix[name] = float(w)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {name!r} in {text!r} is not a number") from None
        if mix[name] < 0:
            raise argparse.ArgumentTypeError(f"weight of {name!r} must be >= 0")
    if not mix or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one category with a positive weight")
    return mix


def cli(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "deploy.cli", *args], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    log(f"$ draftsmith {' '.join(args)} -> {res.returncode}: {(res.stdout + res.stderr).strip()[-300:]}")
    if check and res.returncode != 0:
        raise SystemExit(f"draftsmith {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res


class Traffic:
    """Client threads; each request's category is drawn from the current phase's mix."""

    def __init__(self, url: str, args) -> None:
        self.url, self.args = url, args
        self.mix: dict[str, float] = {}
        self.phase = 0
        self.records: list[dict] = []
        self.errors: list[dict] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.t0 = time.time()

    def set_phase(self, phase: int, mix: dict[str, float]) -> None:
        with self.lock:
            self.phase, self.mix = phase, dict(mix)
        log(f"phase {phase}: traffic mix {mix}")

    def _client(self, i: int) -> None:
        rng = random.Random(f"client:{self.args.seed}:{i}")
        streams = {c: PromptStream(c, seed=self.args.seed * 1000 + i) for c in CATEGORIES}
        spec = None if self.args.mode == "default" else {"mode": self.args.mode}
        with httpx.Client(timeout=600) as http:
            model = http.get(f"{self.url}/v1/models").json()["data"][0]["id"]
            while not self.stop.is_set():
                with self.lock:
                    phase, mix = self.phase, self.mix
                category = rng.choices(list(mix), weights=list(mix.values()))[0]
                body = {"model": model, "messages": [{"role": "user", "content": streams[category].next()}],
                        "max_tokens": self.args.max_tokens, "temperature": self.args.temperature,
                        "metadata": {"category": category}}      # the traffic label the gate tests per category
                if spec is not None:
                    body["speculative"] = spec
                t = time.time()
                try:
                    r = http.post(f"{self.url}/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    self.errors.append({"t": round(t - self.t0, 2), "category": category, "error": repr(e)})
                    time.sleep(1)
                    continue
                if r.status_code != 200:
                    self.errors.append({"t": round(t - self.t0, 2), "category": category,
                                        "status": r.status_code, "body": r.text[:300]})
                    time.sleep(1)
                    continue
                done = time.time()
                data = r.json()
                sd = (data.get("metrics") or {}).get("speculative_decoding") or {}
                toks = (data.get("usage") or {}).get("completion_tokens") or 0
                versions = sd.get("draft_versions") or {}
                self.records.append({
                    "t": round(done - self.t0, 2), "t_start": round(t - self.t0, 2), "phase": phase,
                    "category": category, "mode": sd.get("mode"), "draft_version": str(sd.get("draft_version")),
                    "draft_versions": sorted(str(v) for v in versions) if isinstance(versions, dict) else versions,
                    "draft_tokens": sd.get("draft_tokens") or 0, "accepted_tokens": sd.get("accepted_tokens") or 0,
                    "steps": sd.get("steps"), "zero_draft_steps": sd.get("zero_draft_steps"),
                    "ngram_steps": sd.get("ngram_steps"), "store_steps": sd.get("store_steps"),
                    "completion_tokens": toks,
                    # the first drafted position's acceptances (steps that accepted >= 1 token): a reading of the
                    # drafter that does not move with how far the controller drafts (`first_position_acceptance`)
                    "accepted_first": (sd.get("accepted_per_position") or [None])[0],
                    # the request's own time and its waits (serving/service.py `record`: what the chooser counts)
                    "wall_time_s": sd.get("wall_time_s"), "other_steps_s": sd.get("other_steps_s"),
                    "beside_jobs_s": sd.get("beside_jobs_s"), "shared_steps": sd.get("shared_steps"),
                    "shared_steps_s": sd.get("shared_steps_s"), "own_steps_s": sd.get("own_steps_s"),
                    "latency_s": round(done - t, 3), "tokens_per_s": round(toks / max(done - t, 1e-6), 2)})

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(self.args.clients)]
        for th in self.threads:
            th.start()

    def join(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(timeout=660)


class JobWatch:
    """Polls the scheduler's job state (`<data dir>/distill-job.json`, deploy/scheduler.py `write_job_status`)
    once a second, so the analysis knows when a distillation job ran beside serving: one entry per job id with
    its submitted / started / ended times (epoch s) and last state."""

    def __init__(self, data: Path, interval_s: float = 1.0) -> None:
        self.path, self.interval_s = data / "distill-job.json", interval_s
        self.jobs: dict[str, dict] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        try:
            info = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if isinstance(info, dict) and info.get("id"):
            self.jobs[str(info["id"])] = {k: info.get(k) for k in ("submitted", "started", "ended", "state")}

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.poll()

    def intervals(self, t0: float, now: float) -> list[dict]:
        """[{id, state, start, end}] in seconds since traffic started; a job still running ends at `now`."""
        out = []
        for jid, j in self.jobs.items():
            start = j.get("started") or j.get("submitted")
            if start is None:
                continue
            end = j.get("ended") or now
            out.append({"id": jid, "state": j.get("state"), "start": round(start - t0, 1), "end": round(end - t0, 1)})
        return sorted(out, key=lambda j: j["start"])


# submissions (deploy/ray_jobs.py) and the outcome lines that close a cycle: the draft scheduler's JobOutcome and
# the heads schedule's HeadsTick statuses ("skipped" opens none)
SUBMITTED = re.compile(r"^\[distill\] submitting job ", re.M)
CLOSED = re.compile(r"^\[(?:distill|heads-schedule)\] (?:promoted|canary|rejected|held|failed|discarded):", re.M)


def open_cycles(log_text: str) -> int:
    """Jobs the scheduler submitted whose outcome (registered and gated, or failed) it has not printed yet."""
    return max(0, len(SUBMITTED.findall(log_text)) - len(CLOSED.findall(log_text)))


def drain(distill_log: Path, seconds: float, poll_s: float = 1.0) -> bool | None:
    """Wait up to `seconds` while the scheduler has a cycle open: True once none is, False at the deadline,
    None when there was nothing to wait for (or --drain 0)."""
    if seconds <= 0:
        return None
    deadline, waited = time.time() + seconds, False
    while True:
        try:
            if open_cycles(distill_log.read_text(errors="replace")) == 0:
                return True if waited else None
        except OSError:
            return None
        if time.time() >= deadline:
            return False
        waited = True
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- analysis
def acceptance(rs: list[dict]) -> float | None:
    drafted = sum(r["draft_tokens"] for r in rs)
    return sum(r["accepted_tokens"] for r in rs) / drafted if drafted else None


def first_position_acceptance(rs: list[dict]) -> float | None:
    """Of the steps that drafted, the share whose first drafted token the target accepted (None without the
    per-position counts). Accepted / proposed falls as the adaptive controller drafts further on a better
    drafter; this reading does not depend on how far it drafts."""
    rs = [r for r in rs if r.get("accepted_first") is not None and r.get("steps")]
    drafting = sum(r["steps"] - (r.get("zero_draft_steps") or 0) for r in rs)
    return sum(r["accepted_first"] for r in rs) / drafting if drafting > 0 else None


def tokens_per_s(rs: list[dict]) -> float | None:
    """Mean per-request tokens/s (each request's completion tokens over its latency)."""
    return sum(r["tokens_per_s"] for r in rs) / len(rs) if rs else None


def rolling(rs: list[dict], window: int, fn) -> list[tuple[float, float]]:
    out = []
    for i in range(len(rs)):
        v = fn(rs[max(0, i - window + 1): i + 1])
        if v is not None and i + 1 >= min(window, len(rs)):
            out.append((rs[i]["t"], v))
    return out


def save_choice(url: str, out: Path) -> None:
    """The replica's drafter choice at the end of the traffic (/health `auto_choice`: each drafter's figures per
    label and state, and how many requests went by warm-up, speed and exploration) to `out`/choice.json; a
    service without the choice, or one that does not answer, writes nothing."""
    try:
        choice = httpx.get(f"{url}/health", timeout=10).json().get("auto_choice")
    except (httpx.HTTPError, ValueError) as e:
        log(f"no drafter choice read from /health: {e}")
        return
    if choice:
        (out / "choice.json").write_text(json.dumps(choice, indent=1))


def between(rs: list[dict], lo: float, hi: float) -> list[dict]:
    return [r for r in rs if lo <= r["t"] < hi]


def job_overlap(r: dict, jobs: list[dict]) -> float:
    """The share of a request's lifetime during which a distillation job ran."""
    a, b = r["t_start"], r["t"]
    return sum(max(0.0, min(b, j["end"]) - max(a, j["start"])) for j in jobs) / max(b - a, 1e-9)


def step_figures(rs: list[dict]) -> dict:
    """Requests (each with steps) summed per step: requests, tokens/s per request, ms / drafted / accepted tokens
    per step, the share of steps that drafted nothing, and acceptance (accepted / proposed)."""
    steps = sum(r["steps"] for r in rs)
    return {"requests": len(rs), "tokens_per_s": tokens_per_s(rs),
            "ms_per_step": 1000 * sum(r["latency_s"] for r in rs) / steps,
            "drafted_per_step": sum(r["draft_tokens"] for r in rs) / steps,
            "accepted_per_step": sum(r["accepted_tokens"] for r in rs) / steps,
            "plain_step_share": sum(r.get("zero_draft_steps") or 0 for r in rs) / steps,
            "first_position_acceptance": first_position_acceptance(rs), "acceptance": acceptance(rs)}


def window_rows(records: list[dict], window_s: float) -> list[dict]:
    """Per category and --early-s window of time: requests, tokens/s, ms per step, drafted / accepted tokens per
    step and the share of steps that drafted nothing (what the controller chose, beside what it gained)."""
    rows = []
    end = max((r["t"] for r in records), default=0.0)
    for c in CATEGORIES:
        lo = 0.0
        while lo <= end:
            rs = [r for r in records if r["category"] == c and lo <= r["t"] < lo + window_s and r.get("steps")]
            if rs:
                rows.append({"category": c, "from_s": lo, "to_s": lo + window_s, **step_figures(rs)})
            lo += window_s
    return rows


def contention_rows(records: list[dict], jobs: list[dict]) -> list[dict]:
    """Serving beside a job against serving without one, per category: requests that ran at least 80% of
    their time during a job against those that ran at most 20% (the gate's scoring, between a job's end and
    the next job, counts as no job). Seconds per step and drafted / accepted tokens per step separate what
    the job's CPU share costs from what the controller chose."""
    rows = []
    for c in CATEGORIES:
        for label, keep in (("no job", lambda f: f <= 0.2), ("job running", lambda f: f >= 0.8)):
            rs = [r for r in records if r["category"] == c and r.get("steps") and keep(job_overlap(r, jobs))]
            if rs:
                rows.append({"category": c, "while": label, **step_figures(rs)})
    return rows


def registry_events(history: list[dict], t0: float) -> list[tuple[float, str]]:
    """Alias moves from the registry's history, in seconds since traffic started: promotions, canaries
    started / ended, rollbacks (the watchdog's or an operator's), pauses, watchdog findings. Gate verdicts
    and registrations are in the version table instead."""
    out = []
    for h in history:
        a, t = h.get("action", ""), h.get("time")
        if t is None or t < t0:
            continue
        if a == "promote":
            out.append((round(t - t0, 1), f"v{h.get('version')} champion"))
        elif a == "rollback":
            out.append((round(t - t0, 1), f"rollback v{h.get('from')} -> v{h.get('to')}"))
        elif a == "canary":
            out.append((round(t - t0, 1), f"v{h.get('version')} canary"))
        elif a.startswith("canary "):
            out.append((round(t - t0, 1), f"canary v{h.get('version')} {a.split(' ', 1)[1]}"))
        elif a in ("pause", "resume", "watchdog"):
            out.append((round(t - t0, 1), a))
    return out


def targets(records: list[dict], args) -> dict:
    """The issue's targets, computed from the responses (None where a figure has too little data)."""
    by = {c: sorted((r for r in records if r["category"] == c), key=lambda r: r["t"]) for c in CATEGORIES}
    out: dict = {}
    first_new = next((c for c in args.phase1 if c != "known"), None)
    if first_new and by[first_new]:
        rs = by[first_new]
        t_first = rs[0]["t"]
        early = between(rs, t_first, t_first + args.early_s)
        horizon = min(t_first + 1800, rs[-1]["t"] + 1)
        roll = [v for t, v in rolling(rs, args.window, acceptance) if t <= horizon]
        late = between(rs, horizon - args.early_s, horizon)
        out["new_category"] = first_new
        out["early_requests"], out["late_requests"] = len(early), len(late)   # how much each figure rests on
        out["early_acceptance"] = acceptance(early)
        out["best_rolling_acceptance"] = max(roll) if roll else None
        out["late_acceptance"] = acceptance(late)
        # the issue's own reading: the rolling-`window` curve's first full window (the heads or draft the run
        # started with, before any job learned this category) against its last one within 30 minutes. The
        # 300-s windows above are the smoother, stricter reading: a loop that promotes within the first 300 s
        # (the thirty-first session's did at 175 s) counts its own early gain in the baseline.
        within = [r for r in rs if r["t"] <= horizon]
        if len(within) >= 2 * args.window:
            out["start_rolling_acceptance"] = acceptance(within[: args.window])
            out["end_rolling_acceptance"] = acceptance(within[-args.window:])
            if out["start_rolling_acceptance"] is not None and out["end_rolling_acceptance"] is not None:
                out["acceptance_gain_rolling"] = out["end_rolling_acceptance"] - out["start_rolling_acceptance"]
        out["early_first_position"] = first_position_acceptance(early)
        out["late_first_position"] = first_position_acceptance(late)
        out["early_tokens_per_s"] = tokens_per_s(early)
        out["late_tokens_per_s"] = tokens_per_s(late)
        if out["early_acceptance"] is not None and out["late_acceptance"] is not None:
            out["acceptance_gain_late"] = out["late_acceptance"] - out["early_acceptance"]
        if out["early_acceptance"] is not None and out["best_rolling_acceptance"] is not None:
            out["acceptance_gain_best_rolling"] = out["best_rolling_acceptance"] - out["early_acceptance"]
        if out["early_tokens_per_s"] and out["late_tokens_per_s"]:
            out["tokens_per_s_ratio"] = out["late_tokens_per_s"] / out["early_tokens_per_s"]
        # forgetting: the first new category's acceptance just before the shift vs after it
        if args.shift_at < args.duration:
            # over the whole time after the shift, and at the end of the run (a later job may forget what an
            # earlier one learned): the target holds only if both drops are within it
            before = between(rs, args.shift_at - args.early_s, args.shift_at)
            after = between(rs, args.shift_at, args.duration + 1e9)
            end = between(rs, rs[-1]["t"] - args.early_s, rs[-1]["t"] + 1) if rs[-1]["t"] > args.shift_at else []
            a, b, e = acceptance(before), acceptance(after), acceptance(end)
            out["earlier_category_before_shift"], out["earlier_category_after_shift"] = a, b
            out["earlier_category_end"], out["earlier_category_end_requests"] = e, len(end)
            if a is not None and b is not None:
                out["earlier_category_drop"] = a - b
            if a is not None and e is not None:
                out["earlier_category_drop_end"] = a - e
                out["earlier_category_drop_worst"] = max(a - e, out.get("earlier_category_drop", a - e))
    if by["known"]:
        rs = by["known"]
        out["known_early_acceptance"] = acceptance(between(rs, 0, args.early_s))
        out["known_late_acceptance"] = acceptance(between(rs, rs[-1]["t"] - args.early_s, rs[-1]["t"] + 1))
    return out


KIND_MODE = {"heads": "medusa", "draft": "mjsd"}    # the mode a kind drafts in under the served default's choice


def per_drafter(records: list[dict], args) -> dict:
    """The issue's acceptance readings on each drafter's requests alone (mode medusa: the heads' tree; mjsd: the
    draft's chain), for runs where the replicas choose between them: accepted / proposed of a tree and of MJSD's
    chain are on different scales, so a reading over both moves with the routing as well as with what was learned
    (the fortieth session's run 2). Modes with no request of the first new category are left out."""
    out = {}
    for mode in sorted({r.get("mode") for r in records if r.get("mode")}):
        tg = targets([r for r in records if r.get("mode") == mode], args)
        if tg.get("new_category"):
            out[mode] = tg
    return out


# what each version's job reported (its candidate's metrics): wall seconds, hidden-state seconds, epochs, ...
JOB_FIGURES = ("seconds", "hidden_state_seconds", "epochs", "best_epoch", "stopped_early", "hidden_cache_hits",
               "hidden_cache_misses")


def _sample(s: dict | None) -> str:
    """The gate's sample of a version: "12 (7)" = 12 requests, 7 of them fresh (deploy/heads.py)."""
    if not s or s.get("requests") is None:
        return "-"
    return f"{s['requests']} ({s.get('fresh') or 0})"


def distilled_kind(distill_log: str, args) -> str:
    """"heads" or "draft": the kind `draftsmith distill --kind auto` chose (deploy/cli.py `_served_kind`: the heads
    where registered, unless the drafter choice served the draft: the log then says it distills the draft); where
    the schedule moved to the other kind during the run (deploy/heads.py `follow_served_kind`), the last one."""
    if not args.heads:
        return "draft"
    marks = [(m.start(), "draft" if m.group(1).startswith("draft") else "heads")
             for m in re.finditer(r"drafts with the (draft: distilling it|Medusa heads: distilling them)", distill_log)]
    marks += [(m.start(), "draft" if m.group(1) == "draft" else "heads")
              for m in re.finditer(r"distilling --kind (\w+) from now on", distill_log)]
    return max(marks)[1] if marks else "heads"


def _heads_loop(args) -> bool:
    return getattr(args, "distilled", "heads" if args.heads else "draft") == "heads"


def registry_state(env: dict, args, heads: bool | None = None) -> tuple[list[dict], list[dict]]:
    """(every version with its kind, parent, adapter chain depth and gate figures; the registry's history)
    of the registry the loop distilled (`heads`: the heads' registry, else the draft's; default: the kind
    distilled last), read through the project's Registry in a subprocess (the run's data dir and store)."""
    heads = _heads_loop(args) if heads is None else heads
    code = ("import json,sys; from deploy.registry import Registry, heads_registry\n"
            f"JOB_FIGURES = {JOB_FIGURES!r}\n"
            "r = heads_registry(sys.argv[1] or None, 'medusa') if sys.argv[2] else Registry(sys.argv[1] or None)\n"
            "vs = {v.version: v for v in r.versions()}\n"
            "def depth(v):\n"
            "    d, seen = 0, set()\n"
            "    while v in vs and vs[v].kind == 'adapter' and v not in seen:\n"
            "        seen.add(v); d += 1; v = vs[v].parent_version\n"
            "    return d\n"
            "def sample(v):\n"
            "    try:\n"
            "        e = json.loads(v.tags.get('draftsmith.gate.evidence') or '{}')\n"
            "    except ValueError:\n"
            "        return {}\n"
            "    return {'requests': e.get('requests'), 'fresh': (e.get('window') or {}).get('fresh_requests')}\n"
            "print(json.dumps([{'version': v.version, 'kind': v.kind, 'parent': v.parent_version, 'aliases': v.aliases,"
            " 'depth': depth(v.version), 'gate': v.tags.get('draftsmith.gate.verdict'),"
            " 'gate_acceptance': v.metrics.get('gate_candidate_acceptance'), 'gate_delta': v.metrics.get('gate_delta'),"
            " 'gate_sample': sample(v), 'job': {k: v.metrics.get(k) for k in JOB_FIGURES}}"
            " for v in vs.values()]))\n"
            "print(json.dumps(r.history()))\n")
    res = subprocess.run([sys.executable, "-c", code, args.target or "", "1" if heads else ""], env=env,
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        log(f"could not read the registry: {res.stderr.strip()[-300:]}")
        return [], []
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])


def both_kinds(env: dict, args, versions: list[dict], events: list[tuple[float, str]], t0: float
               ) -> tuple[list[dict], list[dict]]:
    """Where the schedule moved between the kinds during the run (`args.kind_moves`), both registries' versions
    and events, each named by its kind ("draft v2 champion", version "heads 2"); else the ones given."""
    if not getattr(args, "kind_moves", 0) or not args.heads:
        return versions, events
    last = "heads" if _heads_loop(args) else "draft"
    other = "draft" if last == "heads" else "heads"
    ov, oh = registry_state(env, args, heads=other == "heads")
    named = [{**v, "version": f"{other} {v['version']}"} for v in ov] + \
        [{**v, "version": f"{last} {v['version']}"} for v in versions]
    moves = [(t, f"{other} {e}") for t, e in registry_events(oh, t0)] + [(t, f"{last} {e}") for t, e in events]
    return named, sorted(moves)


def evaluate_versions(env: dict, args, events: list[tuple[float, str]], out: Path) -> dict | None:
    """scripts/eval_versions.py on this run's registry, with serving stopped: version 1, the champion when the
    traffic shifted and the final champion, each on the same held-out prompts of every category served."""
    at_shift = "1"
    for t, e in events:
        if e.endswith(" champion") and t <= args.shift_at:
            at_shift = e.split()[0].lstrip("v")
    names = list(dict.fromkeys(["1", at_shift, "champion"]))
    cats = [c for c in CATEGORIES if c in args.phase1 or c in args.phase2]
    cmd = [sys.executable, str(ROOT / "scripts" / "eval_versions.py"), "--data", env["DRAFTSMITH_DATA"],
           "--kind", "medusa" if _heads_loop(args) else "draft", "--versions", ",".join(names), "--categories", ",".join(cats),
           "--prompts", str(args.eval_prompts), "--out", str(out / "version-eval.json")]
    if args.target:
        cmd += ["--target", args.target]
    log(f"evaluating versions {', '.join(names)} at a fixed draft shape")
    with open(out / "version-eval.log", "w") as f:
        res = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        log(f"version evaluation failed (exit {res.returncode}): see {out / 'version-eval.log'}")
        return None
    return json.loads((out / "version-eval.json").read_text())


def plot(records: list[dict], events: list[tuple[float, str]], shift_at: float, window: int, path: Path,
         jobs: list[dict] | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for i, c in enumerate(CATEGORIES):
        rs = sorted((r for r in records if r["category"] == c), key=lambda r: r["t"])
        if not rs:
            continue
        acc = rolling(rs, window, acceptance)
        tps = rolling(rs, window, tokens_per_s)
        if acc:
            ax1.plot([t / 60 for t, _ in acc], [v for _, v in acc], color=f"C{i}", lw=1.6, label=c)
        if tps:
            ax2.plot([t / 60 for t, _ in tps], [v for _, v in tps], color=f"C{i}", lw=1.6, label=c)
    for ax in (ax1, ax2):
        ax.axvline(shift_at / 60, color="black", ls=":", lw=1)
        for t, label in events:
            ax.axvline(t / 60, color="gray", ls="--", lw=0.8)
        for j in jobs or []:                           # a distillation job ran beside serving
            ax.axvspan(j["start"] / 60, j["end"] / 60, color="0.85", alpha=0.5, lw=0)
    ymax = ax1.get_ylim()[1]
    for t, label in events:
        ax1.text(t / 60, ymax, label, rotation=90, va="top", ha="right", fontsize=7)
    ax1.text(shift_at / 60, 0.02, " traffic shift", fontsize=8, va="bottom",
             transform=ax1.get_xaxis_transform())      # y in axes fraction: inside the plot whatever its range
    ax1.set_ylabel(f"live acceptance\n(accepted/proposed, rolling {window} req.)")
    ax2.set_ylabel(f"tokens/s per request\n(rolling {window} req.)")
    ax2.set_xlabel("minutes since traffic started" + (" (shaded: a distillation job running)" if jobs else ""))
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title("Online distillation on traffic the bootstrap never saw (promotions marked)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt(x, nd=3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_summary(out: Path, records: list[dict], errors: list[dict], events, versions: list[dict], args,
                  wall: dict, jobs: list[dict] | None = None, version_eval: dict | None = None) -> dict:
    tg = targets(records, args)
    drafters = per_drafter(records, args) if getattr(args, "auto_choice", False) else {}
    jobs = jobs or []
    contention = contention_rows(records, jobs)
    windows = window_rows(records, args.early_s)
    rows = []
    for v in sorted({r["draft_version"] for r in records}, key=lambda x: (len(x), x)):
        for c in CATEGORIES:
            rs = [r for r in records if r["draft_version"] == v and r["category"] == c]
            if rs:
                rows.append({"draft_version": v, "category": c, "requests": len(rs),
                             "acceptance": acceptance(rs), "tokens_per_s": tokens_per_s(rs),
                             "drafted_per_request": sum(r["draft_tokens"] for r in rs) / len(rs),
                             "first_t": min(r["t"] for r in rs), "last_t": max(r["t"] for r in rs)})
    max_depth = max((v["depth"] for v in versions), default=0)
    summary = {"args": {k: (v if isinstance(v, (int, float, str, dict, list, type(None))) else str(v))
                        for k, v in vars(args).items()},
               "requests": len(records), "failed_requests": len(errors), "errors": errors[:50],
               "rows": rows, "targets": tg, "events": events, "versions": versions,
               "max_chain_depth": max_depth, "wall": wall, "jobs": jobs, "contention": contention, "windows": windows,
               "version_eval": version_eval,
               "per_drafter": {m: {k: t.get(k) for k in ("acceptance_gain_late", "acceptance_gain_rolling",
                                                         "tokens_per_s_ratio", "earlier_category_drop",
                                                         "earlier_category_drop_end")} for m, t in drafters.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# Online learning run ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Setting: {args.clients} clients, mode {args.mode}, temperature {args.temperature}, "
             f"max_tokens {args.max_tokens}, {args.duration:.0f} s of traffic, shift at {args.shift_at:.0f} s; "
             f"phase 1 mix {args.phase1}, phase 2 mix {args.phase2}; scheduler: "
             f"`draftsmith distill {' '.join(args.distill_args)}`; drafting with "
             + (f"the Medusa heads ({args.heads})" if args.heads else f"the draft ({args.draft})")
             + (f" (the replicas choose heads or draft by measured speed; the loop distilled the {args.distilled}"
                + (f", last: its schedule moved between the kinds {args.kind_moves} time(s)"
                   if getattr(args, "kind_moves", 0) else "") + ")"
                if getattr(args, "auto_choice", False) and getattr(args, "distilled", None) else "")
             + ". Acceptance = accepted / proposed draft tokens.",
             "", f"requests: {len(records)}, failed: {len(errors)}, max adapter chain depth: {max_depth}", "",
             "| draft version | category | requests | acceptance | tokens/s per request | drafted per request "
             "| first seen (s) | last seen (s) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['draft_version']} | {r['category']} | {r['requests']} | {fmt(r['acceptance'])} | "
                     f"{fmt(r['tokens_per_s'], 1)} | {r['drafted_per_request']:.1f} | {r['first_t']:.0f} | "
                     f"{r['last_t']:.0f} |")
    lines += ["", "## Targets (issue 15)", "", "| figure | value | target |", "|---|---:|---|"]
    gain = tg.get("acceptance_gain_late")
    lines += [
        f"| {tg.get('new_category', '-')}: acceptance first {args.early_s:.0f} s ({tg.get('early_requests', 0)} requests) | "
        f"{fmt(tg.get('early_acceptance'))} | |",
        f"| {tg.get('new_category', '-')}: acceptance last {args.early_s:.0f} s within 30 min ({tg.get('late_requests', 0)} requests) | "
        f"{fmt(tg.get('late_acceptance'))} | |",
        f"| gain (last - first {args.early_s:.0f} s) | {fmt(gain)} | >= +0.15 {'met' if gain is not None and gain >= 0.15 else 'MISSED'} |",
        f"| first drafted token accepted, first / last {args.early_s:.0f} s (independent of draft length) | "
        f"{fmt(tg.get('early_first_position'))} / {fmt(tg.get('late_first_position'))} | (for reference) |",
        f"| rolling-{args.window} acceptance: first window / last window within 30 min | "
        f"{fmt(tg.get('start_rolling_acceptance'))} / {fmt(tg.get('end_rolling_acceptance'))} | |",
        f"| gain, the issue's reading (last - first rolling-{args.window} window) | {fmt(tg.get('acceptance_gain_rolling'))} | "
        f">= +0.15 {'met' if (tg.get('acceptance_gain_rolling') or 0) >= 0.15 else 'MISSED'} |",
        f"| best rolling-{args.window} acceptance - first | {fmt(tg.get('acceptance_gain_best_rolling'))} | (for reference) |",
        f"| tokens/s last / first {args.early_s:.0f} s | {fmt(tg.get('tokens_per_s_ratio'), 2)} | >= 1.2 "
        f"{'met' if (tg.get('tokens_per_s_ratio') or 0) >= 1.2 else 'MISSED'} |",
        f"| earlier category drop after the shift: all after / last {args.early_s:.0f} s "
        f"({tg.get('earlier_category_end_requests', 0)} requests) | {fmt(tg.get('earlier_category_drop'))} / "
        f"{fmt(tg.get('earlier_category_drop_end'))} | <= 0.03 "
        f"{'met' if tg.get('earlier_category_drop_worst') is not None and tg['earlier_category_drop_worst'] <= 0.03 else 'MISSED/n.a.'} |",
        f"| known traffic acceptance first / last {args.early_s:.0f} s | {fmt(tg.get('known_early_acceptance'))} / "
        f"{fmt(tg.get('known_late_acceptance'))} | (forgetting check) |",
        f"| failed requests | {len(errors)} | 0 {'met' if not errors else 'MISSED'} |",
        f"| max adapter chain depth | {max_depth} | <= K |",
        "", "Registry events (s since traffic started): " + "; ".join(f"{t:.0f} s {e}" for t, e in events),
        "", "| version | kind | parent | depth | aliases | gate | gate acceptance | gate delta | gate sample (fresh) | "
        "job s | hidden states s | epochs (best) | states read / computed |",
        "|---|---|---|---:|---|---|---:|---:|---|---:|---:|---|---|"]
    for v in versions:
        job = (v.get("job") or {}) if v["parent"] else {}     # version 1 came from the bootstrap, not a job
        ep = f"{job['epochs']:.0f} ({job.get('best_epoch') or 0:.0f}){', stopped' if job.get('stopped_early') else ''}" \
            if job.get("epochs") is not None else "-"
        hits = f"{job['hidden_cache_hits']:.0f} / {job.get('hidden_cache_misses') or 0:.0f}" \
            if job.get("hidden_cache_hits") is not None else "-"
        lines.append(f"| {v['version']} | {v['kind']} | {v['parent'] or '-'} | {v['depth']} | "
                     f"{','.join(v['aliases']) or '-'} | {v['gate'] or '-'} | {fmt(v.get('gate_acceptance'))} | "
                     f"{fmt(v.get('gate_delta'))} | {_sample(v.get('gate_sample'))} | {fmt(job.get('seconds'), 0)} | "
                     f"{fmt(job.get('hidden_state_seconds'), 1)} | {ep} | {hits} |")
    lines += ["", f"## Per {args.early_s:.0f}-s window", "",
              "| category | window (s) | requests | tokens/s per request | ms per step | drafted per step | "
              "accepted per step | plain steps | first drafted token accepted |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in windows:
        lines.append(f"| {w['category']} | {w['from_s']:.0f}-{w['to_s']:.0f} | {w['requests']} | "
                     f"{fmt(w['tokens_per_s'], 1)} | {w['ms_per_step']:.0f} | {w['drafted_per_step']:.2f} | "
                     f"{w['accepted_per_step']:.2f} | {w['plain_step_share']:.0%} | "
                     f"{fmt(w.get('first_position_acceptance'))} |")
    if jobs:
        busy = sum(min(j["end"], args.duration) - max(j["start"], 0.0) for j in jobs if j["end"] > 0)
        lines += ["", f"## Serving beside distillation jobs ({len(jobs)} jobs, running {busy:.0f} s of "
                  f"{args.duration:.0f} s of traffic)", "",
                  "Requests that ran >= 80% of their time during a job against those that ran <= 20% (the gate's "
                  "scoring counts as no job).", "",
                  "| category | while | requests | tokens/s per request | ms per step | drafted per step | "
                  "accepted per step | acceptance |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in contention:
            lines.append(f"| {r['category']} | {r['while']} | {r['requests']} | {fmt(r['tokens_per_s'], 1)} | "
                         f"{r['ms_per_step']:.0f} | {r['drafted_per_step']:.2f} | {r['accepted_per_step']:.2f} | "
                         f"{fmt(r['acceptance'])} |")
    if len(drafters) > 1:
        lines += ["", "## Per drafter (the same readings on each drafter's requests alone)", "",
                  "The replicas chose heads or draft per request; a tree's accepted / proposed and MJSD's chain's are "
                  "on different scales, so the readings above also move with the routing.", "",
                  "| mode | requests (new category) | gain, first/last 300 s | rolling-20 gain | tokens/s ratio | "
                  "earlier category's drop (all after / last 300 s) |", "|---|---:|---:|---:|---:|---|"]
        for mode, tg in drafters.items():
            n = len([r for r in records if r.get("mode") == mode and r["category"] == tg["new_category"]])
            lines.append(f"| {mode} | {n} | {fmt(tg.get('acceptance_gain_late'))} | "
                         f"{fmt(tg.get('acceptance_gain_rolling'))} | {fmt(tg.get('tokens_per_s_ratio'), 2)} | "
                         f"{fmt(tg.get('earlier_category_drop'))} / {fmt(tg.get('earlier_category_drop_end'))} |")
    if version_eval and version_eval.get("rows"):
        st = version_eval["setting"]
        lines += ["", f"## Versions at a fixed draft shape (scripts/eval_versions.py: mode {st['mode']}, gamma "
                  f"{st['gamma']}, not adaptive, T=0, {st['prompts']} held-out prompts per category x "
                  f"{st['max_tokens']} tokens)", "",
                  "| version | category | accepted per step | accepted / proposed |", "|---|---|---:|---:|"]
        for r in version_eval["rows"]:
            lines.append(f"| {r['label']} | {r['category']} | {fmt(r['accepted_per_step'])} | {fmt(r['acceptance'])} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


# ----------------------------------------------------------------------------- run
def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, logfile: Path) -> None:
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit(f"the service did not come up; see {logfile}")
        time.sleep(2)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, default=None,
                    help="base draft folder (default $DRAFTSMITH_DATA/bootstrap-draft, i.e. data/bootstrap-draft)")
    ap.add_argument("--medusa-heads", type=Path, default=None,
                    help="Medusa heads folder registered as the heads' version 1 (default: medusa-heads beside the "
                         "draft folder when it exists, as `draftsmith bootstrap` leaves them)")
    ap.add_argument("--no-heads", action="store_true",
                    help="register no heads: the served default drafts with the draft, and the draft is distilled")
    ap.add_argument("--no-suffix-store", action="store_true",
                    help="serve without the replicas' suffix store (DRAFTSMITH_SUFFIX_STORE=0), for an A/B; by "
                         "default it is on and seeded from the bootstrap's teacher data beside the draft")
    ap.add_argument("--auto-choice", action="store_true",
                    help="let the replicas route default requests to the heads or the draft by measured speed (the "
                         "README's default); off by default here, so every default request drafts with the kind "
                         "whose loop is measured (DRAFTSMITH_AUTO_CHOICE=0)")
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "bench-online", help="data dir (wiped first)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "online")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--shift-at", type=float, default=1200.0, help="second shift after this many seconds")
    ap.add_argument("--phase1", type=parse_mix, default=parse_mix("sql=0.75,known=0.25"))
    ap.add_argument("--phase2", type=parse_mix, default=parse_mix("json=0.6,sql=0.2,known=0.2"))
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mode", default="default", help="speculative mode, or 'default' (the served default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", default="4m", help="scheduler: a job at most this often (draftsmith distill --every)")
    ap.add_argument("--min-records", type=int, default=300, help="scheduler: ... once this many new records arrived")
    ap.add_argument("--poll", default="15s")
    ap.add_argument("--margin", type=float, default=0.01, help="gate margin")
    ap.add_argument("--distill-config", type=Path, default=None, help="YAML for training.job (steps, lr, ...)")
    ap.add_argument("--distill-arg", action="append", default=[],
                    help="extra argument for `draftsmith distill` (repeatable, e.g. --distill-arg=--no-watchdog)")
    ap.add_argument("--window", type=int, default=20, help="rolling window (requests) for the curves")
    ap.add_argument("--early-s", type=float, default=300.0, help="length of the 'first minutes' window")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--drain", type=float, default=0.0,
                    help="after the traffic, wait up to this many seconds for a cycle the scheduler has open (a job "
                         "submitted whose gate has not reported) before stopping, so the run's last job is "
                         "registered and judged (default 0: stop at once)")
    ap.add_argument("--eval-prompts", type=int, default=0,
                    help="after the run, decode this many held-out prompts per category with version 1, the champion "
                         "at the shift and the final champion, at a fixed draft shape (scripts/eval_versions.py): "
                         "what each version learned and forgot, without the controller's choices or the load "
                         "(default 0: off)")
    args = ap.parse_args(argv)
    if args.duration <= 0 or not (0 < args.shift_at):
        ap.error("--duration and --shift-at must be > 0")
    if args.clients < 1:
        ap.error("--clients must be >= 1")
    return args


def resummarize(out: Path) -> int:
    """Rewrite summary.json / summary.md / online.png of an earlier run from its responses.jsonl and the
    registry state its summary.json kept (after a change to the analysis; nothing is re-run)."""
    old = json.loads((out / "summary.json").read_text())
    args = _run_args(old)
    args.heads = old["args"].get("heads")
    args.draft = old["args"].get("draft")
    if old["args"].get("distilled"):
        args.distilled = old["args"]["distilled"]
    records = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    events = [tuple(e) for e in old["events"]]
    write_summary(out, records, old["errors"], events, old["versions"], args, wall=old["wall"], jobs=old.get("jobs"),
                  version_eval=old.get("version_eval"))
    plot(records, events, args.shift_at, args.window, out / "online.png", jobs=old.get("jobs"))
    print((out / "summary.md").read_text())
    return 0


def _run_args(old: dict) -> argparse.Namespace:
    args = argparse.Namespace(**old["args"])
    for key in ("distill_args", "distill_arg"):           # a list, kept as its repr by earlier versions
        if isinstance(getattr(args, key, None), str):
            setattr(args, key, ast.literal_eval(getattr(args, key)))
    return args


def _score(tg: dict, failed: int) -> dict:
    """The issue's targets of one reading (`targets`' figures) and whether all are met, under either gain reading."""
    drop = tg.get("earlier_category_drop_worst")
    ok = not failed and (tg.get("tokens_per_s_ratio") or 0) >= 1.2 and drop is not None and drop <= 0.03
    return {"gain_300s": tg.get("acceptance_gain_late"), "gain_rolling": tg.get("acceptance_gain_rolling"),
            "start_rolling": tg.get("start_rolling_acceptance"), "end_rolling": tg.get("end_rolling_acceptance"),
            "tokens_per_s_ratio": tg.get("tokens_per_s_ratio"), "earlier_drop_worst": drop,
            "all_met_300s": ok and (tg.get("acceptance_gain_late") or 0) >= 0.15,
            "all_met_rolling": ok and (tg.get("acceptance_gain_rolling") or 0) >= 0.15}


def _own_reading(records: list[dict], args, kind: str, failed: int) -> dict | None:
    """The issue's targets on the requests of the distilled kind's mode alone (None unless the replicas chose
    per request, or when that mode served none of the new category); `failed`: the run's failed requests."""
    if not getattr(args, "auto_choice", False) or kind not in KIND_MODE:
        return None
    rs = [r for r in records if r.get("mode") == KIND_MODE[kind]]
    tg = targets(rs, args)
    if not tg.get("new_category"):
        return None
    return {"requests": len(rs), "new_category_requests": len([r for r in rs if r["category"] == tg["new_category"]]),
            **_score(tg, failed)}


def rescore(out_md: Path, runs: list[Path]) -> int:
    """The issue's targets of earlier runs, under both readings of the acceptance gain (first / last 300 s, and
    the first / last rolling window the issue names), from each run's responses.jsonl and summary.json
    (nothing is re-run, no run's own files are rewritten): a table in `out_md` and its JSON beside it."""
    rows = []
    for run in runs:
        if not (run / "responses.jsonl").is_file() or not (run / "summary.json").is_file():
            continue
        old = json.loads((run / "summary.json").read_text())
        args = _run_args(old)
        if getattr(args, "duration", 0) < 1500:           # a smoke or a short run: not the 30-minute experiment
            continue
        records = [json.loads(line) for line in (run / "responses.jsonl").read_text().splitlines() if line.strip()]
        tg = targets(records, args)
        kind = old["args"].get("distilled") or ("heads" if old["args"].get("heads") and not old["args"].get("no_heads")
                                                else "draft")
        failed = old.get("failed_requests") or 0
        rows.append({"run": run.name, "kind": kind, "requests": len(records), "failed": old.get("failed_requests"),
                     "new_category_requests": len([r for r in records if r["category"] == tg.get("new_category")]),
                     **_score(tg, failed),
                     # the distilled kind's requests alone, where the replicas chose between heads and draft
                     "own": _own_reading(records, args, kind, failed)})
    lines = ["| run | drafting with | requests (new category) | gain, first/last 300 s | rolling-20: first -> last "
             "(gain) | tokens/s ratio | earlier category's worst drop | failed | all targets (300 s / rolling) |",
             "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['kind']} | {r['requests']} ({r['new_category_requests']}) | {fmt(r['gain_300s'])} | "
                     f"{fmt(r['start_rolling'])} -> {fmt(r['end_rolling'])} ({fmt(r['gain_rolling'])}) | "
                     f"{fmt(r['tokens_per_s_ratio'], 2)} | {fmt(r['earlier_drop_worst'])} | {r['failed']} | "
                     f"{'yes' if r['all_met_300s'] else 'no'} / {'yes' if r['all_met_rolling'] else 'no'} |")
    own = [r for r in rows if r["own"]]
    if own:
        lines += ["", "Runs whose replicas chose heads or draft per request, read on the distilled kind's requests "
                  "alone (a tree's accepted / proposed and MJSD's chain's differ in scale):", "",
                  "| run | distilled | its requests (new category) | gain, first/last 300 s | rolling-20 gain | "
                  "tokens/s ratio | earlier category's worst drop | all targets (300 s / rolling) |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in own:
            o = r["own"]
            lines.append(f"| {r['run']} | {r['kind']} | {o['requests']} ({o['new_category_requests']}) | "
                         f"{fmt(o['gain_300s'])} | {fmt(o['gain_rolling'])} | {fmt(o['tokens_per_s_ratio'], 2)} | "
                         f"{fmt(o['earlier_drop_worst'])} | {'yes' if o['all_met_300s'] else 'no'} / "
                         f"{'yes' if o['all_met_rolling'] else 'no'} |")
    for kind in ("heads", "draft"):
        rs = [r for r in rows if r["kind"] == kind]
        if rs:
            lines.append(f"\n{kind}: all targets met in {sum(r['all_met_300s'] for r in rs)} of {len(rs)} runs reading "
                         f"300-s windows, {sum(r['all_met_rolling'] for r in rs)} of {len(rs)} reading the rolling "
                         f"window; acceptance gain >= +0.15 in {sum((r['gain_300s'] or 0) >= 0.15 for r in rs)} / "
                         f"{sum((r['gain_rolling'] or 0) >= 0.15 for r in rs)}.")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(lines) + "\n")
    out_md.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv_ = sys.argv[1:] if argv is None else argv
    if argv_[:1] == ["--rescore"]:
        if len(argv_) < 3:
            raise SystemExit("usage: bench_online.py --rescore OUT.md RUN_DIR... (folders of earlier runs, each with "
                             "responses.jsonl and summary.json)")
        return rescore(Path(argv_[1]), [Path(p) for p in argv_[2:]])
    if argv is None and sys.argv[1:2] == ["--resummarize"] or argv and argv[:1] == ["--resummarize"]:
        rest = (sys.argv[2:] if argv is None else argv[1:])
        if len(rest) != 1 or not (Path(rest[0]) / "responses.jsonl").is_file():
            raise SystemExit("usage: bench_online.py --resummarize OUT_DIR (a folder with responses.jsonl and "
                             "summary.json of an earlier run)")
        return resummarize(Path(rest[0]))
    args = parse_args(argv)
    data = args.data.resolve()
    home = Path(os.environ.get("DRAFTSMITH_DATA", ROOT / "data"))
    draft = args.draft = args.draft or home / "bootstrap-draft"
    if not (draft / "config.json").is_file():
        raise SystemExit(f"no draft model folder at {draft}: build one with `draftsmith bootstrap` or pass --draft")
    beside = draft.parent / "medusa-heads"           # where `draftsmith bootstrap` leaves them, beside the draft
    args.heads = None if args.no_heads else args.medusa_heads or (
        beside if (beside / "medusa_heads.json").is_file() else None)
    if args.heads is not None and not (args.heads / "medusa_heads.json").is_file():
        raise SystemExit(f"no Medusa heads folder at {args.heads}: build one with `python -m training.heads` "
                         "(or `draftsmith bootstrap`), or pass --no-heads")
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DRAFTSMITH_DATA": str(data), "PYTHONUNBUFFERED": "1"}
    for k in ("REDIS_URL", "MLFLOW_TRACKING_URI", "DRAFTSMITH_API_KEY"):
        env.pop(k, None)
    # the README's defaults: the replicas' suffix store seeded from the bootstrap's teacher data (serve reads it
    # under the data dir, and this run's data dir is a fresh one)
    teacher = draft.parent / "bootstrap" / "teacher.safetensors"
    if args.no_suffix_store:
        env["DRAFTSMITH_SUFFIX_STORE"] = "0"
    elif "DRAFTSMITH_SUFFIX_SEED" not in env and teacher.is_file():
        env["DRAFTSMITH_SUFFIX_SEED"] = str(teacher)
    args.suffix_store = "off" if args.no_suffix_store else env.get("DRAFTSMITH_SUFFIX_SEED", "on, not seeded")
    env["DRAFTSMITH_AUTO_CHOICE"] = "1" if args.auto_choice else "0"
    common = ["--target", args.target] if args.target else []
    t_setup = time.time()
    cli(env, "register", str(draft), *common)
    cli(env, "promote", "1", "--force", *common)
    if args.heads is not None:
        cli(env, "register", str(args.heads), *common)
        cli(env, "promote", "1", "--kind", "medusa", "--force", *common)
    args.distill_args = ["--every", args.every, "--min-records", str(args.min_records), "--poll", args.poll,
                         "--margin", str(args.margin), *common, *args.distill_arg]
    if args.distill_config:
        args.distill_args += ["--config", str(args.distill_config)]
    procs: list[subprocess.Popen] = []
    serve_log, distill_log = out / "serve.log", out / "distill.log"
    # SIGTERM (kill, pkill) runs the `finally` below like Ctrl-C does: the service and the scheduler are stopped
    # with the run instead of being left behind writing into the next run's data dir
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with open(serve_log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(args.port),
                                           "--no-bootstrap", *common], env=env, cwd=ROOT, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        url = f"http://127.0.0.1:{args.port}"
        wait_healthy(url, procs[0], args.start_timeout, serve_log)
        log(f"service healthy after {time.time() - t_setup:.0f} s")
        with open(distill_log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "deploy.cli", "distill", *args.distill_args],
                                          env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        traffic = Traffic(url, args)
        traffic.set_phase(1, args.phase1)
        traffic.start()
        watch = JobWatch(data)
        watch.thread.start()
        t_end = traffic.t0 + args.duration
        shifted = args.shift_at >= args.duration
        last_report = time.time()
        while time.time() < t_end:
            time.sleep(1.0)
            now = time.time() - traffic.t0
            if not shifted and now >= args.shift_at:
                traffic.set_phase(2, args.phase2)
                shifted = True
            if time.time() - last_report >= 60 or time.time() >= t_end:
                last_report = time.time()
                recent = [r for r in traffic.records if r["t"] >= now - 60]
                log(f"{now:.0f} s: {len(traffic.records)} requests ({len(recent) / 60:.2f}/s), "
                    f"{len(traffic.errors)} failed, acceptance last minute {fmt(acceptance(recent))}, "
                    f"versions seen {sorted({r['draft_version'] for r in recent})}")
        traffic.join()
        save_choice(url, out)
        t_drain = time.time()
        drained = drain(distill_log, args.drain)
        drain_s = round(time.time() - t_drain, 1)
        if drained is not None:
            log(f"the scheduler's open cycle {'closed' if drained else 'was still open'} "
                f"{time.time() - t_end:.0f} s after the traffic")
    finally:
        stop_all(procs)
    watch.stop.set()
    watch.poll()
    jobs = watch.intervals(traffic.t0, time.time())
    args.distilled = distilled_kind(distill_log.read_text(errors="replace"), args)
    args.kind_moves = distill_log.read_text(errors="replace").count(" from now on")
    versions, history = registry_state(env, args)
    events = registry_events(history, traffic.t0)
    version_eval = evaluate_versions(env, args, events, out) if args.eval_prompts > 0 else None   # the last kind's
    versions, events = both_kinds(env, args, versions, events, traffic.t0)
    with open(out / "responses.jsonl", "w") as f:
        for r in sorted(traffic.records, key=lambda r: r["t"]):
            f.write(json.dumps(r) + "\n")
    summary = write_summary(out, traffic.records, traffic.errors, events, versions, args,
                            wall={"setup_s": round(traffic.t0 - t_setup, 1), "traffic_s": args.duration,
                                  "drain_s": drain_s}, jobs=jobs,
                            version_eval=version_eval)
    plot(traffic.records, events, args.shift_at, args.window, out / "online.png", jobs=jobs)
    print((out / "summary.md").read_text())
    return 0 if summary["requests"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
