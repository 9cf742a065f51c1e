"""An EAGLE-style draft head: one decoder layer that drafts at the target's feature level (issue 19, step 1).

Source: "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (Li et al. 2024; the issue's
"one decoder layer fed the target's last hidden state and the next token's embedding"). At draft position t
the head reads the target's feature f_t (its last hidden state after the final norm, what its output layer
reads) together with the embedding of the token x_{t+1} that follows it: input = fc([f_t ; e(x_{t+1})]),
then one decoder layer of the target's architecture (its own small KV cache over earlier positions) and a
final norm give a predicted feature f^_{t+1}, which the target's frozen output rows (cut to a kept
vocabulary) turn into a distribution over x_{t+2}. Drafting deeper feeds the prediction back:
fc([f^_{t+1} ; e(x^_{t+2})]). Unlike Medusa heads (medusa.py), deeper candidates see the tokens chosen above
them, so acceptance decays slowly with depth.

Positions in decoding (`EagleDrafter`): committed sequence x_0..x_r (root x_r). The drafter's cache holds
inputs 0..r-1 (input r-1 = (f_{r-1}, x_r): the last committed feature and the root), whose output gives
the root's children (depth 1). A child c at depth 1 is fed as input r = (f^_r, c), and so on down the
tree under the tree mask (tree.py `attention_inputs(prefix_len=r - 1, fed=k)`: the "root" slot is input
r - 1). After verification the tree entries are cropped and the true features of the root and the
accepted path (rows of the verification pass) are fed with the committed tokens: the drafter never runs
on its own predictions across steps, and no extra target forward is needed.

Files: `eagle_head.json` (the layer's config, the kept vocabulary, the target it was trained for) and
`eagle_head.safetensors` (trained weights only; the output rows and embedding are the target's).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from serving.decoding.tree import DraftTree, _float_mask, grow_topk_tree

CONFIG_FILE = "eagle_head.json"
WEIGHTS_FILE = "eagle_head.safetensors"
KIND = "eagle"


def _layer_config(target_config):
    """The target's config cut to one decoder layer and a 1-row embedding (inputs come as embeddings)."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    cfg.vocab_size = 1
    cfg.pad_token_id = None
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    return cfg


class EagleHead(nn.Module):
    def __init__(self, layer_config, output_token_ids: Sequence[int], out_rows: torch.Tensor,
                 embed: torch.Tensor) -> None:
        from transformers import AutoModel

        super().__init__()
        d = layer_config.hidden_size
        if out_rows.shape != (len(output_token_ids), d) or embed.dim() != 2 or embed.shape[1] != d:
            raise ValueError(f"out_rows must be [{len(output_token_ids)}, {d}] and embed [vocab, {d}]")
        self.layer_config = layer_config
        self.output_token_ids = [int(i) for i in output_token_ids]
        self.register_buffer("out_rows", out_rows.detach().float().clone(), persistent=False)
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("token_ids", torch.tensor(self.output_token_ids, dtype=torch.long), persistent=False)
        self.column = {t: j for j, t in enumerate(self.output_token_ids)}   # token id -> its kept-vocabulary column
        self.fc = nn.Linear(2 * d, d)
        self.model = AutoModel.from_config(layer_config).float()

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, *, attention_mask=None, position_ids=None,
                cache=None):
        """feats [B, T, d] (target features f_t or predicted ones), tokens [B, T] (x_{t+1}) -> (predicted
        features f^_{t+1} [B, T, d], cache). `attention_mask` a 2-D padding mask or a 4-D additive mask."""
        x = self.fc(torch.cat([feats.to(self.fc.weight.dtype), self.embed[tokens]], dim=-1))
        out = self.model(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state, out.past_key_values

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Predicted features -> logits over the kept vocabulary (column j = token `output_token_ids[j]`)."""
        return states.to(self.out_rows.dtype) @ self.out_rows.T

    # ------------------------------------------------------------------ files
    @classmethod
    def for_target(cls, target, output_token_ids: Sequence[int]) -> "EagleHead":
        """A new head for `target`: the layer initialised from the target's last decoder layer and final
        norm (a warm start in the target's feature space), fc reading the feature half as identity."""
        ids = torch.as_tensor(list(output_token_ids), dtype=torch.long)
        out_w = target.get_output_embeddings().weight.detach()
        if int(ids.max()) >= out_w.shape[0] or int(ids.min()) < 0:
            raise ValueError(f"output_token_ids outside the target's vocabulary of {out_w.shape[0]}")
        head = cls(_layer_config(target.config), ids.tolist(), out_w[ids], target.get_input_embeddings().weight)
        dec = target.get_decoder()
        with torch.no_grad():
            head.model.layers[0].load_state_dict({k: v.float() for k, v in dec.layers[-1].state_dict().items()})
            head.model.norm.load_state_dict({k: v.float() for k, v in dec.norm.state_dict().items()})
            d = head.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :d] = torch.eye(d)
            head.fc.bias.zero_()
        return head

    def save(self, out_dir: str | Path, **meta) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps({"kind": KIND, "layer_config": self.layer_config.to_dict(),
                                                   "output_token_ids": self.output_token_ids, **meta}))
        return out

    @classmethod
    def load(cls, path: str | Path, target) -> "EagleHead":
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{path} is not an EAGLE head folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            raw = json.loads((path / CONFIG_FILE).read_text())
            ids = [int(i) for i in raw["output_token_ids"]]
            d = int(raw["layer_config"]["hidden_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path / CONFIG_FILE} is not a valid EAGLE head config: {e}") from None
        if d != target.config.hidden_size:
            raise ValueError(f"the head in {path} was built for hidden size {d}, the target has "
                             f"{target.config.hidden_size}")
        head = cls.for_target(target, ids)
        head.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
        return head.eval()


class EagleDrafter:
    """Grows a top-k tree with an EAGLE head, its cache kept in step with the committed sequence (module
    docstring). `branching[d]` children per node at depth d + 1."""

    def __init__(self, head: EagleHead, branching: Sequence[int]) -> None:
        if not branching or any(int(b) < 1 for b in branching):
            raise ValueError(f"branching must be a non-empty list of positive ints, got {list(branching)}")
        self.head = head
        self.branching = [int(b) for b in branching]
        self.cache = None
        self.committed = 0                       # inputs in the cache that belong to the committed sequence
        self.pending_feats: list[torch.Tensor] = []
        self.pending_tokens: list[int] = []

    def push(self, feats: torch.Tensor, tokens: Sequence[int]) -> None:
        """Queue committed inputs (f_t, x_{t+1}) for the next `propose`: feats [n, d], tokens [n]."""
        if len(feats) != len(tokens):
            raise ValueError(f"{len(feats)} features for {len(tokens)} tokens")
        self.pending_feats.extend(feats)
        self.pending_tokens.extend(int(t) for t in tokens)

    def _feed(self, feats, tokens, mask, pos):
        from serving.kvcache import growable_cache

        if self.cache is None:
            self.cache = growable_cache()            # in-place appends; keep_path moves only the path's slots
        device = self.head.fc.weight.device          # on a GPU the tree's mask and positions come from the CPU
        with torch.no_grad():
            states, self.cache = self.head(torch.stack(list(feats))[None],
                                           torch.tensor([list(tokens)], device=device),
                                           attention_mask=_float_mask(mask, self.head.fc.weight.dtype).to(device),
                                           position_ids=pos[None].to(device),
                                           cache=self.cache)
        return states[0]

    def propose(self) -> DraftTree:
        """Feed the queued committed inputs, then grow the tree depth by depth (one head forward per depth)."""
        return self.propose_with_rows()[0]

    def propose_with_logq(self, warp: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[DraftTree,
                                                                                                torch.Tensor]:
        """`propose`, also returning node_logq [N] for tree.py's `verify_mjsd` (as `MedusaHeads.propose_with_logq`):
        each node's token under the head's row at its parent, log-probabilities from `warp` (kept-vocabulary
        logits -> warped log-probs, e.g. warp.py's `warp_logprobs` with the request's settings; None: plain
        log-softmax). Over the kept vocabulary this equals warping the full row with every other token
        impossible. Candidates stay the top-k of the raw rows."""
        tree, rows = self.propose_with_rows()
        used = torch.stack(rows).float()
        logq = warp(used) if warp is not None else torch.log_softmax(used, dim=-1)
        col = self.head.column
        return tree, logq[[p + 1 for p in tree.parents], [col[t] for t in tree.tokens]]

    def propose_with_rows(self) -> tuple[DraftTree, list[torch.Tensor]]:
        """`propose`, also returning the head's logit rows over the kept vocabulary (tree.py's
        `grow_topk_tree` order: the root's row, then one per node that has children)."""
        if not self.pending_tokens:
            raise RuntimeError("nothing committed to draft from: push the features first")
        n, c = len(self.pending_tokens), self.committed
        causal = torch.ones(n, c + n, dtype=torch.bool).tril(c)
        states = self._feed(self.pending_feats, self.pending_tokens, causal, torch.arange(c, c + n))
        self.committed += n
        self.pending_feats, self.pending_tokens = [], []
        prefix_len = self.committed - 1                            # the "root" slot: the last committed input
        feats = [states[-1]]                                       # predicted feature at each node's parent

        def expand(tree: DraftTree, fed: int) -> list[torch.Tensor]:
            mask, pos = tree.attention_inputs(prefix_len, fed=fed)
            out = self._feed([feats[tree.parents[i] + 1] for i in range(fed, len(tree))], tree.tokens[fed:], mask, pos)
            feats.extend(out)
            with torch.no_grad():
                return list(self.head.logits(out))

        with torch.no_grad():
            root_row = self.head.logits(states[-1])
        return grow_topk_tree(self.branching, root_row,
                              lambda row, k: self.head.token_ids[torch.topk(row, k).indices].tolist(), expand)

    def accept(self, feats: torch.Tensor, tokens: Sequence[int]) -> None:
        """After verification: drop the tree's entries and queue the true inputs of the root and the accepted
        path (feats: the verification pass's hidden rows of the root and path nodes; tokens: the path's tokens
        and the target's next token)."""
        extra = 0 if self.cache is None else int(self.cache.get_seq_length()) - self.committed
        if extra > 0:
            self.cache.crop(-extra)
        self.push(feats, tokens)


def eagle_generate(target, head: EagleHead, prompt_ids: list[int], max_new_tokens: int, branching: Sequence[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None, eos_id: int | None = None):
    """Decode with an EAGLE head and tree verification (greedy at T = 0, else tree.py's lossless rule for
    deterministic children); hidden states come from the verification pass. Returns (new tokens, TreeStats)."""
    from serving.decoding.tree import (TreeStats, commit_tree_step, feed_masked_hidden, keep_path,
                                       tree_forward_hidden, tree_rule)

    if len(prompt_ids) < 2:
        raise ValueError("prompt_ids must hold at least two tokens (the head reads a feature and the next token)")
    committed = list(prompt_ids)
    n = len(committed) - 1
    _, hid, cache = feed_masked_hidden(target, committed[:-1], torch.ones(n, n, dtype=torch.bool).tril(),
                                       torch.arange(n), None)
    drafter = EagleDrafter(head, branching)
    drafter.push(hid, committed[1:])
    stats = TreeStats()
    new: list[int] = []
    while len(new) < max_new_tokens:
        tree = drafter.propose()
        prefix_len = len(committed) - 1
        logits, hid, cache = tree_forward_hidden(target, tree, committed[-1], cache, prefix_len)
        res = tree_rule(tree, logits, temperature, generator)
        keep_path(cache, prefix_len, res.path)
        drafter.accept(hid[[0] + [1 + i for i in res.path]], res.tokens + [res.next_token])
        if commit_tree_step(res, tree, stats, new, committed, max_new_tokens, eos_id):
            break
    return new, stats
