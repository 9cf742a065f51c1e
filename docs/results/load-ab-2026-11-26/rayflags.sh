#!/usr/bin/env bash
# A/B: Ray Serve defaults vs throughput settings (no direct ingress), HTTP load 1/4/8 clients
cd /work/main
OPT="RAY_SERVE_USE_GRPC_BY_DEFAULT=1 RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1000 RAY_SERVE_LOG_TO_STDERR=0"
for run in A1 B1 A2 B2; do
  case $run in A*) E="";; B*) E="$OPT";; esac
  echo "== $run $(date +%T) env: $E"
  .venv/bin/python /tmp/cpumon.py /tmp/ab-$run-cpu.json 5 & M=$!
  env $E .venv/bin/python scripts/bench_load.py --clients 1 4 8 --seconds 45 --engine-seconds 0 --out /tmp/ab-$run > /tmp/ab-$run.log 2>&1
  kill $M; wait $M 2>/dev/null
  grep -E "^\|" /tmp/ab-$run.log | head -8
done
echo "== done $(date +%T)"
