"""Ops joined by a value that no stage boundary may cut: merged into one op.

Stages exchange *batched* values (one dim the batch, dim 0 or another as
in a sequence-first ``(seq, batch, dim)``, every other dim fixed) and
*unbatched* ones (no dim depends on the batch: a position table), split
and stitched per micro-batch by the runtime
(:func:`graphpipe.runtime.stage_modules.boundary_meta`). A value whose
shape depends on the batch some other way cannot be cut into
micro-batches: MobileViT unfolds an image into patches and runs its
transformer layers on ``(batch * patches, tokens, dim)``; a
mixture-of-experts block that gives each expert its own module hands it a
data-dependent number of rows. A tuple (a ``split`` or ``topk`` result) is
no tensor to send either.

Capture contracts nodes into ops by module (:func:`graphpipe.frontend.capture.group_nodes`);
when such a value flows from one op into another, :func:`merge_folded_ops`
merges the two, and any op on a path between them (merging two ops of a
DAG joined by an edge and another path would close a cycle), so the
planners, which cut only between ops, never cut it. MobileViT's
unfold-transform-fold block becomes one op; models whose values are all
batched or unbatched keep exactly the ops they had.
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

import torch
import torch.fx as fx

from graphpipe.frontend.reentrant import contracted_graph

__all__ = ["splittable", "merge_folded_ops", "is_batch_dim"]


def _symbols(dim: Any) -> set[str]:
    if isinstance(dim, torch.SymInt):
        return {str(s) for s in dim.node.expr.free_symbols}
    return set()


def is_batch_dim(dim: Any, batch: str) -> bool:
    """Whether ``dim`` is the batch: its symbol, or an expression of it (and other symbols) that always equals it.

    Export does not simplify every such expression: ``EmbeddingBag`` over ``(batch, bag)`` indices of a
    varying ``bag`` returns ``((batch*bag + bag - 1)//bag)`` rows, which is the batch for every size. The
    expression is evaluated at a few sizes of its symbols; equal to the batch at each, it is the batch.
    """
    if str(dim) == batch:
        return True
    if not isinstance(dim, torch.SymInt):
        return False
    expr = dim.node.expr
    symbols = {str(s): s for s in expr.free_symbols}
    if batch not in symbols:
        return False
    for trial in ((2, 3), (5, 7), (8, 2), (13, 11)):
        values = {s: trial[0] if name == batch else trial[1] + i for i, (name, s) in enumerate(symbols.items())}
        try:
            if int(expr.xreplace(values)) != trial[0]:
                return False
        except (TypeError, ValueError):
            return False
    return True


def splittable(value: Any, batch: str | None) -> bool:
    """Whether a node's value (its ``meta["val"]``) may cross a stage boundary.

    True for a non-tensor scalar or no value (left to the rules that place
    it), a tensor of no symbolic dim, and a tensor one dim of which is
    exactly the batch symbol ``batch`` (dim 0, or another: the runtime sends
    it batch-major) and whose other dims are fixed; False for any other
    tensor and for a tuple or list holding a tensor.
    """
    if isinstance(value, (tuple, list)):
        return not any(isinstance(v, torch.Tensor) for v in value)
    if batch is None or not isinstance(value, torch.Tensor):
        return True
    symbols = [_symbols(d) for d in value.shape]
    batched = [k for k, d in enumerate(value.shape) if symbols[k] and is_batch_dim(d, batch)]
    # other dims may vary too (a sequence length), but never with the batch: a (batch * seq, dim) value is folded
    return not any(batch in s for s in symbols) or (len(batched) == 1 and sum(batch in s for s in symbols) == 1)


def merge_folded_ops(nodes: Sequence[fx.Node], owner: MutableMapping[fx.Node, str],
                     path_of: MutableMapping[str, str], batch: str | None) -> dict[str, tuple[str, ...]]:
    """Merge every two ops a non-:func:`splittable` value joins, and the ops on paths between them, in place.

    ``nodes`` in graph (topological) order. A merged op takes the module
    path the members share (dot-wise common prefix) and is named after what
    it is (:func:`_merged_name`). Returns merged op -> the ops it absorbed
    (empty when no value needed it: the common case).
    """
    import networkx as nx

    parent: dict[str, str] = {}

    def find(op: str) -> str:
        while parent.get(op, op) != op:
            op = parent[op]
        return op

    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n in owner:
            first.setdefault(owner[n], i)

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            keep, drop = (ra, rb) if first[ra] <= first[rb] else (rb, ra)
            parent[drop] = keep

    for n in nodes:
        op = owner.get(n)
        if op is None or splittable(n.meta.get("val"), batch):
            continue
        for u in n.users:
            other = owner.get(u)
            if other is not None and other != op:
                union(op, other)
    if not parent:
        return {}
    # merging two ops joined by an edge and a longer path closes a cycle: each cycle's ops merge too (the graph of
    # the strongly connected components is acyclic, so one pass is enough)
    merged_graph = contracted_graph(nodes, lambda n: find(owner[n]) if n in owner else None)
    for component in nx.strongly_connected_components(merged_graph):
        ops = sorted(component, key=first.__getitem__)
        for other in ops[1:]:
            union(ops[0], other)
    groups: dict[str, list[str]] = {}
    for op in first:
        groups.setdefault(find(op), []).append(op)
    for n in nodes:
        if n in owner:
            owner[n] = find(owner[n])
    out, renamed = {}, {}
    for root, members in groups.items():
        if len(members) > 1:
            paths = [path_of[m].split(".") for m in members if path_of.get(m)]  # glue ops have no path
            common = []
            for parts in zip(*paths):
                if len(set(parts)) > 1:
                    break
                common.append(parts[0])
            name = _merged_name(".".join(common), paths, root, (set(path_of) - set(members)) | set(renamed.values()))
            path_of[name] = ".".join(common)
            if name != root:
                renamed[root] = name
                path_of.pop(root, None)
            out[name] = tuple(m for m in members if m != name)
    if renamed:
        for n in nodes:
            if owner.get(n) in renamed:
                owner[n] = renamed[owner[n]]
    return out


def _merged_name(common: str, paths: list[list[str]], first: str, taken: set[str]) -> str:
    """A merged op's name: what it is, not its first member's.

    The module its members share (``mix`` for MobileViT's ``mix.0``, ``mix.1`` and the unfold/fold glue around
    them); when they share none (a GNN whose batch is folded into the node dimension merges its ``convs.*`` and
    its head), the top-level modules it spans joined by ``+`` (``convs+lin``: a character no module path or fx
    node name has, so :func:`graphpipe.frontend.capture.capture` gives such an op the kind ``folded``); the first
    member's name when it has no module at all, or when the name is taken.
    """
    if common:
        name = common
    else:
        tops = list(dict.fromkeys(p[0] for p in paths))
        name = "+".join(tops) if len(tops) > 1 else (tops[0] if tops else first)
    return name if name not in taken else first
