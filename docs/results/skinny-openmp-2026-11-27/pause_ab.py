import torch, time, threading, statistics, os, ctypes, glob
torch.set_num_threads(2)
W = torch.randn(49152, 576); Ws = [torch.randn(1536, 576) for _ in range(60)]
def run(k):
    x = torch.randn(k, 576)
    def one():
        torch.mm(W, x.t())
        for w in Ws: torch.mm(w, x.t())
    one()
    ts = []
    for _ in range(7):
        t = time.perf_counter(); one(); ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 1)
def in_thread(fn):
    out = []; th = threading.Thread(target=lambda: out.append(fn())); th.start(); th.join(); return out[0]
gomp = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))[0])
print("main", {k: run(k) for k in (1, 2, 5)}, "thread", in_thread(lambda: {k: run(k) for k in (1, 2, 5)}))
print("pause ->", gomp.omp_pause_resource_all(2))
print("thread after pause", in_thread(lambda: {k: run(k) for k in (1, 2, 5)}))
print("main", {k: run(k) for k in (1, 2, 5)}, "thread", in_thread(lambda: {k: run(k) for k in (1, 2, 5)}))
