"""Repeated layers: recognising stages made of identical ops, so a search solves each kind once.

A large language model is a chain of identical decoder layers: after
capture, each is an op with the same costs, edges of the same bytes and the
same kind. Two stages holding runs of such ops look different to a search
(their op ids differ) but pose the same problem to the dynamic program: its
answer depends only on the ops' costs and how they are connected, never on
their names or ids. :func:`cost_signature` is that problem's identity, so a
loop over stages (:func:`graphpipe.search.gpp._spread_idle`, which re-splits
every stage of a plan over the idle devices) solves one stage of each kind
and maps the answer onto the others' ops.

Only exact equality counts: two ops with any differing cost, kind or edge
are different. So a memoised answer is the answer the DP would compute, and
plans are the same with or without the shortcut (tests compare them).
"""

from __future__ import annotations

from typing import Sequence

from graphpipe.graph import OpGraph

__all__ = ["cost_signature"]


def cost_signature(graph: OpGraph, op_ids: Sequence[int]) -> tuple:
    """A hashable identity of the subgraph on ``op_ids`` (sorted, in topological order) as the DP sees it.

    Each op's kind, time models, parameter, saved-activation and output
    bytes and weight-gradient model in order, and the edges among them by
    position (with their bytes and saved bytes); names and global ids are
    left out. Equal signatures mean the induced subgraphs
    (:func:`graphpipe.sp.induced_subgraph`) differ only in names.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> g = OpGraph.build("c", [Op(n, "layer", Affine(0, 1.0), Affine(0, 2.0)) for n in "abcd"],
    ...                   [("a", "b", 4.0), ("b", "c", 4.0), ("c", "d", 4.0)])
    >>> cost_signature(g, [0, 1]) == cost_signature(g, [2, 3])
    True
    >>> cost_signature(g, [0, 1]) == cost_signature(g, [1, 2, 3])
    False
    """
    position = {v: i for i, v in enumerate(op_ids)}
    ops = tuple((op.kind, op.fwd, op.bwd, op.param_bytes, op.act_bytes, op.out_bytes, op.wgrad)
                for op in (graph.ops[v] for v in op_ids))
    edges = tuple((position[e.src], position[e.dst], e.bytes, e.saved) for e in graph.edges
                  if e.src in position and e.dst in position)
    return ops, edges
