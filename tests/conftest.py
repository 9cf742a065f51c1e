import os
import sys
from pathlib import Path

# tests/ helpers (tiny_models) importable as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tiny-model forwards are dominated by thread hand-offs: on a shared 2-core machine two torch threads
# per process made them up to 30x slower than one. Every test process runs torch on one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
