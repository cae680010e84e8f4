"""A run's result as frozen records, and the one place they become JSON (docs/design.md, "The runtime").

Rank 0 of every job builds a :class:`RunResult` (:func:`finish_job` for
graphpipe's executor and the ``torch.distributed.pipelining`` baseline,
:meth:`graphpipe.runtime.async_run.StreamEngine.finish` for the asynchronous
stream): the measured figures (:class:`Measured`), the losses, the
per-action records, and ``--check``'s verdict (:class:`CheckResult`, or
:class:`ReplayCheck` for the asynchronous schedules). The launcher hands
it back from :func:`graphpipe.runtime.run_plans`;
:func:`graphpipe.runtime.measure.summarize` turns it, with the plan's
prediction, into a :class:`RunSummary`, what :func:`graphpipe.runtime.run_plan`
returns and ``graphpipe run --json`` prints.

Every record has ``to_dict()`` and ``from_dict()``, the JSON layout
``graphpipe run --json`` has always had: a field's JSON key is its name
(``async`` for :attr:`RunResult.async_run`), keys in field order, an
optional field (one with a default) left out while it is ``None``,
sequences as lists. Readers use attributes; an optional figure a run did
not produce is ``None``.

Example
-------
>>> m = Measured(iteration_time_s=0.5, throughput=16.0, step_times_s=[0.5], warmup_steps=1)
>>> m.step_times_s, m.peak_rss_bytes
((0.5,), None)
>>> m.to_dict()
{'iteration_time_s': 0.5, 'throughput': 16.0, 'step_times_s': [0.5], 'warmup_steps': 1}
>>> Measured.from_dict(m.to_dict()) == m
True
"""

from __future__ import annotations

import os
import socket
import statistics
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

from graphpipe.errors import InputError

if TYPE_CHECKING:
    from graphpipe.plan import Plan
    from graphpipe.runtime.options import RunOptions
    from graphpipe.runtime.reference import Reference

__all__ = ["StepReport", "CheckTally", "Measured", "Fp64Spread", "FullBatch", "CheckResult", "ReplayCheck", "AsyncRun", "RunResult",
           "PlanInfo", "Predicted", "RunDevices", "RunSummary", "load_check", "finish_job"]

R = TypeVar("R", bound="_Record")

FULL_BATCH_NOTE = ("full-batch training (BatchNorm over the whole mini-batch, one dropout draw per op): reported, "
                   "not asserted")


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one rank measured in one step (an engine's :meth:`Engine.step`)."""

    iteration_time_s: float
    """This rank's time from the shared start until its last action and all-reduce finished."""
    loss: float
    """This rank's share of the mini-batch loss (its sink micro-batches; 0 on a rank without the sink)."""
    t0: float = 0.0
    """This rank's ``time.perf_counter()`` at the shared start (the records are relative to it)."""
    records: tuple[Any, ...] = ()
    """The step's per-action records (:class:`~graphpipe.runtime.executor.TimedAction`), times relative to ``t0``
    (they become JSON in
    :func:`finish_job` only)."""
    peak_saved_bytes: int = 0
    """Peak bytes autograd saved for backward during the step (the saved-tensor meter; 0 when not metered)."""
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step on a CUDA rank; None on a CPU."""


@dataclass(frozen=True, slots=True)
class CheckTally:
    """One rank's running ``--check`` comparison: summed over steps and ranks with ``+``."""

    max_abs_diff: float = 0.0
    """Largest ``|a - b|`` of any element compared."""
    num_mismatches: int = 0
    """Elements outside ``atol + rtol |b|`` (widened by the reference's fp64 spread)."""
    num_params: int = 0
    """Parameters this rank counted (each parameter is counted by one rank, once)."""
    num_buffers: int = 0
    """Buffers this rank counted."""

    def __add__(self, other: "CheckTally") -> "CheckTally":
        return CheckTally(max(self.max_abs_diff, other.max_abs_diff), self.num_mismatches + other.num_mismatches,
                          self.num_params + other.num_params, self.num_buffers + other.num_buffers)

    @classmethod
    def of_params(cls, compared: tuple[float, int, int]) -> "CheckTally":
        """From :func:`~graphpipe.runtime.reference.compare_gradients`'s ``(max, mismatches, counted)``."""
        return cls(float(compared[0]), int(compared[1]), int(compared[2]))

    @classmethod
    def of_buffers(cls, compared: tuple[float, int, int]) -> "CheckTally":
        """From :func:`~graphpipe.runtime.reference.compare_buffers`'s ``(max, mismatches, counted)``."""
        return cls(float(compared[0]), int(compared[1]), 0, int(compared[2]))



def _frozen(value: Any) -> Any:
    """Lists (and tuples) as tuples, all the way down; dicts keep their keys."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _plain(value: Any) -> Any:
    """JSON-ready: records as dicts, tuples as lists."""
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _nested(load: Callable[[Any], Any], key: str | None = None, default: Any = None) -> Any:
    """An optional field read from JSON by ``load`` (a nested record), under ``key`` if not its name."""
    metadata = {"load": load, **({"key": key} if key else {})}
    return field(default=default, metadata=metadata)


class _Record:
    """What every record shares: sequences frozen to tuples, and the JSON pair."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (list, tuple, dict)):
                object.__setattr__(self, f.name, _frozen(value))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: keys in field order; an optional field that is ``None`` is left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("skip") or (value is None and _optional(f)):
                continue
            out[f.metadata.get("key", f.name)] = _plain(value)
        return out

    @classmethod
    def from_dict(cls: type[R], doc: Mapping[str, Any]) -> R:
        """The record :meth:`to_dict` wrote; a missing optional key is ``None``, an unknown key an error."""
        if not isinstance(doc, Mapping):
            raise InputError(f"{cls.__name__}: expected a JSON object, got {type(doc).__name__}")
        known = {f.metadata.get("key", f.name): f for f in fields(cls) if not f.metadata.get("skip")}
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise InputError(f"{cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))}; expected some of "
                             f"{', '.join(known)}")
        missing = [key for key, f in known.items() if key not in doc and not _optional(f)]
        if missing:
            raise InputError(f"{cls.__name__}: the object has no {', '.join(map(repr, missing))}")
        values = {}
        for key, f in known.items():
            if key in doc:
                load = f.metadata.get("load")
                values[f.name] = load(doc[key]) if load is not None and doc[key] is not None else doc[key]
        return cls(**values)


def _optional(f) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured(_Record):
    """What a run measured: iteration time (median over the timed steps) and, per run kind, memory and streams."""

    iteration_time_s: float
    throughput: float
    """Samples per second: the mini-batch over the iteration time."""
    step_times_s: tuple[float, ...]
    """Every timed step's time (max over ranks), after the warm-up steps."""
    warmup_steps: int
    timeline_step: int | None = None
    """The step whose per-action records are the measured timeline (the one closest to the median)."""
    stream_time_s: float | None = None
    """Asynchronous schedules: the whole stream of mini-batches, first start to last end."""
    stream_throughput: float | None = None
    stashed_weight_bytes: tuple[float, ...] | None = None
    """Asynchronous schedules, per device: peak bytes of stashed weight versions."""
    stashed_weight_bytes_predicted: tuple[float, ...] | None = None
    iteration: str | None = None
    """How the asynchronous stream's iteration time is read off it."""
    peak_activation_bytes: tuple[float, ...] | None = None
    """Per device: peak bytes autograd saved for backward (with the saved-tensor meter on)."""
    peak_rss_bytes: tuple[float, ...] | None = None
    """Per rank: the process's peak resident set size."""
    cuda_max_memory_allocated_bytes: tuple[float, ...] | None = None
    """Per device under NCCL: the CUDA allocator's peak."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp64Spread(_Record):
    """How far the fp32 reference was from its float64 run: the tolerance ``--check`` added on top."""

    factor: float
    loss: float
    max_grad: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FullBatch(_Record):
    """The same model trained on the whole mini-batch at once, beside the reference: reported, never asserted."""

    loss: float
    loss_abs_diff: float
    max_grad_abs_diff: float
    note: str = FULL_BATCH_NOTE


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult(_Record):
    """``--check``'s verdict on a flushing schedule: loss, every gradient and buffer against one process.

    The torch baseline compares step 0 only and leaves the per-step and
    buffer fields ``None``.
    """

    passed: bool
    max_abs_diff: float
    loss: float
    reference_loss: float
    loss_abs_diff: float
    steps_checked: int | None = None
    losses_checked: tuple[float, ...] | None = None
    reference_losses: tuple[float, ...] | None = None
    num_params_checked: int
    num_params: int
    num_buffers_checked: int | None = None
    num_buffers: int | None = None
    num_mismatches: int
    rtol: float
    atol: float
    batchnorm: str | None = None
    inexact_ops: tuple[str, ...] | None = None
    """Ops whose input had no batch dimension: their dropout or BatchNorm cannot be cut per micro-batch."""
    fp64_spread: Fp64Spread | None = _nested(Fp64Spread.from_dict)
    full_batch: FullBatch | None = _nested(FullBatch.from_dict)
    unseeded_ops: dict[str, str] | None = None
    """Ops drawing from the global random generator (op -> what), which ``--check`` cannot replay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayCheck(_Record):
    """``--check``'s verdict on an asynchronous schedule: every micro-batch's loss and the final weights against a
    single-process replay of the version schedule."""

    passed: bool
    max_abs_diff: float
    num_mismatches: int
    num_params_checked: int
    num_params: int
    losses_checked: int
    """How many micro-batch losses were compared."""
    what: str
    reference: str
    loss: float
    reference_loss: float
    rtol: float
    atol: float


def load_check(doc: Mapping[str, Any]) -> CheckResult | ReplayCheck:
    """The check record of a ``check`` object (:class:`ReplayCheck` has a ``what``)."""
    return ReplayCheck.from_dict(doc) if "what" in doc else CheckResult.from_dict(doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncRun(_Record):
    """An asynchronous schedule's spec (:class:`~graphpipe.sched.async_pipe.AsyncSpec`) and its stashed versions."""

    schedule: str
    vertical_sync: bool
    update_every: int
    stash: bool
    stashed_versions: tuple[tuple[int, ...], ...]
    """Per stage, per replica: the most weight versions it kept at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult(_Record):
    """Rank 0's result of one job (one plan run for some steps)."""

    measured: Measured = field(metadata={"load": Measured.from_dict})
    losses: tuple[float, ...]
    """The mini-batch loss of every step (of the resumed steps only, after a resume)."""
    records: tuple[dict[str, Any], ...]
    """The measured timeline's step: one ``TimedAction`` (as a dict) per action and all-reduce, every rank."""
    backend: str
    rank_cpus: tuple[tuple[int, ...], ...] | None = None
    """Per rank: the CPUs it may run on."""
    baseline: str | None = None
    """The torch baseline: the torch schedule class that ran the plan."""
    async_run: AsyncRun | None = _nested(AsyncRun.from_dict, key="async")
    check: CheckResult | ReplayCheck | None = _nested(load_check)
    precision: str | None = None
    resumed_from_step: int | None = None
    restarts: int | None = None
    """With ``resumed_from_step``: how many times every rank was started again."""
    check_skipped: str | None = None
    """Why ``--check`` did not run (its references would not fit in host memory)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInfo(_Record):
    """What plan ran."""

    model: str
    strategy: str
    schedule: str
    num_devices: int
    batch_size: int
    num_stages: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Predicted(_Record):
    """The plan's predicted figures a run is compared with (the simulator's, per device where a list)."""

    iteration_time_s: float | None = None
    throughput: float | None = None
    bubble_fraction: tuple[float, ...] | None = None
    peak_memory_bytes: tuple[float, ...] | None = None
    peak_activation_bytes: tuple[float, ...] | None = None
    stashed_weight_bytes: tuple[float, ...] | None = None
    host_memory_bytes: tuple[float, ...] | None = None
    """Per rank: the host memory the launcher expected it to hold (:mod:`graphpipe.runtime.memory`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDevices(_Record):
    """The device the plan was made for, and the one the run ran on."""

    planned: str
    run: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary(_Record):
    """A run beside its plan's prediction: what :func:`graphpipe.runtime.run_plan` returns and ``--json`` prints."""

    plan: PlanInfo = field(metadata={"load": PlanInfo.from_dict})
    measured: Measured = field(metadata={"load": Measured.from_dict})
    predicted: Predicted = field(metadata={"load": Predicted.from_dict})
    losses: tuple[float, ...]
    backend: str | None
    precision: str
    plan_precision: str | None
    """The precision the plan's costs were made at (``None``: not recorded)."""
    rank_cpus: tuple[tuple[int, ...], ...] | None = None
    prediction_error: float | None = None
    """``|predicted - measured| / measured`` of the iteration time."""
    memory_error: float | None = None
    """Worst relative error of measured activation bytes against predicted (:func:`~graphpipe.runtime.measure.memory_error`)."""
    check: CheckResult | ReplayCheck | None = _nested(load_check)
    resumed_from_step: int | None = None
    restarts: int | None = None
    async_run: AsyncRun | None = _nested(AsyncRun.from_dict, key="async")
    baseline: str | None = None
    check_skipped: str | None = None
    devices: RunDevices | None = _nested(RunDevices.from_dict)
    timeline: Any = field(default=None, compare=False, repr=False, metadata={"skip": True})
    """The measured :class:`~graphpipe.sched.Timeline` (``None`` without records); not part of the JSON."""


def finish_job(rank: int, world_size: int, plan: Plan, options: RunOptions, reports: Sequence[StepReport],
               tally: CheckTally, reference: Reference | None, *, backend: str, baseline: str | None = None,
               control=None) -> RunResult | None:
    """Combine every rank's figures on rank 0 into its :class:`RunResult` (collective: every rank calls it).

    ``reports``: this rank's :class:`~graphpipe.runtime.driver.StepReport`
    of every step run. Records are relative to each rank's own start after
    the barrier. On one host ``time.perf_counter`` is one monotonic clock
    shared by all processes, so rank 0 shifts every rank's records to the
    earliest start: the measured timeline is then causally exact (a
    consumer's F never starts before its producer's F ended). Across hosts
    each rank's barrier exit stays its zero. ``tally``: this rank's
    ``--check`` comparison. ``reference``: ``--check``'s
    :class:`~graphpipe.runtime.reference.Reference` (``None`` on ranks that
    computed none); the torch ``baseline``'s is one plain PyTorch step
    (:func:`~graphpipe.runtime.reference.reference_step`), checked on step 0.
    """
    import torch
    import torch.distributed as dist

    sg = plan.stage_graph
    times = torch.tensor([r.iteration_time_s for r in reports], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=control)
    losses = torch.tensor([r.loss for r in reports], dtype=torch.float64)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=control)
    max_abs = torch.tensor([tally.max_abs_diff], dtype=torch.float64)
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=control)
    counts = torch.tensor([tally.num_mismatches, tally.num_params, tally.num_buffers], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=control)
    total = CheckTally(float(max_abs[0]), int(counts[0]), int(counts[1]), int(counts[2]))
    measured_idx = list(range(options.warmup_steps, options.steps))
    step_list = [float(times[i]) for i in measured_idx]
    med = statistics.median(step_list)
    shown = min(measured_idx, key=lambda i: (abs(float(times[i]) - med), i))
    gathered = [None] * world_size if rank == 0 else None
    mine = (socket.gethostname(), reports[shown].t0, [asdict(r) for r in reports[shown].records],
            sorted(os.sched_getaffinity(0)))
    dist.gather_object(mine, gathered, dst=0, group=control)
    if rank != 0:
        return None
    if len({host for host, _, _, _ in gathered}) == 1:
        origin = min(t0 for _, t0, _, _ in gathered)
        gathered = [(host, t0, [_shift(r, t0 - origin) for r in recs], cpus) for host, t0, recs, cpus in gathered]
    loss_list = [float(x) for x in losses]
    check = None
    if options.check and baseline is not None:
        check = _baseline_check(plan, options, loss_list, reference, total)
    elif options.check:
        check = _check_summary(plan, options, loss_list, reference, total)
    return RunResult(
        measured=Measured(iteration_time_s=med, throughput=sg.batch_size / med, step_times_s=step_list,
                          warmup_steps=options.warmup_steps, timeline_step=shown),
        losses=loss_list, records=[r for _, _, recs, _ in gathered for r in recs], backend=backend,
        rank_cpus=[cpus for _, _, _, cpus in gathered], baseline=baseline, check=check)


def _baseline_check(plan: Plan, options: RunOptions, losses: list[float], reference: Reference | None,
                    total: CheckTally) -> CheckResult:
    """The torch baseline's verdict: step 0's loss and every gradient against one plain PyTorch step."""
    from graphpipe.runtime.reference import reference_step
    from graphpipe.runtime.runnable import data_seed, plan_granularity

    sg = plan.stage_graph
    if reference is None:
        reference = reference_step(plan.model, options.seed, sg.batch_size, data_seed(options.seed, 0), "cpu",
                                   plan_granularity(plan), meta_params=True)  # the baseline's weights
    ref_loss = reference.losses[0]
    loss_diff = abs(losses[0] - ref_loss)
    total_params = reference.num_params  # every parameter the forward uses must have been compared once
    passed = (total.num_mismatches == 0 and loss_diff <= options.atol + options.rtol * abs(ref_loss)
              and total.num_params == total_params)
    return CheckResult(passed=bool(passed), max_abs_diff=max(total.max_abs_diff, loss_diff), loss=losses[0],
                       reference_loss=ref_loss, loss_abs_diff=loss_diff, num_params_checked=total.num_params,
                       num_params=total_params, num_mismatches=total.num_mismatches, rtol=options.rtol,
                       atol=options.atol)


def _check_summary(plan: Plan, options: RunOptions, losses: list[float], reference: Reference,
                   total: CheckTally) -> CheckResult:
    """Rank 0's verdict over every step: losses, gradients and buffers; plus the full-batch comparison (reported)."""
    import torch

    from graphpipe.runtime.numerics import SPREAD_FACTOR, allowed
    from graphpipe.runtime.reference import reference_run
    from graphpipe.runtime.runnable import plan_granularity

    steps = len(reference.losses)
    loss_diffs = [abs(losses[k] - reference.losses[k]) for k in range(steps)]
    loss_spread = reference.loss_spread or (0.0,) * steps
    losses_ok = all(d <= float(allowed(torch.tensor(r), options.atol, options.rtol, w))
                    for d, r, w in zip(loss_diffs, reference.losses, loss_spread))
    num_buffers = len(reference.buffers[0]) if reference.buffers else 0
    passed = (total.num_mismatches == 0 and losses_ok and total.num_params == reference.num_params
              and total.num_buffers == num_buffers)
    fp64 = None
    if reference.grad_spread:  # the tolerance each value got on top of atol + rtol |b|
        fp64 = Fp64Spread(factor=SPREAD_FACTOR, loss=max(loss_spread),
                          max_grad=max((w for step in reference.grad_spread for w in step.values()), default=0.0))
    full = reference_run(plan.model, options.seed, plan.stage_graph.batch_size, {}, 1, options.lr,
                         granularity=plan_granularity(plan), meta_params=reference.meta_params)
    full_batch = FullBatch(
        loss=full.losses[0], loss_abs_diff=abs(full.losses[0] - reference.losses[0]),
        max_grad_abs_diff=max((float((g - reference.grads[0][n]).abs().max()) for n, g in full.grads[0].items()
                               if n in reference.grads[0] and g.numel()), default=0.0))
    return CheckResult(
        passed=bool(passed), max_abs_diff=max([total.max_abs_diff, *loss_diffs]), loss=losses[0],
        reference_loss=reference.losses[0], loss_abs_diff=loss_diffs[0], steps_checked=steps,
        losses_checked=losses[:steps], reference_losses=reference.losses, num_params_checked=total.num_params,
        num_params=reference.num_params, num_buffers_checked=total.num_buffers, num_buffers=num_buffers,
        num_mismatches=total.num_mismatches, rtol=options.rtol, atol=options.atol, batchnorm=options.batchnorm_for(plan),
        inexact_ops=reference.unbatched or None, fp64_spread=fp64, full_batch=full_batch)


def _shift(record: dict, offset: float) -> dict:
    return {**record, "ready": record["ready"] + offset, "start": record["start"] + offset, "end": record["end"] + offset}
