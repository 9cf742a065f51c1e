import sys, torch, time
sys.path.insert(0, '/work/main')
torch.set_num_threads(2)
from serving.engine import Engine
e = Engine.from_paths(None, "data/bootstrap-draft", device="cpu")
for i in range(2):
    print(e.calibrate(force=True))
