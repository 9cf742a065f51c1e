import torch, time, os, sys, statistics
import torch.nn.functional as F
sys.path.insert(0, "/work/main")
from serving.models import load_causal_lm
from serving.kvcache import BatchKV
from pathlib import Path
torch.set_num_threads(2)
p = Path(os.path.expanduser("~/.cache/draftsmith/models/smollm2-135m-instruct"))
m = load_causal_lm(p, "cpu", torch.float32)
lin = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
def fwd(self, x):
    sh = x.shape
    x2 = x.reshape(-1, sh[-1])
    if x2.shape[0] <= 128:
        y = torch.mm(self.weight, x2.t()).t().contiguous()
        if self.bias is not None: y = y + self.bias
        return y.reshape(*sh[:-1], -1)
    return F.linear(x, self.weight, self.bias)
def patch(on):
    for mod in lin:
        if on: mod.forward = fwd.__get__(mod)
        elif "forward" in mod.__dict__: del mod.forward
prompt = list(range(1000, 1200))
kv = BatchKV(m, torch.device("cpu")); kv.add_row(None, 0)
with torch.no_grad():
    kv.feed([prompt], keep=1)
    sizes = [1,4,8,12,16,24,32,64]
    res = {on: {n: [] for n in sizes} for on in (False, True)}
    for r in range(5):
        for on in (False, True):
            patch(on)
            for n in sizes:
                t = time.perf_counter(); kv.feed([prompt[:n]], keep=n); dt = time.perf_counter() - t
                kv.drop_last(0, n)
                if r: res[on][n].append(dt)
    for on in (False, True):
        med = {n: statistics.median(v)*1e3 for n, v in res[on].items()}
        print("patched" if on else "stock  ", " ".join(f"{n}:{med[n]:.1f}({med[n]/med[1]:.2f})" for n in sizes))
    # equality
    patch(False); a = m(input_ids=torch.tensor([prompt[:50]])).logits
    patch(True); b = m(input_ids=torch.tensor([prompt[:5]])).logits; patch(False); c = m(input_ids=torch.tensor([prompt[:5]])).logits
    print("maxdiff", (b-c).abs().max().item(), "argmax same", bool((b.argmax(-1)==c.argmax(-1)).all()))
