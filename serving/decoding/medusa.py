"""Medusa heads: drafts read off the target's own last hidden state, verified as a tree (issue 19, step 1).

Source: "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (Cai et al.
2024, in ../shared/papers/), sections "Medusa heads" and "Tree attention". Head k (k = 1..K) maps the
target's last hidden state h_i at position i (after the final norm, the vector the target's own output
layer reads) to a distribution over the token at position i + k + 1: h_i's own output row predicts i + 1,
head 1 the token after it, and so on. Each head is a residual block `x + SiLU(W x + b)` (W zero at
initialisation, so an untrained head starts as the target's own next-token prediction) followed by the
target's output rows, frozen and shared, cut to a kept vocabulary as the standalone draft's are
(training/vocab.py): a head costs one d x d matmul plus d x V_keep, with no draft forward at all.

Conditioned on the committed token (`use_token`, a measured option): at proposal time the token at i + 1
is already known (it is the root of the tree: the token the target itself just emitted), so head k may also
read its embedding (the target's input embedding row, frozen): x = h_i + U_k e(x_{i+1}), U_k zero at
initialisation. This is the one-step half of EAGLE's idea ("EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", Li et al. 2024: a draft fed the target's feature and the next token's
embedding); the heads stay non-autoregressive, so candidates of depth d do not see the tokens chosen at
depths 1..d-1 (Medusa's own limitation, which the tree of top-k candidates offsets).

Alignment in decoding (`medusa_generate`): the committed sequence is `prefix + [root]`, the target's cache
holds the prefix, and `h` is the hidden state at the last prefix position (the one whose logits produced
the root). Head k on h proposes candidates for depth k of the tree under the root. After the tree pass,
the new root is the target's token after the accepted path, and the new h is the hidden state of the last
accepted node (the root itself when no node was accepted): both come from the verification pass, so
drafting costs no extra target forward.

The heads' doubt prunes the tree (`floor`, mode medusa's knob `node_floor`): a fixed shape verifies every node
whatever the heads think of it, and a node the heads give little chance is seldom accepted: it costs a place in
the verification pass, and it counts as proposed in accepted / proposed. Each node carries its path probability,
the product over its path of each depth's softmax probability of its token (the heads are trained to match the
target's own distribution, so at T=0 this estimates the chance the target accepts that node); nodes under `floor`
are left out, with everything below them, while the root's first child always stays (a step the controller
planned to draft still proposes, so its evidence keeps coming). The same rule as a draft chain's confidence stop
(serving/controller.py, STOP_CONFIDENCE), applied per node; the value is measured in
scripts/bench_tree_floor.py. The tree stays a deterministic function of the heads' output, so every rule verifies
it exactly as it verifies the full shape (speculative sampling on the tree stays lossless).

Files: a heads folder holds `medusa_heads.json` (sizes, the kept vocabulary, the target it was trained
for) and `medusa_heads.safetensors` (the trained weights only: no pickle, and the frozen rows are the
target's, taken at load time).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from serving.decoding.tree import (ROOT, DraftTree, TreeStats, commit_tree_step, feed_masked_hidden, keep_path,
                                   tree_forward_hidden, tree_rule)

CONFIG_FILE = "medusa_heads.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
KIND = "medusa"


@dataclass(frozen=True)
class HeadsConfig:
    hidden_size: int
    num_heads: int
    num_layers: int = 1          # residual blocks per head
    use_token: bool = True       # heads also read the committed token's embedding

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"hidden_size, num_heads and num_layers must be >= 1, got {self}")


class _ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads over the target's hidden state. `out_rows` [V_keep, d] are the target's output rows of the
    kept token ids `output_token_ids` (frozen buffers); `embed` the target's input embedding (frozen,
    used only with `use_token`)."""

    def __init__(self, config: HeadsConfig, output_token_ids: Sequence[int], out_rows: torch.Tensor,
                 embed: torch.Tensor | None = None) -> None:
        super().__init__()
        d = config.hidden_size
        if out_rows.dim() != 2 or out_rows.shape != (len(output_token_ids), d):
            raise ValueError(f"out_rows must be [{len(output_token_ids)}, {d}], got {tuple(out_rows.shape)}")
        if config.use_token and (embed is None or embed.dim() != 2 or embed.shape[1] != d):
            raise ValueError("use_token heads need the target's input embedding [vocab, hidden_size]")
        self.config = config
        self.output_token_ids = [int(i) for i in output_token_ids]
        self.register_buffer("out_rows", out_rows.detach().clone(), persistent=False)
        self.register_buffer("token_ids", torch.tensor(self.output_token_ids, dtype=torch.long), persistent=False)
        self.register_buffer("embed", embed.detach() if (config.use_token and embed is not None)
                             else torch.zeros(0, d), persistent=False)
        self.blocks = nn.ModuleList(nn.Sequential(*[_ResBlock(d) for _ in range(config.num_layers)])
                                    for _ in range(config.num_heads))
        self.token_proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(config.num_heads)) \
            if config.use_token else None
        if self.token_proj is not None:
            for p in self.token_proj:
                nn.init.zeros_(p.weight)

    # ------------------------------------------------------------------ forward
    def head_states(self, h: torch.Tensor, root: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, d] (+ root token ids [B]) -> each head's final state [K, B, d] (before the output rows)."""
        h = h.to(self.out_rows.dtype)
        e = None
        if self.token_proj is not None:
            if root is None:
                raise ValueError("these heads read the committed token: pass `root`")
            e = self.embed[root.to(self.embed.device)].to(h.dtype)
        outs = []
        for k, block in enumerate(self.blocks):
            x = h if e is None else h + self.token_proj[k](e)
            outs.append(block(x))
        return torch.stack(outs)

    def forward(self, h: torch.Tensor, root: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the kept vocabulary, [K, B, V_keep] (column j is token `output_token_ids[j]`)."""
        return self.head_states(h, root) @ self.out_rows.T

    # ------------------------------------------------------------------ proposing
    def propose(self, h: torch.Tensor, root: int, branching: Sequence[int], floor: float = 0.0) -> DraftTree:
        """A tree under `root`: every node at depth d gets the top-`branching[d]` tokens of head d + 1 (the
        same candidates under every parent: the heads do not see earlier depths). Depth <= num_heads.
        `floor` > 0 prunes it by the heads' own doubt (module docstring, "The heads' doubt prunes the tree")."""
        return self._grow(h, root, branching, floor)[0]

    def propose_with_logq(self, h: torch.Tensor, root: int, branching: Sequence[int],
                          warp: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          floor: float = 0.0) -> tuple[DraftTree, torch.Tensor]:
        """`propose`, also returning node_logq [N] for tree.py's `verify_mjsd`: each node's token under its
        depth's head, log-probabilities from `warp` (logits [K, V_keep] -> warped log-probs, e.g. warp.py's
        `warp_logprobs` with the request's temperature / top-k / top-p, as the target rows are warped; None:
        plain log-softmax). Over the kept vocabulary this equals warping the full row with every other token
        impossible (-inf). Candidates stay the top-k of the raw head logits (pruned by `floor` as `propose`)."""
        tree, logits, depths, cols = self._grow(h, root, branching, floor)
        if not len(tree):
            return tree, logits.new_zeros(0)
        used = logits[: len(branching)]
        logq = (warp(used) if warp is not None else torch.log_softmax(used, dim=-1)).float()
        return tree, logq[torch.tensor(depths, device=logq.device), torch.tensor(cols, device=logq.device)]

    def _grow(self, h: torch.Tensor, root: int, branching: Sequence[int],
              floor: float = 0.0) -> tuple[DraftTree, torch.Tensor, list[int], list[int]]:
        """The tree, the heads' logits [K, V_keep], and each node's head index and kept-vocabulary column."""
        if len(branching) > self.config.num_heads:
            raise ValueError(f"a tree of depth {len(branching)} needs {len(branching)} heads; these have "
                             f"{self.config.num_heads}")
        with torch.no_grad():
            logits = self.forward(h.reshape(1, -1), torch.tensor([root]))[:, 0].float()     # [K, V_keep]
        return grow_tree(logits, branching, self.output_token_ids, floor)

    # ------------------------------------------------------------------ files
    def save(self, out_dir: str | Path, **meta) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()},
                  str(out / WEIGHTS_FILE))
        cfg = {"kind": KIND, "hidden_size": self.config.hidden_size, "num_heads": self.config.num_heads,
               "num_layers": self.config.num_layers, "use_token": self.config.use_token,
               "output_token_ids": self.output_token_ids, **meta}
        (out / CONFIG_FILE).write_text(json.dumps(cfg))
        return out

    @classmethod
    def for_target(cls, target, config: HeadsConfig, output_token_ids: Sequence[int]) -> "MedusaHeads":
        """New (untrained) heads reading `target`'s output rows and input embedding."""
        ids = torch.as_tensor(list(output_token_ids), dtype=torch.long)
        out_w = target.get_output_embeddings().weight.detach()
        if int(ids.max()) >= out_w.shape[0] or int(ids.min()) < 0:
            raise ValueError(f"output_token_ids outside the target's vocabulary of {out_w.shape[0]}")
        embed = target.get_input_embeddings().weight.detach() if config.use_token else None
        return cls(config, ids.tolist(), out_w[ids].float(), None if embed is None else embed.float())

    @classmethod
    def load(cls, path: str | Path, target) -> "MedusaHeads":
        """Heads saved by `save`, bound to `target`'s rows. Clear errors for a folder that is not one."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not cfg_file.is_file() or not w_file.is_file():
            raise FileNotFoundError(f"{path} is not a Medusa heads folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            raw = json.loads(cfg_file.read_text())
            config = HeadsConfig(int(raw["hidden_size"]), int(raw["num_heads"]), int(raw.get("num_layers", 1)),
                                 bool(raw.get("use_token", True)))
            ids = [int(i) for i in raw["output_token_ids"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{cfg_file} is not a valid heads config: {e}") from None
        d = target.get_output_embeddings().weight.shape[1]
        if d != config.hidden_size:
            raise ValueError(f"heads in {path} were built for hidden size {config.hidden_size}, the target has {d}")
        heads = cls.for_target(target, config, ids)
        heads.load_state_dict(load_file(str(w_file)))
        return heads.eval()


def grow_tree(logits: torch.Tensor, branching: Sequence[int], token_ids: Sequence[int],
              floor: float = 0.0) -> tuple[DraftTree, torch.Tensor, list[int], list[int]]:
    """The heads' tree from their logits [K, V_keep] (row d: head d + 1 over the kept vocabulary, column j is
    token `token_ids[j]`): every node at depth d gets the top-`branching[d]` columns of row d. With `floor` > 0
    a node is kept only while its path probability (the product, over its path, of each depth's raw softmax
    probability of its token) is at least `floor`; the root's first child always stays, so a tree of depth >= 1
    is never empty. Returns the tree, `logits`, and each node's depth (head index) and column."""
    tokens: list[int] = []
    parents: list[int] = []
    cols: list[int] = []                       # each node's column of the kept vocabulary
    depths: list[int] = []
    logp = torch.log_softmax(logits[: len(branching)], dim=-1) if floor > 0 else None
    cut = math.log(floor) if floor > 0 else -math.inf
    frontier = [(ROOT, 0.0)]                   # (node, log-probability of its path)
    for d, k in enumerate(branching):
        top = torch.topk(logits[d], int(k)).indices.tolist()
        new = []
        for node, lp in frontier:
            for i, c in enumerate(top):
                path = lp + (float(logp[d, c]) if logp is not None else 0.0)
                if path < cut and not (d == 0 and i == 0):
                    break                      # the rest of `top` is no more likely under this parent
                tokens.append(int(token_ids[c]))
                parents.append(node)
                cols.append(c)
                depths.append(d)
                new.append((len(tokens) - 1, path))
        frontier = new
        if not frontier:
            break
    return DraftTree(tuple(tokens), tuple(parents)), logits, depths, cols


def read_heads_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


# ---------------------------------------------------------------------- a reference decode loop
def medusa_generate(target, heads: MedusaHeads, prompt_ids: list[int], max_new_tokens: int,
                    branching: Sequence[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                    eos_id: int | None = None, floor: float = 0.0) -> tuple[list[int], TreeStats]:
    """Decode with Medusa heads and tree verification: per step the heads propose a tree from the hidden
    state the previous pass left (pruned by `floor` as `MedusaHeads.propose`), ONE target pass scores it (and
    yields the next hidden state), the rule (greedy at T = 0, else tree.py's lossless `verify_deterministic`)
    keeps a path plus one target token. Returns (new tokens, stats). The target must expose `get_decoder()` /
    `get_output_embeddings()`."""
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids must hold at least one token")
    committed = list(prompt_ids)
    cache, h = None, None
    if len(committed) > 1:                                        # prefill all but the root
        _, hid, cache = _feed_causal(target, committed[:-1])
        h = hid[-1]
    stats = TreeStats()
    new: list[int] = []
    while len(new) < max_new_tokens:
        tree = heads.propose(h, committed[-1], branching, floor) if h is not None else DraftTree((), ())
        prefix_len = len(committed) - 1
        logits, hid, cache = tree_forward_hidden(target, tree, committed[-1], cache, prefix_len)
        res = tree_rule(tree, logits, temperature, generator)
        keep_path(cache, prefix_len, res.path)
        h = hid[res.path[-1] + 1 if res.path else 0]
        if commit_tree_step(res, tree, stats, new, committed, max_new_tokens, eos_id):
            break
    return new, stats


def _feed_causal(target, ids: list[int]):
    n = len(ids)
    return feed_masked_hidden(target, ids, torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n), None)
