"""Random streams that do not depend on rank, placement, schedule or recomputation (issue 21).

Why: a pipelined run draws its dropout masks on many ranks, in an order set
by the schedule, and a re-materialised stage draws them a second time in its
backward. With the global RNG every one of those choices changes the masks,
and ``--check`` cannot compare with anything. So every stochastic op draws
from a generator of its own, seeded by

    ``(seed, step, op, first row)``

where *op* is the fx node's name (the same in the pipeline's stage modules
and the single-process reference) and *first row* is the first sample, in
the mini-batch, of the rows the call holds: a stage replica's shard of one
micro-batch. Rank, device, schedule and time do not enter, so

* the same shard gets the same mask on any rank and in any order;
* a recomputed forward (``torch.utils.checkpoint``) gets the same mask: the
  seed is a function of the call's arguments, not of an RNG state;
* the reference (:func:`graphpipe.runtime.jobs.reference_run`) runs the
  whole mini-batch but cuts every stochastic op's input at the same shard
  boundaries (:class:`ReferenceContext`), so its masks are the pipeline's.

The *context* travels as the last argument of every stage module
(``rng_ctx``, default ``None`` = plain PyTorch semantics): a
:class:`ShardContext` in the pipeline, a :class:`ReferenceContext` in the
reference. :mod:`graphpipe.runtime.batchnorm` uses the same contexts to
normalise per micro-batch.

Ops seeded this way: ``nn.Dropout``, ``nn.Dropout1d/2d/3d`` and
``F.dropout``, ``F.dropout1d/2d/3d``, ``torch.dropout``. Any other op that
draws random numbers from the global generator (``torch.rand`` in a
forward, ``nn.RReLU``, ``nn.AlphaDropout``, a custom layer with its own RNG)
is found by :func:`find_unseeded_random`, and the run warns, naming the op,
that ``--check`` cannot be exact.

Example
-------
>>> import torch
>>> ctx = ShardContext(seed=0, step=1, lo=4, rows=2, mb_lo=4, mb_rows=2)
>>> x = torch.ones(2, 6)
>>> torch.equal(seeded_dropout(x, 0.5, True, ctx, "drop"), seeded_dropout(x, 0.5, True, ctx, "drop"))
True
>>> ref = ReferenceContext(seed=0, step=1, batch_size=8, chunks={"drop": {"dropout": 2}})
>>> full = seeded_dropout(torch.ones(8, 6), 0.5, True, ref, "drop")
>>> torch.equal(full[4:6], seeded_dropout(x, 0.5, True, ctx, "drop"))
True
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ShardContext", "ReferenceContext", "stream_seed", "seeded_dropout", "SeededDropout",
           "instrument_dropout", "find_unseeded_random", "DROPOUT_MODULES"]

log = logging.getLogger(__name__)

DROPOUT_MODULES: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""Modules whose masks are drawn per shard (exact types: AlphaDropout subclasses _DropoutNd too but is not one)."""

# function -> (channel-wise?) for the functional dropouts fx records as call_function
_DROPOUT_FUNCTIONS = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, torch.dropout: False}


def stream_seed(seed: int, step: int, op: str, lo: int) -> int:
    """The 63-bit seed of op ``op``'s generator for the rows starting at ``lo`` in step ``step``.

    A hash, so neighbouring rows or steps do not get correlated streams
    (``manual_seed(k)`` and ``manual_seed(k + 1)`` are independent in
    Philox/MT, but a hash also keeps op names apart).

    >>> stream_seed(0, 0, "drop", 0) == stream_seed(0, 0, "drop", 0) != stream_seed(0, 0, "drop", 2)
    True
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{op}/{lo}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class ShardContext:
    """The rows one stage call holds in the pipeline: ``[lo, lo + rows)`` of step ``step``'s mini-batch.

    ``mb_lo, mb_rows``: the whole micro-batch those rows belong to (a
    replicated stage's shard is a part of it); synchronised BatchNorm keys
    its statistics by the micro-batch.
    """

    seed: int
    step: int
    lo: int
    rows: int
    mb_lo: int
    mb_rows: int
    unbatched: list = field(default_factory=list, compare=False)
    """Ops whose input had no batch dimension of ``rows`` (their draws cannot be replayed by the reference)."""

    def pieces(self, op: str, kind: str, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(first row, rows)`` pieces of ``x`` to draw or normalise separately: the whole shard."""
        if x.dim() == 0 or x.shape[0] != self.rows:
            self.unbatched.append(op)
        return [(self.lo, x)]

    @staticmethod
    def join(outs: Sequence[torch.Tensor]) -> torch.Tensor:
        return outs[0]


@dataclass(frozen=True, slots=True)
class ReferenceContext:
    """The single-process reference: the whole mini-batch, cut per op at the pipeline's shard boundaries.

    ``chunks[op][kind]`` is the number of rows each call of that op holds
    in the pipeline (``kind``: ``dropout`` or ``batchnorm``); ops missing
    from it see the whole batch as one piece.
    """

    seed: int
    step: int
    batch_size: int
    chunks: Mapping[str, Mapping[str, int]]
    unbatched: list = field(default_factory=list, compare=False)

    def pieces(self, op: str, kind: str, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        size = self.chunks.get(op, {}).get(kind, self.batch_size)
        if x.dim() == 0 or x.shape[0] != self.batch_size:
            self.unbatched.append(op)
            return [(0, x)]
        return [(lo, x[lo:lo + size]) for lo in range(0, self.batch_size, size)]

    @staticmethod
    def join(outs: Sequence[torch.Tensor]) -> torch.Tensor:
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def seeded_dropout(x: torch.Tensor, p: float, training: bool, ctx, op: str, channelwise: bool = False) -> torch.Tensor:
    """``F.dropout`` (or ``dropout2d``-style when ``channelwise``) with masks from :func:`stream_seed`.

    ``ctx=None`` falls back to PyTorch's own dropout (global generator).
    """
    if not training or p == 0.0:
        return x
    if ctx is None:
        if channelwise:
            return F.dropout2d(x, p, True) if x.dim() == 4 else F.dropout1d(x, p, True) if x.dim() == 3 else F.dropout3d(x, p, True)
        return F.dropout(x, p, True)
    if p >= 1.0:
        return x * 0.0
    outs = []
    for lo, piece in ctx.pieces(op, "dropout", x):
        gen = torch.Generator(device=piece.device).manual_seed(stream_seed(ctx.seed, ctx.step, op, lo))
        shape = (*piece.shape[:2], *([1] * (piece.dim() - 2))) if channelwise and piece.dim() > 2 else piece.shape
        keep = torch.empty(shape, dtype=piece.dtype, device=piece.device).bernoulli_(1.0 - p, generator=gen)
        outs.append(piece * keep * (1.0 / (1.0 - p)))
    return ctx.join(outs)


class SeededDropout(nn.Module):
    """Stands in for an ``nn.Dropout*`` module: same ``p``, follows ``train()``/``eval()``, seeded masks."""

    def __init__(self, p: float, channelwise: bool):
        super().__init__()
        self.p, self.channelwise = p, channelwise

    def forward(self, x: torch.Tensor, ctx=None, op: str = "") -> torch.Tensor:
        return seeded_dropout(x, self.p, self.training, ctx, op, self.channelwise)

    def extra_repr(self) -> str:
        return f"p={self.p}, channelwise={self.channelwise}"


def instrument_dropout(gm: torch.fx.GraphModule, ctx_node: torch.fx.Node) -> list[str]:
    """Rewrite every dropout of ``gm`` (in place) to draw its mask per shard; returns the rewritten node names."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if type(module) not in DROPOUT_MODULES or not node.args:
                continue
            if not isinstance(module, SeededDropout):
                _set_submodule(gm, node.target, SeededDropout(module.p, type(module) is not nn.Dropout))
            node.args = (node.args[0], ctx_node, node.name)
            node.kwargs = {}
            done.append(node.name)
        elif node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            names = ("input", "p", "train") if node.target is torch.dropout else ("input", "p", "training", "inplace")
            args = dict(zip(names, node.args))
            args.update(node.kwargs)
            training = args.get("train", args.get("training", True))
            channelwise = _DROPOUT_FUNCTIONS[node.target]
            node.target = seeded_dropout
            node.args = (args["input"], float(args.get("p", 0.5)), training, ctx_node, node.name, channelwise)
            node.kwargs = {}
            done.append(node.name)
    return done


def _set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class _RandomSpy(TorchDispatchMode):
    """Records aten calls that draw from the global generator (no ``generator=`` argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.hits.append(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


def _draws(func, args, kwargs) -> bool:
    """Whether a random-tagged aten call really draws from the global generator.

    Not when it was given a generator, and not when its probability is zero
    or it is told it is not training (attention kernels carry ``dropout_p``
    and are tagged random even at 0).
    """
    if any(isinstance(a, torch.Generator) for a in tree_leaves((args, kwargs))):
        return False
    named = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            named[arg.name] = args[i]
        elif arg.name not in named and arg.has_default_value():
            named[arg.name] = arg.default_value
    if named.get("dropout_p", None) == 0 or named.get("train", True) is False:
        return False
    return not ("dropout" in func.overloadpacket.__name__ and named.get("p", None) == 0)


def find_unseeded_random(gm: torch.fx.GraphModule, inputs: Sequence[Any], ctx) -> dict[str, str]:
    """fx node -> what it calls, for every node that draws from the global RNG when run with ``ctx``.

    Runs the (instrumented) graph once, node by node, in training mode. Such
    an op's draws differ between the pipeline and the reference, so
    ``--check`` cannot be exact for it.
    """
    found: dict[str, str] = {}

    class Spy(torch.fx.Interpreter):
        def run_node(self, n):
            spy = _RandomSpy()
            with spy:
                out = super().run_node(n)
            if spy.hits and n.op not in ("placeholder", "output"):
                what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                if n.op == "call_module":
                    what = f"{what} ({type(gm.get_submodule(n.target)).__name__})"
                found[n.name] = f"{what} -> aten.{spy.hits[0]}"
            return out

    with torch.no_grad():
        Spy(gm).run(*inputs, ctx)
    return found
