import torch, sys, time, collections
sys.path.insert(0, "/work/main")
torch.set_num_threads(2)
from serving import kvcache
from serving.engine import Engine
from serving.config import SamplingParams, SpecParams
e = Engine.from_paths(None, "data/bootstrap-draft")
T = collections.defaultdict(list)
orig = kvcache.BatchKV.feed
def feed(self, blocks, keep):
    t = time.perf_counter(); out = orig(self, blocks, keep); dt = time.perf_counter() - t
    who = "T" if self.model is e.target.model else "D"
    T[(who, len(blocks), max(len(b) for b in blocks), self.cache.get_seq_length() if hasattr(self.cache, "get_seq_length") else -1)].append(dt)
    return out
kvcache.BatchKV.feed = feed
tok = e.tokenizer
msgs = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"}]
prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
if hasattr(prompt, "input_ids"): prompt = prompt["input_ids"]
s = SamplingParams(temperature=0.0, max_tokens=64)
for spec in [SpecParams(mode="target"), SpecParams(mode="speculative", gamma=4, adaptive=False), SpecParams(mode="target"), SpecParams(mode="speculative", gamma=4, adaptive=False)]:
    T.clear()
    t = time.perf_counter(); r = e.generate_all(list(prompt), s, spec, log_mode="none"); w = time.perf_counter() - t
    agg = collections.defaultdict(list)
    for (who, rows, n, L), v in T.items(): agg[(who, rows, n)] += v
    print(spec.mode, f"wall {w:.2f}", {k: (len(v), round(sum(v)/len(v)*1e3, 1)) for k, v in sorted(agg.items())})
