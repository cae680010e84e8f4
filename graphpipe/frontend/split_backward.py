"""Zero bubble's split backward: I (input gradients) now, W (weight gradients) later (docs/design.md, "Schedules and the simulator").

The runtime's executor runs a stage's I and W actions with these; ``graphpipe
profile`` splits each op's backward with the same two calls to measure W's share of it
(:func:`graphpipe.frontend.profile.time_ops`).

Autograd computes a layer's input and weight gradients in one node call
(``AddmmBackward`` returns both), but only the outputs somebody asked for:
``torch.autograd.grad(outputs, stage_inputs)`` runs every node on the path
from the stage's outputs to its inputs and skips the weight-gradient halves.
That is the I action. For W we need the gradient that flowed *into* every
node that consumes a parameter; a pre-hook on those nodes captures it during
I, and W asks autograd for the parameters' gradients from those nodes only
(``GradientEdge`` roots), so the input-gradient path is not walked twice.
This is how ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` work; written here for our stage programs.

When some parameter consumer is not on any path to a stage input (the
first stage, whose inputs are data; a parameter feeding only a branch that
does not reach an input), I cannot capture its gradient, and W runs the
ordinary backward from the stage outputs restricted to the parameters
(``inputs=params``): the same numbers, with the input-gradient path computed
a second time. I retains the autograd graph for W; W frees it.

Example
-------
>>> import torch
>>> lin = torch.nn.Linear(3, 2)
>>> x = torch.randn(4, 3, requires_grad=True)
>>> y = lin(x)
>>> g = torch.ones_like(y)
>>> (dx,), pending = backward_input([y], [g], [x], list(lin.parameters()))
>>> lin.weight.grad is None and pending.captured is not None
True
>>> backward_weight(pending)
>>> torch.allclose(lin.weight.grad, g.t() @ x) and torch.allclose(dx, g @ lin.weight)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["PendingWeightGrad", "backward_input", "backward_weight"]


@dataclass(slots=True)
class PendingWeightGrad:
    """What W needs: the stage's roots and their gradients (fallback), its parameters, and the captured
    gradients flowing into each parameter-consuming autograd node (None: recompute from the roots)."""

    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    params: list[torch.nn.Parameter]
    captured: dict[Node, tuple[torch.Tensor | None, ...]] | None
    groups: list[tuple[list[Node], list[int]]] | None
    """:func:`_capture_points`' groups (None exactly when ``captured`` is): W asks autograd for each group's
    parameters from its own points."""


def _grad_accumulator(p: torch.Tensor) -> Node:
    """The AccumulateGrad node of leaf ``p`` (created lazily by autograd; a view reaches it)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def _capture_points(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    params: Sequence[torch.Tensor]) -> list[tuple[list[Node], list[int]]] | None:
    """Nodes on I's path (from a root to an input) that a parameter's gradient flows through first, walking up
    from the parameter, grouped: ``(points, parameter indices)`` where parameters that share a point share a
    group (a layer's weight and bias). None when some parameter is reachable from a root without crossing
    I's path."""
    accumulators = [_grad_accumulator(p) for p in params]
    parents: dict[Node, list[Node]] = {}
    root_nodes = {t.grad_fn for t in roots if t.grad_fn is not None}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    found = {n: i for i, n in enumerate(dict.fromkeys(stack))}  # discovery order: a deterministic order of W's roots
    while stack:  # reverse edges of the graph below the roots
        node = stack.pop()
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            parents.setdefault(fn, []).append(node)
            if fn not in found:
                found[fn] = len(found)
                stack.append(fn)

    def up(starts, stop):
        closure, hit = set(), set()
        stack = [n for n in starts if n in parents or n in root_nodes]
        closure.update(stack)
        while stack:
            for q in parents.get(stack.pop(), ()):
                if q in stop:
                    hit.add(q)
                elif q not in closure:
                    closure.add(q)
                    stack.append(q)
        return closure, hit

    on_path, _ = up([_grad_accumulator(x) for x in inputs if x.requires_grad and x.grad_fn is None]
                    + [x.grad_fn for x in inputs if x.grad_fn is not None], set())
    groups: list[tuple[set[Node], set[int]]] = []  # (capture points, parameter indices): disjoint points
    for i, acc in enumerate(accumulators):
        closure, hit = up([acc], on_path)
        if closure & root_nodes:
            return None
        points, params = set(hit), {i}
        for group in [g for g in groups if g[0] & points]:  # parameters sharing a point share one group
            groups.remove(group)
            points |= group[0]
            params |= group[1]
        groups.append((points, params))
    return [(sorted(points, key=found.get), sorted(params)) for points, params in groups]


def backward_input(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """I: gradients of ``inputs`` (None where unused) from ``roots`` with gradients ``root_grads`` (None for a
    scalar loss), the graph retained; parameter gradients are left for :func:`backward_weight`."""
    roots, root_grads = list(roots), list(root_grads)
    params = [p for p in params if p.requires_grad]
    groups = _capture_points(roots, inputs, params) if params and inputs else None
    consumers = [node for points, _ in groups for node in points] if groups is not None else None
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []

    def capture(node):
        def hook(grad_outputs):
            captured[node] = tuple(grad_outputs)
        return hook

    try:
        for node in consumers or ():
            handles.append(node.register_prehook(capture(node)))
        if inputs and roots:
            dinputs = list(torch.autograd.grad(roots, list(inputs), root_grads, retain_graph=True, allow_unused=True))
        else:
            dinputs = [None] * len(inputs)
    finally:
        for h in handles:
            h.remove()
    complete = consumers is not None and len(captured) == len(consumers)
    return dinputs, PendingWeightGrad(roots, root_grads, params, captured if complete else None,
                                      groups if complete else None)


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the parameters' gradients into ``.grad`` and free the graph I retained."""
    if not pending.params or not pending.roots:
        return
    if pending.captured is None:
        torch.autograd.backward(pending.roots, pending.root_grads, inputs=pending.params)
        return
    # One autograd call per group, asking for that group's parameters only: a point's input-gradient edge
    # leads to other groups' parameters, which this call does not ask for, so autograd prunes it and the
    # input-gradient path I already walked is not walked again (one call for every parameter would walk
    # it, and pay a second input-gradient product per layer). Within a group, a point downstream of another
    # is reached twice (as a root and through the other): its incoming gradient is pinned to the captured
    # one so nothing is counted twice. The graph is kept until the last group's call.
    groups = pending.groups
    for n, (points, indices) in enumerate(groups):
        edges, grads = [], []
        for node in points:
            for k, g in enumerate(pending.captured[node]):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(g)
        if not edges:
            continue
        params = [pending.params[i] for i in indices]
        handles = [node.register_prehook(lambda _, saved=pending.captured[node]: saved) for node in points] \
            if len(points) > 1 else []
        try:
            dweights = torch.autograd.grad(edges, params, grads, allow_unused=True, retain_graph=n < len(groups) - 1)
        finally:
            for h in handles:
                h.remove()
        for p, dw in zip(params, dweights):
            if dw is None:
                continue
            if p.grad is None:
                p.grad = dw
            else:
                p.grad += dw
    pending.captured = None
