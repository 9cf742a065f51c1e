# torch.compile probe of the default target's decoder (45th session, not served): run from the repository root,
#   .venv/bin/python docs/results/compile-probe-2026-12-01/pass_cost.py
# Output: probe.txt beside this file.
import time, torch, statistics
from serving.models import ensure_default_target, load_causal_lm
from serving.decoding.tree import feed_masked, keep_path, _float_mask
torch.set_num_threads(2)
m = load_causal_lm(ensure_default_target(), device="cpu", dtype=torch.bfloat16)
ids = torch.randint(0, 49152, (240,)).tolist()
_, c = feed_masked(m, ids[:200], torch.ones(200, 200, dtype=torch.bool).tril(), torch.arange(200), None)
dec = m.get_decoder()
def run(d, n):
    mask = torch.ones(n, 200 + n, dtype=torch.bool).tril(200)
    with torch.no_grad():
        out = d(input_ids=torch.tensor([ids[200:200 + n]]), attention_mask=_float_mask(mask, torch.bfloat16),
                position_ids=torch.arange(200, 200 + n)[None], past_key_values=c, use_cache=True)
    keep_path(c, 199, [])
    return out
def bench(d, label):
    for n in (1, 8):
        ts = []
        for _ in range(20):
            t0 = time.perf_counter(); run(d, n); ts.append(time.perf_counter() - t0)
        print(label, n, f"{statistics.median(ts)*1e3:.1f} ms", flush=True)
bench(dec, "eager")
t0 = time.time()
cd = torch.compile(dec, dynamic=True)
try:
    run(cd, 1); run(cd, 8)
    print("compile+first runs", round(time.time() - t0, 1), "s", flush=True)
    bench(cd, "compiled")
except Exception as e:
    print("compile failed:", type(e).__name__, str(e)[:500])
