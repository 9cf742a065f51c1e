#!/bin/bash
# issue 18: HTTP load before (2c4ddee) and after (6bcd033) the reshape, same draft folder, same client script
cd /work/main
for round in 1 2; do
 for name in before after; do
  DATA=/tmp/ab/data-$name-$round; rm -rf $DATA; mkdir -p $DATA
  echo "=== $name round $round $(date +%T)"
  PYTHONPATH=/tmp/wt-$name DRAFTSMITH_DATA=$DATA setsid .venv/bin/python -m deploy.cli serve --port 8123 \
     --draft /work/main/data/bootstrap-draft --no-bootstrap > /tmp/ab/serve-$name-$round.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 2; done
  curl -s http://127.0.0.1:8123/health | head -c 400; echo
  .venv/bin/python scripts/bench_load.py --url http://127.0.0.1:8123 --clients 1 4 --seconds 45 --engine-seconds 0 \
     --out /tmp/ab/$name-$round 2>&1 | tail -4
  kill -INT -- -$SP; for i in $(seq 1 60); do kill -0 $SP 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$SP 2>/dev/null; sleep 3
 done
done
echo done
