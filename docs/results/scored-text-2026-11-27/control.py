import sys, time, random, torch, json
sys.path.insert(0, '/work/main')
torch.set_num_threads(2)
from serving.models import load_causal_lm, ensure_default_target, load_tokenizer
from training import draft_builder as db
from training.teacher import load_examples
from training.vocab import DEFAULT_VOCAB_SIZE
tp = ensure_default_target(); tok = load_tokenizer(tp)
train_ex = load_examples('/work/main/data/bootstrap/teacher.safetensors')
held_ex = load_examples('/work/main/data/bootstrap/teacher.heldout.safetensors')
subset, _ = db.choose_output_vocabulary(train_ex, tok, DEFAULT_VOCAB_SIZE)
for st in (165,):
    torch.manual_seed(0); random.seed(0)
    target = load_causal_lm(tp, 'cpu', torch.float32)
    draft = db.make_draft_from_target(target, 2); del target
    t0 = time.time()
    f = db.train_draft(draft, train_ex, held_ex, subset, deadline=time.time() + 1e9, max_steps=st, bf16=False, progress=lambda s: None)
    print('on-policy', st, f['heldout_top1_agreement_after'], db.per_source_agreement(draft, held_ex, subset), round(time.time() - t0), flush=True)
