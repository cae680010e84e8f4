"""The series-parallel tree as GraphPipe's DP sees it (paper §4; docs/design.md#series-parallel-decomposition).

The DP of :mod:`graphpipe.search.gpp_dp` searches stages that are unions of
SP-tree nodes: a whole node, a contiguous range of >= 2 children of a series
node, or a contiguous run of >= 2 children of a parallel node. This module
builds that tree once per graph: children of a parallel node in
:func:`parallel_order` (so similar branches sit next to each other and can
share a stage), and per node the prefix sums of its children's costs, so a
block's sums are one subtraction (:mod:`graphpipe.search.gpp_blocks`).
:func:`chain_tree` is the sequential (SPP) view of the same graph: its ops in
topological order as one series node.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "sabt"]
>>> g = OpGraph.build("diamond", ops, [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)])
>>> tree = build_tree(g)
>>> tree.kinds[tree.root], tree.longest_path, chain_tree(g).longest_path
('series', 3, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.sp import decompose

__all__ = ["DPTree", "build_tree", "chain_tree", "parallel_order"]


@dataclass(frozen=True, slots=True)
class DPTree:
    """The SP tree as the DP sees it: ``op_ids`` refer to ``graph``, the graph searched.

    kinds[x] in {"op", "series", "parallel"}; children[x] ordered (series in
    dependency order, parallel by :func:`parallel_order`); ``sums[x][i]`` are
    prefix sums over children ``0..i-1`` of (fwd alpha, fwd beta, bwd alpha,
    bwd beta, param bytes, act bytes) -- a leaf counts as one child, itself.
    """

    graph: OpGraph
    kinds: tuple[str, ...]
    children: tuple[tuple[int, ...], ...]
    op_ids: tuple[tuple[int, ...], ...]
    sums: tuple[tuple[tuple[float, ...], ...], ...]
    root: int
    longest_path: int
    """Ops on the longest path of the graph: no stage graph is deeper."""

    def width(self, x: int) -> int:
        """Number of children (1 for a leaf, which is its own only child)."""
        return max(1, len(self.children[x]))

    def block_ops(self, x: int, lo: int, hi: int) -> tuple[int, ...]:
        """Ops of children ``lo..hi-1`` of node ``x`` (the whole leaf for a leaf)."""
        if not self.children[x]:
            return self.op_ids[x]
        return tuple(sorted(o for c in self.children[x][lo:hi] for o in self.op_ids[c]))


def parallel_order(graph: OpGraph, branches: Sequence[Sequence[int]]) -> list[int]:
    """Order of parallel branches (op-id lists): most per-sample work first, then smallest op id.

    Part of the search space's definition: runs of branches that share a stage
    are contiguous in this order.
    """
    def work(ops: Sequence[int]) -> float:
        return sum(graph.ops[o].fwd.beta + graph.ops[o].bwd.beta for o in ops)

    return sorted(range(len(branches)), key=lambda i: (-work(branches[i]), min(branches[i])))


def build_tree(graph: OpGraph) -> DPTree:
    """Decompose ``graph`` (which must be series-parallel) into the DP's tree."""
    tree = decompose(graph)
    if tree.merged:
        raise InputError(f"graph {graph.name!r} is not series-parallel; contract it first with "
                         "graphpipe.sp.make_series_parallel (the planner does)")
    n = len(tree.nodes)
    kinds = [tree.nodes[x].kind for x in range(n)]
    op_ids = [tuple(tree.nodes[x].op_ids) for x in range(n)]
    children: list[tuple[int, ...]] = []
    for x in range(n):
        kids = tuple(tree.nodes[x].children)
        if kinds[x] == "parallel":
            order = parallel_order(graph, [op_ids[c] for c in kids])
            kids = tuple(kids[i] for i in order)
        children.append(kids)
    sums = []
    longest = [0] * n
    for x in range(n):  # post-order: children first
        if kinds[x] == "op":
            op = graph.ops[op_ids[x][0]]
            parts = [(op.fwd.alpha, op.fwd.beta, op.bwd.alpha, op.bwd.beta, float(op.param_bytes), float(op.act_bytes))]
            longest[x] = 1
        else:
            parts = [sums[c][-1] for c in children[x]]
            lengths = [longest[c] for c in children[x]]
            longest[x] = sum(lengths) if kinds[x] == "series" else max(lengths)
        prefix = [(0.0,) * 6]
        for p in parts:
            prefix.append(tuple(a + b for a, b in zip(prefix[-1], p)))
        sums.append(tuple(prefix))
    return DPTree(graph, tuple(kinds), tuple(children), tuple(op_ids), tuple(sums), tree.root, longest[tree.root])


def chain_tree(graph: OpGraph) -> DPTree:
    """The graph seen as one series of its ops in id (topological) order: the SPP search space.

    Every contiguous range of a topological order is convex and any cut into
    ranges is a DAG of stages, so this tree is valid input for the DP. Its
    in-flight model is the chain's (each range waits for all later ones),
    an upper bound on what graph-1F1B gives the real stage graph, so memory
    is checked conservatively. gpp searches it beside the SP tree so that
    the sequential partitions PipeDream considers are inside its space.
    """
    n = graph.num_ops
    kinds = ["op"] * n + ["series"] if n > 1 else ["op"]
    children = [()] * n + [tuple(range(n))] if n > 1 else [()]
    op_ids = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    leaf = []
    for op in graph.ops:
        leaf.append((op.fwd.alpha, op.fwd.beta, op.bwd.alpha, op.bwd.beta, float(op.param_bytes), float(op.act_bytes)))
    sums = [((0.0,) * 6, leaf[i]) for i in range(n)]
    if n > 1:
        prefix = [(0.0,) * 6]
        for p in leaf:
            prefix.append(tuple(a + b for a, b in zip(prefix[-1], p)))
        sums.append(tuple(prefix))
    return DPTree(graph, tuple(kinds), tuple(children), tuple(op_ids), tuple(sums), len(kinds) - 1, n)
