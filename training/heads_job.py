"""Online distillation of Medusa heads or an EAGLE-style head from the replay buffer (issue 19, step 3):
buffer -> heads candidate.

    examples_from_buffer(entries, sequences) -> list[dict]      # training/heads.py's example format
    run_heads_distillation(cfg, progress) -> Path               # a candidate heads folder (cfg "kind")
    resolve_for_remote(cfg) -> cfg                              # before it runs elsewhere (a Ray job)
    fresh_examples(..., after=window["sequence_cut"]) -> (examples, window)   # requests no job trained on yet
    python -m training.heads_job --parent-heads DIR [--kind eagle] [--parent-version 3] [--budget 120] [--out DIR]

**Where the target's opinion comes from.** Every verification step in the buffer stores the target's top-k
log-probabilities for rows 0..gamma; row i is the target's distribution of sequence token `position + i`
given the committed prefix, as long as the draft tokens before it are the committed ones. Collected over a
request's steps, these rows cover every generated position (each step scores at least its accepted tokens
and the next one), so a request becomes one example: its sequence, its prompt length and one top-k row per
answer token (cut at the first position no step scored). The heads also need the target's last hidden
state at each position, which the buffer does not hold: the job recomputes it with ONE teacher-forced
target pass per request (training/heads.py `target_hidden_rows`, measured at bootstrap: about 62 s per
100k tokens on 2 CPU threads, while storing the 576-wide states of every position would add 1.2 KB per
token to the buffer, about 5x its step records). Successive jobs read overlapping windows, so the states
of a sequence once computed are kept on disk (training/hidden_cache.py, bounded, shared with the gate)
and read back by later jobs instead of recomputed.

**What is trained.** Medusa (kind "medusa"): the heads' own weights (residual blocks; the output rows stay
the target's frozen rows on the parent's kept vocabulary): about 1M parameters, as small as a LoRA adapter on
the draft would be, so an online version stores full weights and needs no adapter chain. Training starts
from the parent heads (the champion) and keeps the epoch of best held-out agreement (training/heads.py
`train_heads`). EAGLE (kind "eagle"): the head's decoder layer and its feature projection (2.4M parameters
at the default target, still small enough to store whole; a LoRA on one layer would save storage, not
time), trained from the parent head with `train_eagle` on the same examples and the target's features
at every position (one teacher-forced pass per request, as for Medusa); the epoch of best held-out
first-token agreement is kept, the parent's own score included, so a job never hands on a worse head.
Both stop early once `patience` epochs in a row (default 2; 0 trains to the budget) gain no more than
`min_gain` (0.002) of held-out agreement over the best epoch: replayed on the 65 logged jobs of the
earlier online runs, that ends training 38% sooner and keeps a best epoch 0.0045 under the full run's on
average, under what a held-out sample of about 1,000 positions resolves (docs/benchmarks.md, "The
twenty-third session"). A job beside serving slows serving for as long as it runs.

**Which records.** Read-only (no consumer group, so the draft's distillation jobs keep every record): the
newest `max_records` training steps and the newest `eval_records` held-out steps (`training.data.is_heldout`,
the split every job and the gate use), of any decoding mode. With `replay_ratio` r > 0 the job also trains on
the newest r x (window steps) training steps OLDER than its window (`training.data.replay_window`, as the
draft's job replays): after a traffic shift the window holds only the new traffic, and a head trained on it
alone loses some of what it did on the earlier traffic (docs/benchmarks.md, "EAGLE head versions"). A replayed
request already in the window is not trained on twice. The default is r = 1, as for the draft's job: in the
30-minute online experiment (docs/benchmarks.md, "The seventeenth session") heads trained on their window alone
lost 0.07-0.12 of live acceptance on the earlier traffic after a shift, with r = 1 they kept rising on it.
The window is 12,000 steps for Medusa heads (4,000 for EAGLE, not measured): on the buffer a 30-minute online run
left (scripts/bench_heads_window.py, docs/benchmarks.md "The twenty-sixth session"), one job from that run's
final champion scored +0.001 / +0.000 (4,000 steps, two seeds), +0.013 (8,000) and +0.022 / +0.026 (12,000) of
held-out chain acceptance over all categories: the smaller window learnt the newest traffic as well but lost
0.02-0.03 on the earlier one, which the larger window, with its equal replay, kept. The job takes about twice as
long (135 s against 42-64 s, on the same 120-s training budget).

The candidate folder: `medusa_heads.json` + `medusa_heads.safetensors` (MedusaHeads.save; EAGLE: eagle_head.*,
EagleHead.save) + `candidate.json`
(parent_version, target, target_sha256, metrics before/after, train_config, data_window, whose
`sequence_cut` is the buffer's sequence cursor taken after the job's reads: deploy/heads.py's fresh evidence),
which `Registry.register_heads` reads (deploy/registry.py). Importing this module does not import torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

DEFAULTS = {"max_records": 12000, "eval_records": 1000, "heldout_fraction": 0.1, "budget_s": 120.0, "lr": 3e-4,
            "batch_size": 256, "max_epochs": 20, "min_train_rows": 64, "min_heldout_rows": 16,
            "buffer_prefix": "draftsmith:buf", "redis_url": None, "target": None, "parent_heads": None,
            "parent_version": None, "target_sha256": None, "out_dir": None, "seed": 0, "kind": "medusa",
            "replay_ratio": 1.0, "patience": 2, "min_gain": 0.002}
# an EAGLE batch is sequences (Medusa's is rows); a gentler step; the window not measured for EAGLE: kept at 4000
EAGLE_DEFAULTS = {"lr": 2e-4, "batch_size": 8, "max_records": 4000}
KINDS = ("medusa", "eagle")                      # serving/config.py HEADS_MODES (training may not import it)


class NotEnoughRows(RuntimeError):
    """Too few scored positions in the buffer for a heads job; nothing was trained."""


def examples_from_buffer(entries, sequences: dict) -> list[dict]:
    """One example per request (module docstring): {"tokens", "prompt_len", "topk_ids" [A, k],
    "topk_logprobs" [A, k], "hard" [A] (the target's top-1 per answer token), "source", "request_id"}.
    Requests with fewer than 2 scored answer tokens are left out."""
    rows: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for e in entries:
        st = e.record
        seq_rec = sequences.get(st.request_id)
        if seq_rec is None:
            continue
        seq = np.asarray(seq_rec.token_ids, dtype=np.int64)
        p, d = int(st.position), np.asarray(st.draft_tokens, dtype=np.int64)
        if p < 1 or p > len(seq):
            continue
        avail = seq[p: p + len(d)]
        bad = np.flatnonzero(avail != d[: len(avail)])
        m = int(bad[0]) if bad.size else len(avail)          # rows 0..m are conditioned on committed tokens
        per = rows.setdefault(st.request_id, {})
        for i in range(min(m, st.target_topk_ids.shape[0] - 1) + 1):
            if p + i >= len(seq):
                break
            per.setdefault(p + i, (st.target_topk_ids[i], st.target_topk_logprobs[i]))
    out = []
    for rid, per in rows.items():
        rec = sequences[rid]
        P = int(rec.prompt_len)
        A = 0
        while P + A in per:
            A += 1
        if A < 2 or P < 1:
            continue
        k = min(per[P + j][0].shape[0] for j in range(A))
        ids = np.stack([per[P + j][0][:k] for j in range(A)]).astype(np.int64)
        lps = np.stack([per[P + j][1][:k] for j in range(A)]).astype(np.float32)
        hard = ids[np.arange(A), lps.argmax(axis=1)]
        out.append({"tokens": np.asarray(rec.token_ids[: P + A], dtype=np.int64).tolist(), "prompt_len": P,
                    "topk_ids": ids, "topk_logprobs": lps, "hard": hard, "source": rec.source or "unlabelled",
                    "request_id": rid})
    return out


def read_examples(*, redis_url: str | None, buffer_prefix: str, n: int, heldout: bool,
                  heldout_fraction: float, before_id: str | None = None,
                  category_floor: int = 0, target_sha256: str | None = None) -> tuple[list[dict], dict]:
    """The newest `n` training (or held-out) steps of the buffer (older than `before_id` if given) as
    examples, read-only; and the window. Held out with `category_floor`: the gate's sample, topped up to
    that many requests per traffic source (training/data.py `stratified_heldout`). With `target_sha256`,
    requests another target scored are left out (buffer/redis_store.py `ReplayBufferReader(target=...)`)."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader, resolve_redis_url, stream_id_key
    from training.data import newest_steps, stratified_heldout

    reader = ReplayBufferReader(resolve_redis_url(redis_url), BufferConfig(prefix=buffer_prefix),
                                target=target_sha256 or None)
    try:
        if heldout and category_floor and before_id is None:
            entries, seqs = stratified_heldout(reader, n, heldout_fraction=heldout_fraction,
                                               category_floor=category_floor)
        else:
            entries, seqs = newest_steps(reader, n, heldout=heldout, heldout_fraction=heldout_fraction,
                                         before_id=before_id)
    finally:
        reader.client.close()
    ids = sorted((e.stream_id for e in entries), key=stream_id_key)
    window = {"stream": reader.config.steps_key, "first_id": ids[0] if ids else None,
              "last_id": ids[-1] if ids else None, "steps": len(entries), "heldout": heldout,
              "heldout_fraction": heldout_fraction}
    return examples_from_buffer(entries, seqs), window


def fresh_examples(*, redis_url: str | None, buffer_prefix: str, after: str, n: int,
                   heldout_fraction: float, target_sha256: str | None = None) -> tuple[list[dict], dict]:
    """The gate's fresh evidence as examples (training/data.py `fresh_window`: the not-held-out requests whose
    SequenceRecord was written after `after`, a job's `data_window.sequence_cut`), read-only; and the window.
    `target_sha256` as for `read_examples`."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader, resolve_redis_url
    from training.data import fresh_window

    reader = ReplayBufferReader(resolve_redis_url(redis_url), BufferConfig(prefix=buffer_prefix),
                                target=target_sha256 or None)
    try:
        entries, seqs = fresh_window(reader, after, n, heldout_fraction=heldout_fraction)
    finally:
        reader.client.close()
    examples = examples_from_buffer(entries, seqs)
    return examples, {"sequence_cut": after, "requests": len(examples), "steps": len(entries)}


def sequence_cut(*, redis_url: str | None, buffer_prefix: str) -> str:
    """The buffer's sequence cursor now (buffer/redis_store.py `sequence_cursor`): taken by a job after its
    reads, every request it could have trained on has its SequenceRecord at or before it."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader, resolve_redis_url

    reader = ReplayBufferReader(resolve_redis_url(redis_url), BufferConfig(prefix=buffer_prefix))
    try:
        return reader.sequence_cursor()
    finally:
        reader.client.close()


def _config(cfg: dict) -> dict:
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown heads-job settings {unknown}; known: {sorted(DEFAULTS)}")
    given = {k: v for k, v in cfg.items() if v is not None}
    if given.get("kind", "medusa") not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {given.get('kind')!r}")
    out = {**DEFAULTS, **(EAGLE_DEFAULTS if given.get("kind") == "eagle" else {}), **given}
    if not out["parent_heads"]:
        raise ValueError("parent_heads (the heads folder to start from, e.g. the materialised champion) is required")
    for key in ("max_records", "eval_records", "batch_size", "max_epochs"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {out[key]!r}")
    if isinstance(out["patience"], bool) or not isinstance(out["patience"], int) or out["patience"] < 0:
        raise ValueError(f"patience must be an integer >= 0 (0: train to the budget), got {out['patience']!r}")
    g = out["min_gain"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0.0 <= g < 1.0):
        raise ValueError(f"min_gain must be a number in [0, 1), got {g!r}")
    if not (0.0 < float(out["heldout_fraction"]) < 1.0):
        raise ValueError(f"heldout_fraction must be in (0, 1), got {out['heldout_fraction']!r}")
    if not (float(out["budget_s"]) > 0 and float(out["lr"]) > 0):
        raise ValueError("budget_s and lr must be > 0")
    r = out["replay_ratio"]
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 <= r <= 10.0):
        raise ValueError(f"replay_ratio must be a number in [0, 10], got {r!r}")
    return out


def resolve_for_remote(cfg: dict) -> dict:
    """`cfg` validated (ValueError here, in the driver) with what a job running elsewhere (a Ray task, a Ray
    job's entrypoint: deploy/ray_jobs.py) must not resolve on its own: the Redis URL and absolute parent and
    output folders (the output fixed now, so the driver knows where the candidate will be)."""
    from buffer.redis_store import resolve_redis_url

    c = _config(cfg)
    return {**cfg, "kind": c["kind"], "redis_url": resolve_redis_url(c["redis_url"]),
            "parent_heads": str(Path(c["parent_heads"]).resolve()),
            "out_dir": str(Path(c["out_dir"]).resolve() if c["out_dir"] else
                           _default_out_dir(c["parent_version"], c["kind"]).resolve())}


def run_heads_distillation(cfg: dict, progress: Callable[[str], None] = print) -> Path:
    """One job (module docstring): returns the candidate folder. NotEnoughRows when the buffer holds too
    few scored positions (training or held-out); ValueError for a bad setting; ModelLoadError when the
    parent heads do not load on the target."""
    import torch

    from serving.models import default_dtype, load_causal_lm, resolve_model_path
    from training.hidden_cache import hidden_cache_for

    c = _config(cfg)
    t0 = time.time()
    torch.manual_seed(int(c["seed"]))
    mine = c["target_sha256"]                  # requests another target scored are not this job's to learn
    train_ex, train_window = read_examples(redis_url=c["redis_url"], buffer_prefix=c["buffer_prefix"],
                                           n=c["max_records"], heldout=False, heldout_fraction=c["heldout_fraction"],
                                           target_sha256=mine)
    held_ex, held_window = read_examples(redis_url=c["redis_url"], buffer_prefix=c["buffer_prefix"],
                                         n=c["eval_records"], heldout=True, heldout_fraction=c["heldout_fraction"],
                                         target_sha256=mine)
    replay_ex, replay_window = _replay(c, train_ex, train_window)
    cut = sequence_cut(redis_url=c["redis_url"], buffer_prefix=c["buffer_prefix"])     # after every read
    progress(f"[heads-job] {len(train_ex)} training requests ({train_window['steps']} steps), {len(replay_ex)} "
             f"replayed older requests ({replay_window['steps']} steps), {len(held_ex)} held-out requests "
             f"({held_window['steps']} steps) from the buffer in {time.time() - t0:.1f} s")
    n_window = len(train_ex)
    train_ex = train_ex + replay_ex
    tpath = resolve_model_path(c["target"])
    dtype = default_dtype("cpu")
    target = load_causal_lm(tpath, "cpu", dtype)                     # the hidden states serving sees
    cache = hidden_cache_for(tpath, dtype)          # states kept between jobs and gates (training/hidden_cache.py)
    train_fn = _train_eagle if c["kind"] == "eagle" else _train_medusa
    heads, metrics = train_fn(c, target, train_ex, held_ex, progress, cache)
    measure = metrics.pop("_measure")
    metrics.update(heldout_records=held_window["steps"], seconds=round(time.time() - t0, 1),
                   replay_requests=len(replay_ex), replay_steps=replay_window["steps"])
    if cache is not None:
        metrics.update(hidden_cache_hits=cache.hits, hidden_cache_misses=cache.misses)
    out = Path(c["out_dir"]) if c["out_dir"] else _default_out_dir(c["parent_version"], c["kind"])
    heads.save(out, built_by="training.heads_job", parent_heads=str(c["parent_heads"]))
    meta = {"kind": c["kind"], "parent_version": c["parent_version"], "target": c["target"] or str(tpath),
            "target_sha256": c["target_sha256"], "metrics": metrics,
            "train_config": {k: c[k] for k in ("kind", "max_records", "eval_records", "budget_s", "lr",
                                                "batch_size", "max_epochs", "heldout_fraction", "seed",
                                                "replay_ratio", "patience", "min_gain")},
            # last_id: the newest step the job looked at, training or held out (a schedule's cursor)
            "data_window": {**{k: train_window[k] for k in ("stream", "first_id", "steps")},
                            "last_id": _newest_id(train_window["last_id"], held_window["last_id"]),
                            "last_training_id": train_window["last_id"], "sequence_cut": cut,
                            "requests": n_window, "heldout_steps": held_window["steps"],
                            "heldout_requests": len(held_ex),
                            "replay": {k: replay_window[k] for k in ("first_id", "last_id", "steps")}
                            | {"requests": len(replay_ex)}}}
    (out / "candidate.json").write_text(json.dumps(meta, indent=1, default=str))
    progress(f"[heads-job] {measure} {metrics['offline_acceptance_before']:.4f} -> "
             f"{metrics['offline_acceptance_after']:.4f}; wrote {out} in {time.time() - t0:.0f} s")
    return out


def _replay(c: dict, train_ex: list[dict], window: dict) -> tuple[list[dict], dict]:
    """The replay share (module docstring, "Which records"): examples of the newest replay_ratio x (window
    steps) training steps older than the window, requests already in the window left out; and that window."""
    n = int(round(float(c["replay_ratio"]) * window["steps"]))
    if n < 1 or not window["first_id"]:
        return [], {"first_id": None, "last_id": None, "steps": 0}
    ex, rep = read_examples(redis_url=c["redis_url"], buffer_prefix=c["buffer_prefix"], n=n, heldout=False,
                            heldout_fraction=c["heldout_fraction"], before_id=window["first_id"],
                            target_sha256=c["target_sha256"])
    seen = {e["request_id"] for e in train_ex}
    return [e for e in ex if e["request_id"] not in seen], rep


def _load_parent(cls, c: dict, target):
    from serving.models import ModelLoadError

    try:
        return cls.load(c["parent_heads"], target)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelLoadError(f"cannot load the parent heads {c['parent_heads']}: {e}") from e


def _check_rows(c: dict, n_train: int, n_held: int) -> None:
    if n_train < c["min_train_rows"] or n_held < c["min_heldout_rows"]:
        raise NotEnoughRows(f"the buffer holds {n_train} training and {n_held} held-out scored positions; a heads "
                            f"job needs at least {c['min_train_rows']} and {c['min_heldout_rows']}")


def _train_medusa(c: dict, target, train_ex: list[dict], held_ex: list[dict], progress, cache=None):
    """Medusa heads from the parent on the examples (module docstring); (heads, metrics). `cache`: the
    target's hidden states kept between jobs (training/hidden_cache.py), or None."""
    from serving.decoding.medusa import MedusaHeads
    from training.heads import (HeadData, chain_acceptance, head_agreement, kept_index, target_hidden_rows,
                                train_heads)

    heads = _load_parent(MedusaHeads, c, target)
    vocab_index = kept_index(target, heads.output_token_ids)
    K = heads.config.num_heads
    th = time.time()
    train = HeadData(train_ex, target_hidden_rows(target, train_ex, cache=cache, progress=progress), K,
                     vocab_index) if train_ex else None
    held = HeadData(held_ex, target_hidden_rows(target, held_ex, cache=cache, progress=progress), K,
                    vocab_index) if held_ex else None
    n_train, n_held = (len(train) if train else 0), (len(held) if held else 0)
    _check_rows(c, n_train, n_held)
    hidden_s = time.time() - th
    before_agree, before_chain = head_agreement(heads, held), chain_acceptance(heads, held)
    progress(f"[heads-job] {n_train} training rows, {n_held} held-out rows (hidden states {hidden_s:.1f} s); "
             f"before: held-out agreement per head {before_agree}, chain acceptance {before_chain}")
    figures = train_heads(heads, train, held, deadline=time.time() + float(c["budget_s"]),
                          batch_size=c["batch_size"], lr=float(c["lr"]), max_epochs=c["max_epochs"],
                          patience=c["patience"] or None, min_gain=float(c["min_gain"]), progress=progress)
    after_chain = figures["heldout_chain_acceptance"]
    metrics = {"heldout_chain_acceptance_before": sum(before_chain) / K,
               "heldout_chain_acceptance_after": sum(after_chain) / K,
               "heldout_head1_agreement_before": before_agree[0],
               "heldout_head1_agreement_after": figures["heldout_head_agreement"][0],
               "training_rows": n_train, "heldout_rows": n_held, "train_steps": figures["steps"],
               "epochs": figures["epochs"], "best_epoch": figures["best_epoch"] or 0,
               "stopped_early": float(figures["converged"]), "hidden_state_seconds": round(hidden_s, 1),
               "_measure": f"chain acceptance (accepted / proposed, greedy chain of {K})"}
    # the registry and the gate read "offline_acceptance_*": here accepted / proposed of a greedy chain of K heads
    metrics["offline_acceptance_before"] = metrics["heldout_chain_acceptance_before"]
    metrics["offline_acceptance_after"] = metrics["heldout_chain_acceptance_after"]
    return heads, metrics


def _train_eagle(c: dict, target, train_ex: list[dict], held_ex: list[dict], progress, cache=None):
    """An EAGLE head from the parent on the examples (module docstring); (head, metrics). `cache` as
    `_train_medusa`."""
    from serving.decoding.eagle import EagleHead
    from training.heads import kept_index, target_hidden_states, train_eagle

    head = _load_parent(EagleHead, c, target)
    vocab_index = kept_index(target, head.output_token_ids)
    # rows the loss scores: answer positions whose token is in the head's vocabulary (as `_eagle_batch`)
    n_train = sum(max(0, len(e["topk_ids"]) - max(0, 2 - e["prompt_len"])) for e in train_ex)
    n_held = sum(max(0, len(e["topk_ids"]) - max(0, 2 - e["prompt_len"])) for e in held_ex)
    _check_rows(c, n_train, n_held)
    th = time.time()
    train_f = target_hidden_states(target, train_ex, cache=cache, progress=progress)
    held_f = target_hidden_states(target, held_ex, cache=cache, progress=progress)
    hidden_s = time.time() - th
    progress(f"[heads-job] {n_train} training rows, {n_held} held-out rows (hidden states {hidden_s:.1f} s)")
    figures = train_eagle(head, train_ex, train_f, held_ex, held_f, vocab_index,
                          deadline=time.time() + float(c["budget_s"]), batch_size=c["batch_size"], lr=float(c["lr"]),
                          max_epochs=c["max_epochs"], patience=c["patience"] or None, min_gain=float(c["min_gain"]),
                          tag="heads-job", progress=progress)
    metrics = {"heldout_agreement_before": figures["heldout_agreement_before"],
               "heldout_agreement_after": figures["heldout_agreement"],
               "training_rows": n_train, "heldout_rows": n_held, "train_steps": figures["steps"],
               "epochs": figures["epochs"], "best_epoch": figures["best_epoch"] or 0,
               "stopped_early": float(figures["converged"]), "hidden_state_seconds": round(hidden_s, 1),
               "_measure": "held-out first-token agreement (the head's top-1 = the target's, teacher-forced)"}
    # the registry and the gate read "offline_acceptance_*": here the head's teacher-forced first-token agreement
    metrics["offline_acceptance_before"] = metrics["heldout_agreement_before"]
    metrics["offline_acceptance_after"] = metrics["heldout_agreement_after"]
    return head, metrics


def _newest_id(*ids: str | None) -> str | None:
    from buffer.redis_store import stream_id_key

    known = [i for i in ids if i]
    return max(known, key=stream_id_key) if known else None


def _default_out_dir(parent_version, kind: str = "medusa") -> Path:
    from buffer.paths import data_dir

    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "heads" if kind == "medusa" else kind
    return data_dir() / "candidates" / f"{name}-from-v{parent_version or 'none'}-{stamp}-{uuid.uuid4().hex[:6]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent-heads", type=Path, required=True, help="heads folder to start from")
    ap.add_argument("--kind", choices=KINDS, default="medusa", help="what the folder holds (default medusa)")
    ap.add_argument("--parent-version", default=None, help="its registry version (recorded as the parent)")
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--out", type=Path, default=None, help="candidate folder (default under <data>/candidates)")
    ap.add_argument("--budget", type=float, default=DEFAULTS["budget_s"], help="training seconds")
    ap.add_argument("--max-records", type=int, default=None,
                    help=f"newest training steps per job (default {DEFAULTS['max_records']}; EAGLE "
                         f"{EAGLE_DEFAULTS['max_records']})")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--buffer-prefix", default=DEFAULTS["buffer_prefix"])
    ap.add_argument("--replay-ratio", type=float, default=DEFAULTS["replay_ratio"],
                    help="also train on this many older training steps per window step (default 1; 0: none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        run_heads_distillation({"parent_heads": str(args.parent_heads), "kind": args.kind,
                                "parent_version": args.parent_version,
                                "target": args.target, "out_dir": args.out, "budget_s": args.budget,
                                "max_records": args.max_records, "redis_url": args.redis_url,
                                "buffer_prefix": args.buffer_prefix, "replay_ratio": args.replay_ratio})
    except (NotEnoughRows, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
