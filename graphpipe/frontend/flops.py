"""FLOP formulas torch's counter lacks, and a record of ops whose cost nobody knows (docs/design.md, "Capture").

The capture charges each op the FLOPs ``torch.utils.flop_counter.FlopCounterMode``
counts while the graph runs once. That counter knows the dense kernels
(``mm``, ``bmm``, convolutions, attention) and counts everything else as
free. Two things follow:

* A mixture-of-experts layer that runs its experts through
  ``aten._grouped_mm`` (transformers 5.x does, for Mixtral and Qwen2-MoE, or
  its own ``transformers::grouped_mm_fallback`` loop) would be counted at
  its router and attention alone: :data:`EXTRA_FORMULAS` gives the grouped
  matmul its FLOPs.
* Attention on CPU tensors runs a fused CPU kernel torch's counter does not
  know, so a model captured on the CPU was charged nothing for attention.
* Any other kernel with no formula (a library's fused op, a new matmul
  variant) would be silently free. :class:`UnknownCosts` collects the ops
  that look like compute (a matmul, convolution or attention by name, or an
  op outside ATen) yet were counted at zero, so the capture can warn once.

Example
-------
>>> import torch
>>> a, b = torch.ones(6, 16), torch.ones(3, 16, 8)  # 6 rows, 3 experts, 2 rows each
>>> with flop_counter() as counter:
...     _ = torch.ops.aten._grouped_mm(a, b, torch.tensor([2, 4, 6], dtype=torch.int32))
>>> counter.get_total_flops() == 2 * 6 * 16 * 8
True
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = ["grouped_mm_flop", "cpu_attention_flop", "EXTRA_FORMULAS", "flop_counter", "UnknownCosts"]

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, tuple[str, ...]]] = set()

_HEAVY_WORDS = ("mm", "matmul", "conv", "attention", "einsum", "gemm", "linear")
"""Op names that say "this is where the compute is": zero FLOPs from such an op means no formula, not no work."""
_FREE_NAMESPACES = ("aten", "prims", "graphpipe", "_c10d_functional", "c10d_functional", "higher_order")
"""Namespaces whose zero-FLOP ops are genuinely cheap (elementwise, views) or graphpipe's own markers."""
_RESAMPLING = ("upsample", "_upsample", "grid_sampler")
"""Interpolation kernels (``upsample_bilinear2d`` says "linear"): a few operations per output element, not a matmul."""


def grouped_mm_flop(a_shape, b_shape, offs=None, bias=None, out_dtype=None, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: 2 multiply-adds per product term, per group.

    Layouts (torch's): ``a`` 2-D and ``b`` 3-D ``(G, K, N)``: the rows of
    ``a`` are split among the G groups by ``offs``, each row meets one
    group's matrix, ``2 M K N``; 3-D by 3-D is a batched matmul,
    ``2 G M K N``; 2-D by 2-D splits the shared ``K`` into groups (a weight
    gradient), ``2 M K N``; 3-D ``(G, M, K)`` by 2-D ``(K, N)`` splits the
    columns, ``2 M K N``. The offsets are data, so rows past the last offset
    are counted too (an upper bound, exact when every row is routed).
    """
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 0


def cpu_attention_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the fused CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``): the two
    matmuls of attention, as torch counts its GPU kernels."""
    return sdpa_flop_count(q_shape, k_shape, v_shape)


EXTRA_FORMULAS: dict[str, Any] = {
    "aten::_grouped_mm": grouped_mm_flop,
    # the kernel scaled_dot_product_attention runs on CPU tensors: torch counts its GPU siblings only
    "aten::_scaled_dot_product_flash_attention_for_cpu": cpu_attention_flop,
    # transformers' own loop over experts (input (S, K), weights (G, K, N), offsets), which it exports instead of
    # aten._grouped_mm where that kernel is unavailable (under export at fp32, on CPUs of older torch)
    "transformers::grouped_mm_fallback": grouped_mm_flop,
}
"""Op name -> FLOP formula (over shapes) for ops torch's counter lacks; looked up when a counter is made, since
a library registers its ops when it is imported."""


def _op(name: str):
    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter with :data:`EXTRA_FORMULAS` added for the ops that exist now (nothing printed)."""
    extra = {op: formula for op, formula in ((_op(n), f) for n, f in EXTRA_FORMULAS.items()) if op is not None}
    return FlopCounterMode(display=False, custom_mapping=extra)


class UnknownCosts:
    """Ops that look like compute but were counted at zero FLOPs, by op name, with how many graph nodes."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def note(self, target: Any, flops: float) -> None:
        """Record ``target`` (an fx ``call_function`` target) when it ran at ``flops`` == 0 and looks like compute."""
        if flops or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return
        name = target.name() if hasattr(target, "name") else str(target)
        namespace, _, op = name.partition("::")
        base = op.split(".")[0]
        heavy = any(word in base for word in _HEAVY_WORDS) and not base.startswith(_RESAMPLING)
        if heavy or namespace not in _FREE_NAMESPACES:
            self.counts[name] = self.counts.get(name, 0) + 1

    def warn(self, model: str) -> None:
        """One warning naming every op with an unknown cost (nothing when there is none)."""
        key = (model, tuple(sorted(self.counts)))
        if not self.counts or key in _WARNED:  # once per model and ops in a process (ranks, repeated captures)
            return
        _WARNED.add(key)
        ops = ", ".join(f"{name} ({n} node{'s' if n > 1 else ''})" for name, n in sorted(self.counts.items()))
        log.warning("%s: no FLOP formula for %s: counted as free, so the plan under-prices the ops that call them "
                    "(measure the model with `graphpipe profile` and plan with --profile)", model, ops)
