"""Does teacher-forced scoring of packaged text (off-policy) add to the bootstrap's on-policy teacher data?"""
import gzip, json, random, re, sys, time
import numpy as np, torch
sys.path.insert(0, '/work/main')
torch.set_num_threads(2)
from serving.models import load_causal_lm, ensure_default_target, load_tokenizer
from training import draft_builder as db
from training.teacher import load_examples, attention_implementation, topk_logprobs
from training.prompts import _data_dir, load_prompts, _humaneval

budget_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 40000
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 110
random.seed(0); torch.manual_seed(0)
tp = ensure_default_target(); tok = load_tokenizer(tp)
train_ex = load_examples('/work/main/data/bootstrap/teacher.safetensors')
held_ex = load_examples('/work/main/data/bootstrap/teacher.heldout.safetensors')
print('on-policy', len(train_ex), sum(len(e['topk_ids']) for e in train_ex), 'held', len(held_ex))

# corpus: (user, assistant) pairs
pairs = []
rows = [json.loads(l) for l in (_data_dir() / 'gsm8k' / 'test.jsonl').read_text().splitlines() if l.strip()][:-100]
for r in rows:
    ans = re.sub(r'<<[^>]*>>', '', r['answer']).replace('#### ', 'The answer is ')
    pairs.append(('gsm8k', r['question'], ans))
for r in _humaneval()[:-20]:
    pairs.append(('humaneval', f"Complete this Python function:\n```python\n{r['prompt'].strip()}\n```",
                  f"```python\n{r['prompt'].strip()}\n{r['canonical_solution'].rstrip()}\n```"))
import pydoc_data.topics as T
for name, text in T.topics.items():
    paras = [p.strip() for p in text.split('\n\n') if len(p.strip()) > 200]
    for p in paras[:6]:
        pairs.append(('pydoc', f"Explain {name.lower()} in Python.", p))
random.shuffle(pairs)
print('pairs', len(pairs), {s: sum(1 for p in pairs if p[0] == s) for s in ('gsm8k', 'humaneval', 'pydoc')})

target = load_causal_lm(tp, 'cpu', torch.float32)
scored, n_tok, t0 = [], 0, time.time()
B = 4
for i in range(0, len(pairs), B):
    if n_tok >= budget_tokens:
        break
    batch = []
    for src, u, a in pairs[i:i + B]:
        p = tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=True, return_dict=False)
        p = [int(x) for x in p][-300:]
        ans = tok(a, add_special_tokens=False)['input_ids'][:128]
        batch.append((src, p, ans))
    L = max(len(p) + len(a) for _, p, a in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long); att = torch.zeros_like(ids)
    for r, (_, p, a) in enumerate(batch):
        ids[r, :len(p) + len(a)] = torch.tensor(p + a); att[r, :len(p) + len(a)] = 1
    with torch.no_grad(), attention_implementation(target):
        logits = target(input_ids=ids, attention_mask=att).logits
    for r, (src, p, a) in enumerate(batch):
        P, A = len(p), len(a)
        lg = logits[r, P - 1:P - 1 + A].float()
        lp, ix = torch.log_softmax(lg, -1).topk(20, -1)
        scored.append({"tokens": p + a, "prompt_len": P, "topk_ids": ix.to(torch.int32).numpy(),
                       "topk_logprobs": lp.to(torch.float16).numpy(), "source": 'scored-' + src,
                       "hard": ix[:, 0].tolist()})
        n_tok += A
dt = time.time() - t0
print(f'scored {len(scored)} examples, {n_tok} tokens in {dt:.0f} s ({n_tok/dt:.0f} tok/s)', flush=True)
del target
tf = sum(int((np.asarray(e['tokens'][e['prompt_len']:]) == e['topk_ids'][:, 0]).sum()) for e in scored)
print(f'target top-1 = text token on {tf/n_tok:.3f} of scored positions')

orig_batch = db._batch
def _batch(examples, vocab_index, device='cpu'):
    b = orig_batch(examples, vocab_index, device)
    hard = []
    for e in examples:
        P, A = e['prompt_len'], len(e['topk_ids'])
        hard.append(torch.tensor(e['hard'] if 'hard' in e else e['tokens'][P:P + A], dtype=torch.long))
    b['hard'] = vocab_index[torch.cat(hard)]
    return b
db._batch = _batch

from training.vocab import DEFAULT_VOCAB_SIZE
subset, _ = db.choose_output_vocabulary(train_ex, tok, DEFAULT_VOCAB_SIZE)
res = {}
for arm, data, st in (('on-policy', train_ex, steps), ('on+scored', train_ex + scored, steps),
                      ('on+scored 1.5x steps', train_ex + scored, int(steps * 1.5))):
    torch.manual_seed(0); random.seed(0)
    target = load_causal_lm(tp, 'cpu', torch.float32)
    draft = db.make_draft_from_target(target, 2); del target
    t0 = time.time()
    f = db.train_draft(draft, data, held_ex, subset, deadline=time.time() + 1e9, max_steps=st, bf16=False,
                       progress=lambda s: None)
    by = db.per_source_agreement(draft, held_ex, subset)
    res[arm] = (f['heldout_top1_agreement_after'], by, round(time.time() - t0))
    print(arm, res[arm], flush=True)
json.dump(res, open('/tmp/mb/offpolicy.json', 'w'))
