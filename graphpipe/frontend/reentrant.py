"""Layers a module's forward leaves and re-enters: cut into pieces so the op graph stays acyclic.

Capture contracts the nodes that ran inside one module call into one op
(:func:`graphpipe.frontend.capture.group_nodes`). When a module computes something of
its own, hands it to a child that is an op of its own, and then goes on with
the child's result (an EfficientNet block written with ``nn.Sequential``
children: the block's squeeze-and-excite runs between its depthwise and
projection children, and its residual add after them), the contracted graph
has a cycle ``block -> block.project -> block``, which no stage order can
run.

Such an op is cut by *level*: a node's level is how many times the longest
path from the op's first nodes to it leaves the op and comes back. Nodes of
one level form one op, in order: the block's own nodes before the child
(level 0) and after it (level 1). A path from a level-``k`` node that leaves
the op reaches only nodes of level ``k + 1`` or more, so no piece is both
before and after another op. Ops on no cycle are left whole, so models that
contract cleanly keep exactly the ops they had.

Example: an op ``blocks.0`` whose ``add`` reads ``blocks.0.project``, which
reads ``blocks.0``'s ``mul`` becomes ``blocks.0`` (the ``mul``) and
``blocks.0[1]`` (the ``add``).
"""

from __future__ import annotations

from typing import Callable, Mapping, MutableMapping, Sequence

import torch.fx as fx

__all__ = ["contracted_graph", "cyclic_ops", "split_reentrant_ops"]


def contracted_graph(nodes: Sequence[fx.Node], op_of: Callable[[fx.Node], str | None]):
    """The ``networkx.DiGraph`` of ops: one vertex per op ``op_of`` gives a node, an edge where a node of one
    op reads a node of another (nodes ``op_of`` maps to None are left out)."""
    import networkx as nx

    contracted = nx.DiGraph()
    for n in nodes:
        op = op_of(n)
        if op is None:
            continue
        contracted.add_node(op)
        for m in n.all_input_nodes:
            src = op_of(m)
            if src is not None and src != op:
                contracted.add_edge(src, op)
    return contracted


def cyclic_ops(nodes: Sequence[fx.Node], owner: Mapping[fx.Node, str]) -> list[str]:
    """Ops on a cycle of the contracted graph (in order of their first node); empty when it is acyclic."""
    import networkx as nx

    on_cycle = set()
    for component in nx.strongly_connected_components(contracted_graph(nodes, owner.get)):
        if len(component) > 1:
            on_cycle.update(component)
    first = {}
    for n in nodes:
        if n in owner:
            first.setdefault(owner[n], len(first))
    return sorted(on_cycle, key=first.__getitem__)


def split_reentrant_ops(nodes: Sequence[fx.Node], owner: MutableMapping[fx.Node, str],
                        path_of: MutableMapping[str, str]) -> list[str]:
    """Cut every op on a cycle into its levels (module docstring), in place; returns the new ops' names.

    ``nodes`` in graph (topological) order. A piece of level ``k >= 1`` of op
    ``name`` is named ``name[k]`` and keeps ``name``'s module path.
    """
    added = []
    for op in cyclic_ops(nodes, owner):
        level: dict[fx.Node, int] = {}
        reach: dict[fx.Node, int] = {}  # other nodes: the highest level of the op's nodes reaching them
        for n in nodes:
            mine = owner.get(n) == op
            best = 0 if mine else -1
            for m in n.all_input_nodes:
                if m in level:
                    best = max(best, level[m])
                elif m in reach:
                    best = max(best, reach[m] + 1 if mine else reach[m])
            if mine:
                level[n] = best
            elif best >= 0:
                reach[n] = best
        for n, k in level.items():
            if k:
                piece = f"{op}[{k}]"
                if piece not in path_of:
                    path_of[piece] = path_of.get(op, "")
                    added.append(piece)
                owner[n] = piece
    return added
