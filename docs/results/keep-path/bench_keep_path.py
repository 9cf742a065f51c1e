import sys, time, torch
sys.path.insert(0, ".")   # run from the repository root
torch.set_num_threads(2)
from transformers import DynamicCache
from serving.models import resolve_model_path, load_causal_lm
from serving.kvcache import growable_cache
from serving.decoding.tree import keep_path, DraftTree, tree_forward_hidden, feed_masked_hidden
m = load_causal_lm(resolve_model_path(None), "cpu", torch.float32)
tree = DraftTree.from_paths([[1,2,3],[1,4,5],[6,7,8],[6,9,10],[11,12,13],[11,14,15]])   # 15 nodes
def run(make, steps=40):
    ids = list(range(100, 400)); n=len(ids)
    _,_,c = feed_masked_hidden(m, ids, torch.ones(n,n,dtype=torch.bool).tril(), torch.arange(n), make())
    prefix = n; tf=tk=0
    for i in range(steps):
        t0=time.perf_counter(); _,_,c = tree_forward_hidden(m, tree, 42, c, prefix); t1=time.perf_counter()
        keep_path(c, prefix, [0,1]); t2=time.perf_counter()
        tf+=t1-t0; tk+=t2-t1; prefix += 3
    return tf/steps*1000, tk/steps*1000
run(DynamicCache, 3)
for k in range(3):
    print("dynamic  fwd %.2f ms keep %.3f ms" % run(DynamicCache))
    print("growable fwd %.2f ms keep %.3f ms" % run(growable_cache))
