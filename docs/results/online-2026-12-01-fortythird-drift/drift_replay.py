"""Replay the drift trigger over a finished online run's MLflow store: at each logged live interval of the
champion, would the old rule (the champion's gate figure, `gate_predicted_live_acceptance`) and the new one
(deploy/scheduler.py `drift_reference`: its own earlier live figure, else the previous version's, else the gate
figure) have called drift? Run with DRAFTSMITH_DATA set to a copy of the run's data folder:

    DRAFTSMITH_DATA=/tmp/run2-data .venv/bin/python docs/results/online-2026-12-01-fortythird-drift/drift_replay.py
"""
import math
import sys
from statistics import NormalDist

from deploy.registry import Registry
from deploy.scheduler import DriftPolicy, drift_reference, live_figure

window_s = float(sys.argv[1]) if len(sys.argv) > 1 else 180.0      # the run's --drift-window (3m)
reg = Registry()
champ = reg.champion()
info = reg.get(champ)
since = reg.champion_since_ms(info)
pol = DriftPolicy(window_s=window_s)
z = NormalDist().inv_cdf(pol.confidence)
gate = info.metrics.get("gate_predicted_live_acceptance", info.metrics.get("gate_expected_rate"))
ivs = [it for it in reg.live_intervals(champ, since_ms=since) if it.get("draft_tokens")]
print(f"champion version {champ}: gate figure {gate:.3f}, {len(ivs)} live intervals since it became champion; "
      f"window {window_s:.0f} s, confidence {pol.confidence}, tolerance {pol.tolerance}")
t0 = min(it["time_ms"] for it in ivs)
fired = {"old": 0, "new": 0}
for k in range(1, len(ivs) + 1):
    sub = ivs[:k]
    recent = live_figure(sub, pol.window_s)
    if not recent.enough(pol):
        continue
    old = recent.rate + z * recent.se - gate * (1 - pol.tolerance) < 0
    what, value, se = drift_reference(reg, champ, info, since, sub, pol)
    new = recent.rate - value * (1 - pol.tolerance) + z * math.hypot(recent.se, se) < 0
    fired["old"] += old
    fired["new"] += new
    print(f"{(sub[-1]['time_ms'] - t0) / 1000:6.0f} s  live {recent.rate:.3f} +- {recent.se:.3f}  "
          f"old rule: {'DRIFT' if old else '-':5s}  new rule against {what}: {'DRIFT' if new else '-'}")
print(f"intervals judged where the old rule calls drift: {fired['old']}; the new rule: {fired['new']}")
