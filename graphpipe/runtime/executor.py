"""Interpret one rank's action list for one training iteration (docs/design.md, "The runtime").

The executor turns the rank's part of the schedule into typed actions once
(:class:`~graphpipe.runtime.hosted.Forward`,
:class:`~graphpipe.runtime.hosted.Backward` — B, or zero bubble's I with
``input_only`` — and :class:`~graphpipe.runtime.hosted.WeightGrad`), each
holding what the plan fixes for it (its stage, rows, messages, loss scale),
and dispatches them on their type to the
:class:`~graphpipe.runtime.hosted.HostedStage` that computes them, with
their own sends and receives (:mod:`graphpipe.runtime.hosted` describes F,
B, I and W).

After the last ``B`` (or ``W``) of a data-parallel stage its replicas sum
the stage's gradients asynchronously
(:meth:`~graphpipe.runtime.hosted.HostedStage.sync_gradients`), in a fixed
per-device-set order, so the all-reduce overlaps the rest of the schedule
as in the simulator. At the end of the iteration, in one fixed order on
every rank (so collectives of overlapping groups cannot cross): the
replicas' gradient all-reduces complete; every BatchNorm commits its
deferred running statistics
(:meth:`~graphpipe.runtime.batchnorm.ShardedBatchNorm.commit`); the copies
of every tied parameter get the sum of their gradients (:class:`TiedSync`).

Every action is timed (``time.perf_counter``; CUDA is synchronised first
when measuring), relative to a start shared through a barrier by the
caller; its messages are posted right after its compute ends.

Test hook (documented in :mod:`graphpipe.runtime`): ``fault`` (a
:class:`~graphpipe.runtime.options.FaultInjection` for rank ``r`` at ``F`` or
``B``) makes rank ``r`` raise at its first action of that kind; at ``hang``
it stops answering at its first F instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from graphpipe.actions import Action
from graphpipe.runtime.comm import Mailbox
from graphpipe.runtime.hosted import (Backward, Forward, GradientSync, HostedStage, StageAction, StageServices,
                                      WeightGrad, flat_grad_buffer, zero_grads)
from graphpipe.runtime.intra_stage import replica_lead, replica_ranks
from graphpipe.runtime.measure import NoMeter, SavedBytesMeter
from graphpipe.runtime.routing import Routing, shard_size
from graphpipe.runtime.stage_modules import StageProgram, ValueMeta
from graphpipe.stages import StageGraph

__all__ = ["TimedAction", "StepResult", "ExecutorContext", "RankExecutor", "InjectedFailure", "TiedSync", "zero_grads", "flat_grad_buffer"]


class InjectedFailure(RuntimeError):
    """Raised by the fault-injection test hook (:class:`~graphpipe.runtime.options.FaultInjection`)."""


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One executed action or all-reduce on one rank; times in seconds from the iteration start."""

    rank: int
    stage_id: int
    kind: str
    """F, B, I, W (zero bubble's split backward), or AR (gradient all-reduce of the stage's replicas)."""
    mb_id: int
    ready: float
    """When every input had arrived (F/B) or the all-reduce was issued (AR)."""
    start: float
    end: float


class LossTerms:
    """One iteration's loss terms on this rank (its sink micro-batches), kept on the device until read.

    Reading a loss on the host waits for the device to finish the step; a
    plain PyTorch loop does not wait unless its user reads ``loss.item()``.
    So the iteration ends without a read: :meth:`tensor` sums the terms on
    the device (no wait), :meth:`by_micro_batch` and :meth:`total` copy them
    to the host once, when first asked.
    """

    __slots__ = ("_mb_ids", "_values", "_device", "_host")

    def __init__(self, terms: list[tuple[int, torch.Tensor]], device: torch.device) -> None:
        self._mb_ids = [mb for mb, _ in terms]
        self._values = torch.stack([t for _, t in terms]) if terms else None
        self._device = device
        self._host: dict[int, float] | None = None

    def tensor(self) -> torch.Tensor:
        """The sum of the terms as a 0-dim float64 tensor on the device (zero when this rank has none)."""
        if self._values is None:
            return torch.zeros((), dtype=torch.float64, device=self._device)
        return self._values.to(torch.float64).sum()

    def by_micro_batch(self) -> dict[int, float]:
        """Micro-batch -> this rank's loss term (one device-to-host copy, on the first call)."""
        if self._host is None:
            self._host = {}
            if self._values is not None:
                for mb_id, value in zip(self._mb_ids, self._values.tolist()):
                    self._host[mb_id] = self._host.get(mb_id, 0.0) + value
        return self._host

    def total(self) -> float:
        return sum(self.by_micro_batch().values())


@dataclass(slots=True)
class StepResult:
    iteration_time_s: float
    """This rank's time from the shared start until its last action and all-reduce finished."""
    terms: LossTerms
    """This rank's loss terms, on the device (:attr:`loss` reads them)."""
    records: list[TimedAction] = field(default_factory=list)
    t0: float = 0.0
    """This rank's ``time.perf_counter()`` at the shared start (records are relative to it)."""
    peak_saved_bytes: int = 0
    """Peak bytes of tensors saved for backward on this rank during the iteration (:class:`SavedBytesMeter`)."""
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the iteration on a CUDA rank; None on CPU."""

    @property
    def loss(self) -> float:
        """This rank's share of the mini-batch loss (sum over its sink micro-batches); waits for the device."""
        return self.terms.total()


@dataclass(frozen=True, slots=True)
class TiedSync:
    """One tied parameter as this rank sees it: the copies it hosts and the group of every owning rank.

    ``copies``: ``(stage, parameter name in the stage's module)`` on this
    rank; ``group``: the ranks of every stage owning a copy (None when that
    is this rank alone).
    """

    name: str
    copies: tuple[tuple[int, str], ...]
    group: object | None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ExecutorContext:
    """Everything a :class:`RankExecutor` needs, built once per rank by :func:`~graphpipe.runtime.setup.setup_rank`."""

    rank: int
    stage_graph: StageGraph
    """The plan's stage graph (for an asynchronous stream: the stream's, ``K`` mini-batches long)."""
    actions: tuple[Action, ...]
    """This rank's actions of one iteration, in order."""
    programs: Mapping[int, StageProgram]
    """Stage id -> the program of every stage this rank hosts."""
    routing: Routing
    meta: Mapping[str, ValueMeta]
    """Boundary value -> its per-sample shape, dtype and whether a gradient flows back through it."""
    loss_fn: Callable[[Any], torch.Tensor]
    device: torch.device
    timeout_s: float
    """Longest wait for a message or a collective before the rank fails, naming what it waited for."""
    link_groups: Mapping[tuple[int, int], object] = field(default_factory=dict)
    """A process group per directed rank pair under NCCL (:func:`~graphpipe.runtime.comm.make_link_groups`)."""
    dp_groups: Mapping[tuple[int, ...], object] = field(default_factory=dict)
    """The replicas' group of every replicated stage this rank hosts, by device tuple."""
    allreduce_order: Mapping[tuple[int, ...], Sequence[int]] = field(default_factory=dict)
    """Per device tuple, the order its stages' gradient all-reduces are issued in (the same on every replica)."""
    tied: tuple[TiedSync, ...] = ()
    seed: int = 0
    batchnorm: str = "per-micro-batch"
    fault: Any = None
    """Test hook (:class:`~graphpipe.runtime.options.FaultInjection`); None in real runs."""
    loss_batch_size: int | None = None
    """The mini-batch every loss term is scaled by (None: the stage graph's batch; an asynchronous stream's is
    the plan's mini-batch, not the stream's rows)."""
    measure: bool = True
    """Time every action (synchronising the device first) and meter saved activations; off in the training API."""
    compile: bool = False
    """Run every hosted stage's forward (and so its backward) compiled by ``torch.compile``."""


class RankExecutor:
    """Runs ``ctx.actions`` (this rank's part of the schedule) with the stage programs hosted on this rank."""

    def __init__(self, ctx: ExecutorContext):
        self.ctx = ctx
        self.rank = ctx.rank
        self.sg = sg = ctx.stage_graph
        self.actions = tuple(ctx.actions)
        self.programs = dict(ctx.programs)
        # one object per hosted stage: module, parameters and gradient buffer, BatchNorms, forward, what its
        # re-materialization and split backward keep per micro-batch (runtime/hosted.py)
        self.hosted = {s: HostedStage.of(sg.stages[s], prog, compile=ctx.compile)
                       for s, prog in sorted(self.programs.items())}
        self.routing = routing = ctx.routing
        self.meta = dict(ctx.meta)
        self.loss_fn = ctx.loss_fn
        self.device = ctx.device
        self.timeout = timedelta(seconds=ctx.timeout_s)
        # Receives are posted an action ahead on CUDA only when actions are not timed: a measuring run synchronises
        # the whole device after each action, which would wait for a posted receive whose sender waits for us.
        self.mailbox = Mailbox(self.rank, routing, self._buffer_spec, self.device, ctx.timeout_s, ctx.link_groups,
                               post_early=self.device.type == "cuda" and not ctx.measure,
                               sized_ahead=lambda key: self.meta[key[7]].sized_by_data)
        self.dp_groups = dict(ctx.dp_groups)
        self.allreduce_order = {k: tuple(v) for k, v in ctx.allreduce_order.items()}
        last_b: dict[int, int] = {}
        for pos, a in enumerate(self.actions):
            if a.kind in ("B", "W"):
                last_b[a.stage_id] = pos
        self._last_b_pos = {pos: s for s, pos in last_b.items()}
        self._edge_values = routing.edge_values
        # Persistent gradient storage, one flat buffer per stage (see zero_grad), where replicas all-reduce it or
        # the run is timed against a profile that accumulated into one; otherwise (the training API on a stage
        # of one replica) autograd creates each step's gradients, as a plain loop's first backward does.
        for s, h in self.hosted.items():
            if ctx.measure or sg.stages[s].num_replicas > 1:
                h.bind_grad_buffers()
            else:
                h.leave_grads_to_autograd()
        self._autograd_grads = tuple(h for h in self.hosted.values() if not h.persistent_grads)
        self.seed = ctx.seed
        self.step = 0
        self.batchnorm = ctx.batchnorm
        self.tied = tuple(ctx.tied)
        # parameters and buffers are model state, not activations (capture excludes both too). Training through
        # the API measures nothing: no saved-tensor hooks, no device synchronisation per action.
        self.measure = ctx.measure
        self.saved_meter = SavedBytesMeter(t for prog in self.programs.values()
                                           for t in (*prog.module.parameters(), *prog.module.buffers())) \
            if ctx.measure else NoMeter()
        # what the hosted stages share while they compute: messages, values' metadata, loss, meter, step
        self.services = StageServices(self.mailbox, self.meta, self.loss_fn, self.device, ctx.measure,
                                      self.saved_meter, seed=ctx.seed)
        for h in self.hosted.values():
            h.services = self.services
        fault = ctx.fault
        self._fail_at = fault.at if fault is not None and fault.rank == self.rank else None
        self._fault_text = fault.describe() if fault is not None else ""
        # Asynchronous schedules: the stream's loss terms are scaled by the mini-batch, not by the stream's rows.
        self.loss_batch_size = ctx.loss_batch_size or sg.batch_size
        self._last_terms = LossTerms([], self.device)
        self.ops: tuple[StageAction, ...] = self._typed_actions()
        """The rank's actions, typed, in order: what :meth:`run_iteration` dispatches."""
        self.planned_meta = dict(self.meta)
        """Boundary values' metadata at the capture's sizes; :meth:`prepare_step` evaluates it at a step's."""
        self._by_rows: dict[int, tuple[Routing, tuple[StageAction, ...]]] = {sg.batch_size: (routing, self.ops)}
        self._shape_key: tuple | None = None
        self.intra_stage = None
        """The FSDP and tensor-parallel stages hosted here (:class:`~graphpipe.runtime.intra_stage.IntraStage`,
        set by :func:`~graphpipe.runtime.setup.setup_rank`)."""

    @property
    def sink_losses(self) -> dict[int, float]:
        """Micro-batch -> this rank's loss term in the last iteration (sink stages); waits for the device."""
        return self._last_terms.by_micro_batch()

    def _typed_actions(self) -> tuple[StageAction, ...]:
        plans = {a: self._plan(a) for a in dict.fromkeys(self.actions)}
        return tuple(plans[a] for a in self.actions)

    def prepare_step(self, rows: int, bindings: Mapping[str, int] | None = None) -> None:
        """Size the next iteration for a mini-batch of ``rows`` rows and the symbols' sizes ``bindings``
        (:class:`~graphpipe.frontend.shapes.StepShape`): every value crossing a cut takes its shape at those
        sizes, and a partial batch (fewer rows than planned) keeps every micro-batch with proportionally fewer
        rows (:meth:`~graphpipe.runtime.routing.Routing.row`). Every rank derives the same from the same
        inputs, so no message says how big the next one is. The plan's sizes cost nothing after the first
        call; another size is worked out once and kept."""
        key = (rows, tuple(sorted((bindings or {}).items())))
        if key == self._shape_key:
            return
        if rows not in self._by_rows:
            routing = self.routing.at_rows(rows)
            self.routing, self._edge_values = routing, routing.edge_values
            self._by_rows[rows] = (routing, self._typed_actions())
        self.routing, self.ops = self._by_rows[rows]
        self.mailbox.routing = self.routing
        self.meta.clear()  # in place: the hosted stages' services hold this dictionary
        self.meta.update({v: m.at(bindings or {}) for v, m in self.planned_meta.items()})
        self._shape_key = key

    # ------------------------------------------------------------ helpers
    def _buffer_spec(self, key) -> tuple[tuple[int, ...], torch.dtype]:
        m = self.meta[key[7]]
        return m.shape(self.routing.rows[key]), m.dtype

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for h in self.hosted.values() for p in h.parameters()]

    def _plan(self, a: Action) -> StageAction:
        """Action ``a`` as a typed action with what the plan fixes for it (the routing and the stage graph are
        fixed once built): its rows, the messages it consumes and sends, its loss scale."""
        sg, routing, stage = self.sg, self.routing, self.sg.stages[a.stage_id]
        hosted = self.hosted[a.stage_id]
        if a.kind == "W":
            return WeightGrad(a, hosted)
        if a.kind not in ("F", "B", "I"):
            raise RuntimeError(f"rank {self.rank}: action {a} has kind {a.kind!r}; the runtime runs F, B, I, W")
        q = routing.replica(a.stage_id, self.rank)
        lead = replica_lead(stage, q) == self.rank  # a TP group's messages leave from its first rank only
        receives, sends = [], []
        if a.kind == "F":
            rows = self._shard_rows(a.stage_id, a.mb_id, q)
            for piece in routing.incoming(a.stage_id, a.mb_id, q):
                src = replica_lead(sg.stages[piece.producer], piece.producer_replica)
                receives += [(piece, v, src, Routing.key("F", piece, v))
                             for v in self._edge_values[(piece.producer, piece.consumer)]]
            for piece in routing.outgoing(a.stage_id, a.mb_id, q) if lead else ():
                sends += [(dst, Routing.key("F", piece, v), v, piece.producer_rows if self.meta[v].batched else None,
                           False) for v in self._edge_values[(piece.producer, piece.consumer)]
                          for dst in replica_ranks(sg.stages[piece.consumer], piece.consumer_replica)]
            mini_batch = self.loss_batch_size * routing.batch_rows / sg.batch_size  # fewer in a partial batch
            return Forward(a, hosted, rows, routing.row(a.mb_id * stage.micro_batch_size),
                           (rows.stop - rows.start) / mini_batch, tuple(receives), tuple(sends))
        for piece in routing.outgoing(a.stage_id, a.mb_id, q):
            src = replica_lead(sg.stages[piece.consumer], piece.consumer_replica)
            receives += [(piece, v, src, Routing.key("B", piece, v))
                         for v in self._edge_values[(piece.producer, piece.consumer)] if v in routing.grad_values]
        answered: set[str] = set()  # unbatched values whose gradient goes back with their first piece
        for piece in routing.incoming(a.stage_id, a.mb_id, q) if lead else ():
            for v in self._edge_values[(piece.producer, piece.consumer)]:
                if v not in routing.grad_values:
                    continue
                batched = self.meta[v].batched
                for dst in replica_ranks(sg.stages[piece.producer], piece.producer_replica):
                    sends.append((dst, Routing.key("B", piece, v), v, piece.consumer_rows if batched else None,
                                  not batched and v in answered))
                if not batched:
                    answered.add(v)
        return Backward(a, hosted, a.kind == "I", tuple(receives), tuple(sends))

    def _prefetch(self, op: StageAction) -> None:
        """Post the receives of ``op`` now (CUDA ranks: :meth:`Mailbox.prefetch`), so its messages travel while
        the action before it computes; waited for only where ``op`` consumes them."""
        if self.mailbox.post_early:
            for _, _, src, key in op.receives:
                self.mailbox.prefetch(src, key)

    @property
    def weights(self) -> dict[int, Any]:
        """Asynchronous schedules: stage -> the weight versions its F and B run on (set by the asynchronous
        worker, :mod:`graphpipe.runtime.stash`)."""
        return {s: h.weights for s, h in self.hosted.items() if h.weights is not None}

    def ensure_grads(self) -> None:
        """Rebind the persistent gradient buffers, zeroed, when something dropped a ``.grad``.

        ``optimizer.zero_grad()`` sets ``.grad = None`` by default; the next
        iteration's backwards must accumulate into the flat buffers the
        replicas all-reduce, so they come back before it (the API calls this
        at the start of every step). The buffers are reused, not reallocated.
        A stage without a persistent buffer
        (:meth:`~graphpipe.runtime.hosted.HostedStage.leave_grads_to_autograd`)
        is left alone: its first backward creates the gradients.
        """
        for h in self.hosted.values():
            if h.persistent_grads and any(p.grad is None for p in h.trainable()):
                h.bind_grad_buffers()

    def zero_grad(self) -> None:
        """Clear the gradient buffers in place, before an iteration's timed region.

        Persistent buffers, as Megatron-style runtimes keep (see
        :func:`zero_grads`), so the run pays what the profile timed. Each
        stage's gradients are views into one flat buffer
        (:func:`flat_grad_buffer`), so a replicated stage all-reduces that
        buffer as is: no flatten and unflatten copies on the iteration's tail.
        """
        for h in self.hosted.values():
            h.zero_grad()

    def _sync(self) -> None:
        """Wait for the device, so the per-action timestamps are the kernels' (only when measuring)."""
        if self.measure and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _shard_rows(self, stage_id: int, mb_id: int, replica: int) -> slice:
        stage = self.sg.stages[stage_id]
        row = self.routing.row  # the plan's rows, or a partial batch's proportionally fewer
        # this replica's share of the micro-batch: its place in the stage (split) or in its round-robin group
        # (1F1B-RR; the whole micro-batch in one-replica groups)
        per = shard_size(stage)
        lo = mb_id * stage.micro_batch_size + (replica % stage.shards_per_micro_batch) * per
        return slice(row(lo), row(lo + per))

    # ------------------------------------------------------------ actions
    def _run(self, op: StageAction, inputs: Sequence[torch.Tensor] | None, t0: float) -> tuple[float, float, float]:
        """Dispatch one typed action to the stage that computes it; ``(ready, start, end)`` from ``t0``."""
        match op:
            case Forward():
                return self._forward(op, inputs, t0)
            case Backward():
                if self._fail_at == "B":
                    raise InjectedFailure(f"injected failure at action {op.action} ({self._fault_text})")
                return op.hosted.run_backward(op, t0)
            case WeightGrad():
                return op.hosted.run_weight_grad(op, t0)
        raise TypeError(f"rank {self.rank}: {op!r} is not a typed action")

    def _forward(self, op: Forward, inputs: Sequence[torch.Tensor] | None, t0: float) -> tuple[float, float, float]:
        """F, after the fault hook's F and hang points (a hung rank's heartbeats point here)."""
        if self._fail_at is not None:
            if self._fail_at == "F":
                raise InjectedFailure(f"injected failure at action {op.action} ({self._fault_text})")
            if self._fail_at == "hang":
                while True:  # a silent rank: its peers must time out, not wait forever
                    time.sleep(3600)
        return op.hosted.run_forward(op, inputs, t0)

    # ------------------------------------------------------------ iteration
    def release_groups(self) -> list:
        """Forget every process group this executor reaches (replicas', tied parameters', links', synchronised
        BatchNorms', weight versions'); returns the distinct ones this rank belongs to.

        The end of training: a group one of these objects still held would
        keep its threads until the interpreter exits, where gloo's can abort
        the rank (:mod:`graphpipe.runtime.teardown`). The executor runs no
        iteration afterwards.
        """
        found: dict[int, object] = {}

        def keep(group) -> None:
            if isinstance(group, dist.ProcessGroup):
                found.setdefault(id(group), group)

        for group in (*self.dp_groups.values(), *self.mailbox.groups.values(), *(t.group for t in self.tied)):
            keep(group)
        for h in self.hosted.values():
            if h.weights is not None:
                keep(h.weights.group)
                h.weights.group = None
            for bn in h.batchnorms:
                keep(bn.group)
                bn.group = None
        self.dp_groups = {}
        self.tied = tuple(replace(t, group=None) for t in self.tied)
        self.mailbox.groups = {}
        self.mailbox.reset()  # posted receives and sends hold the transport of the groups they went through
        self.ctx = replace(self.ctx, link_groups={}, dp_groups={}, tied=self.tied)
        return list(found.values())

    def run_iteration(self, inputs: Sequence[torch.Tensor] | None, t0: float, step: int = 0, *,
                      wait: bool = False) -> StepResult:
        """Run every action of this rank once (step ``step``); gradients are left in ``.grad`` (all-reduced).

        Gradients accumulate over micro-batches into the buffers
        :meth:`zero_grad` cleared, as in single-device training. ``wait``:
        on a CUDA rank, end the step's time when the device has finished its
        work (a timed step, ``graphpipe run``'s); otherwise the step returns
        once the host has queued it, as a plain loop's step does.
        """
        self.step = self.services.step = step
        self.mailbox.reset()
        if inputs is not None:  # the batch on this rank's device once: micro-batches are views of it, not activations
            inputs = tuple(x.to(self.device) for x in inputs)
        self.saved_meter.reset(inputs or ())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        for h in self.hosted.values():
            h.saved.clear()
        records: list[TimedAction] = []
        loss_terms = self.services.loss_terms = []  # this iteration's, on the device
        issued: dict[tuple[int, ...], int] = {}
        done_stages: set[int] = set()
        pending: list[GradientSync] = []
        finished_at: dict[int, float] = {}
        ops = self.ops
        if self.intra_stage:  # FSDP / TP stages (runtime/intra_stage.py)
            self.intra_stage.before_iteration()
        for pos, op in enumerate(ops):
            if pos + 1 < len(ops):  # the next action's messages travel while this one computes (CUDA)
                self._prefetch(ops[pos + 1])
            ready, start, end = self._run(op, inputs, t0)
            a = op.action
            records.append(TimedAction(self.rank, a.stage_id, a.kind, a.mb_id, ready, start, end))
            if pos in self._last_b_pos:
                done_stages.add(self._last_b_pos[pos])
                if self.intra_stage:  # a sharded stage's reduce-scatter, a TP stage's replica all-reduce
                    self.intra_stage.after_last_backward(self._last_b_pos[pos])
                pending.extend(self._issue_gradient_syncs(done_stages, issued))
            # An all-reduce that finished during this action ends no later than now (best resolution
            # without a polling thread).
            finished_at.update({i: time.perf_counter() - t0 for i, sync in enumerate(pending)
                                if i not in finished_at and sync.is_completed()})
        for h in self._autograd_grads:
            h.fill_missing_grads()
        saved = [(s, mb) for s, h in self.hosted.items() for mb in h.saved]
        waiting = [(s, mb) for s, h in self.hosted.items() for mb in h.pending_w]
        if saved or waiting:
            raise RuntimeError(f"rank {self.rank}: forward without backward for {sorted(saved)[:4]}, input "
                               f"gradients without weight gradients for {sorted(waiting)[:4]}")
        for i, sync in enumerate(pending):
            sync.wait(self.mailbox.wait_work)
            self._sync()
            done = finished_at.get(i, time.perf_counter() - t0)
            issued_at = sync.issued_at - t0
            records.append(TimedAction(self.rank, sync.stage_id, "AR", 0, issued_at, issued_at, done))
        self._commit_batchnorms()
        self._sum_tied_gradients()
        self.mailbox.flush()
        self._sync()
        if wait and cuda and not self.measure:  # the step's time is the device's, not how fast the host queued it
            torch.cuda.synchronize(self.device)
        self._last_terms = LossTerms(loss_terms, self.device)  # read on the host only when asked
        self.services.loss_terms = []
        return StepResult(time.perf_counter() - t0, self._last_terms, records, t0, self.saved_meter.peak,
                          torch.cuda.max_memory_allocated(self.device) if cuda else None)

    def _commit_batchnorms(self) -> None:
        """Deferred running statistics of every BatchNorm here, stage by stage (replicas merge their shards)."""
        for stage_id in sorted(self.programs):
            stage = self.sg.stages[stage_id]
            if not self.hosted[stage_id].batchnorms:
                continue
            group = None
            if stage.num_replicas > 1 and (self.batchnorm != "sync" or stage.round_robin):
                group = self.dp_groups[stage.devices]  # replicas hold different rows' statistics: merge them
            for bn in self.hosted[stage_id].batchnorms:
                bn.commit(group, int(stage.samples_per_replica), self.sg.batch_size)

    def _sum_tied_gradients(self) -> None:
        """Every copy of a tied parameter gets the sum of all copies' gradients (each stage's counted once).

        A copy on an FSDP-sharded or tensor-parallel stage is a DTensor whose gradient is already summed over
        the stage's replicas: every device of that stage gathers it whole (a collective over the stage's own
        mesh), the stage's first device adds it to the sum, and each device keeps its own piece of the sum."""
        from graphpipe.runtime.intra_stage import as_local_like, whole_gradient

        for tie in self.tied:
            params = [self._param(s, name) for s, name in tie.copies]
            if not params[0].requires_grad:
                continue  # frozen: the copies never change
            total = None
            for (s, _), p in zip(tie.copies, params):
                grad = whole_gradient(p)  # collective on a parallel stage's mesh: every device of it calls
                if self.sg.stages[s].devices[0] != self.rank or grad is None:
                    continue  # replicas hold the same, already all-reduced gradient: count the stage once
                total = grad.clone() if total is None else total.add_(grad)
            if total is None:
                total = torch.zeros(params[0].shape, dtype=params[0].dtype, device=self.device)
            if tie.group is not None:
                self.mailbox.wait_work(dist.all_reduce(total, group=tie.group, async_op=True),
                                       f"gradient sum of tied parameter {tie.name}")
            for p in params:
                piece = as_local_like(total, p)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)

    def _param(self, stage_id: int, name: str) -> torch.nn.Parameter:
        return self.hosted[stage_id].param(name)

    def _issue_gradient_syncs(self, done_stages: set[int], issued: dict) -> list[GradientSync]:
        """Start the gradient all-reduce (:meth:`HostedStage.sync_gradients`) of every finished replicated stage
        whose turn has come, in each device set's fixed order (the same on every replica)."""
        started = []
        for devices, order in self.allreduce_order.items():
            if self.rank not in devices:
                continue
            while issued.get(devices, 0) < len(order) and order[issued.get(devices, 0)] in done_stages:
                stage_id = order[issued.get(devices, 0)]
                issued[devices] = issued.get(devices, 0) + 1
                sync = self.hosted[stage_id].sync_gradients(self.dp_groups[devices])
                if sync is not None:
                    started.append(sync)
        return started
