"""BatchNorm under micro-batching and replication: the two modes of ``--batchnorm`` (docs/semantics.md).

A pipeline never sees the mini-batch at once: a stage normalises one
micro-batch at a time, and each replica of a data-parallel stage only its
shard of it. Training is therefore *defined* by one of two modes, recorded
in the plan (``Plan.batchnorm``) and used by the single-process reference of
``--check`` too, so the check compares like with like:

``per-micro-batch`` (default; GPipe's semantics)
    every call normalises the rows it holds — one micro-batch, or one
    replica's shard of it — with their own mean and variance. Running
    statistics are *deferred* as in torchgpipe's ``DeferredBatchNorm``:
    each call records its rows' count, sum and sum of squares (float64),
    and once per step, after the last micro-batch, the running mean and
    (unbiased) variance move by one momentum step towards the statistics of
    the whole mini-batch. The running buffers thus end every step exactly
    as full-batch training would leave them (up to rounding). Cost: none in
    compute; a replicated stage all-reduces a ``(shards, 2C + 1)`` float64
    table per BatchNorm once per step.
``sync``
    replicas of a stage normalise a micro-batch with the statistics of all
    its shards (as ``nn.SyncBatchNorm``): two all-reduces of ``C`` floats per
    BatchNorm call in the forward (mean, then variance) and two in the backward,
    on the critical path of every micro-batch. Running statistics as above.
    Stages with one replica behave as ``per-micro-batch``.

Neither mode equals full-batch training when micro-batches are smaller
than the mini-batch (normalising 4 samples is not normalising 8); ``--check``
reports that difference separately, without asserting it.

The statistics a call records are keyed by ``(fx node, first row)``, so a
re-materialised forward (``torch.utils.checkpoint``) overwrites its own
record instead of counting twice.

Example
-------
>>> import torch
>>> from graphpipe.runtime.rng import ShardContext
>>> bn = ShardedBatchNorm(torch.nn.BatchNorm1d(3))
>>> x = torch.arange(24.0).reshape(8, 3)
>>> for lo in (0, 4):
...     _ = bn(x[lo:lo + 4], ShardContext(0, 0, lo, 4, lo, 4), "bn")
>>> bn.commit()
>>> torch.allclose(bn.running_mean, 0.1 * x.mean(0)), int(bn.num_batches_tracked)
(True, 1)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BATCHNORM_MODES", "DEFAULT_BATCHNORM", "ShardedBatchNorm", "instrument_batchnorm", "check_batchnorm_mode",
           "sharded_batchnorms"]

from graphpipe.plan import BATCHNORM_MODES

DEFAULT_BATCHNORM = BATCHNORM_MODES[0]


def check_batchnorm_mode(mode: str) -> str:
    """``mode`` if known, else an :class:`~graphpipe.errors.InputError` naming the choices."""
    from graphpipe.errors import InputError

    if mode not in BATCHNORM_MODES:
        raise InputError(f"--batchnorm must be one of {', '.join(BATCHNORM_MODES)}, got {mode!r}")
    return mode


class ShardedBatchNorm(nn.Module):
    """Stands in for an ``nn.BatchNorm1d/2d/3d``: same parameters and buffers (the same tensors), same names.

    Called as ``(x, ctx, op)``: ``ctx`` None keeps PyTorch's semantics;
    otherwise every piece ``ctx.pieces`` gives is normalised on its own (or,
    with :attr:`group` set, with the statistics of the whole micro-batch
    across the group) and its statistics wait in :attr:`pending` for
    :meth:`commit`.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.weight, self.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(bn, name))
        self.group = None
        """Process group of the stage's replicas under ``--batchnorm sync`` (None: normalise each shard)."""
        self.pending: dict[tuple[str, int], torch.Tensor] = {}
        """``(op, first row) -> [count, sum(C), sum of squares(C)]`` (float64) since the last commit."""

    def forward(self, x: torch.Tensor, ctx=None, op: str = "") -> torch.Tensor:
        batch_stats = self.training or not self.track_running_stats
        if ctx is None or not batch_stats:
            return self._torch_forward(x)
        outs = []
        for lo, piece in ctx.pieces(op, "batchnorm", x):
            if self.group is not None:
                y, stats = self._sync_piece(piece)
                lo = ctx.mb_lo  # every replica records the same, whole-micro-batch statistics
            else:
                y = F.batch_norm(piece, None, None, self.weight, self.bias, True, 0.0, self.eps)
                stats = _stats(piece)
            if self.track_running_stats:
                record = getattr(ctx, "record", None)  # a compiled stage's context keys the statistics after the call
                if record is not None:
                    record(self, op, stats)
                else:
                    self.pending[(op, lo)] = stats
            outs.append(y)
        return ctx.join(outs)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``_BatchNorm.forward``'s semantics (running statistics updated per call)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or self.running_mean is None
        return F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                            self.running_var if not self.training or self.track_running_stats else None,
                            self.weight, self.bias, use_batch, factor, self.eps)

    def _sync_piece(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise with the mean and variance over every replica's shard (differentiable all-reduces)."""
        dims = [0] + list(range(2, piece.dim()))
        shape = (1, -1) + (1,) * (piece.dim() - 2)
        # replicas hold equal shards of a micro-batch (routing's rule), so the count needs no message
        count = float(piece.numel() // piece.shape[1] * dist.get_world_size(self.group))
        mean = _AllReduceSum.apply(piece.sum(dims), self.group) / count
        centred = piece - mean.reshape(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims), self.group) / count
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        with torch.no_grad():
            n = torch.tensor([count], dtype=torch.float64, device=piece.device)
            stats = torch.cat([n, mean.double() * count, (var.double() + mean.double() ** 2) * count])
        return y, stats

    @torch.no_grad()
    def commit(self, group=None, shard_rows: int = 0, batch_size: int = 0) -> None:
        """Move the running statistics one momentum step towards the step's recorded statistics.

        ``group`` (replicas that each hold some shards, per-micro-batch mode):
        the records are summed over it first, in a table of
        ``batch_size // shard_rows`` slots indexed by first row, so every
        replica commits the same numbers in the same order.
        """
        if not self.pending:
            return
        for op in sorted({op for op, _ in self.pending}):
            rows = {lo: s for (o, lo), s in self.pending.items() if o == op}
            if group is not None:
                # on the statistics' device: an NCCL group reduces CUDA tensors only
                device = next(iter(rows.values())).device if rows else self.running_mean.device
                table = torch.zeros(batch_size // shard_rows, 2 * self.num_features + 1, dtype=torch.float64, device=device)
                for lo, s in rows.items():
                    table[lo // shard_rows] = s
                dist.all_reduce(table, group=group)
                rows = {i * shard_rows: table[i] for i in range(table.shape[0]) if table[i, 0] > 0}
            self._update(torch.stack([rows[lo] for lo in sorted(rows)]))
        self.pending.clear()

    def _update(self, table: torch.Tensor) -> None:
        total = table.sum(0)
        c = self.num_features
        n = total[0]
        mean = total[1:1 + c] / n
        var = (total[1 + c:] / n - mean * mean).clamp_min(0.0)
        if n > 1:
            var = var * (n / (n - 1))
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, sync={self.group is not None}"


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; the gradient of a sum over replicas is the sum of their gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _stats(piece: torch.Tensor) -> torch.Tensor:
    dims = [0] + list(range(2, piece.dim()))
    x = piece.detach().double()
    n = torch.tensor([float(x.numel() // x.shape[1])], dtype=torch.float64, device=x.device)
    return torch.cat([n, x.sum(dims), (x * x).sum(dims)])


def instrument_batchnorm(gm: torch.fx.GraphModule, ctx_node: torch.fx.Node) -> list[str]:
    """Replace every BatchNorm module call of ``gm`` (in place) by a :class:`ShardedBatchNorm` call."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not node.args:
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, ShardedBatchNorm):
            pass
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and type(module).__module__.startswith("torch."):
            parent, _, name = node.target.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, name, ShardedBatchNorm(module))
        else:
            continue
        node.args = (node.args[0], ctx_node, node.name)
        node.kwargs = {}
        done.append(node.name)
    return done


def sharded_batchnorms(module: nn.Module) -> Sequence[ShardedBatchNorm]:
    """The :class:`ShardedBatchNorm` modules of ``module``, in ``named_modules`` order (the same on every replica)."""
    return [m for _, m in module.named_modules() if isinstance(m, ShardedBatchNorm)]
