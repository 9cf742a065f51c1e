import torch, time, torch.nn.functional as F
torch.set_num_threads(2)
torch.manual_seed(0)
shapes = {"qo":(576,576),"gateup":(1536,576),"down":(576,1536),"head":(49152,576)}
def tm(fn, reps=30):
    for _ in range(3): fn()
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter()-t)/reps*1e3)
    return sorted(ts)[2]
for name,(o,i) in shapes.items():
    W = torch.randn(o,i); Wt = W.t().contiguous()
    reps = 5 if name=="head" else 100
    for k in (1,2,3,4,5,8,16):
        x = torch.randn(k,i)
        a = tm(lambda: F.linear(x,W), reps)
        b = tm(lambda: torch.mm(W, x.t()).t(), reps)
        c = tm(lambda: torch.mm(x, Wt), reps)
        print(f"{name} k{k}: linear {a:.3f}  W@x.T {b:.3f}  x@Wt {c:.3f}", flush=True)
