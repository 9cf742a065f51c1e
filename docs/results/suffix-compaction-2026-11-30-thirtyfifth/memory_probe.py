import gc, time, sys, tracemalloc, random
sys.path.insert(0, ".")
from serving.decoding.suffix import SuffixStore
random.seed(0)
vocab = list(range(49152)); w = [1.0 / (r + 1) for r in range(49152)]
answers = [random.choices(vocab, w, k=120) for _ in range(2300)]
tracemalloc.start()
s = SuffixStore()
for a in answers:
    s.add([], a)
cur, peak = tracemalloc.get_traced_memory()
gc.collect(); gc.collect(); t = time.perf_counter(); gc.collect(); full = (time.perf_counter() - t) * 1e3
print(f"tokens {len(s)}, keys {len(s.index)}, memory {cur / 2**20:.1f} MiB (peak {peak / 2**20:.1f}), full collection {full:.0f} ms, compactions {getattr(s, 'compactions', '-')}")
