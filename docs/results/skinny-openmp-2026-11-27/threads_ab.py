import torch, sys, time, statistics
sys.path.insert(0, "/work/main")
torch.set_num_threads(2)
from serving.engine import Engine
from serving.kvcache import BatchKV
e = Engine.from_paths(None, "data/bootstrap-draft")
prompt = list(range(1000, 1100))
dev = torch.device("cpu")
tk = BatchKV(e.target.model, dev); tk.add_row(None, 0); tk.feed([prompt], keep=1)
dk = BatchKV(e.draft.model, dev); dk.add_row(None, 0); dk.feed([prompt], keep=1)
def t_target(n):
    t = time.perf_counter(); tk.feed([prompt[:n]], keep=n); dt = time.perf_counter() - t; tk.drop_last(0, n); return dt
def d_feed(k):
    for i in range(k):
        dk.feed([prompt[i:i+1]], keep=1)
    dk.drop_last(0, k)
for label, pre in [("alone", 0), ("after 4 draft feeds", 4), ("alone", 0), ("after 4 draft feeds", 4)]:
    res = {}
    for n in (1, 5):
        ts = []
        for _ in range(8):
            if pre: d_feed(pre)
            ts.append(t_target(n))
        res[n] = statistics.median(ts) * 1e3
    print(label, {k: round(v, 1) for k, v in res.items()})
with torch.no_grad():
  x = torch.randn(1, 5, 576)
  import time
import threading
def in_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn())); th.start(); th.join(); return out[0]
def bench(n):
    return statistics.median([t_target(n) for _ in range(8)]) * 1e3
for rep in range(2):
    print("main", {n: round(bench(n), 1) for n in (1, 2, 5)})
    print("thread", in_thread(lambda: {n: round(bench(n), 1) for n in (1, 2, 5)}))
    print("thread nt", in_thread(lambda: (torch.get_num_threads(), {n: round(bench(n), 1) for n in (1, 2, 5)})))
def setnt():
    torch.set_num_threads(2)
    return {n: round(bench(n), 1) for n in (1, 2, 5)}
print("thread set_num_threads(2)", in_thread(setnt))
def setnt1():
    torch.set_num_threads(1)
    return {n: round(bench(n), 1) for n in (1, 2, 5)}
print("thread set_num_threads(1)", in_thread(setnt1))
print("main again", {n: round(bench(n), 1) for n in (1, 2, 5)})
