# bf16 against fp32 on this host (45th session): one target pass of n tokens after a 200-token cache, the two dtypes
# interleaved pass by pass, 20 repeats, median. Run from the repository root:
#   .venv/bin/python docs/results/dtype-2026-12-01-fortyfifth/dtype.py
import time, torch, statistics
from serving.models import ensure_default_target, load_causal_lm
from serving.decoding.tree import feed_masked
torch.set_num_threads(2)
ms = {dt: load_causal_lm(ensure_default_target(), device="cpu", dtype=dt) for dt in (torch.bfloat16, torch.float32)}
ids = torch.randint(0, 49152, (240,)).tolist()
caches = {}
for dt, m in ms.items():
    _, caches[dt] = feed_masked(m, ids[:200], torch.ones(200, 200, dtype=torch.bool).tril(), torch.arange(200), None)
from serving.decoding.tree import keep_path
res = {(dt, n): [] for dt in ms for n in (1, 4, 8, 16)}
for rep in range(20):
    for n in (1, 4, 8, 16):
        for dt, m in ms.items():
            c = caches[dt]
            t0 = time.perf_counter()
            feed_masked(m, ids[200:200 + n], torch.ones(n, 200 + n, dtype=torch.bool).tril(200), torch.arange(200, 200 + n), c)
            res[(dt, n)].append(time.perf_counter() - t0)
            keep_path(c, 199, [])
for n in (1, 4, 8, 16):
    print(n, " ".join(f"{str(dt)[6:]} {statistics.median(res[(dt, n)]) * 1e3:.1f} ms" for dt in ms))
