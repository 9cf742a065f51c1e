import gc, sys, time, json, os
import importlib.util
root = os.getcwd()
spec = importlib.util.spec_from_file_location("b", "scripts/bench_suffix.py"); b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
stats = {0: [], 1: [], 2: []}
t = {}
def cb(phase, info):
    if phase == "start": t["s"] = time.perf_counter()
    else: stats[info["generation"]].append((time.perf_counter() - t["s"]) * 1e3)
gc.callbacks.append(cb)
if os.environ.get("NOGC"): gc.disable()
print("tracked objects at start", len(gc.get_objects()))
b.main(["--compaction", "4", "--depth", "3", "--min-support", "0.3", "--teacher", os.environ.get("TEACHER", "data/bootstrap/teacher.safetensors"), "--out", "/tmp/gcp"])
for g, v in stats.items():
    print(g, len(v), "max %.1f ms" % max(v, default=0), "total %.0f ms" % sum(v))
print("tracked objects at end", len(gc.get_objects()))
