"""One target forward of 1 / 5 / 9 new tokens over a 150-token cache, per dtype (median of 15, 2 threads):
what a decode step and a verify pass cost on this CPU in fp32, bf16 (oneDNN) and fp16.
Run: .venv/bin/python docs/results/dtype-amx/step_dtype.py"""
import time

import torch

from serving.models import ensure_default_target, load_causal_lm

torch.set_num_threads(2)
path = ensure_default_target()
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    model = load_causal_lm(path, "cpu", dtype)
    with torch.no_grad():
        cache = model(torch.randint(0, 49000, (1, 150)), use_cache=True).past_key_values
        for rows in (1, 5, 9):
            times = []
            for _ in range(15):
                x = torch.randint(0, 49000, (1, rows))
                t0 = time.perf_counter()
                model(x, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                cache.crop(-rows)
            times.sort()
            print(f"{str(dtype):15s} rows {rows}: median {1000 * times[len(times) // 2]:.1f} ms", flush=True)
