"""Per-step target forward time: a BatchKV with no holes vs one with rejected-draft holes (same tokens)."""
import time, sys, statistics as st, torch
sys.path.insert(0, '/work/main')
from serving.models import load_causal_lm, ensure_default_target
from serving.kvcache import BatchKV
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
m = load_causal_lm(ensure_default_target(), "cpu", dtype)
m = getattr(m, "model", m) if not hasattr(m, "lm_head") else m
print(type(m))
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (50,), generator=g).tolist()
toks = torch.randint(100, 40000, (200,), generator=g).tolist()

def run(holes_every: int, steps: int = 96):
    kv = BatchKV(m, torch.device("cpu")); kv.add_row(None, 0)
    kv.feed([prompt], 1)
    ts = []
    for i in range(steps):
        block = [toks[i]]
        t0 = time.perf_counter()
        if holes_every and i % holes_every == 0 and i < 40:
            kv.feed([block + [5, 6, 7]], 4); kv.drop_last(0, 3)       # a 3-token draft, all rejected
        else:
            kv.feed([block], 1)
            ts.append(time.perf_counter() - t0)
    return st.median(ts[-40:]), kv.slots, kv.lengths[0]

for rep in range(3):
    for he in (0, 4, 2):
        med, slots, ln = run(he)
        print(f"holes_every={he} median step {med*1e3:.2f} ms  slots {slots} valid {ln}", flush=True)
# a plain step on a cache whose mask has one hole vs none
