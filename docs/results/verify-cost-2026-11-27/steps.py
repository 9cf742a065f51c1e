"""Target forward time per step in the engine: by tokens fed (k + 1) and by holes in the target's cache."""
import sys, time, statistics as st, collections, torch
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/work/main/scripts')
torch.set_num_threads(2)
from serving.engine import Engine
from serving.kvcache import BatchKV
from serving.config import SamplingParams, SpecParams
from traffic_prompts import prompt_ids
slack = int(sys.argv[1]) if len(sys.argv) > 1 else 64
e = Engine.from_paths(None, "/work/main/data/bootstrap-draft", device="cpu")
e.scheduler.compact_slack = slack
tgt_model = e.target.model
log = []
orig = BatchKV.feed
def feed(self, blocks, keep):
    t0 = time.perf_counter()
    out = orig(self, blocks, keep)
    if self.model is tgt_model and self.rows == 1:
        log.append((max(len(b) for b in blocks), self.slots - self.lengths[0], time.perf_counter() - t0, self.slots))
    return out
BatchKV.feed = feed
ids = prompt_ids(e.tokenizer, n=2)
prompts = [p for v in ids.values() for p in v]
sp = lambda seed: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=64, seed=seed)
e.generate_all(prompts[0], sp(0), SpecParams(mode="mjsd"), log_mode="none")
res = {}
for mode in ("target", "mjsd"):
    log.clear()
    for i, p in enumerate(prompts):
        e.generate_all(p, sp(i), SpecParams(mode=mode), log_mode="none")
    res[mode] = list(log)
by = collections.defaultdict(list)
for mode, L in res.items():
    for n, holes, dt, slots in L:
        if n > 20: continue    # prefill
        by[(mode, n, 'holes' if holes else 'none')].append(dt)
for k in sorted(by):
    v = by[k]
    print(k, len(v), 'median %.1f ms' % (1e3 * st.median(v)), 'mean %.1f' % (1e3 * st.mean(v)))
