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

from typing import Any, Mapping

import torch
import torch.fx
from torch.utils._pytree import tree_map

__all__ = ["SPREAD_FACTOR", "float64_graph", "spread", "allowed", "rows_as_the_pipeline", "ROW_KERNELS"]

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


ROW_KERNELS = {torch.ops.aten.conv1d.default: (0, 3), torch.ops.aten.conv2d.default: (0, 4),
               torch.ops.aten.conv3d.default: (0, 5), torch.ops.aten.convolution.default: (0, 3),
               torch.ops.aten.linear.default: (0, 2), torch.ops.aten.mm.default: (0, 2),
               torch.ops.aten.addmm.default: (1, 2)}
"""Kernels whose fp32 rounding depends on how many rows they get (a 1x1 convolution over 3x3 maps sums in another
order at 16 rows than at 4), with the position of the argument whose rows they treat independently and the
fewest dims it has then (an unbatched ``conv1d`` input or a 1-D ``linear`` input contracts over dim 0)."""


def rows_as_the_pipeline(gm: torch.fx.GraphModule, layout: Mapping[str, Mapping[str, int]],
                         batch_size: int) -> torch.fx.GraphModule:
    """``gm`` (in place) with every :data:`ROW_KERNELS` call run on the rows its pipelined call holds.

    The whole-batch reference (plans whose stages hold shards of several
    sizes) runs a convolution over all ``batch_size`` rows where the
    pipeline runs it on a stage's shard; the results differ by rounding,
    and where a ReLU input sits within that rounding of zero the two take
    different branches and a gradient moves by its own size. Run on the
    same rows (``layout[node]["dropout"]``: the stage's shard), each kernel
    rounds as in the run. A call whose argument's dim 0 is not the batch
    (flattened tokens) runs whole.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ROW_KERNELS:
            continue
        rows = layout.get(node.name, {}).get("dropout", batch_size)
        if 0 < rows < batch_size and batch_size % rows == 0:
            node.args = (node.target, ROW_KERNELS[node.target], rows, batch_size, *node.args)
            node.target = _by_rows
    gm.recompile()
    return gm


def _by_rows(kernel, where: tuple[int, int], rows: int, batch_size: int, *args: Any, **kwargs: Any):
    """``kernel(*args, **kwargs)``, its row argument cut into ``rows``-row pieces when it has the batch's rows
    (and no other argument does: a full-size bias would not broadcast against a piece)."""
    arg, min_dim = where
    x = args[arg]
    others = [a for i, a in enumerate(args) if i != arg] + list(kwargs.values())
    if (not isinstance(x, torch.Tensor) or x.dim() < min_dim or x.shape[0] != batch_size
            or any(isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == batch_size for a in others)):
        return kernel(*args, **kwargs)
    outs = [kernel(*args[:arg], x[lo:lo + rows], *args[arg + 1:], **kwargs) for lo in range(0, batch_size, rows)]
    return torch.cat(outs)
