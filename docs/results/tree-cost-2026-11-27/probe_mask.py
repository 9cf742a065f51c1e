import time, statistics, torch
from serving.models import ensure_default_target, load_causal_lm, default_dtype
from serving.decoding.tree import DraftTree, ROOT, tree_forward, keep_path, feed_masked
torch.set_num_threads(2)
m = load_causal_lm(ensure_default_target(), "cpu", default_dtype("cpu"))
V = m.config.vocab_size; prefix=200
g=torch.Generator().manual_seed(0)
ids=torch.randint(0,V,(prefix+40,),generator=g).tolist()
def causal(ids_, cache, start):
    n=len(ids_); return feed_masked(m, ids_, torch.ones(n,start+n,dtype=torch.bool).tril(start), torch.arange(start,start+n), cache)
_, cache = causal(ids[:prefix], None, 0)
def timed(fn, reps=15):
    ts=[]
    for _ in range(reps+2):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0); keep_path(cache, prefix-1, [])
    return statistics.median(ts[2:])*1e3
dec = m.get_decoder()
def plain(n):   # transformers' own path: no custom mask
    with torch.no_grad():
        out = dec(input_ids=torch.tensor([ids[prefix:prefix+n]]), past_key_values=cache, use_cache=True)
        return m.get_output_embeddings()(out.last_hidden_state[0])
def body(n):
    with torch.no_grad():
        return dec(input_ids=torch.tensor([ids[prefix:prefix+n]]), past_key_values=cache, use_cache=True)
one = timed(lambda: plain(1))
print(f"one {one:.1f}")
for n in (5, 9, 17, 33):
    tree = DraftTree(tuple(ids[prefix+1:prefix+n]), tuple(ROOT if i % 4 == 0 else i - 1 for i in range(n-1)))
    t_tree = timed(lambda: tree_forward(m, tree, ids[prefix], cache, prefix))
    t_mask = timed(lambda: causal(ids[prefix:prefix+n], cache, prefix))
    t_plain = timed(lambda: plain(n)); t_body = timed(lambda: body(n))
    print(f"n={n}: tree {t_tree:.1f} ({t_tree/one:.2f}x)  causal-with-4D-mask {t_mask:.1f} ({t_mask/one:.2f}x)  plain {t_plain:.1f} ({t_plain/one:.2f}x)  body-only {t_body:.1f}")
