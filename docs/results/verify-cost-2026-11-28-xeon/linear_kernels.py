import torch, time
torch.set_num_threads(2)
torch.manual_seed(0)
def t(f, n=25):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1000
import torch.utils.mkldnn as um
for (o,i) in [(49152,576),(1536,576),(576,1536),(576,576)]:
    W=torch.randn(o,i); WT=W.t().contiguous()
    lin=torch.nn.Linear(i,o,bias=False); lin.weight.data=W
    mk=um.to_mkldnn(torch.nn.Sequential(torch.nn.Linear(i,o,bias=False)))
    mk[0].weight  # noqa
    for rows in (1,2,3,4,5,6,8,16,32):
        x=torch.randn(rows,i)
        a=t(lambda: torch.nn.functional.linear(x,W))
        b=t(lambda: torch.mm(W,x.t()))
        c=t(lambda: x@WT)
        d=t(lambda: mk(x.to_mkldnn()).to_dense())
        print(f"{o}x{i} r{rows}: F.linear {a:.3f} | W@xT {b:.3f} | x@WT(NN) {c:.3f} | mkldnn {d:.3f}", flush=True)
