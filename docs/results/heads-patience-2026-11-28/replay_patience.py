"""Replay the early-stopping rule of training/heads.py BestEpoch on the epoch logs of earlier online runs
(docs/results/online-*/serve.log and distill.log): per (patience, min_gain), the training seconds it would
have saved and how far below the full run's best epoch (weighted held-out agreement) the kept epoch is.
Run from the repository root: python docs/results/heads-patience-2026-11-28/replay_patience.py"""
import re,glob,ast
runs=[]
for f in sorted(glob.glob('docs/results/online-*/serve.log'))+sorted(glob.glob('docs/results/online-*/distill.log')):
    cur=None
    for line in open(f,errors='replace'):
        m=re.search(r'\[heads-job\] \d+ training rows.*before: held-out agreement per head (\[[^\]]*\])',line)
        if m:
            cur={'f':f,'before':ast.literal_eval(m.group(1)),'ep':[],'t':[]}; runs.append(cur); continue
        m=re.search(r'\[heads\] epoch (\d+) done after (\d+) s; held-out agreement per head (\[[^\]]*\])',line)
        if m and cur is not None:
            cur['ep'].append(ast.literal_eval(m.group(3))); cur['t'].append(int(m.group(2)))
W=[0.8**k for k in range(3)]
sc=lambda a: sum(w*x for w,x in zip(W,a))/sum(W)
runs=[r for r in runs if len(r['ep'])>=3]
print(len(runs),'jobs')
for P in (1,2,3):
  for md in (0.0,0.002,0.005):
    lost=[];saved=[];tot=[]
    for r in runs:
        s=[sc(a) for a in r['ep']]; full=max(s)
        best=-1;since=0;stop=len(s)
        for i,x in enumerate(s):
            if x>best+md: best_i=i; since=0
            else: since+=1
            best=max(best,x)
            if since>=P: stop=i+1;break
        kept=max(s[:stop]); lost.append(full-kept); 
        t_full=r['t'][-1]; t_stop=r['t'][stop-1]; saved.append(t_full-t_stop); tot.append(t_full)
    import statistics as st
    print(f'patience {P} min_delta {md}: mean score lost {st.mean(lost):.4f} max {max(lost):.4f}; training s saved {sum(saved)}/{sum(tot)} = {sum(saved)/sum(tot):.0%}')
