import time, torch
from serving.models import load_causal_lm, ensure_default_target
m = load_causal_lm(ensure_default_target(), "cpu", torch.float32)
d = load_causal_lm("data/bootstrap-draft-2", "cpu", torch.float32)
ids = torch.randint(100, 20000, (1, 150))
for th in (1, 2, 1, 2):
    torch.set_num_threads(th)
    with torch.no_grad():
        m(ids); t = time.perf_counter()
        for _ in range(3): m(ids)
        tt = (time.perf_counter() - t) / 3; t = time.perf_counter()
        for _ in range(3): d(ids)
        td = (time.perf_counter() - t) / 3
    print(th, f"target prefill 150 tok {tt*1000:.0f} ms, draft {td*1000:.0f} ms", flush=True)
