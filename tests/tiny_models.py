"""Tiny models built from a config, so every test runs in seconds on a CPU.

`make_tokenizer()` is a byte-level tokenizer (256 byte tokens + 3 specials, no merges) with a
ChatML chat template like SmolLM2's. `make_model(seed)` is a 2-layer Llama of width 32 over that
vocabulary. `save_pair(tmp)` writes a target and a draft folder sharing the tokenizer, the same
layout as any local Hugging Face model folder.
"""
from __future__ import annotations

from pathlib import Path

import torch

EOS_ID = 258  # "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(seed: int = 0, layers: int = 2, hidden: int = 32, vocab_size: int = 259, sharp: float = 1.0):
    """A randomly initialised Llama; `sharp` scales the output layer (higher = peakier, fewer ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=258, pad_token_id=min(256, vocab_size - 1), bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
    return model.eval()


def save_pair(root: Path, target_seed: int = 0, draft_seed: int = 1, draft_layers: int = 1) -> tuple[Path, Path]:
    root = Path(root)
    tok = make_tokenizer()
    paths = []
    for name, seed, layers in (("target", target_seed, 2), ("draft", draft_seed, draft_layers)):
        p = root / name
        make_model(seed, layers=layers, sharp=8.0).save_pretrained(p)
        tok.save_pretrained(p)
        paths.append(p)
    return paths[0], paths[1]


class ListSink:
    """A replay-buffer sink that keeps the records in lists (the engine's RecordSink protocol)."""

    def __init__(self):
        self.steps, self.seqs = [], []

    def push_step(self, r):
        self.steps.append(r)

    def push_sequence(self, r):
        self.seqs.append(r)
