"""The one-minute CI smoke of scripts/bench_online.py (the online-learning experiment, issue 15).

The same script as the 30-minute run, on tiny models: it registers a base draft, starts `draftsmith serve`
(real Ray Serve, an embedded Redis in its own data dir, MLflow on SQLite) and the `draftsmith distill`
scheduler as subprocesses, drives two clients through a traffic shift, and writes its figures. The test
checks what the script produced: every request answered, both phases' categories served and recorded with
their draft versions, the buffer fed the scheduler (a job ran), and the summary, table and plot written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiny_models
from tests.api_helpers import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_bench_online_smoke(tmp_path):
    target, draft = tiny_models.save_pair(tmp_path / "models", draft_layers=1)
    cfg = tmp_path / "distill.yaml"
    cfg.write_text("steps: 3\nmin_steps: 1\nlora_r: 4\nbatch_tokens: 512\nmin_records: 8\neval_records: 64\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_online.py"), "--target", str(target), "--draft", str(draft),
           "--data", str(tmp_path / "data"), "--out", str(out), "--port", str(free_port()),
           "--duration", "60", "--shift-at", "30", "--phase1", "sql=1", "--phase2", "json=0.7,sql=0.3", "--clients", "2", "--max-tokens", "12",
           "--every", "10s", "--min-records", "20", "--poll", "2s", "--distill-config", str(cfg),
           "--window", "5", "--early-s", "20", "--start-timeout", "300", "--drain", "150"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] >= 10, summary["requests"]
    assert summary["failed_requests"] == 0, summary["errors"]
    records = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(records) == summary["requests"]
    phases = {r["phase"] for r in records}
    assert phases == {1, 2}, phases
    cats1 = {r["category"] for r in records if r["phase"] == 1}
    cats2 = {r["category"] for r in records if r["phase"] == 2}
    assert cats1 == {"sql"} and "json" in cats2
    assert all(r["draft_version"] not in ("None", "") for r in records), "every response names its draft version"
    assert sum(r["draft_tokens"] for r in records) > 0, "the draft proposed tokens"
    # the registry as the script read it: version 1 is the base (depth 0); every version's depth is recorded
    versions = {v["version"]: v for v in summary["versions"]}
    assert versions["1"]["kind"] == "base" and versions["1"]["depth"] == 0
    assert summary["max_chain_depth"] == max(v["depth"] for v in summary["versions"])
    # (the earlier, known traffic is left out here: its prompts exceed the tiny models' 512-token context)
    # the scheduler saw the served records: at least one job ran (trained, gated, whatever the verdict)
    distill_log = (out / "distill.log").read_text()
    assert "scheduler started" in distill_log, distill_log[-2000:]
    assert len(summary["versions"]) >= 2 or "job" in distill_log.lower(), distill_log[-2000:]
    md = (out / "summary.md").read_text()
    assert "| draft version | category |" in md and "Targets (issue 15)" in md
    # the first / last windows say how many requests of the new category they rest on
    tg, sql = summary["targets"], [r for r in records if r["category"] == "sql"]
    assert 1 <= tg["early_requests"] <= len(sql) and 0 <= tg["late_requests"] <= len(sql)
    assert f"({tg['early_requests']} requests)" in md and f"({tg['late_requests']} requests)" in md
    assert (out / "online.png").stat().st_size > 10_000
    # the analysis redone from the run's own output (nothing re-run): the same figures, both forgetting windows
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_online.py"), "--resummarize", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    redone = json.loads((out / "summary.json").read_text())
    assert redone["requests"] == summary["requests"] and redone["targets"]["early_acceptance"] == tg["early_acceptance"]
    assert "earlier category drop after the shift: all after / last" in (out / "summary.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_online.py"), "--resummarize", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "responses.jsonl" in bad.stderr


def test_bench_online_smoke_with_heads(tmp_path):
    """As a bootstrapped deployment runs: Medusa heads beside the draft (where `draftsmith bootstrap` leaves
    them) are registered as the heads' version 1, the served default drafts with them, and `draftsmith distill`
    with no --kind distills them: heads jobs on the Ray of `draftsmith serve`, registered in the heads registry."""
    import torch

    from serving.engine import Engine
    from tests.deploy.test_heads_registry import make_heads

    target, draft = tiny_models.save_pair(tmp_path / "models", draft_layers=1)
    model = Engine.from_paths(str(target), None, dtype=torch.float32).target.model
    make_heads(model, draft.parent / "medusa-heads", seed=1, scale=0.05)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_online.py"), "--target", str(target), "--draft", str(draft),
           "--data", str(tmp_path / "data"), "--out", str(out), "--port", str(free_port()),
           "--duration", "60", "--shift-at", "30", "--phase1", "sql=1", "--phase2", "json=0.7,sql=0.3", "--clients", "2",
           "--max-tokens", "12", "--every", "10s", "--min-records", "20", "--poll", "2s",
           "--distill-arg=--heads-budget=3s", "--distill-arg=--canary-share=0", "--distill-arg=--min-requests=2",
           # a job beside serving defaults to nice 10; two clients on tiny models keep both cores busy, and in a
           # one-minute run a job that yields to them would not finish
           "--distill-arg=--job-nice=0",
           # a busy CI host may still be gating the first job when the minute ends: wait for that cycle
           "--window", "5", "--early-s", "20", "--start-timeout", "300", "--eval-prompts", "1", "--drain", "150"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] >= 10 and summary["failed_requests"] == 0, summary["errors"]
    records = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"medusa"}, "the served default drafts with the heads"
    assert records[0]["draft_version"] == "medusa-v1" and sum(r["draft_tokens"] for r in records) > 0
    # each record carries the first drafted position's acceptances and the request's own time from the response
    assert all(0 <= r["accepted_first"] <= r["accepted_tokens"] and r["wall_time_s"] > 0 for r in records), records[0]
    assert all(r["other_steps_s"] >= 0 and r["beside_jobs_s"] >= 0 for r in records)
    assert summary["versions"][0]["version"] == "1" and summary["max_chain_depth"] == 0     # full-weight heads
    # each job's own figures (its candidate's metrics) beside its version: wall and hidden-state seconds, epochs
    jobbed = [v for v in summary["versions"] if v["version"] != "1" and (v.get("job") or {}).get("seconds")]
    assert len(jobbed) == len(summary["versions"]) - 1, summary["versions"]    # every registered job's version
    assert all(v["job"]["epochs"] >= 1 and v["job"]["hidden_state_seconds"] >= 0 for v in jobbed), summary["versions"]
    distill_log = (out / "distill.log").read_text()
    assert "the served default drafts with the Medusa heads" in distill_log, distill_log[-2000:]
    assert "[heads-schedule]" in distill_log and "submitting job draftsmith-medusa-v1-" in distill_log, \
        distill_log[-3000:]
    assert "drafting with the Medusa heads" in (out / "summary.md").read_text()
    # the scheduler's jobs as the script watched them (distill-job.json), and serving beside them
    jobs = summary["jobs"]
    assert jobs and all(j["id"].startswith("draftsmith-medusa-") and j["end"] >= j["start"] for j in jobs), jobs
    assert "## Serving beside distillation jobs" in (out / "summary.md").read_text()
    assert {w["category"] for w in summary["windows"]} == {"sql", "json"}
    assert sum(w["requests"] for w in summary["windows"]) == summary["requests"]    # every request in one window
    # the versions side by side at a fixed tree after the run: version 1 and the final champion on each category
    ev = summary["version_eval"]
    assert ev["setting"]["mode"] == "medusa" and {r["category"] for r in ev["rows"]} == {"sql", "json"}
    assert ev["rows"][0]["version"] == "1" and ev["rows"][-1]["label"].endswith("(champion)"), ev["rows"]
    assert "## Versions at a fixed draft shape" in (out / "summary.md").read_text()


def test_first_position_acceptance_and_the_saved_choice(tmp_path):
    """The first drafted token's acceptance over the steps that drafted (steps less plain steps), None without the
    per-position counts of older runs; the replica's choice is read from a real /health and saved, and a service
    that does not answer leaves no file and no error."""
    import http.server
    import threading

    from scripts.bench_online import first_position_acceptance, save_choice, step_figures

    a = {"steps": 10, "zero_draft_steps": 2, "accepted_first": 6, "draft_tokens": 24, "accepted_tokens": 9,
         "latency_s": 1.0, "tokens_per_s": 19.0}
    b = {"steps": 5, "zero_draft_steps": 5, "accepted_first": 0, "draft_tokens": 0, "accepted_tokens": 0,
         "latency_s": 0.5, "tokens_per_s": 10.0}
    assert first_position_acceptance([a, b]) == 6 / 8          # b drafted on no step: it adds no denominator
    assert first_position_acceptance([b]) is None and first_position_acceptance([{"steps": 3}]) is None
    assert step_figures([a, b])["first_position_acceptance"] == 6 / 8

    body = json.dumps({"status": "ok", "auto_choice": {"chosen": {"fastest": 7}}}).encode()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        save_choice(f"http://127.0.0.1:{srv.server_port}", tmp_path)
    finally:
        srv.shutdown()
    assert json.loads((tmp_path / "choice.json").read_text()) == {"chosen": {"fastest": 7}}
    (tmp_path / "choice.json").unlink()
    save_choice(f"http://127.0.0.1:{free_port()}", tmp_path)     # nothing listens there
    assert not (tmp_path / "choice.json").exists()


def test_open_cycles_count_submitted_jobs_without_an_outcome_line():
    from scripts.bench_online import open_cycles

    sub = "[distill] submitting job draftsmith-medusa-v1-x to Ray at 1.2.3.4:5 as a Ray task (1 CPU, 0 GPU)\n"
    done = "[distill] Ray job draftsmith-medusa-v1-x succeeded in 31 s: /tmp/c\n"
    assert open_cycles("") == 0
    assert open_cycles(sub + done) == 1, "a finished job is not a closed cycle: its gate has not reported"
    assert open_cycles(sub + done + "[heads-schedule] rejected: no gain (version 2)\n") == 0
    assert open_cycles(sub + "[distill] promoted: version 2 promoted to champion\n" + sub) == 1
    assert open_cycles(sub + "[heads-schedule] skipped: 3 new step records\n") == 1, "a skip closes nothing"
    assert open_cycles("[distill] failed: no champion draft to distill from\n") == 0


def test_distilled_kind_reads_the_schedules_choice_and_its_moves():
    from argparse import Namespace

    from scripts.bench_online import distilled_kind

    heads = Namespace(heads=True)
    to_draft = "[distill] the served default drafts with the draft: distilling it (--kind draft; ...)\n"
    to_heads = "[distill] the served default drafts with the Medusa heads: distilling them (--kind medusa; ...)\n"
    moved = "[distill] ... the replicas now draft with the medusa heads; ..., distilling --kind medusa from now on\n"
    assert distilled_kind("", heads) == "heads" and distilled_kind(to_draft, Namespace(heads=False)) == "draft"
    assert distilled_kind(to_draft, heads) == "draft" and distilled_kind(to_heads, heads) == "heads"
    assert distilled_kind(to_draft + moved + to_heads, heads) == "heads"     # the schedule moved: the last kind
    assert distilled_kind(to_heads + moved.replace("medusa heads", "draft").replace("kind medusa", "kind draft")
                          + to_draft, heads) == "draft"


def test_contention_rows_split_requests_by_the_share_of_their_time_a_job_ran():
    """Pure logic of the 'serving beside jobs' table: a request counts as 'job running' when a job covered at
    least 80% of its lifetime, 'no job' at most 20%, and neither in between; per-step figures are sums over
    requests, not means of ratios."""
    from scripts.bench_online import contention_rows, job_overlap

    jobs = [{"id": "a", "start": 10.0, "end": 20.0}, {"id": "b", "start": 30.0, "end": 40.0}]

    def req(t0, t1, steps, drafted, accepted):
        return {"category": "sql", "t_start": t0, "t": t1, "latency_s": t1 - t0, "steps": steps,
                "draft_tokens": drafted, "accepted_tokens": accepted, "tokens_per_s": 10.0}

    inside, outside, straddle = req(11, 19, 8, 16, 8), req(0, 9, 10, 10, 2), req(15, 25, 5, 5, 5)
    assert job_overlap(inside, jobs) == 1.0 and job_overlap(outside, jobs) == 0.0
    assert job_overlap(straddle, jobs) == 0.5 and job_overlap(req(5, 45, 1, 0, 0), jobs) == 0.5   # two jobs
    rows = {r["while"]: r for r in contention_rows([inside, outside, straddle, req(0, 8, 10, 30, 6)], jobs)}
    assert set(rows) == {"no job", "job running"}
    assert rows["job running"]["requests"] == 1 and rows["job running"]["ms_per_step"] == 1000.0
    assert rows["no job"]["requests"] == 2
    assert rows["no job"]["drafted_per_step"] == 40 / 20 and rows["no job"]["accepted_per_step"] == 8 / 20
    assert abs(rows["no job"]["ms_per_step"] - 1000 * 17 / 20) < 1e-9 and rows["no job"]["acceptance"] == 8 / 40


def test_the_issues_rolling_reading_and_the_rescore_of_saved_runs(tmp_path):
    """Issue 15's acceptance gain read two ways: first / last 300 s, and the first / last rolling window of
    `window` requests (a promotion inside the first 300 s lowers only the first reading's baseline); --rescore
    scores saved runs from their responses and summaries without touching them, and skips short runs."""
    import argparse

    from scripts.bench_online import rescore, targets

    def req(t, drafted, accepted, cat="sql", tps=10.0):
        return {"t": t, "t_start": t - 1, "category": cat, "draft_tokens": drafted, "accepted_tokens": accepted,
                "tokens_per_s": tps}

    # 0.2 for the first 4 requests (t 1-4), 0.6 from t 100 (a promotion inside the first 300 s), 0.7 at the end
    records = ([req(t, 10, 2) for t in (1, 2, 3, 4)] + [req(100 + t, 10, 6) for t in range(8)]
               + [req(1500 + t, 10, 7, tps=20.0) for t in range(4)])
    args = argparse.Namespace(phase1={"sql": 0.75, "known": 0.25}, window=4, early_s=300.0, shift_at=1800.0,
                              duration=1800.0)
    tg = targets(records, args)
    assert tg["start_rolling_acceptance"] == pytest.approx(0.2) and tg["end_rolling_acceptance"] == pytest.approx(0.7)
    assert tg["acceptance_gain_rolling"] == pytest.approx(0.5)
    assert tg["early_acceptance"] == pytest.approx((8 + 48) / 120)       # the first 300 s hold the promotion
    assert tg["acceptance_gain_late"] == pytest.approx(0.7 - 56 / 120)
    assert targets(records[:6], args).get("acceptance_gain_rolling") is None   # fewer than two windows
    run = tmp_path / "online-run"
    run.mkdir()
    (run / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"args": {**vars(args), "heads": "h", "no_heads": False}, "failed_requests": 0}
    (run / "summary.json").write_text(json.dumps(summary))
    short = tmp_path / "online-smoke"
    short.mkdir()
    (short / "responses.jsonl").write_text((run / "responses.jsonl").read_text())
    (short / "summary.json").write_text(json.dumps({**summary, "args": {**summary["args"], "duration": 60.0}}))
    before = (run / "summary.json").read_text()
    assert rescore(tmp_path / "out" / "t.md", [run, short]) == 0
    rows = json.loads((tmp_path / "out" / "t.json").read_text())
    assert [r["run"] for r in rows] == ["online-run"] and rows[0]["kind"] == "heads"
    assert rows[0]["gain_rolling"] == pytest.approx(0.5) and rows[0]["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert rows[0]["all_met_rolling"] is False      # no shift in this run: the forgetting figure is missing
    assert "online-run" in (tmp_path / "out" / "t.md").read_text() and (run / "summary.json").read_text() == before


def test_job_latency_splits_requests_by_whether_a_job_ran_when_they_ended(tmp_path, capsys):
    """scripts/job_latency.py on logs in the formats bench_online writes: requests that ended while a job ran
    (or within the grace after it) against the others, the cold start left out; a missing log is a CLI error."""
    from scripts.job_latency import main, report

    access = ("(ServeReplica pid=1) INFO 2026-11-30 10:00:{s:02d},100 draftsmith_Draftsmith x y -- POST "
              "/v1/chat/completions 200 {ms}ms\n")
    serve = "".join(access.format(s=s, ms=ms) for s, ms in
                    [(1, 9000), (2, 4000), (10, 4000), (21, 15000), (25, 13000), (33, 11000), (50, 3000)])
    serve += access.format(s=55, ms=5000).replace(" 200 ", " 500 ")          # a failed request: not counted
    distill = ("[distill] submitting job draftsmith-medusa-v1-20261130-100020-4cddc8 to Ray at x as a Ray task\n"
               "[distill] Ray job draftsmith-medusa-v1-20261130-100020-4cddc8 succeeded in 10 s: /tmp/c\n"
               "[distill] submitting job draftsmith-medusa-v2-20261130-100100-aaaaaa to Ray at x\n")   # still running
    text = report(serve, distill, grace_s=5, skip=1)
    assert "| during a job | 3 | 13.0 | 15.0 |" in text, text       # ended at :21, :25 (in the job), :33 (grace)
    assert "| between jobs | 3 | 4.0 | 4.0 |" in text, text
    assert "1 jobs, median 10.0 s each" in text
    (tmp_path / "serve.log").write_text(serve)
    (tmp_path / "distill.log").write_text(distill)
    assert main([str(tmp_path), "--skip", "1"]) == 0 and "during a job" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])


def test_the_per_drafter_reading_separates_learning_from_routing(tmp_path):
    """With the replicas choosing per request, a tree's accepted / proposed (heads) and MJSD's chain's (draft) are
    on different scales: traffic moving from the heads to the draft lowers the mixed reading although neither
    drafter forgot anything. `per_drafter` and the rescore's own-kind reading read each drafter alone."""
    import argparse

    from scripts.bench_online import per_drafter, rescore, targets

    def req(t, mode, accepted, cat="sql", tps=10.0):
        return {"t": t, "t_start": t - 1, "category": cat, "mode": mode, "draft_tokens": 10,
                "accepted_tokens": accepted, "tokens_per_s": tps}

    # SQL on the heads: 0.4 at first, 0.7 from 900 s; after the shift (1,200 s) most SQL goes to the draft (0.5)
    records = ([req(t, "medusa", 4) for t in range(10, 300, 30)]
               + [req(t, "medusa", 7, tps=20.0) for t in range(900, 1200, 30)]
               + [req(t, "mjsd", 5, tps=20.0) for t in range(1200, 1800, 20)]
               + [req(t, "medusa", 7, tps=20.0) for t in range(1210, 1800, 60)])
    args = argparse.Namespace(phase1={"sql": 0.75, "known": 0.25}, window=4, early_s=300.0, shift_at=1200.0,
                              duration=1800.0, auto_choice=True)
    mixed = targets(records, args)
    assert mixed["earlier_category_drop"] > 0.1                          # the mix moved to the other scale
    heads = per_drafter(records, args)["medusa"]
    assert heads["earlier_category_drop"] == pytest.approx(0.0) and heads["acceptance_gain_late"] == pytest.approx(0.3)
    assert "mjsd" not in per_drafter(records, args) or per_drafter(records, args)["mjsd"]["new_category"] == "sql"
    run = tmp_path / "online-auto"
    run.mkdir()
    (run / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"args": {**vars(args), "distilled": "heads"}, "failed_requests": 0}))
    assert rescore(tmp_path / "t.md", [run]) == 0
    row = json.loads((tmp_path / "t.json").read_text())[0]
    assert row["own"]["requests"] == 30 and row["own"]["earlier_drop_worst"] == pytest.approx(0.0)
    assert row["own"]["all_met_300s"] is True and row["all_met_300s"] is False
    assert "distilled kind's requests alone" in (tmp_path / "t.md").read_text()


def test_a_run_whose_schedule_moved_reports_both_kinds_versions_and_promotions(monkeypatch):
    """The forty-first session's run: the schedule distilled the draft (v2-v4), then moved to the heads (v2). The
    summary lists both registries' versions and promotions, each named by its kind; a run that did not move keeps
    the one registry's, unnamed."""
    import argparse

    import scripts.bench_online as bo

    seen = []

    def fake_state(env, args, heads=None):
        seen.append(heads)
        return [{"version": "1", "depth": 0}, {"version": "2", "depth": 1}], [
            {"action": "promote", "version": "2", "time": 1100.0}, {"action": "promote", "version": "3", "time": 900.0}]

    monkeypatch.setattr(bo, "registry_state", fake_state)
    args = argparse.Namespace(heads="h", distilled="heads", kind_moves=1)
    versions, events = bo.both_kinds({}, args, [{"version": "1", "depth": 0}], [(1500.0, "v2 champion")], 1000.0)
    assert seen == [False]                                        # the other kind's registry: the draft's
    assert [v["version"] for v in versions] == ["draft 1", "draft 2", "heads 1"]
    assert events == [(100.0, "draft v2 champion"), (1500.0, "heads v2 champion")]   # before t0: left out
    args.kind_moves = 0
    assert bo.both_kinds({}, args, [{"version": "1"}], [(5.0, "v2 champion")], 0.0) == ([{"version": "1"}],
                                                                                       [(5.0, "v2 champion")])
