"""Tree verification: many draft continuations checked in ONE target pass (issue 19, step 2).

Source: "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (Cai et al.
2024, in ../shared/papers/), section "Tree attention": candidates of several positions are arranged as a
tree, every node attends only to its ancestors (a tree attention mask) at the position id of its depth,
and the longest accepted path is kept. The multi-candidate acceptance rule for sampled children is
SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer: Accelerating Generative LLM
Serving with Tree-based Speculative Inference and Verification").

Layout. The committed sequence is `prefix + [root]`: the KV cache holds the `prefix_len` tokens before the
root, the root (last committed token) is not cached yet. A verification pass feeds `[root] + tree nodes`
(N + 1 query positions): row 0 (the root) attends to the prefix and itself, node i to the prefix, the root
and its ancestors-or-self. Position ids: root `prefix_len`, node i `prefix_len + depth_i` (depth 1 =
children of the root). Logit row 0 predicts the root's children, row 1 + i the children of node i. After
acceptance `keep_path` keeps the root's and the accepted path's cache entries, in order, so the cache equals
one built by a plain forward over the accepted sequence.

Acceptance rules (target = p, draft = q, as in speculative.py), each returning the accepted path (node
indices, root to leaf), its tokens, and one more token from the target:

- `verify_greedy` (T = 0): descend into the child whose token is the target's argmax.
- `verify_deterministic`: children proposed deterministically (top-k of any drafter). At a node with target
  distribution p, try its children x_1, x_2, ... in order: accept x_j with probability p_j(x_j), where
  p_1 = p and p_{j+1} = p_j with x_j zeroed, renormalised. If all are rejected, emit a sample of the last
  residual. Proof of losslessness: the rejections up to j happen with probability 1 - sum_{i<j} p(x_i)
  and p_j(x_j) = p(x_j) / (1 - sum_{i<j} p(x_i)), so x_j is emitted with probability p(x_j); a token y
  outside the children with (1 - sum_i p(x_i)) * p(y) / (1 - sum_i p(x_i)) = p(y). An accepted child
  continues with the target distribution at that child: the emitted sequence is distributed as the target.
- `verify_typical` (lossy, any drafter): Medusa's typical acceptance on the tree (typical.py's test at each
  node: accept child x iff p(x) > min(posterior_threshold, posterior_alpha exp(-H(p)))); the deepest node
  whose whole path passes wins (the first in node order among equals), then the target's argmax after it.
- `verify_mjsd` (lossy, as MJSD, serving/decoding/mjsd.py): MJSD's joint test on every root-to-node path.
  With node_logq[i] the proposer's warped log q of node i's token given its parent (Medusa: head d's
  distribution at depth d; the draft tree: the draft's row at the parent), joint log p / log q summed along
  the path, node i passes iff min(1, p(path)/q(path)) > tau (strict; a joint q of 0 fails). The DEEPEST
  passing node wins, whether or not its ancestors pass (no break, as MJSD's longest passing prefix); among
  equally deep ones the larger joint p, then the lower node index. tau <= 0: the deepest node (same
  tie-break); tau >= 1: none. Then ONE plain sample from the target row after it (no residual), as
  `mjsd_verify`; on a chain it is exactly `mjsd_verify`. `tree_node_logq` builds node_logq from a drafter's
  warped rows (`TreeDrafter.propose`, `grow_topk_tree`); `MedusaHeads.propose_with_logq` returns it.
- `verify_sampled`: children drawn i.i.d. from q (the draft at their parent), possibly with repeats, given
  in draw order. For each draw x: accept with probability min(1, p(x) / q(x)); on rejection
  p <- norm(max(0, p - q)). All rejected: sample the residual. SpecInfer, Theorem 4.2: lossless.

Numerics as speculative.py: fp32, a residual of mass <= RESIDUAL_MIN_MASS falls back to the target row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import math

import torch

from serving.decoding.speculative import RESIDUAL_MIN_MASS, recovery_probs
from serving.decoding.warp import sample, warp_probs

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    """Candidate tokens as a tree, nodes in topological order (a parent before its children)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]                     # ROOT (-1) = child of the root
    depth: tuple[int, ...] = field(init=False)   # 1 = child of the root

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        depth = []
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"node {i}: token must be a non-negative int, got {t!r}")
            if not (p == ROOT or 0 <= p < i):
                raise ValueError(f"node {i}: parent {p} must be -1 (the root) or an earlier node (0..{i - 1})")
            depth.append(1 if p == ROOT else depth[p] + 1)
        object.__setattr__(self, "depth", tuple(depth))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "DraftTree":
        """A trie of candidate continuations: shared prefixes become one node; order of first appearance."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            parent = ROOT
            for t in path:
                t = int(t)
                key = (parent, t)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = index[key]
        return cls(tuple(tokens), tuple(parents))

    def graft(self, path: Sequence[int]) -> "DraftTree":
        """This tree with the candidate continuation `path` added under the root: it follows existing nodes
        while their tokens match and appends the rest as one new branch (each new node the last child of its
        parent, so every existing node keeps its index and its children their order)."""
        tokens, parents = list(self.tokens), list(self.parents)
        node = ROOT
        for i, t in enumerate(path):
            t = int(t)
            child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == t), None)
            if child is None:
                for t in path[i:]:
                    tokens.append(int(t))
                    parents.append(node)
                    node = len(tokens) - 1
                break
            node = child
        if len(tokens) == len(self.tokens):
            return self
        return DraftTree(tuple(tokens), tuple(parents))

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    def children(self, node: int) -> list[int]:
        """Children of `node` (ROOT for the root's), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def chain_from(self, path: Sequence[int]) -> list[int]:
        """`path` (node indices from the root's child down) continued through first children to a leaf: the
        chain a tree step records (the accepted path, then the first rejected branch)."""
        chain = list(path)
        kids = self.children(chain[-1] if chain else ROOT)
        while kids:
            chain.append(kids[0])
            kids = self.children(kids[0])
        return chain

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j != ROOT:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def attention_inputs(self, prefix_len: int, fed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask and position ids. fed=None: the verification pass, [root] + every node after a cache holding
        the prefix (the first query row is the root). fed=k: nodes k..N-1 after a cache holding the prefix,
        the root and nodes 0..k-1 (a drafter growing the tree depth by depth).

        Returns (mask [q, kv] bool, position_ids [q])."""
        n = len(self)
        anc = self.ancestor_mask()
        if fed is None:
            q = n + 1
            mask = torch.zeros(q, prefix_len + q, dtype=torch.bool)
            mask[:, : prefix_len + 1] = True                      # prefix and root, for every row
            mask[1:, prefix_len + 1:] = anc
            pos = torch.tensor([prefix_len] + [prefix_len + d for d in self.depth])
            return mask, pos
        q = n - fed
        mask = torch.zeros(q, prefix_len + 1 + n, dtype=torch.bool)
        mask[:, : prefix_len + 1] = True
        mask[:, prefix_len + 1:] = anc[fed:]
        pos = torch.tensor([prefix_len + d for d in self.depth[fed:]])
        return mask, pos


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [q, kv] -> additive [1, 1, q, kv] (0 = attend), the 4-D form transformers passes through as-is."""
    out = torch.zeros(mask.shape, dtype=dtype)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]


def feed_masked(model, ids: Sequence[int], mask: torch.Tensor, positions: torch.Tensor, cache):
    """One forward of `ids` (batch 1) with a custom [q, kv] bool mask; returns (fp32 logits [q, V], cache)."""
    logits, _, cache = feed_masked_hidden(model, ids, mask, positions, cache)
    return logits, cache


def feed_masked_hidden(model, ids: Sequence[int], mask: torch.Tensor, positions: torch.Tensor, cache,
                       logits: bool = True):
    """As `feed_masked`, also returning the last hidden states (after the final norm, what the output layer
    reads): (fp32 logits [q, V], hidden [q, d], cache). For drafts that read the target's features
    (serving/decoding/medusa.py). logits=False: the output layer does not run, logits is None (a tree pass
    whose rule reads only some rows, `verdict_on_demand`)."""
    from serving.kvcache import growable_cache

    if cache is None:
        cache = growable_cache()      # appends in place: no copy of the whole cache per forward
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model.get_decoder()(input_ids=torch.as_tensor([list(ids)], dtype=torch.long, device=device),
                                  attention_mask=_float_mask(mask, dtype).to(device),
                                  position_ids=positions[None].to(device), past_key_values=cache, use_cache=True)
        h = out.last_hidden_state[0]
        if not logits:
            return None, h, out.past_key_values
        rows = model.get_output_embeddings()(h)
    return rows.float(), h, out.past_key_values


def tree_forward(model, tree: DraftTree, root_token: int, cache, prefix_len: int):
    """The verification pass: feed [root] + every node; fp32 logits [N + 1, V] (row 0: the root) and cache."""
    mask, pos = tree.attention_inputs(prefix_len)
    return feed_masked(model, [root_token, *tree.tokens], mask, pos, cache)


def tree_forward_hidden(model, tree: DraftTree, root_token: int, cache, prefix_len: int, logits: bool = True):
    """`tree_forward` that also returns the hidden states: (logits [N + 1, V], hidden [N + 1, d], cache);
    logits=False: (None, hidden, cache), for `verdict_on_demand`."""
    mask, pos = tree.attention_inputs(prefix_len)
    return feed_masked_hidden(model, [root_token, *tree.tokens], mask, pos, cache, logits=logits)


def cache_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def keep_path(cache, prefix_len: int, path: Sequence[int]):
    """Keep the prefix, the root (slot prefix_len) and the slots of `path`'s nodes (slot prefix_len + 1 + i),
    in that order; drop every other tree entry. Works in place on a transformers DynamicCache; on the
    growable layers of serving/kvcache.py (what `feed_masked_hidden` creates) only the path's slots move."""
    from serving.kvcache import GrowableLayer

    keep = None
    for layer in cache.layers:
        if isinstance(layer, GrowableLayer):
            layer.keep_tail(prefix_len + 1, [prefix_len + 1 + i for i in path])
            continue
        if keep is None:
            keep = torch.tensor(list(range(prefix_len + 1)) + [prefix_len + 1 + i for i in path], dtype=torch.long)
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
    return cache


# ---------------------------------------------------------------------- acceptance rules
@dataclass(frozen=True)
class TreeVerifyResult:
    path: list[int]        # accepted node indices, root to leaf
    tokens: list[int]      # their tokens
    next_token: int        # one token from the target after the path

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _check_rows(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    if rows.dim() != 2 or rows.shape[0] != len(tree) + 1:
        raise ValueError(f"{name} must be [N + 1, vocab] = [{len(tree) + 1}, vocab], got {tuple(rows.shape)}")
    if len(tree) and max(tree.tokens) >= rows.shape[1]:
        raise ValueError(f"tree token {max(tree.tokens)} outside the vocabulary of {name} ({rows.shape[1]})")


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerifyResult:
    """T = 0: follow the target's argmax (ties to the lowest id, as warp.py) through the tree."""
    _check_rows(tree, target_logits, "target_logits")
    best = target_logits.argmax(dim=-1).tolist()
    node, path = ROOT, []
    while True:
        want = best[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return TreeVerifyResult(path, [tree.tokens[i] for i in path], want)
        path.append(nxt)
        node = nxt


def verify_deterministic(tree: DraftTree, target_probs: torch.Tensor,
                         generator: torch.Generator | None = None) -> TreeVerifyResult:
    """Lossless rule for deterministic children (module docstring). target_probs [N + 1, V], warped."""
    _check_rows(tree, target_probs, "target_probs")
    node, path = ROOT, []
    while True:
        p = target_probs[node + 1].float()
        accepted = None
        for c in tree.children(node):
            x = tree.tokens[c]
            if float(torch.rand((), generator=generator, device=p.device)) < float(p[x]):
                accepted = c
                break
            p = p.clone()
            p[x] = 0.0
            mass = p.sum()
            if float(mass) <= RESIDUAL_MIN_MASS:
                p = target_probs[node + 1].float()               # rounding only: fall back to the target
            else:
                p = p / mass
        if accepted is None:
            return TreeVerifyResult(path, [tree.tokens[i] for i in path], int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def verify_typical(tree: DraftTree, target_probs: torch.Tensor, posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3) -> TreeVerifyResult:
    """Medusa's typical acceptance on a tree (module docstring); deterministic. target_probs [N + 1, V], warped."""
    from serving.decoding.typical import typical_thresholds

    _check_rows(tree, target_probs, "target_probs")
    rows = target_probs.float()
    thr = typical_thresholds(rows, posterior_threshold, posterior_alpha).tolist()
    ok = [False] * len(tree)
    best, best_depth = ROOT, 0
    for i, (t, par) in enumerate(zip(tree.tokens, tree.parents)):      # parents come before children
        if (par == ROOT or ok[par]) and float(rows[par + 1, t]) > thr[par + 1]:
            ok[i] = True
            if tree.depth[i] > best_depth:
                best, best_depth = i, tree.depth[i]
    path = tree.path_to(best) if best != ROOT else []
    return TreeVerifyResult(path, [tree.tokens[i] for i in path], int(rows[best + 1].argmax()))


def tree_node_logq(tree: DraftTree, logq_rows: torch.Tensor) -> torch.Tensor:
    """`verify_mjsd`'s node_logq from a drafter's warped log-probability rows: logq_rows [M, V], row 0 the
    root's (its children were read off it), row 1 + i node i's (as `grow_topk_tree` / `TreeDrafter.propose`
    return them, warped with the request's temperature / top-k / top-p); rows of leaves may be absent.
    Returns fp32 [N]: logq_rows[parent + 1, token] for every node."""
    if logq_rows.dim() != 2:
        raise ValueError(f"logq_rows must be [rows, vocab], got {tuple(logq_rows.shape)}")
    if not len(tree):
        return logq_rows.new_zeros(0, dtype=torch.float32)
    need = max(tree.parents) + 2
    if logq_rows.shape[0] < need:
        raise ValueError(f"logq_rows has {logq_rows.shape[0]} rows; the tree's parents need {need}")
    if max(tree.tokens) >= logq_rows.shape[1]:
        raise ValueError(f"tree token {max(tree.tokens)} outside the vocabulary of logq_rows ({logq_rows.shape[1]})")
    rows = torch.tensor(tree.parents, dtype=torch.long, device=logq_rows.device) + 1
    cols = torch.tensor(tree.tokens, dtype=torch.long, device=logq_rows.device)
    return logq_rows[rows, cols].float()


def verify_mjsd(tree: DraftTree, target_probs: torch.Tensor, node_logq: torch.Tensor | Sequence[float],
                tau: float = 0.1, generator: torch.Generator | None = None) -> TreeVerifyResult:
    """MJSD's joint test on the tree (module docstring); lossy. target_probs [N + 1, V], warped; node_logq [N]:
    the proposer's warped log q of each node's token given its parent. One draw from `generator`."""
    _check_rows(tree, target_probs, "target_probs")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
        raise ValueError(f"tau must be a finite number, got {tau!r}")
    n = len(tree)
    try:
        logq = node_logq.detach().to("cpu", torch.float64) if isinstance(node_logq, torch.Tensor) \
            else torch.tensor([float(x) for x in node_logq], dtype=torch.float64)
    except (TypeError, ValueError):
        raise ValueError(f"node_logq must be a sequence of {n} log-probabilities, got {node_logq!r}") from None
    if logq.dim() != 1 or logq.numel() != n:
        raise ValueError(f"node_logq must hold one log-probability per node, [N] = [{n}], got {tuple(logq.shape)}")
    if bool(torch.isnan(logq).any()) or bool((logq == float("inf")).any()):
        raise ValueError("node_logq must hold log-probabilities (finite or -inf), not NaN or +inf")
    if n:
        rows = torch.tensor(tree.parents, dtype=torch.long, device=target_probs.device) + 1
        cols = torch.tensor(tree.tokens, dtype=torch.long, device=target_probs.device)
        logp = target_probs[rows, cols].double().log().tolist()
    else:
        logp = []
    logq = logq.tolist()
    best, key = ROOT, None
    if tau < 1:
        log_tau = math.log(tau) if tau > 0 else None
        jp, jq = [0.0] * n, [0.0] * n
        for i, par in enumerate(tree.parents):                    # parents come before children
            jp[i] = logp[i] + (jp[par] if par != ROOT else 0.0)
            jq[i] = logq[i] + (jq[par] if par != ROOT else 0.0)
            # min(1, r) > tau  <=>  log p - log q > log tau  (0 < tau < 1); a joint q of 0 fails
            if log_tau is not None and (jq[i] == float("-inf") or not jp[i] - jq[i] > log_tau):
                continue
            k = (tree.depth[i], jp[i])                            # deeper, then likelier; ties: lower index
            if key is None or k > key:
                best, key = i, k
    path = tree.path_to(best) if best != ROOT else []
    nxt = int(sample(target_probs[best + 1].float(), generator))       # a plain target sample, as mjsd_verify
    return TreeVerifyResult(path, [tree.tokens[i] for i in path], nxt)


def verify_sampled(tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   draws: dict[int, list[int]] | None = None,
                   generator: torch.Generator | None = None) -> TreeVerifyResult:
    """SpecInfer's multi-step rule for children drawn i.i.d. from the draft (module docstring).

    draft_probs [N + 1, V]: row 1 + i is the distribution node i's children were drawn from (row 0: the
    root's). draws: node (ROOT for the root) -> the child node of each draw in draw order, a child repeated
    when its token was drawn more than once; default: each child once, in node order."""
    _check_rows(tree, target_probs, "target_probs")
    _check_rows(tree, draft_probs, "draft_probs")
    node, path = ROOT, []
    while True:
        p = target_probs[node + 1].float()
        q = draft_probs[node + 1].float()
        order = draws.get(node, tree.children(node)) if draws is not None else tree.children(node)
        accepted = None
        for c in order:
            x = tree.tokens[c]
            qx = float(q[x])
            ratio = 0.0 if qx <= 0 else min(1.0, float(p[x]) / qx)
            if float(torch.rand((), generator=generator, device=p.device)) < ratio:
                accepted = c
                break
            p = recovery_probs(q, p)
        if accepted is None:
            return TreeVerifyResult(path, [tree.tokens[i] for i in path], int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def inner_rows(tree: DraftTree) -> list[int]:
    """The logit rows every tree rule reads while it walks (row 0: the root's, row 1 + i: node i's): the root's
    and those of nodes with children. A leaf's row is read only where the walk ends at that leaf (the one
    target token after the path) and by a step's record (`DraftTree.chain_from`)."""
    parents = set(tree.parents)
    return [0] + [1 + i for i in range(len(tree)) if i in parents]


def verdict_on_demand(tree: DraftTree, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                      verdict: Callable[[torch.Tensor], TreeVerifyResult],
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, TreeVerifyResult]:
    """A tree rule that runs the target's output layer on the rows it reads, not on every node.

    hidden [N + 1, d]: a verification pass's last hidden states (row 0 the root's); `logits_of(h [m, d])`:
    fp32 logits [m, V] (the output layer, on the full vocabulary); `verdict(rows [N + 1, V])`: the rule
    (`serving.engine.tree_verdict` and the verify_* rules above), drawing from `generator` where it samples;
    without a generator (a rule that samples would draw from torch's global one) every row is computed.

    Every rule here picks its path from the rows of the root and of nodes with children (`inner_rows`); a
    leaf's row only gives the token after a path that ends there. So the output layer runs on the inner rows
    first (the leaves' rows hold a copy of the root's meanwhile), then on the leaf of the step's record chain
    (`DraftTree.chain_from`); where the path itself ends at that leaf, the rule runs again on the filled rows
    from the generator's state before its first run: the same draws give the same path, and the token after
    it is the one a pass with every row would give. A tree whose leaves are a third of its nodes saves a
    third of the output layer (49,152 x 576 on the default target: a fifth of its weights).

    Returns (rows [N + 1, V]: real at the inner rows and the record chain's nodes, the root's copy
    elsewhere; the rule's result)."""
    n = len(tree)
    inner = inner_rows(tree)
    if len(inner) == n + 1 or generator is None:              # the empty tree, or no state to run the rule again
        rows = logits_of(hidden)
        return rows, verdict(rows)
    part = logits_of(hidden[inner])
    rows = part[:1].expand(n + 1, -1).clone()
    rows[torch.tensor(inner, device=rows.device)] = part
    state = generator.get_state()
    res = verdict(rows)
    chain = tree.chain_from(res.path)                         # a tree with nodes: the chain ends at a leaf
    leaf = 1 + chain[-1]
    rows[leaf] = logits_of(hidden[leaf: leaf + 1])[0]
    if res.path and res.path[-1] == chain[-1]:                # the path ended at that leaf: its token, again
        generator.set_state(state)
        res = verdict(rows)
    return rows, res


def tree_branching(depth: int, width: int, branch: int) -> tuple[int, ...]:
    """The served tree shape (mode `tree`): `width` children of the root, `branch` children of each depth-1
    node, one child of every deeper node; `depth` levels."""
    if depth < 1 or width < 1 or branch < 1:
        raise ValueError(f"depth, width and branch must be >= 1, got {depth}, {width}, {branch}")
    return ((width,) + (branch,) + (1,) * (depth - 2))[:depth]


def tree_size(branching: Sequence[int]) -> int:
    """Nodes of a tree with `branching[d]` children per node at depth d + 1."""
    n, level = 0, 1
    for b in branching:
        level *= int(b)
        n += level
    return n


# ---------------------------------------------------------------------- a reference decode loop
LogitsMap = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class TreeStats:
    steps: int = 0
    accepted: int = 0        # draft tokens accepted
    nodes: int = 0           # tree nodes verified

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


def grow_topk_tree(branching: Sequence[int], root_row: torch.Tensor,
                   top_tokens: Callable[[torch.Tensor, int], list[int]],
                   expand: Callable[[DraftTree, int], list[torch.Tensor]]) -> tuple[DraftTree, list[torch.Tensor]]:
    """Grow a tree depth by depth: every node at depth d gets `top_tokens(its row, branching[d])` children;
    `expand(tree so far, first new node)` returns the rows of the new nodes (one drafter forward per depth;
    the leaves need none). Rows: [root_row, row of node 0, ...]. Returns (tree, rows)."""
    rows = [root_row]
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [ROOT]
    for d, k in enumerate(branching):
        new = []
        for node in frontier:
            for t in top_tokens(rows[node + 1], int(k)):
                tokens.append(int(t))
                parents.append(node)
                new.append(len(tokens) - 1)
        frontier = new
        if d + 1 < len(branching):
            rows.extend(expand(DraftTree(tuple(tokens), tuple(parents)), new[0]))
    return DraftTree(tuple(tokens), tuple(parents)), rows


class TreeDrafter:
    """Grows a top-k tree from a standalone draft model: `branching[d]` children per node at depth d + 1,
    one draft forward per depth over that depth's new nodes (tree mask), the draft cache kept in step with
    the committed sequence like the target's."""

    def __init__(self, model, branching: Sequence[int], map_logits: LogitsMap = _identity) -> None:
        if not branching or any(int(b) < 1 for b in branching):
            raise ValueError(f"branching must be a non-empty list of positive ints, got {list(branching)}")
        self.model = model
        self.branching = [int(b) for b in branching]
        self.map_logits = map_logits
        self.cache = None

    def propose(self, committed: list[int]) -> tuple[DraftTree, torch.Tensor]:
        """A tree of continuations of `committed`; also the draft logits [fed nodes + 1, V] (row 0: root; warped,
        `tree_node_logq` turns them into `verify_mjsd`'s node_logq)."""
        n_cached = cache_length(self.cache)
        catch_up = committed[n_cached:]                           # always includes the root (last token)
        pos = torch.arange(n_cached, len(committed))
        causal = torch.ones(len(catch_up), n_cached + len(catch_up), dtype=torch.bool).tril(n_cached)
        logits, self.cache = feed_masked(self.model, catch_up, causal, pos, self.cache)
        self.prefix_len = len(committed) - 1
        def expand(tree: DraftTree, fed: int) -> list[torch.Tensor]:
            mask, pos = tree.attention_inputs(self.prefix_len, fed=fed)
            out, self.cache = feed_masked(self.model, tree.tokens[fed:], mask, pos, self.cache)
            return [self.map_logits(r) for r in out]

        tree, rows = grow_topk_tree(self.branching, self.map_logits(logits[-1]),
                                    lambda row, k: torch.topk(row, k).indices.tolist(), expand)
        self.fed = len(rows) - 1
        return tree, torch.stack(rows)

    def accept(self, path: list[int]) -> None:
        """Keep the root and the accepted path's nodes the draft has cached (a prefix of the path)."""
        keep_path(self.cache, self.prefix_len, [i for i in path if i < self.fed])


def tree_rule(tree: DraftTree, logits: torch.Tensor, temperature: float,
              generator: torch.Generator | None = None) -> TreeVerifyResult:
    """The reference loops' rule: greedy at T = 0, else `verify_deterministic` on the warped target rows."""
    if temperature == 0:
        return verify_greedy(tree, logits)
    return verify_deterministic(tree, warp_probs(logits, temperature, 0, 1.0), generator)


def commit_tree_step(res: TreeVerifyResult, tree: DraftTree, stats: TreeStats, new: list[int],
                     committed: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    """Count the step and append its tokens (accepted path + the target's token, cut at EOS and at the
    budget) to `new` and `committed`; True when decoding is over (EOS emitted)."""
    stats.steps += 1
    stats.accepted += res.num_accepted
    stats.nodes += len(tree)
    step = res.tokens + [res.next_token]
    if eos_id is not None and eos_id in step:
        step = step[: step.index(eos_id) + 1]
    step = step[: max_new_tokens - len(new)]
    new.extend(step)
    committed.extend(step)
    return eos_id is not None and bool(step) and step[-1] == eos_id


def tree_generate(target, draft, prompt_ids: list[int], max_new_tokens: int, branching: Sequence[int],
                  temperature: float = 0.0, generator: torch.Generator | None = None,
                  eos_id: int | None = None, draft_map: LogitsMap = _identity,
                  target_map: LogitsMap = _identity) -> tuple[list[int], TreeStats]:
    """Decode with tree verification: per step the draft proposes a top-k tree, ONE target pass scores it,
    the rule (greedy at T = 0, else `verify_deterministic`) keeps a path plus one target token, and both
    caches keep the accepted path only. Returns (new tokens, stats)."""
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids must hold at least one token")
    drafter = TreeDrafter(draft, branching, draft_map)
    committed = list(prompt_ids)
    cache = None
    if len(committed) > 1:                                        # prefill all but the root
        n = len(committed) - 1
        _, cache = feed_masked(target, committed[:-1], torch.ones(n, n, dtype=torch.bool).tril(),
                               torch.arange(n), None)
    stats = TreeStats()
    new: list[int] = []
    while len(new) < max_new_tokens:
        tree, _ = drafter.propose(committed)
        prefix_len = len(committed) - 1
        logits, cache = tree_forward(target, tree, committed[-1], cache, prefix_len)
        res = tree_rule(tree, target_map(logits), temperature, generator)
        keep_path(cache, prefix_len, res.path)
        drafter.accept(res.path)
        if commit_tree_step(res, tree, stats, new, committed, max_new_tokens, eos_id):
            break
    return new, stats
