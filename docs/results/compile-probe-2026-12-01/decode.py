# torch.compile probe of the default target's decoder (45th session, not served): run from the repository root,
#   .venv/bin/python docs/results/compile-probe-2026-12-01/decode.py
# Output: probe.txt beside this file.
import time, torch, statistics
from serving.models import ensure_default_target, load_causal_lm
from serving.decoding.tree import feed_masked
torch.set_num_threads(2)
m = load_causal_lm(ensure_default_target(), device="cpu", dtype=torch.bfloat16)
ids = torch.randint(0, 49152, (200,)).tolist()
def decode(n=48):
    logits, c = feed_masked(m, ids, torch.ones(200, 200, dtype=torch.bool).tril(), torch.arange(200), None)
    L = 200; ts = []
    tok = int(logits[-1].argmax())
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits, c = feed_masked(m, [tok], torch.ones(1, L + 1, dtype=torch.bool), torch.arange(L, L + 1), c)
        ts.append(time.perf_counter() - t0)
        tok = int(logits[-1].argmax()); out.append(tok); L += 1
    return out, ts
ref, ts = decode(); print("eager median", f"{statistics.median(ts)*1e3:.1f}", flush=True)
t0 = time.time()
m.get_decoder().compile(dynamic=True)
out, ts = decode(); print("compiled first decode", round(time.time()-t0,1), "s; steps median", f"{statistics.median(ts)*1e3:.1f}", "max", f"{max(ts)*1e3:.0f}", flush=True)
out, ts = decode(); print("compiled second decode median", f"{statistics.median(ts)*1e3:.1f}", "max", f"{max(ts)*1e3:.0f}", "same tokens", out == ref, flush=True)
from torch._dynamo.utils import counters
print({k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")})
