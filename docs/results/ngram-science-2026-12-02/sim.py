# The controller choosing the n-gram proposer on unlabelled traffic: a synthetic replay (see output.txt; docs/benchmarks.md, "The forty-sixth session").
# Run from the repository root: .venv/bin/python docs/results/ngram-science-2026-12-02/sim.py
import random, sys, statistics
sys.path.insert(0,'.'); sys.path.insert(0,'tests/serving')
import serving.controller as cm
from serving.controller import ReplicaPriors, RequestController
from test_controller import costs
def session(seed, cats, label=False):
    rng=random.Random(seed)
    c=costs(target_ms=57.0, draft_ms=5.0, slope=0.08)
    pri=ReplicaPriors(prior=0.5)
    out={}
    for cat,(pn,pd,avail_p) in cats:
        for r in range(4):
            ctrl=RequestController(gamma=4, costs=c, priors=pri, version="v1", greedy=True, use_ngram=True, category=cat if label else "")
            t=tok=0
            for s in range(64):
                plan=ctrl.plan(4 if rng.random()<avail_p else 0)
                p = pn if plan.proposer=="ngram" else pd
                a=0
                while a<plan.k and rng.random()<p: a+=1
                ctrl.observe(plan,a)
                t+= 57*(1+0.08*plan.k) + (5*plan.k if plan.proposer=="draft" else 0); tok+=a+1
            out.setdefault(cat,[]).append(tok/t*57)
    return {k: sum(v)/len(v) for k,v in out.items()}
cats=[("maths",(0.6,0.5,0.4)),("science",(0.03,0.12,0.4)),("code",(0.4,0.35,0.4)),("everyday",(0.1,0.3,0.3))]
for label in (False,True):
    res=[session(s,cats,label) for s in range(30)]
    print("labelled" if label else "unlabelled", {k: round(statistics.mean(r[k] for r in res),3) for k in res[0]})
orig_est = RequestController._estimate
import dataclasses
for S in (8.0, 4.0, 2.0, 1.0):
    def curve_patch(self, k, S=S):
        alpha=self.alpha; out=[]
        strength = getattr(self, "_s", cm.DEPTH_STRENGTH)
        for i in range(max(0,int(k))):
            p = self.prior_curve[i] if i < len(self.prior_curve) else alpha
            r = self.reached[i] if i < len(self.reached) else 0.0
            q = self.passed[i] if i < len(self.passed) else 0.0
            out.append((q + strength * p) / (r + strength))
        return out
    cm.AcceptanceEstimate.curve = curve_patch
    def est_patch(self, proposer, S=S):
        e = orig_est(self, proposer)
        if proposer == "ngram": e._s = S
        return e
    RequestController._estimate = est_patch
    for label in (False,True):
        res=[session(s,cats,label) for s in range(30)]
        print("ngram request strength", S, "labelled" if label else "unlabelled", {k: round(statistics.mean(r[k] for r in res),3) for k in res[0]})
