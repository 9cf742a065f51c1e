#!/usr/bin/env bash
# on the lent GPU machine, from the repository root: bash /tmp/b/go.sh PHASE
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD DRAFTSMITH_CACHE=/tmp/dcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
R=/tmp/gpu-results; mkdir -p "$R" "$OUT"
case "$1" in
setup)
  pip install --no-deps --no-index --target /tmp/site /tmp/b/wheels/*.whl -q 2>&1 | tail -3
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "from serving.models import resolve_model_path; print(resolve_model_path(None))" 2>&1 | tail -2
  ;;
tests)
  DRAFTSMITH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -x \
     tests/serving/test_cuda_tree_modes.py tests/serving/test_engine_rules.py 2>&1 | tail -15 | tee "$R/cuda-tests.log"
  ;;
bench)
  shift; STEPS="$*" bash scripts/bench_gpu.sh /tmp/b/data "$R" "$OUT/gpu-results.tgz" 2>&1 | tail -80
  ;;
esac
tar czf "$OUT/gpu-results.tgz" -C /tmp gpu-results
