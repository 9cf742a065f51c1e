import time, torch, sys
from serving.runner import SequenceRunner
rec = []
f = SequenceRunner.feed
def spy(self, chunk, *a, **kw):
    t = time.perf_counter(); r = f(self, chunk, *a, **kw); rec.append((torch.get_num_threads(), len(chunk), round(time.perf_counter() - t, 3))); return r
SequenceRunner.feed = spy
exec(open("/tmp/svc.py").read())
print(rec[-6:])
