"""The trace behind "one bad prompt stopped the heads" (docs/benchmarks.md, the sixteenth session): the adaptive
medusa default on maths, science, code and everyday prompts, each 3 times, interleaved with target, mjsd and the
fixed tree as bench_traffic.py runs them; prints per request the plan (depth:alpha) and [accepted/proposed] of
each step. Run from the repository root: .venv/bin/python docs/results/.../trace_controller.py"""
import sys, time, torch
sys.path.insert(0, ".")
torch.set_num_threads(2)
from serving.engine import Engine
from serving.config import SamplingParams, SpecParams
from serving.controller import RequestController
from scripts.traffic_prompts import prompt_ids
eng = Engine.from_paths(None, "data/bootstrap-draft", heads="data/medusa-heads")
tok = eng.tokenizer
orig_plan = RequestController.plan
orig_obs = RequestController.observe
log = []
def plan(self, n=0):
    p = orig_plan(self, n)
    if self.draft_key == "medusa":
        e = self._estimate("draft")
        log.append(f"{p.k}{'p' if p.probe else ''}:{e.alpha:.2f}" + (f"({self.step_s(0)*1000:.1f},{self.step_s(1)*1000:.1f},{self.step_s(3)*1000:.1f})" if p.k == 0 else ""))
    return p
def observe(self, plan, accepted, proposed=None):
    if self.draft_key == "medusa" and plan.k:
        log.append(f"[{accepted}/{proposed}]")
    return orig_obs(self, plan, accepted, proposed)
RequestController.plan = plan
RequestController.observe = observe
P = prompt_ids(tok, ["maths", "science", "code", "everyday"], 4)
for c in P:
    for ids in [x for x in P[c] for _ in range(3)]:
        for spec in (SpecParams(mode="medusa", extra={"rule": "mjsd"}), SpecParams(mode="target"), SpecParams(mode="mjsd"), SpecParams(mode="medusa", adaptive=False)):
            log.clear()
            r = eng.generate_all(ids, SamplingParams(temperature=0, top_k=0, top_p=1.0, max_tokens=64, seed=1), spec)
            if spec.mode == "medusa" and spec.adaptive:
                st = r.stats
                print(c, st.steps, st.draft_tokens, st.accepted_tokens, st.zero_draft_steps, " ".join(log[:40]))
print(eng.costs.snapshot())
print(eng.priors._est if hasattr(eng.priors, "_est") else vars(eng.priors))
