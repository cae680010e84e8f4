"""Stages compiled with ``torch.compile`` (``graphpipe run --compile``, ``Pipeline(..., compile=True)``).

Why: a practitioner on a GPU trains with ``torch.compile``; a pipeline that
runs its stages eagerly loses to a compiled plain loop however well it is
scheduled. Each hosted stage's forward (its
:class:`~graphpipe.runtime.stage_modules.BoundForward`, parameters passed in)
is compiled with inductor; autograd through the compiled forward runs the
compiled backward AOTAutograd built with it, so F and B are both compiled.

A stage compiles whole or not at all (``fullgraph=True``): a graph break
would silently run part of the stage eagerly (or all of it, when dynamo
gives up on the frame), and a stage that keeps recompiling would, past
dynamo's recompile limit, fall back to eager without a word. Both become a
:class:`CompileError` naming the stage and the compiler's reason.

Each stage compiles its own generated ``forward`` (one code object per
stage), so a rank hosting many stages (virtual stages, branches sharing a
device) does not spend one code object's recompile limit on all of them.

The run's semantics (docs/semantics.md) survive compilation:

* dropout masks are the eager ones: the per-shard seed
  (:func:`~graphpipe.runtime.rng.stream_seed`) is computed outside the
  graph and enters it as a tensor (:class:`TracedContext`), and the mask is
  drawn by the :func:`~graphpipe.runtime.rng.keep_mask` operator, which
  the compiler keeps whole and which draws what eager dropout draws. A
  micro-batch or a step is thus new data, not a new graph;
* BatchNorm's per-call statistics leave the graph as values and are filed
  under their shard after the call, as the eager stage files them;
* a random factory whose size carries the batch (drop-path's
  ``torch.rand((B, 1, 1))``) draws through the
  :func:`~graphpipe.runtime.rng.sized_draw` operator from its seed, the
  values the eager stage draws; any other op that draws from the *global*
  generator (seeded per shard by forking it,
  :func:`~graphpipe.runtime.rng.seeded_call`) cannot be traced: such a
  stage is refused, naming the op.

Refused up front: split backward (zero bubble's I and W actions): AOTAutograd
compiles a stage's backward into one graph returning the input and the
weight gradients together, so I cannot leave the weight half for W (W would
run the whole compiled backward a second time).

Shapes are static (``dynamic=False``): a stage sees the same micro-batch
shape every call, and a second shape (a replica's shard of another size) is
one more compilation, not a dynamic graph.

Example
-------
>>> from graphpipe.actions import Action
>>> compile_refusal([Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)]) is not None
True
>>> compile_refusal([Action(0, "F", 0), Action(0, "B", 0)]) is None
True
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from graphpipe.runtime.rng import ShardContext, keep_mask, sized_draw, stream_seed
from graphpipe.runtime.stage_modules import CTX_NAME

__all__ = ["CompileError", "compile_refusal", "CompiledForward", "TracedContext"]


class CompileError(RuntimeError):
    """A stage ``torch.compile`` could not compile (raised at its first call, naming the stage)."""


def compile_refusal(actions: Iterable, flag: str = "--compile") -> str | None:
    """Why a schedule with these actions cannot run compiled stages, or None when it can (``flag``: how the user
    asked for compilation, named in the message)."""
    kinds = {a.kind for a in actions}
    if kinds & {"I", "W"}:
        return (f"{flag} cannot run a split-backward (zero bubble) schedule: torch.compile's backward is one "
                "graph computing a stage's input and weight gradients together, so I cannot leave the weight "
                f"gradients to W; plan another schedule or run without {flag}")
    return None


class TracedContext:
    """What a compiled stage gets as its ``rng_ctx``: one object per stage, the same on every call.

    A :class:`~graphpipe.runtime.rng.ShardContext` differs per micro-batch
    and step; dynamo would specialise the graph on its numbers and recompile
    for each. This one holds only what is constant (which dropout reads
    which seed) and, per call, :attr:`seeds` (a tensor: graph input) and
    :attr:`records` (BatchNorm statistics the call produced, emptied by
    :class:`CompiledForward` after it).
    """

    mb_lo = 0
    """Read by synchronised BatchNorm for its record's key, which :meth:`record` leaves to after the call."""

    def __init__(self, dropout_ops: tuple[str, ...]):
        self.index = {op: i for i, op in enumerate(dropout_ops)}
        self.seeds = torch.zeros(max(len(dropout_ops), 1), dtype=torch.int64)
        self.records: list = []

    def pieces(self, op: str, kind: str, x: torch.Tensor):
        return [(0, x)]  # a stage call holds one shard; its first row is filed outside the graph

    @staticmethod
    def join(outs):
        return outs[0]

    def keep_mask(self, op: str, shape: list[int], dtype: torch.dtype, device: torch.device, q: float):
        """Dropout ``op``'s keep-mask, drawn from this call's seed for it."""
        return keep_mask(self.seeds[self.index[op]], shape, dtype, device, q)

    def sized_draw(self, op: str, normal: bool, shape: list[int], dtype: torch.dtype, device: torch.device):
        """Random factory ``op``'s draw of ``shape`` (a drop-path's ``rand``), from this call's seed for it."""
        return sized_draw(self.seeds[self.index[op]], normal, shape, dtype, device)

    def record(self, bn, op: str, stats: torch.Tensor) -> None:
        """A BatchNorm's statistics of this call (filed under the shard by :meth:`CompiledForward.__call__`)."""
        self.records.append((bn, op, stats))


def _ctx_users(graph: torch.fx.Graph, module: torch.nn.Module):
    """``(dropout op names, ops drawing from the global generator)`` of a stage graph, from the nodes that
    read its ``rng_ctx`` placeholder."""
    from graphpipe.runtime.rng import SIZED_DRAWS, SeededDropout, seeded_dropout

    ctx = next((n for n in graph.nodes if n.op == "placeholder" and n.name == CTX_NAME), None)
    dropouts, global_draws = [], []
    for node in ctx.users if ctx is not None else ():
        if getattr(node.target, "seeded_attention", False):  # attention dropout: drawn as a dropout when compiled
            dropouts.append(node.kwargs["rng_op"])
        elif getattr(node.target, "wrapped", None) in SIZED_DRAWS and node.kwargs.get("rng_size_at") is not None:
            dropouts.append(node.kwargs["rng_op"])  # drop-path's batch-sized rand: drawn from its seed (sized_draw)
        elif "rng_ctx" in node.kwargs:
            global_draws.append(node.kwargs.get("rng_op", node.name))
        elif node.op == "call_module" and isinstance(module.get_submodule(node.target), SeededDropout):
            dropouts.append(node.args[2])
        elif node.op == "call_function" and node.target is seeded_dropout:
            dropouts.append(node.args[4])
    return tuple(dropouts), tuple(global_draws)


class CompiledForward:
    """``forward`` (a stage's bound forward) compiled by ``torch.compile`` on its first call.

    Compilation is lazy so that a rank compiles only what it runs, and a
    failure names the stage: a compiler error, a graph break or hitting the
    recompile limit becomes :class:`CompileError`.
    """

    def __init__(self, forward: Callable, stage_id: int, backend: str | Callable = "inductor"):
        self.eager = forward
        self.stage_id = stage_id
        self._slots = None
        self._ctx = None
        self._refusal = None
        module = getattr(forward, "module", None)
        target = forward
        if isinstance(module, torch.fx.GraphModule):
            bound = getattr(forward, "bound", None)
            # the generated forward of the stage's own graph module: one code object per stage
            target = bound.forward if bound is not None else module.forward
            self._slots = forward.slots if bound is not None else []
            dropouts, global_draws = _ctx_users(module.graph, module)
            if global_draws:
                self._refusal = (f"stage {stage_id} cannot be compiled by torch.compile: {', '.join(global_draws)} "
                                 "draw(s) from the global random generator, which graphpipe seeds per shard by "
                                 "forking it, and a compiled graph cannot fork it; run without --compile")
            self._ctx = TracedContext(dropouts)
        self._compiled = torch.compile(target, backend=backend, dynamic=False, fullgraph=True)
        self._checked = False

    @property
    def module(self):
        return self.eager.module

    def __call__(self, *xs, **kwargs):
        if self._refusal is not None:
            raise CompileError(self._refusal)
        shard = None
        if self._ctx is not None and xs and isinstance(xs[-1], ShardContext):
            shard, traced = xs[-1], self._ctx
            if traced.index:  # a new tensor per call: a backward recomputing a mask must see its own seeds
                traced.seeds = torch.tensor([stream_seed(shard.seed, shard.step, op, shard.lo) for op in traced.index],
                                            dtype=torch.int64)
            xs = (*xs[:-1], traced)
        if self._slots:
            xs = (*[table[name] for table, name in self._slots], *xs)
        try:
            out = self._compiled(*xs, **kwargs)
        except Exception as exc:  # the compiler's errors have many types; every one ends the run, named
            if self._checked and not _from_compiler(exc):
                raise  # the model's own error at run time
            raise self._error(exc) from exc
        finally:
            records = self._ctx.records if self._ctx is not None else ()
            for bn, op, stats in records:
                if shard is not None:
                    bn.pending[(op, shard.mb_lo if bn.group is not None else shard.lo)] = stats
            if records:
                records.clear()
        self._checked = True
        return out

    def _error(self, exc: BaseException) -> CompileError:
        cause = exc
        while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
            cause = inner  # the compiler's own error, not dynamo's wrapper of it
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        if type(exc).__name__ == "FailOnRecompileLimitHit" or "recompile limit" in str(exc):
            limit = torch._dynamo.config.recompile_limit
            first = (f"it was recompiled more than torch._dynamo.config.recompile_limit={limit} times (a new "
                     "input shape, dtype or grad mode each time); raise that limit or run without --compile")
            return CompileError(f"stage {self.stage_id} cannot be compiled by torch.compile: {first}")
        return CompileError(f"stage {self.stage_id} cannot be compiled by torch.compile "
                            f"({type(cause).__name__}: {first}); run without --compile")


def _from_compiler(exc: BaseException) -> bool:
    """True for an error raised by dynamo or inductor (a graph break, a recompile limit), not by the model."""
    from torch._dynamo import exc as dynamo_exc

    return isinstance(exc, (dynamo_exc.TorchDynamoException, dynamo_exc.FailOnRecompileLimitHit))
