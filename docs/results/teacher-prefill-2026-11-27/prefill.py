"""Prefill and short generations of the teacher's target under three attention paths (run from the repository
root with the venv's python; bf16 on CPU, 2 threads):

- matmuls: training/teacher.py's grouped attention at every query length (the code before 5b18694),
- grouped: the same attention as committed (prefill handed to PyTorch's fused SDPA kernel),
- sdpa: transformers' own SDPA path.

Half the rows are left-padded by 20 tokens (as the teacher's batches are). Prints one line per measurement."""
import time

import torch

import training.teacher as teacher
from serving.models import default_dtype, ensure_default_target, load_causal_lm
from training.teacher import attention_implementation, left_pad

torch.set_num_threads(2)
m = load_causal_lm(ensure_default_target(), "cpu", default_dtype("cpu")).eval()
print(m.dtype, torch.__version__)
keep = teacher.PREFILL_SDPA_MIN_QUERIES


def ctx(path):
    teacher.PREFILL_SDPA_MIN_QUERIES = 10 ** 9 if path == "matmuls" else keep
    return attention_implementation(m) if path != "sdpa" else torch.no_grad()


for B, L in [(64, 100), (16, 400), (64, 400)]:
    ids = torch.randint(100, 5000, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[: B // 2, :20] = 0
    for path in ("matmuls", "grouped", "sdpa"):
        with torch.no_grad(), ctx(path):
            t = time.time()
            m(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            dt = time.time() - t
        print(f"prefill B {B} L {L} {path}: {dt:.2f} s, {B * L / dt:.0f} prompt tok/s", flush=True)

for B, L, N in [(64, 60, 32), (64, 400, 32)]:
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(L - 20 * (i % 2))] for i in range(B)]
    ids, mask = left_pad(prompts, 0)
    for path in ("matmuls", "grouped"):
        with torch.no_grad(), ctx(path):
            t = time.time()
            m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            dt = time.time() - t
        print(f"generate B {B} prompt {L} new {N} {path}: {dt:.1f} s, {B * N / dt:.0f} new tok/s", flush=True)
teacher.PREFILL_SDPA_MIN_QUERIES = keep
