#!/usr/bin/env bash
# A/B: replica torch threads 1 (default on 2 cores) vs 2; HTTP load 1/4/8 clients; first run also in-process at 1 and 2 threads
cd /work/main
for run in T1a T2a T1b T2b; do
  case $run in T1*) TH=1;; T2*) TH=2;; esac
  EXTRA="--engine-seconds 0"; [ $run = T1a ] && EXTRA="--engine-seconds 30 --engine-threads 1"
  echo "== $run $(date +%T) threads=$TH $EXTRA"
  .venv/bin/python /tmp/cpumon.py /tmp/ab2-$run-cpu.json 5 & M=$!
  DRAFTSMITH_TORCH_THREADS=$TH .venv/bin/python scripts/bench_load.py --clients 1 4 8 --seconds 45 $EXTRA --out /tmp/ab2-$run > /tmp/ab2-$run.log 2>&1
  kill $M; wait $M 2>/dev/null
  grep -E "^\||\[engine\]|In-process" /tmp/ab2-$run.log | head -16
done
echo "== done $(date +%T)"
