"""How far fp32 rounding alone moves a model's numbers: the tolerance ``--check`` adds (docs/semantics.md).

A pipeline sums a step's gradients in another order than one process does
(micro-batch by micro-batch, replica by replica), so its fp32 numbers differ
from the single-process reference by rounding. On a well-conditioned network
that is far below ``assert_close``'s fp32 tolerances; on an ill-conditioned
one (BatchNorm over a few values per channel, an EfficientNet or Inception
at small images and micro-batches) rounding alone moves a gradient by more
than its own size, and plain eager PyTorch at fp32 differs from fp64 by as
much. A fixed tolerance then fails correct runs.

So the reference is run a second time in float64 (the same graph, semantics,
data and steps), and each compared tensor gets, on top of the fixed
tolerance, :data:`SPREAD_FACTOR` times its *spread*: the largest
``|fp32 - fp64|`` of the reference itself at that step. A correct pipeline is
one more fp32 evaluation, as far from fp64 as the reference is; a wrong
gradient (a micro-batch missed, a term doubled) moves a tensor by about its
own size, far past the spread of any network whose numbers mean anything.

Example
-------
>>> import torch
>>> spread({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 2.5], dtype=torch.float64)})
{'w': 0.5}
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.fx
from torch.utils._pytree import tree_map

__all__ = ["SPREAD_FACTOR", "float64_graph", "spread", "allowed"]

SPREAD_FACTOR = 8.0
"""Multiples of the reference's own fp32-vs-fp64 spread a pipelined value may differ by: two fp32 evaluations
of one sum in different orders each lie about one spread from fp64, and the largest element of a tensor
strays further than its typical one."""


def float64_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (in place) with its floating tensors and every ``float32`` an op names (a cast, a ``full``) in float64.

    The exported graph spells out the dtypes the model used at capture;
    left alone, a cast back to float32 would put fp32 rounding into the
    float64 run, or mix dtypes in a matmul.
    """
    def wider(v):
        return torch.float64 if v is torch.float32 else v

    for node in gm.graph.nodes:
        node.args = tree_map(wider, node.args)
        node.kwargs = tree_map(wider, node.kwargs)
    gm.recompile()
    return gm.double()


def spread(fp32: Mapping[str, torch.Tensor], fp64: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per name present in both: the largest ``|fp32 - fp64|`` over the tensor's elements."""
    out = {}
    for name, a in fp32.items():
        b = fp64.get(name)
        if b is None or a.shape != b.shape or not a.is_floating_point():
            continue
        out[name] = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return out


def allowed(reference: torch.Tensor, atol: float, rtol: float, spread_of: float = 0.0) -> torch.Tensor:
    """Elementwise tolerance: ``atol + rtol * |reference| + SPREAD_FACTOR * spread``."""
    return atol + rtol * reference.abs() + SPREAD_FACTOR * spread_of
