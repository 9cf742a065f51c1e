#!/bin/bash
# start the service, 1 client for ~60 s, sample per-process CPU and py-spy the replica
cd /work/main
PORT=8123
.venv/bin/draftsmith serve --port $PORT --no-bootstrap > /tmp/prof_serve.log 2>&1 &
SP=$!
for i in $(seq 1 150); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 2; done
echo "healthy after $((i*2)) s"
REP=$(pgrep -f "ServeReplica:draftsmith" | head -1)
echo "replica pid $REP"
.venv/bin/python - <<'PY' &
import httpx, time, json
t=time.time(); n=0; tok=0
with httpx.Client(base_url="http://127.0.0.1:8123", timeout=300) as c:
    while time.time()-t < 75:
        r=c.post("/v1/chat/completions", json={"messages":[{"role":"user","content":f"Explain question {n} about trains in a few sentences."}],"max_tokens":64,"temperature":0.7})
        tok+=r.json()["usage"]["completion_tokens"]; n+=1
print("client:", n, "requests", tok/(time.time()-t), "tok/s", flush=True)
PY
CL=$!
sleep 10
# per-process CPU over 40 s
ps -eo pid,comm,args --no-headers | awk '{print $1}' > /tmp/pids
declare -A T0
for p in $(cat /tmp/pids); do [ -r /proc/$p/stat ] && T0[$p]=$(awk '{print $14+$15}' /proc/$p/stat); done
( timeout 40 .venv/bin/py-spy record --pid $REP --duration 38 --threads --format raw --nonblocking -o /tmp/replica_spy.txt >/dev/null 2>&1 & )
sleep 40
for p in $(cat /tmp/pids); do
  [ -r /proc/$p/stat ] || continue
  t1=$(awk '{print $14+$15}' /proc/$p/stat); d=$((t1 - ${T0[$p]:-0}))
  [ $d -gt 20 ] && echo "$d ticks $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-110)"
done | sort -rn
wait $CL
kill -INT $SP; wait $SP
