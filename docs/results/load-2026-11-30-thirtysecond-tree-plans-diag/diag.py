"""Diagnosis of the tree batch's shared depth (thirty-second session): run at commit a585ccc (plan_tree_batch, reverted
in the next commit) from the repository root as  .venv/bin/python diag.py batch|row CLIENTS : one warm one-client level,
then CLIENTS clients for 30 s; prints the tree depths planned per (rows in the pass, k), the tree passes' mean time by
(rows, block width), and the cost model's table. batch2.txt / row2.txt are its output at 2 clients."""
import sys, time, json, argparse, collections
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/work/main/scripts')
import bench_load as bl
import serving.scheduler as sm
from serving.kvcache import BatchKV
from serving.controller import RequestController
arm = sys.argv[1]; clients = int(sys.argv[2])
passes, kplans = [], collections.Counter()
real_feed = BatchKV.feed_tree
def feed(self, blocks, masks, pos, keep):
    t = time.perf_counter(); out = real_feed(self, blocks, masks, pos, keep)
    passes.append((len(blocks), max(len(b) for b in blocks), time.perf_counter() - t)); return out
BatchKV.feed_tree = feed
real_block = sm.BatchScheduler._tree_block
def block(self, req, cached, plan):
    kplans[(len(self.trees), plan.k if plan is not None else -1)] += 1
    return real_block(self, req, cached, plan)
sm.BatchScheduler._tree_block = block
args = argparse.Namespace(draft='data/bootstrap-draft', medusa_heads='data/medusa-heads', engine_buffer=None,
    device='cpu', solo_trees=False, row_tree_plans=(arm == 'row'), mode='default', max_tokens=96, engine_seconds=30,
    requests=None)
from training.prompts import load_prompts
import inspect
print(inspect.signature(bl.engine_baseline))
prompts = load_prompts("gsm8k", "train", 200)
bl.engine_baseline(prompts, args)                     # warm: one client, as the benchmark's first level
passes.clear(); kplans.clear()
res = bl.engine_baseline(prompts, args, clients=clients)
eng = bl._ENGINES[max(bl._ENGINES)][0]
by = collections.defaultdict(list)
for rows, width, t in passes:
    by[(rows, width)].append(t)
print(arm, clients, "tok/s", round(res["tokens_per_s"], 1))
print("plans (rows, k): count", sorted(kplans.items()))
print("passes (rows, width): n, mean ms")
for key in sorted(by):
    print("  ", key, len(by[key]), round(1000 * sum(by[key]) / len(by[key]), 1))
snap = eng.costs.snapshot()
print("cost model target_s ms:", {n: round(1000 * t, 1) for n, t in sorted(snap["target_s"].items())}, "load", round(snap["load"], 3))
print("draft_token_s", snap["draft_token_s"], "overhead", snap["overhead_s"])
