#!/usr/bin/env bash
# on the lent GPU machine, from the repository root: bash .gpu/go.sh PHASE [STEPS...]
#   stash N   : copy the carried chunk .gpu/cN to /tmp/b/parts (kept while the machine stays warm)
#   run STEPS : join the parts, install the wheels, then scripts/bench_gpu.sh with STEPS
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD DRAFTSMITH_CACHE=/tmp/dcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
R=/tmp/gpu-results; mkdir -p "$R" "$OUT" /tmp/b/parts
case "$1" in
stash)
  cp .gpu/c$2/* /tmp/b/parts/ && ls -la /tmp/b/parts | tail -n +2 ;;
run)
  shift
  for c in .gpu/c*; do cp $c/* /tmp/b/parts/; done
  cd /tmp/b && cat parts/bundle.tar.part* | tar x && cd - >/dev/null || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/b/wheels/*.whl 2>&1 | tail -3
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "from serving.models import resolve_model_path; print(resolve_model_path(None))" 2>&1 | tail -2
  STEPS="$*" bash scripts/bench_gpu.sh /tmp/b/data "$R" "$OUT/gpu-results.tgz" 2>&1 | tail -120 ;;
esac
tar czf "$OUT/gpu-results.tgz" -C /tmp gpu-results
