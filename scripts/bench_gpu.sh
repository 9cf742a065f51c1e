#!/usr/bin/env bash
# The GPU table in one go, for a machine lent for minutes (issue 19: "GPU: the same table, plus J/token"):
#   (1) tree verification cost against a one-token target step (scripts/bench_tree.py --cost-only);
#   (2) GSM8K held-out per draft kind at T=0 and at T=1 (scripts/bench_decode.py), J/token from NVML;
#   (3) the traffic mix, every category, T=0 (scripts/bench_traffic.py), J/token from NVML;
#   (4) concurrent clients in-process, 1 / 4 / 8, the default MJSD and target-only (scripts/bench_load.py --no-http).
#
#   bash scripts/bench_gpu.sh [DATA] [RESULTS] [TARBALL]
#
# DATA holds bootstrap-draft/ (draftsmith bootstrap), medusa-heads/ and eagle-head/ (python -m training.heads);
# RESULTS (default /tmp/gpu-results) gets every benchmark's files; after each step they are packed into TARBALL
# (when given) so that a run cut short still returns what it finished. Each step has its own time limit;
# a failed step is reported and the next one runs. PYTHON picks the interpreter (default python3); DEVICE=cpu
# SMOKE=1 tries the whole script on the CPU in a minute (1 prompt each, 8 tokens) before a lent GPU's time is spent.
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-data}
RESULTS=${2:-/tmp/gpu-results}
TARBALL=${3:-}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
# GPU_N prompts x GPU_TOKENS tokens for GSM8K (default 5 x 96), GPU_TRAFFIC_N prompts per traffic category
# (default 2); STEPS picks steps by name (default: all). Sized for minutes: on an H200 HF's eager target step
# is bound by the host's Python (about 20 target-only tokens/s, docs/benchmarks.md).
if [ -n "${SMOKE:-}" ]; then N=(--n 1 --max-tokens 8); NT=(--n 1 --max-tokens 8 --temperatures 0); R=2
else N=(--n "${GPU_N:-5}" --max-tokens "${GPU_TOKENS:-96}"); NT=(--n "${GPU_TRAFFIC_N:-2}" --temperatures 0); R=30; fi
LOAD_S=${GPU_LOAD_SECONDS:-20}; [ -n "${SMOKE:-}" ] && LOAD_S=3
STEPS=${STEPS:-cudnn-on cudnn-off tree decode-T0 traffic decode-T1 load-mjsd load-target}
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv > "$RESULTS/gpu.txt" 2>&1
cat "$RESULTS/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$RESULTS/gpu.txt"

pack() {
    if [ -n "$TARBALL" ]; then tar czf "$TARBALL" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"; fi
}

step() {   # step NAME SECONDS ARGS...: one benchmark, its log in RESULTS/NAME.log (progress bars dropped)
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) echo "== $name: skipped (STEPS)"; return 0 ;; esac
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$PY" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    grep -v 'it/s\]\|s/it\]' "$RESULTS/$name.log" | tail -n 25
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    pack
}

HEADS=(--medusa-heads "$DATA/medusa-heads" --eagle-head "$DATA/eagle-head")
# torch's cuDNN attention on and off (serving/models.py configure_cuda_attention): target-only on fresh prompts,
# no untimed warm pass, so a per-shape plan cost shows
for c in on off; do
    DRAFTSMITH_CUDNN_SDPA=$([ $c = on ] && echo 1 || echo 0) step "cudnn-$c" 90 scripts/bench_decode.py \
        --device "$DEVICE" --draft "$DATA/bootstrap-draft" "${N[@]}" --temperature 0 --modes target,mjsd \
        --no-warm-each --no-full-vocab --out "$RESULTS/cudnn-$c"
done
step tree 60 scripts/bench_tree.py --device "$DEVICE" --cost-only --draft "$DATA/bootstrap-draft" --out "$RESULTS/tree" \
    --repeats "$R"
step decode-T0 150 scripts/bench_decode.py --device "$DEVICE" --draft "$DATA/bootstrap-draft" "${HEADS[@]}" \
    "${N[@]}" --temperature 0 --modes target,mjsd,medusa,eagle --no-full-vocab --out "$RESULTS/decode"
step traffic 200 scripts/bench_traffic.py --device "$DEVICE" --draft "$DATA/bootstrap-draft" "${HEADS[@]}" \
    "${NT[@]}" --modes default,target,medusa,eagle --out "$RESULTS/traffic"
step decode-T1 150 scripts/bench_decode.py --device "$DEVICE" --draft "$DATA/bootstrap-draft" "${HEADS[@]}" \
    "${N[@]}" --temperature 1 --modes target,mjsd,medusa,eagle --no-full-vocab --out "$RESULTS/decode"
for m in mjsd target; do
    step "load-$m" 120 scripts/bench_load.py --no-http --device "$DEVICE" --draft "$DATA/bootstrap-draft" --mode "$m" \
        --engine-clients 4 8 --engine-seconds "$LOAD_S" --max-tokens 64 --out "$RESULTS/load-$m"
done
echo "== done $(date +%T)"
