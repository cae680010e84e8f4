"""Random streams that do not depend on rank, placement, schedule or recomputation (docs/semantics.md).

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
* the reference (:func:`graphpipe.runtime.reference.reference_run`) runs the
  whole mini-batch but cuts every stochastic op's input at the same shard
  boundaries (:class:`ReferenceContext`), so its masks are the pipeline's.

The *context* travels as the last argument of every stage module
(``rng_ctx``, default ``None`` = plain PyTorch semantics): a
:class:`ShardContext` in the pipeline, a :class:`ReferenceContext` in the
reference. :mod:`graphpipe.runtime.batchnorm` uses the same contexts to
normalise per micro-batch.

Ops seeded this way: ``nn.Dropout``, ``nn.Dropout1d/2d/3d`` and
``F.dropout``, ``F.dropout1d/2d/3d``, ``torch.dropout`` draw their masks
from generators of their own (:func:`seeded_dropout`). Any other op that
draws from the *global* generator (``torch.randn_like`` in a forward,
``nn.RReLU``, a layer kept whole by the capture such as
``nn.TransformerEncoderLayer`` with its dropouts) is found by running the
graph once under a dispatch spy (:func:`instrument_random`) and then runs
inside :func:`seeded_call`: the global generator is forked and seeded from
the same key around the call, and the reference calls it once per shard.
What remains is an op with a generator of its *own* (its draws depend on
how often it ran, on which rank): :func:`find_unseeded_random` names it,
and the run warns that ``--check`` cannot be exact for it.

Compiled stages (:mod:`graphpipe.runtime.compiled`) draw the same masks:
every mask comes from :func:`draw_keep`, eagerly or through the
:func:`keep_mask` operator whose seed is a tensor input of the compiled
graph. ``scaled_dot_product_attention`` with dropout runs its kernel in
:func:`seeded_call` eagerly; in a compiled stage, and in the reference of
a compiled run (:func:`explicit_attention`), it is written out with such
a mask, as the kernel's own masks cannot be drawn inside a graph.

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

import contextlib
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ShardContext", "ReferenceContext", "stream_seed", "seeded_dropout", "SeededDropout", "seeded_call",
           "instrument_dropout", "instrument_random", "find_unseeded_random", "DROPOUT_MODULES", "draw_keep",
           "keep_mask", "explicit_attention", "SIZED_DRAWS", "draw_sized", "sized_draw"]

log = logging.getLogger(__name__)

DROPOUT_MODULES: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""Modules whose masks are drawn per shard (exact types: AlphaDropout subclasses _DropoutNd too but is not one)."""

# function -> (channel-wise?) for the functional dropouts fx records as call_function
_DROPOUT_FUNCTIONS = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, torch.dropout: False,
                      torch.ops.aten.dropout.default: False, torch.ops.aten.feature_dropout.default: True}
_ATEN_STYLE = (torch.dropout, torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default)
"""Dropouts whose arguments are ``(input, p, train)`` (the others: ``(input, p, training, inplace)``)."""


def stream_seed(seed: int, step: int, op: str, lo: int) -> int:
    """The 63-bit seed of op ``op``'s generator for the rows starting at ``lo`` in step ``step``.

    A hash of the whole key: an arithmetic mix of four numbers would let
    two ops, or a row offset and a step, land on the same seed.

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
    planned: int | None = None
    """The plan's batch when this step has fewer rows (a partial batch): the plan's shard boundaries move to
    ``floor(x * batch_size / planned)``, as the pipeline's (:meth:`~graphpipe.runtime.routing.Routing.row`)."""

    def pieces(self, op: str, kind: str, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        whole = self.planned or self.batch_size
        size = self.chunks.get(op, {}).get(kind, whole)
        if x.dim() == 0 or x.shape[0] != self.batch_size:
            self.unbatched.append(op)
            return [(0, x)]

        def row(sample: int) -> int:
            return sample * self.batch_size // whole

        return [(row(lo), x[row(lo):row(lo + size)]) for lo in range(0, whole, size)]

    @staticmethod
    def join(outs: Sequence[torch.Tensor]) -> torch.Tensor:
        return outs[0] if len(outs) == 1 else torch.cat(outs)


_region = threading.local()
"""Which draws are ours right now: ``ours`` (our generators, in :func:`seeded_dropout`) and ``seeded``
(the global generator, forked and seeded by :func:`seeded_call`); the spy counts only the others."""


@contextlib.contextmanager
def _mark(kind: str):
    setattr(_region, kind, getattr(_region, kind, 0) + 1)
    try:
        yield
    finally:
        setattr(_region, kind, getattr(_region, kind) - 1)


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
        shape = (*piece.shape[:2], *([1] * (piece.dim() - 2))) if channelwise and piece.dim() > 2 else piece.shape
        outs.append(piece * _keep(ctx, op, lo, shape, piece, 1.0 - p) * (1.0 / (1.0 - p)))
    return ctx.join(outs)


def _keep(ctx, op: str, lo: int, shape, like: torch.Tensor, q: float) -> torch.Tensor:
    """Op ``op``'s keep-mask for the rows starting at ``lo``: from the compiled stage's context
    (:class:`~graphpipe.runtime.compiled.TracedContext`, the seed a tensor input) or drawn here."""
    traced = getattr(ctx, "keep_mask", None)
    if traced is not None:
        return traced(op, list(shape), like.dtype, like.device, q)
    return draw_keep(stream_seed(ctx.seed, ctx.step, op, lo), shape, like.dtype, like.device, q)


def draw_keep(seed: int, shape, dtype: torch.dtype, device: torch.device, q: float) -> torch.Tensor:
    """A dropout keep-mask of ``shape``: Bernoulli(``q``) draws from a generator of its own seeded with ``seed``.

    The one place masks are drawn, eagerly or (through :func:`keep_mask`) inside a compiled stage, so both
    draw the same bits.
    """
    keep = torch.empty(tuple(shape), dtype=dtype, device=device)
    if keep.device.type != "meta":  # a shape-only run (a model on the meta device) draws nothing
        gen = torch.Generator(device=keep.device).manual_seed(seed)
        with _mark("ours"):
            keep.bernoulli_(q, generator=gen)
    return keep


@torch.library.custom_op("graphpipe::keep_mask", mutates_args=())
def keep_mask(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, device: torch.device, q: float) -> torch.Tensor:
    """:func:`draw_keep` with the seed in a one-element int64 tensor, as an operator ``torch.compile`` keeps whole.

    Why: a compiled stage cannot create a generator inside its graph, and a
    seed passed as a Python int would be a constant of the graph (one
    recompilation per micro-batch and step). As a tensor it is an input.
    """
    return draw_keep(int(seed.item()), shape, dtype, device, q)


@keep_mask.register_fake
def _(seed, shape, dtype, device, q):
    return torch.empty(tuple(shape), dtype=dtype, device=device)


SIZED_DRAWS = {torch.ops.aten.rand.default: False, torch.ops.aten.randn.default: True}
"""Random factories a compiled stage draws through :func:`sized_draw` (value: normal, not uniform) when their size
carries the batch (drop-path); eagerly they run in :func:`seeded_call` with the global generator seeded alike."""


def draw_sized(seed: int, normal: bool, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.randn``/``torch.rand`` of ``shape`` from a generator of its own seeded with ``seed``: the values
    the global generator seeded with ``seed`` gives (:func:`seeded_call`), so compiled and eager stages agree."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if out.device.type != "meta":
        gen = torch.Generator(device=out.device).manual_seed(seed)
        with _mark("ours"):
            if normal:
                out.normal_(generator=gen)
            else:
                out.uniform_(generator=gen)
    return out


@torch.library.custom_op("graphpipe::sized_draw", mutates_args=())
def sized_draw(seed: torch.Tensor, normal: bool, shape: list[int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """:func:`draw_sized` with the seed in a one-element int64 tensor, an operator ``torch.compile`` keeps whole
    (as :func:`keep_mask`: the seed is an input of the graph, not a constant)."""
    return draw_sized(int(seed.item()), normal, shape, dtype, device)


@sized_draw.register_fake
def _(seed, normal, shape, dtype, device):
    return torch.empty(tuple(shape), dtype=dtype, device=device)


class SeededDropout(nn.Module):
    """Stands in for an ``nn.Dropout*`` module: same ``p``, follows ``train()``/``eval()``, seeded masks."""

    def __init__(self, p: float, channelwise: bool):
        super().__init__()
        self.p, self.channelwise = p, channelwise

    def forward(self, x: torch.Tensor, ctx=None, op: str = "") -> torch.Tensor:
        return seeded_dropout(x, self.p, self.training, ctx, op, self.channelwise)

    def extra_repr(self) -> str:
        return f"p={self.p}, channelwise={self.channelwise}"


def seeded_call(fn, args: tuple, kwargs: dict, ctx, op: str, size_at: int | None = None):
    """``fn(*args, **kwargs)`` with the global generator seeded per shard (:func:`stream_seed`), then restored.

    In the reference (:class:`ReferenceContext`) ``fn`` runs once per shard
    of the op's stage: every argument whose dim 0 is the batch is sliced and
    tensor outputs are concatenated, so each shard draws what it draws in the
    pipeline. Only valid for ops that treat samples independently (the ops
    that draw random numbers usually do: dropout, noise, transformer layers).
    ``size_at``: the position of a factory's ``size`` argument whose first entry is the batch
    (``torch.rand((x.shape[0], 1, 1))``, the drop-path of timm and Hugging Face models); each shard
    draws its own rows of it.
    """
    if ctx is None:
        return fn(*args, **kwargs)
    traced = getattr(ctx, "sized_draw", None)
    if traced is not None and size_at is not None and fn in SIZED_DRAWS:  # a compiled stage: its seed is an input
        return traced(op, SIZED_DRAWS[fn], list(args[size_at]), kwargs.get("dtype") or torch.get_default_dtype(),
                      torch.device(kwargs.get("device") or "cpu"))
    if size_at is not None:  # a stand-in of the batch rows the size names, for the pieces
        size = list(args[size_at])
        first = torch.empty((size[0], 0), device="meta")
    else:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if first is None:
        ctx.unbatched.append(op)
        return fn(*args, **kwargs)
    pieces = ctx.pieces(op, "dropout", first)
    rows = first.shape[0]
    outs = []
    for lo, piece in pieces:
        if size_at is not None:
            a, k = (*args[:size_at], [piece.shape[0], *size[1:]], *args[size_at + 1:]), kwargs
        elif len(pieces) == 1:
            a, k = args, kwargs
        else:
            cut = slice(lo - pieces[0][0], lo - pieces[0][0] + piece.shape[0])
            a = tuple(_rows(x, rows, cut) for x in args)
            k = {key: _rows(x, rows, cut) for key, x in kwargs.items()}
        devices = {x.device for x in (*a, *k.values()) if isinstance(x, torch.Tensor) and x.device.type == "cuda"}
        if isinstance(k.get("device"), (torch.device, str)) and torch.device(k["device"]).type == "cuda":
            devices.add(torch.device(k["device"]))  # a factory's draws come from the device it makes them on
        devices = sorted(devices, key=str)
        seed = stream_seed(ctx.seed, ctx.step, op, lo)
        with torch.random.fork_rng(devices=devices), _mark("seeded"):
            torch.default_generator.manual_seed(seed)
            for d in devices:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
            outs.append(fn(*a, **k))
    return outs[0] if len(outs) == 1 else _cat_outputs(outs)


_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTIONS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


@contextlib.contextmanager
def explicit_attention(on: bool = True):
    """Within it, attention with dropout draws its masks as compiled stages do (:func:`seeded_attention`):
    the ``--check`` reference of a compiled run."""
    before = getattr(_region, "explicit_attention", False)
    _region.explicit_attention = on
    try:
        yield
    finally:
        _region.explicit_attention = before


def _seeded_attention(fn):
    """A stand-in for ``scaled_dot_product_attention`` (``fn``) taking ``rng_ctx``/``rng_op``.

    Eagerly, with its dropout, it runs the kernel inside :func:`seeded_call`
    (the kernel's own masks, from the forked global generator). A compiled
    stage cannot fork that generator, so there (and in the reference of a
    compiled run, :func:`explicit_attention`) the attention is written out
    (scores, softmax, a keep-mask as :func:`seeded_dropout` draws it, times
    the values): the same function of (seed, step, op, rows) in both.
    """
    def call(*args, rng_ctx=None, rng_op: str = "", **kwargs):
        named = {**dict(zip(_ATTENTION_ARGS, args)), **kwargs}
        p = named.get("dropout_p", 0.0)
        if rng_ctx is None or not p or not (getattr(rng_ctx, "keep_mask", None) is not None
                                            or getattr(_region, "explicit_attention", False)):
            return seeded_call(fn, args, kwargs, rng_ctx, rng_op)
        query = named["query"]
        rows = query.shape[0]
        pieces = rng_ctx.pieces(rng_op, "dropout", query)
        outs = []
        for lo, piece in pieces:
            cut = slice(lo - pieces[0][0], lo - pieces[0][0] + piece.shape[0])
            part = {k: _rows(v, rows, cut) for k, v in named.items()}
            outs.append(_written_attention(part, lambda shape, like: _keep(rng_ctx, rng_op, lo, shape, like, 1.0 - p)))
        return rng_ctx.join(outs)

    call.__name__ = call.__qualname__ = "seeded_attention"
    call.seeded_attention = True
    return call


def _written_attention(a: Mapping[str, Any], keep) -> torch.Tensor:
    """``scaled_dot_product_attention`` of the arguments ``a`` written out, its dropout mask from ``keep``."""
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    p = a["dropout_p"]
    if a.get("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = a.get("scale") or 1.0 / float(q.shape[-1]) ** 0.5
    scores = (q @ k.transpose(-2, -1)) * scale
    if a.get("is_causal", False):
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    attn = torch.softmax(scores, dim=-1)
    attn = attn * keep(attn.shape, attn) * (1.0 / (1.0 - p))
    return attn @ v


def _rows(x, rows: int, cut: slice):
    return x[cut] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows else x


def _cat_outputs(outs: list):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat_outputs([o[i] for o in outs]) for i in range(len(first)))
    return first


_SEEDED_CLASSES: dict[type, type] = {}


def _seeded_class(cls: type) -> type:
    """A subclass of module class ``cls`` whose forward takes ``rng_ctx``/``rng_op`` and runs in :func:`seeded_call`."""
    if cls not in _SEEDED_CLASSES:
        def forward(self, *args, rng_ctx=None, rng_op: str = "", **kwargs):
            return seeded_call(lambda *a, **k: cls.forward(self, *a, **k), args, kwargs, rng_ctx, rng_op)

        _SEEDED_CLASSES[cls] = type(f"Seeded{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return _SEEDED_CLASSES[cls]


def _seeded_function(fn, method: str | None = None):
    """A function calling ``fn`` (or ``args[0].method``) inside :func:`seeded_call`; fx names it after ``fn``."""
    def call(*args, rng_ctx=None, rng_op: str = "", rng_size_at: int | None = None, **kwargs):
        target = (lambda self, *a, **k: getattr(self, method)(*a, **k)) if method else fn
        return seeded_call(target, args, kwargs, rng_ctx, rng_op, rng_size_at)

    call.__name__ = call.__qualname__ = f"seeded_{method or getattr(fn, '__name__', 'op')}"
    call.wrapped = fn
    return call


def instrument_random(gm: torch.fx.GraphModule, ctx_node: torch.fx.Node, inputs: Sequence[Any]) -> list[str]:
    """Route every call drawing from the global generator through :func:`seeded_call` (in place).

    Runs ``gm`` once on ``inputs`` (training mode, no grad) to find them;
    returns the rewritten node names.
    """
    from graphpipe.runtime.batchnorm import sharded_batchnorms

    rows = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), 1)
    found = _spy(gm, inputs, ShardContext(0, 0, 0, rows, 0, rows))
    for bn in sharded_batchnorms(gm):
        bn.pending.clear()
    done = []
    for node in list(gm.graph.nodes):
        if node.name not in found or found[node.name][1]:  # own generators cannot be seeded from outside
            continue
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            module.__class__ = _seeded_class(type(module))
        elif node.op == "call_function":
            seeded = _seeded_attention if node.target in _ATTENTIONS else _seeded_function
            size_at = _batch_size_argument(node)
            if size_at is not None:
                node.kwargs = {**node.kwargs, "rng_size_at": size_at}
            node.target = seeded(node.target)
        elif node.op == "call_method":
            node.op, node.target = "call_function", _seeded_function(None, node.target)
        else:
            continue
        node.kwargs = {**node.kwargs, "rng_ctx": ctx_node, "rng_op": node.name}
        done.append(node.name)
    return done


def instrument_dropout(gm: torch.fx.GraphModule, ctx_node: torch.fx.Node) -> list[str]:
    """Rewrite every dropout of ``gm`` (in place) to draw its mask per shard; returns the rewritten node names."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            # a dropout module called twice (T5's encoder.dropout) was replaced at its first call
            if (type(module) not in DROPOUT_MODULES and type(module) is not SeededDropout) or not node.args:
                continue
            if not isinstance(module, SeededDropout):
                _set_submodule(gm, node.target, SeededDropout(module.p, type(module) is not nn.Dropout))
            node.args = (node.args[0], ctx_node, node.name)
            node.kwargs = {}
            done.append(node.name)
        elif node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            names = ("input", "p", "train") if node.target in _ATEN_STYLE else ("input", "p", "training", "inplace")
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


def _batch_size_argument(node: torch.fx.Node) -> int | None:
    """Position of a random factory's ``size`` argument whose first entry is the batch: a symbol of the
    captured graph (its batch is its one dynamic dimension), not a literal (``aten.rand([B, 1, 1])``)."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "size" and i < len(node.args):
            size = node.args[i]
            if isinstance(size, (list, tuple)) and size and isinstance(size[0], torch.fx.Node):
                return i
    return None


class _RandomSpy(TorchDispatchMode):
    """Records aten calls that draw random numbers we did not seed: ``(op name, with a generator of its own)``."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            own = any(isinstance(a, torch.Generator) for a in tree_leaves((args, kwargs)))
            if not (getattr(_region, "ours", 0) if own else getattr(_region, "seeded", 0)):
                self.hits.append((str(func.overloadpacket.__name__), own))
        return func(*args, **kwargs)


def _draws(func, args, kwargs) -> bool:
    """Whether a random-tagged aten call really draws from the global generator.

    Not when its probability is zero or it is told it is not training
    (attention kernels carry ``dropout_p`` and are tagged random even at 0).
    """
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
    """fx node -> what it calls, for every node whose draws are not seeded per shard when run with ``ctx``.

    Runs the (instrumented) graph once, node by node, in training mode. Such
    an op's draws differ between the pipeline and the reference, so
    ``--check`` cannot be exact for it.
    """
    return {name: what for name, (what, _) in _spy(gm, inputs, ctx).items()}


def _spy(gm: torch.fx.GraphModule, inputs: Sequence[Any], ctx) -> dict[str, tuple[str, bool]]:
    found: dict[str, tuple[str, bool]] = {}

    class Spy(torch.fx.Interpreter):
        def run_node(self, n):
            spy = _RandomSpy()
            with spy:
                out = super().run_node(n)
            if spy.hits and n.op not in ("placeholder", "output"):
                what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                if n.op == "call_module":
                    what = f"{what} ({type(gm.get_submodule(n.target)).__name__})"
                own = any(o for _, o in spy.hits)
                name = next((h for h, o in spy.hits if o), spy.hits[0][0])
                found[n.name] = (f"{what} -> aten.{name}" + (" with a generator of its own" if own else ""), own)
            return out

    from graphpipe.runtime.materialize import as_traced

    with torch.no_grad(), as_traced(gm, inputs) as convert:  # a bf16 trace runs under autocast only
        Spy(gm).run(*[convert(x) for x in inputs], ctx)
    return found
