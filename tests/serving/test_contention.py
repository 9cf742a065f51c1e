"""Jobs beside serving (serving/contention.py): markers written and removed, markers of processes that are gone
swept, the watch's count, the decorator that marks only beside serving, and a replica's scheduler on fewer
threads while a marker is live."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from serving import contention
from serving.contention import ContentionWatch, busy, busy_beside_serving, marks_busy, read_busy


def test_a_marker_lives_for_the_block_and_names_its_process(tmp_path):
    with busy("a distillation job", cores=1, directory=tmp_path) as path:
        live = read_busy(tmp_path)
        assert [m["pid"] for m in live] == [os.getpid()] and live[0]["what"] == "a distillation job"
        assert json.loads(path.read_text())["cores"] == 1
        with busy("the gate", cores=2, directory=tmp_path):
            assert sorted(m["cores"] for m in read_busy(tmp_path)) == [1, 2]
    assert read_busy(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_marker_is_removed_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with busy("a job that fails", directory=tmp_path):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_markers_of_processes_that_are_gone_are_swept_and_garbage_is_skipped(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(proc.stdout)
    (tmp_path / f"{dead}-x.json").write_text(json.dumps({"pid": dead, "what": "killed job", "cores": 1}))
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.txt").write_text("ignored")
    assert read_busy(tmp_path) == []
    assert not (tmp_path / f"{dead}-x.json").exists()      # swept
    assert (tmp_path / "junk.json").exists()                # unreadable: skipped, left alone
    assert read_busy(tmp_path / "missing") == []


def test_bad_cores_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cores"):
            with busy("x", cores=bad):
                pass


def test_the_watch_counts_cores_and_rereads_after_its_interval(tmp_path):
    watch = ContentionWatch(tmp_path, interval_s=3600)
    assert watch.busy_cores() == 0
    with busy("job", cores=2, directory=tmp_path):
        assert watch.busy_cores() == 0                      # cached within the interval
        assert ContentionWatch(tmp_path, interval_s=0).busy_cores() == 2
    fresh = ContentionWatch(tmp_path, interval_s=0)
    assert fresh.busy_cores() == 0


def test_only_a_process_beside_serving_marks_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_BUSY_DIR", str(tmp_path))

    @marks_busy("a job")
    def job():
        return [m["what"] for m in read_busy(tmp_path)]

    monkeypatch.setattr(contention.os, "nice", lambda inc: 0)     # its own machine: normal priority
    assert job() == []
    monkeypatch.setattr(contention.os, "nice", lambda inc: 10)    # niced by the distill machinery: beside serving
    assert job() == ["a job"]
    with busy_beside_serving("the gate"):
        assert [m["what"] for m in read_busy(tmp_path)] == ["the gate"]
    assert read_busy(tmp_path) == []


def test_the_job_and_the_gate_are_marked():
    """The two places that compute beside serving carry the decorator."""
    from deploy.distill_job import run_job
    from deploy.gate import run_gate

    for fn in (run_job, run_gate):
        assert fn.__wrapped__ is not None and fn.__code__ is not fn.__wrapped__.__code__


def test_a_replica_runs_on_fewer_threads_while_a_job_beside_it_holds_a_core(tmp_path, monkeypatch):
    """With a live marker for one core, the scheduler's drafting steps run on wide_threads - 1 and its plain
    steps on the decoding count - 1 (at least 1); T=0 output is unchanged; without the marker the wide count
    comes back. A fixed gamma: every step drafts (an adaptive request on a loaded host may plan plain steps)."""
    from tests.serving.test_batching import PROMPTS, ids, make_engine
    from tests import tiny_models
    from serving.config import SamplingParams, SpecParams
    from serving.kvcache import BatchKV

    pair = tiny_models.save_pair(tmp_path / "pair")
    eng = make_engine(pair)
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    spec = SpecParams(mode="speculative", gamma=3, adaptive=False)
    prompt = ids(eng, PROMPTS[0])
    alone = eng.generate_all(prompt, sampling, spec).token_ids
    decode = torch.get_num_threads()
    seen: list[tuple[int, int]] = []
    feed = BatchKV.feed

    def spy_feed(self, blocks, keep, *a, **kw):
        seen.append((max(len(b) for b in blocks), torch.get_num_threads()))
        return feed(self, blocks, keep, *a, **kw)

    monkeypatch.setattr(BatchKV, "feed", spy_feed)
    marks = tmp_path / "busy"
    eng.scheduler.wide_threads = decode + 1
    eng.scheduler.contention = ContentionWatch(marks, interval_s=0)
    with busy("a distillation job", cores=1, directory=marks):
        assert eng.generate_all(prompt, sampling, spec).token_ids == alone
    assert {t for n, t in seen if n > 1} == {decode}, seen
    assert torch.get_num_threads() == decode
    seen.clear()
    assert eng.generate_all(prompt, sampling, spec).token_ids == alone
    assert {t for n, t in seen if n > 1} == {decode + 1}, seen
