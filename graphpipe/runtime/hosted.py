"""One pipeline stage as the rank hosting it holds and runs it: :class:`HostedStage` (docs/design.md, "The runtime").

A rank hosts one or more stages (a stage's replica, virtual stages of an
interleaved schedule, branches sharing a device). Everything that belongs
to one of them lives in one object: its program and module, its parameters
and their flat gradient buffer, its BatchNorms, its bound forward, what its
re-materialization and zero bubble's split backward keep per micro-batch,
and the names its tensors have in the model (what a checkpoint keys them
by). It also *computes*: :meth:`HostedStage.run_forward`,
:meth:`HostedStage.run_backward` and :meth:`HostedStage.run_weight_grad` run one
typed action each (:class:`Forward`, :class:`Backward`, :class:`WeightGrad`),
receiving the messages it consumes and sending those it produces, and
:meth:`HostedStage.sync_gradients` is the one place a stage's replicas
combine their gradients. The :class:`~graphpipe.runtime.executor.RankExecutor`
keeps what is the rank's, not a stage's: the action loop, the mailbox, the
all-reduce order, BatchNorm commits and tied parameters; the stages of a
rank share its :class:`StageServices`.

``Forward`` of micro-batch ``j``: gather the stage's inputs (rows of the
model inputs, pieces received from every producer stage — concatenated in
sample order when the consumer's micro-batch is larger, a slice when it is
smaller), run the stage module, send every outgoing piece, keep the inputs
and outputs for the backward. On the sink stage compute the loss
``loss_fn(output) * rows / batch_size``: ``loss_fn`` is a mean over its
batch, so these terms sum to the mini-batch mean and the gradients equal
single-device training on the whole mini-batch.

``Backward``: sum the gradient pieces of every output from every consumer
into one tensor per output, ``torch.autograd.backward`` from the outputs
(and the loss on the sink), and send the gradient of every received input
piece back to its producer. Parameter gradients accumulate over
micro-batches. Zero bubble's I (:mod:`graphpipe.frontend.split_backward`) is a
``Backward`` with ``input_only``: it computes only the gradients of the
stage inputs (graph retained) and sends them; its :class:`WeightGrad` (W)
computes the weight gradients later and sends nothing.

Every stage call gets a :class:`~graphpipe.runtime.rng.ShardContext` (seed,
step, the rows it holds) as its last argument: dropout masks and BatchNorm
statistics then depend on those rows only, never on rank or schedule
(docs/semantics.md). Each action returns its ``(ready, start, end)`` times
relative to the iteration's start: ``ready`` before its inputs are
gathered, ``start`` when compute begins, ``end`` when compute ends — its
messages are posted right after, so a consumer never starts before its
producer's ``end``, as in the simulator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from graphpipe.actions import Action
from graphpipe.runtime.batchnorm import sharded_batchnorms
from graphpipe.runtime.rng import ShardContext
from graphpipe.runtime.stage_modules import BoundForward, StageProgram, ValueMeta
from graphpipe.frontend.split_backward import PendingWeightGrad, backward_input, backward_weight
from graphpipe.stages import Stage

__all__ = ["HostedStage", "StageServices", "Forward", "Backward", "WeightGrad", "StageAction", "GradientSync",
           "zero_grads", "flat_grad_buffer"]


def zero_grads(params) -> None:
    """Zero each parameter's ``.grad`` in place, allocating it on first use (persistent buffers).

    With ``grad = None`` an iteration's first backward allocates (and, on a
    CPU, page-faults) fresh gradient tensors and only later micro-batches
    accumulate; with persistent buffers every backward accumulates, which is
    what ``graphpipe profile`` times.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def flat_grad_buffer(params) -> torch.Tensor | None:
    """One zeroed buffer holding every gradient of ``params``, each ``.grad`` a view into it.

    Autograd accumulates into an existing ``.grad`` in place, so the buffer
    always holds the current gradients and an all-reduce can take it as is.
    ``None`` (gradients left alone) when there are no parameters or they mix
    dtypes or devices.
    """
    if not params or len({(p.dtype, p.device) for p in params}) > 1:
        return None
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@dataclass(eq=False)
class StageServices:
    """What the stages of one rank share while they compute: the mailbox, the boundary values' metadata, the
    loss, the saved-activation meter, and the iteration's step and loss terms (one object per executor)."""

    mailbox: Any
    """The rank's :class:`~graphpipe.runtime.comm.Mailbox` (every message in and out)."""
    meta: Mapping[str, ValueMeta]
    """Boundary value -> its per-sample shape, dtype, batch dimension and whether a gradient flows back."""
    loss_fn: Callable[[Any], torch.Tensor]
    device: torch.device
    measure: bool
    """Synchronise the device around each action's compute, so its times are the kernels' (``graphpipe run``)."""
    saved_meter: Any
    """:class:`~graphpipe.runtime.measure.SavedBytesMeter` (or ``NoMeter`` when nothing is measured)."""
    seed: int = 0
    step: int = 0
    """The iteration being run (every :class:`~graphpipe.runtime.rng.ShardContext` carries it)."""
    working: int = 0
    """Bytes of re-materialized activations counted now (one backward runs at a time on a rank)."""
    loss_terms: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """This iteration's ``(micro-batch, loss term)`` of the sink stages, on the device until read."""

    def sync(self) -> None:
        """Wait for the device, so the per-action timestamps are the kernels' (only when measuring)."""
        if self.measure and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True, slots=True, eq=False)
class Forward:
    """F of one micro-batch on this rank's shard, with what the plan fixes for it (worked out once per
    executor, not per step: on a host-bound step these lookups are a visible share of an action's time)."""

    action: Action
    hosted: "HostedStage"
    rows: slice
    """Rows ``[lo, hi)`` of the mini-batch the shard holds."""
    mb_lo: int
    """First row of the whole micro-batch the shard belongs to (a replica's shard is a part of it)."""
    scale: float
    """The shard's share of the mini-batch: its loss term's factor."""
    receives: tuple[tuple[Any, str, int, tuple], ...]
    """``(piece, value, source rank, message key)`` of the activations of every incoming piece, in order."""
    sends: tuple[tuple[int, tuple, str, slice | None, bool], ...]
    """``(destination rank, message key, value, its rows, zeros)`` of every outgoing piece's activations, in send
    order; rows None: an unbatched value, sent whole."""


@dataclass(frozen=True, slots=True, eq=False)
class Backward:
    """B of one micro-batch (or zero bubble's I, ``input_only``): the gradients it receives for its outputs and
    sends for its inputs."""

    action: Action
    hosted: "HostedStage"
    input_only: bool
    """Zero bubble's I: input gradients only, the weight gradients left for its :class:`WeightGrad`."""
    receives: tuple[tuple[Any, str, int, tuple], ...]
    """``(piece, value, source rank, message key)`` of the gradient of every outgoing piece."""
    sends: tuple[tuple[int, tuple, str, slice | None, bool], ...]
    """``(destination rank, message key, value, its rows, zeros)`` of every incoming piece's gradient; ``zeros``:
    a later copy of an unbatched value whose gradient went back with the first (zeros instead)."""


@dataclass(frozen=True, slots=True, eq=False)
class WeightGrad:
    """Zero bubble's W of one micro-batch: the weight gradients its I left pending; no messages."""

    action: Action
    hosted: "HostedStage"
    receives: tuple = ()


StageAction = Forward | Backward | WeightGrad
"""One typed action of a rank's list: what :class:`~graphpipe.runtime.executor.RankExecutor` dispatches."""


@dataclass(eq=False)
class GradientSync:
    """A stage's gradient all-reduce with its replicas, in flight (:meth:`HostedStage.sync_gradients`)."""

    stage_id: int
    work: Any
    flat: torch.Tensor
    grads: list[torch.Tensor] | None
    """The gradients a flattened copy was reduced for (copied back by :meth:`wait`); None: the stage's own flat
    buffer was reduced in place."""
    issued_at: float
    """``time.perf_counter()`` when it was issued."""

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, wait_work: Callable[[Any, str], None]) -> None:
        """Wait for the reduction (through the mailbox's timed wait) and put a copy's sums back in ``.grad``."""
        wait_work(self.work, f"gradient all-reduce of stage {self.stage_id} with its replicas")
        if self.grads is not None:
            for g, reduced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
                g.copy_(reduced)


@dataclass(eq=False)
class HostedStage:
    """One stage on the rank hosting it (module docstring). Built by :meth:`of`."""

    stage: Stage
    program: StageProgram
    forward: BoundForward | Any
    """The stage's forward with its parameters passed in (no attribute chains per micro-batch)."""
    batchnorms: tuple
    """Its :class:`~graphpipe.runtime.batchnorm.ShardedBatchNorm` modules, in a fixed order."""
    grad_buffer: torch.Tensor | None = None
    """Every gradient of the stage, each ``.grad`` a view into it (None where dtypes or devices mix)."""
    grad_views: list[torch.Tensor] | None = None
    redo_bytes: int | list[int] | None = None
    """A re-materializing stage's working set in B (per segment with checkpoints), probed once."""
    weights: Any = None
    """Asynchronous schedules: the weight versions F and B run on (:mod:`graphpipe.runtime.stash`)."""
    stash: dict[int, list] = field(default_factory=dict)
    """Micro-batch -> inputs (and handed-over values) a re-materializing stage keeps until its B."""
    pending_w: dict[int, PendingWeightGrad] = field(default_factory=dict)
    """Micro-batch -> the weight gradient zero bubble's I left for its W."""
    segment_calls: dict[int, set[int]] = field(default_factory=dict)
    """Micro-batch -> the checkpoint segments that ran (a second call is a re-materialization)."""
    persistent_grads: bool = True
    """Whether the gradients live in one flat buffer kept across steps (:meth:`bind_grad_buffers`). Without
    (:meth:`leave_grads_to_autograd`), an iteration's first backward hands each parameter its freshly computed
    gradient, as in a plain training loop after ``optimizer.zero_grad()``."""
    services: StageServices | None = field(default=None, repr=False)
    """What the rank's stages share while computing (set by the executor that runs this stage)."""
    saved: dict[int, tuple] = field(default_factory=dict)
    """Micro-batch -> ``(input leaves, outputs by name, loss term)`` its forward keeps until its backward."""
    _slots: tuple | None = field(default=None, repr=False)
    """(the module, the ``_parameters`` dicts of its sub-modules in ``modules()`` order), for :meth:`parameters`."""

    @classmethod
    def of(cls, stage: Stage, program: StageProgram, *, compile: bool = False) -> "HostedStage":
        """``compile``: the bound forward compiled by ``torch.compile`` (:mod:`graphpipe.runtime.compiled`)."""
        forward = BoundForward(program.module)
        if compile:
            from graphpipe.runtime.compiled import CompiledForward

            forward = CompiledForward(forward, stage.id)
        return cls(stage, program, forward, tuple(sharded_batchnorms(program.module)))

    @property
    def stage_id(self) -> int:
        return self.stage.id

    @property
    def module(self) -> torch.nn.Module:
        return self.program.module

    def parameters(self) -> list[torch.nn.Parameter]:
        """The stage module's parameters, each once, in ``module.parameters()``'s order.

        Read through the owners' ``_parameters`` dicts, found once per module
        (as :class:`~graphpipe.runtime.stage_modules.BoundForward` reads its
        tensors): ``module.parameters()`` walks every sub-module on each call,
        and the training API asks at every step (:meth:`RankExecutor.ensure_grads
        <graphpipe.runtime.executor.RankExecutor.ensure_grads>`). A parameter
        replaced later (a checkpoint load, a materialization, a weight
        version) is the one returned; the module's structure is fixed once
        built.
        """
        seen: set[int] = set()
        out = []
        for table in self._tables():
            for p in table.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _tables(self) -> list[dict]:
        """The ``_parameters`` dicts of the module's sub-modules, found once per module."""
        module = self.program.module
        if self._slots is None or self._slots[0] is not module:
            self._slots = (module, [m._parameters for m in module.modules() if m._parameters])
        return self._slots[1]

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that train: a frozen one (``requires_grad=False``) gets no gradient buffer, no
        all-reduce and so no optimizer state (optimizers skip a parameter whose ``.grad`` is None)."""
        return [p for p in self.parameters() if p.requires_grad]

    def param(self, name: str) -> torch.nn.Parameter:
        """The parameter called ``name`` in the stage module."""
        return self.program.module.get_parameter(name)

    def checkpoint_keys(self) -> dict[str, torch.Tensor]:
        """The stage's parameters and buffers by their names in the model (a tied copy by its original's):
        what a checkpoint stores them under."""
        names = self.program.param_names
        out = {names.get(n, n): p for n, p in self.program.module.named_parameters()}
        out.update(dict(self.program.module.named_buffers()))
        return out

    def bind_grad_buffers(self) -> None:
        """``.grad`` as views into one zeroed flat buffer (:func:`flat_grad_buffer`; an existing buffer and its
        views are reused), or zeroed per-parameter tensors where the stage mixes dtypes or devices."""
        params = self.trainable()
        if self.grad_views is not None:
            self.grad_buffer.zero_()
            for p, g in zip(params, self.grad_views):
                p.grad = g
            return
        flat = flat_grad_buffer(params)
        if flat is not None:
            self.grad_buffer, self.grad_views = flat, [p.grad for p in params]
        else:
            zero_grads(params)

    def leave_grads_to_autograd(self) -> None:
        """No flat buffer: a ``.grad`` that is None when an iteration starts (``optimizer.zero_grad()``) is
        created by autograd from the first micro-batch's gradient instead of being added to zeros.

        For a stage whose gradients are never all-reduced (one replica) and
        whose steps are not timed against a profile: it saves the memset of
        the buffer and one addition per parameter per step (a kernel each on
        a GPU), and the sums are the same numbers (``0 + g`` is ``g``).
        :meth:`fill_missing_grads` gives a parameter no micro-batch reached
        its zero gradient afterwards, as the buffer would have.
        """
        self.persistent_grads = False
        self.grad_buffer = self.grad_views = None
        for p in self.trainable():  # a new executor starts from no gradient, as a bound buffer starts zeroed
            p.grad = None

    def fill_missing_grads(self) -> None:
        """A zero ``.grad`` for every trainable parameter that has none after an iteration (one the stage's
        outputs do not depend on): every trainable parameter has a gradient after a step, with or without a
        persistent buffer."""
        for table in self._tables():  # straight from the tables: run after every step, it builds no list
            for p in table.values():
                if p is not None and p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            zero_grads(self.trainable())

    def idle(self) -> bool:
        """No micro-batch is waiting for its backward or its weight gradient."""
        return not self.pending_w

    # ------------------------------------------------------------ computing
    def run_forward(self, op: Forward, inputs: Sequence[torch.Tensor] | None, t0: float) -> tuple[float, float, float]:
        """Run F (module docstring): receive, compute (re-materializing if the stage does), send; keep what the
        backward needs. Returns ``(ready, start, end)`` relative to ``t0``."""
        sv, prog, stage, rows = self.services, self.program, self.stage, op.rows
        mb_id = op.action.mb_id
        ready_at = time.perf_counter()
        values: dict[str, torch.Tensor] = {name: inputs[index][rows] for name, index in prog.model_inputs}
        parts: dict[str, list[torch.Tensor]] = {}
        for _, value, src, key in op.receives:
            parts.setdefault(value, []).append(sv.mailbox.recv(src, key))
        leaves = {}
        for value, chunks in parts.items():
            # an unbatched value (a position table) comes whole with every piece: the first copy is the stage's
            t = chunks[0] if len(chunks) == 1 or not sv.meta[value].batched else torch.cat(chunks)
            t = sv.meta[value].from_wire(t)  # messages carry the batch at dim 0; (seq, batch, dim) moves back
            if sv.meta[value].needs_grad:
                t.requires_grad_(True)
                leaves[value] = t
            values[value] = t
        sv.sync()
        start = time.perf_counter()
        ctx = ShardContext(sv.seed, sv.step, rows.start, rows.stop - rows.start, op.mb_lo, stage.micro_batch_size)
        args = [values[n] for n in prog.input_names]
        scale = op.scale
        # the stage's forward, and the loss on the sink (so re-materialization covers it)
        run_stage = partial(self._run, mb_id, scale) if stage.recompute else None
        meter = sv.saved_meter
        with meter.hooks():  # activation memory, measured (runtime/measure.py)
            if stage.recompute and prog.segments:  # re-materialization one checkpointed segment at a time
                sent, out, loss, pieces = self._forward_segments(mb_id, args, ctx, scale)
            elif stage.recompute:  # re-materialization: keep the inputs, re-run the forward inside B (non-reentrant)
                sent, out, loss = torch.utils.checkpoint.checkpoint(run_stage, *args, ctx, use_reentrant=False)
                self.stash[mb_id] = [meter.hold(t) for t in args if isinstance(t, torch.Tensor)]
            else:
                sent, out, loss = self._run(mb_id, scale, *args, ctx)
        by_name = dict(zip(prog.output_names, sent))
        sv.sync()
        end = time.perf_counter()  # compute ends here; messages leave after it (the simulator's semantics)
        for dst, key, value, value_rows, _ in op.sends:
            t = by_name[value]
            sv.mailbox.send(dst, key, t if value_rows is None else sv.meta[value].to_wire(t)[value_rows])
        self.saved[mb_id] = (leaves, by_name, loss)
        if loss is not None and sv.mailbox.rank in stage.devices[::stage.tp]:  # a TP group's loss counts once
            # read once at the iteration's end: a float() here would wait for the device
            sv.loss_terms.append((mb_id, loss.detach().float()))
        if stage.recompute and self.redo_bytes is None:  # once, after the timed compute
            self.redo_bytes = ([meter.probe(fn, *xs, ctx) for fn, xs in pieces]
                               if prog.segments else meter.probe(run_stage, *args, ctx))
        return ready_at - t0, start - t0, end - t0

    def _run(self, mb_id: int, scale: float, *xs):
        """``(sent, out, loss)``: the stage's forward of micro-batch ``mb_id`` on ``xs`` (its inputs and shard
        context), and on the sink the loss term, scaled by the shard's share of the mini-batch."""
        versions = self.weights
        sent, out = self.forward(*xs) if versions is None else versions.call(mb_id, *xs)
        return sent, out, (self.services.loss_fn(out) * scale if self.program.is_sink else None)

    def _forward_segments(self, mb_id: int, args: list, ctx, scale: float):
        """A re-materializing stage's forward, one checkpoint per segment (:func:`segment_stage`).

        Each segment runs under ``torch.utils.checkpoint`` (non-reentrant);
        the stage's inputs and the values a segment hands to a later one are
        held (counted) until B ends. The last segment's checkpoint also builds
        the stage's output and the loss, as a whole-stage checkpoint does.
        Returns ``(sent, out, loss, pieces)``, ``pieces`` each segment's
        callable and inputs, for the probe.
        """
        prog, versions, meter = self.program, self.weights, self.services.saved_meter
        loss_fn = self.services.loss_fn
        env = dict(zip(prog.input_names, args))
        held = [meter.hold(t) for t in args if isinstance(t, torch.Tensor)]
        pieces = []
        last = len(prog.segments) - 1
        for j, seg in enumerate(prog.segments):
            def fn(*xs, seg=seg, tail=j == last):
                got = seg.module(*xs) if versions is None else versions.call(mb_id, *xs, module=seg.module)
                if not tail:
                    return got
                mine = dict(zip(seg.output_names, got))  # the stage's output from every segment's values
                sent, out = prog.assemble(*(mine[n] if n in mine else env[n] for n in prog.gathers))
                return sent, out, (loss_fn(out) * scale if prog.is_sink else None)
            xs = [env[n] for n in seg.input_names]
            pieces.append((fn, xs))
            got = torch.utils.checkpoint.checkpoint(self._counted(mb_id, j, fn), *xs, ctx, use_reentrant=False)
            if j < last:
                env.update(zip(seg.output_names, got))
                held += [meter.hold(env[n]) for n in seg.handed]
        self.stash[mb_id] = held
        return (*got, pieces)  # the last segment's (sent, out, loss)

    def _counted(self, mb_id: int, j: int, fn):
        """``fn`` (segment ``j`` of micro-batch ``mb_id``), whose calls after the first are its
        re-materialization inside B: that segment's probed working set replaces the one counted before."""
        sv = self.services

        def run(*xs):
            calls = self.segment_calls.setdefault(mb_id, set())
            if j in calls:
                rebuilt = self.redo_bytes[j]
                sv.saved_meter.add(rebuilt - sv.working)
                sv.working = rebuilt
            calls.add(j)
            return fn(*xs)
        return run

    def _begin_rebuild(self) -> None:
        """B, I or W starts: a whole-stage checkpoint rebuilds all the stage's activations now (segments count
        theirs as each rebuilds, :meth:`_counted`)."""
        sv = self.services
        whole = self.stage.recompute and not self.program.segments
        sv.working = (self.redo_bytes or 0) if whole else 0
        sv.saved_meter.add(sv.working)

    def _end_rebuild(self) -> None:
        sv = self.services
        sv.saved_meter.add(-sv.working)
        sv.working = 0

    def run_backward(self, op: Backward, t0: float) -> tuple[float, float, float]:
        """Run B, or zero bubble's I (input gradients only; the weight gradients wait for :meth:`run_weight_grad`):
        receive the outputs' gradients, compute, send the inputs' gradients."""
        sv, meta = self.services, self.services.meta
        mb_id = op.action.mb_id
        ready_at = time.perf_counter()
        leaves, outputs, loss = self.saved.pop(mb_id)
        grads: dict[str, torch.Tensor] = {}
        for piece, value, src, key in op.receives:
            g = sv.mailbox.recv(src, key)
            acc = grads.get(value)
            rows = piece.producer_rows
            m = meta[value]
            if not m.batched:  # every consumer shard's gradient of the whole value: summed
                grads[value] = g if acc is None else acc + g
                continue
            if acc is None and rows.start == 0 and rows.stop == outputs[value].shape[m.batch_dim]:
                grads[value] = m.from_wire(g)  # a piece covering every row (the usual case): the received buffer
                continue
            if acc is None:
                acc = grads[value] = torch.zeros_like(outputs[value])
            m.to_wire(acc)[rows] += g  # a view: the rows land in acc
        sv.sync()
        start = time.perf_counter()
        tensors, grad_tensors = [], []
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grad_tensors.append(None)
        for value, g in grads.items():
            out = outputs[value]
            if out.requires_grad:
                tensors.append(out)
                grad_tensors.append(g)
        self._begin_rebuild()  # the checkpoint rebuilds the stage's activations for this backward
        if op.input_only:
            leaves_in = [leaves[v] for v in sorted(leaves)]
            dinputs, self.pending_w[mb_id] = backward_input(tensors, grad_tensors, leaves_in, self.trainable())
            for leaf, g in zip(leaves_in, dinputs):
                leaf.grad = g
        elif tensors:
            torch.autograd.backward(tensors, grad_tensors)
        self._end_rebuild()
        if self.weights is not None:
            self.weights.after_backward(mb_id)
        if not op.input_only:
            self.stash.pop(mb_id, None)
            self.segment_calls.pop(mb_id, None)
        sv.sync()
        end = time.perf_counter()
        for dst, key, value, value_rows, zeros in op.sends:
            leaf = leaves[value]
            g = leaf.grad
            if g is None or zeros:  # an unbatched value's later copies get no gradient: the stage used the first
                g = torch.zeros_like(leaf)
            sv.mailbox.send(dst, key, g if value_rows is None else meta[value].to_wire(g)[value_rows])
        return ready_at - t0, start - t0, end - t0

    def run_weight_grad(self, op: WeightGrad, t0: float) -> tuple[float, float, float]:
        """Run W: the weight gradients of a micro-batch whose I ran; frees the graph I retained."""
        sv = self.services
        mb_id = op.action.mb_id
        sv.sync()
        start = time.perf_counter()
        self._begin_rebuild()
        backward_weight(self.pending_w.pop(mb_id))
        self._end_rebuild()
        self.stash.pop(mb_id, None)
        self.segment_calls.pop(mb_id, None)
        sv.sync()
        end = time.perf_counter()
        return start - t0, start - t0, end - t0

    def sync_gradients(self, group) -> GradientSync | None:
        """Start summing this stage's gradients with its replicas over ``group`` (their data-parallel group),
        asynchronously; None when it has no trainable parameter.

        The one place a stage's replicas combine their gradients: after the
        stage's last backward of the iteration, in the rank's fixed order
        (:class:`~graphpipe.runtime.executor.RankExecutor`). Every replica
        reduces the same tensors: a parameter no micro-batch reached gets a
        zero gradient first. The stage's flat gradient buffer is reduced as
        is; a stage without one (mixed dtypes) or whose ``.grad`` was
        replaced reduces a flattened copy, put back by
        :meth:`GradientSync.wait`.
        """
        params = self.trainable()
        if not params:
            return None
        zero_grads([p for p in params if p.grad is None])  # every replica reduces the same tensors
        flat = self.grad_buffer
        grads = None
        if flat is None or any(p.grad._base is not flat for p in params):
            # no flat buffer (mixed dtypes) or a .grad replaced by another tensor: reduce a copy
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
        issued_at = time.perf_counter()
        return GradientSync(self.stage_id, dist.all_reduce(flat, group=group, async_op=True), flat, grads, issued_at)
