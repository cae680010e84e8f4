"""A real run as a :class:`graphpipe.sched.Timeline`, so traces and Gantt charts work for it.

The executor times every action on every rank (seconds from the iteration's
shared start). :func:`measured_timeline` turns those records into the
simulator's :class:`~graphpipe.sched.Timeline` through
:func:`graphpipe.sched.build_timeline`, so ``write_trace``, ``plot_gantt``
and ``plot_gantt_pair`` (simulated beside measured) take either.

An action record spans compute only: from the moment its inputs were in
(``start``) to the moment its outputs were posted (``end``); waiting for
inputs is bubble, as in the simulator. A gradient all-reduce record spans
issue to observed completion. The iteration time is the measured one
(max over ranks, all-reduces included).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from graphpipe.actions import Action
from graphpipe.plan import Plan

if TYPE_CHECKING:
    from graphpipe.runtime.results import RunResult, RunSummary

__all__ = ["measured_timeline", "summarize", "format_summary", "loss_line", "memory_error", "SavedBytesMeter"]



def is_weight_copy(tensor: Any) -> bool:
    from graphpipe.frontend.capture import is_weight_copy as rule

    return rule(tensor)

class SavedBytesMeter:
    """Live and peak bytes of the tensors autograd keeps for backward on one rank (the activations of docs/design.md, "The cost model").

    :meth:`hooks` installs ``torch.autograd.graph.saved_tensors_hooks``:
    every tensor a forward saves is counted once per storage (views of one
    activation share it) until autograd releases it -- the packed handle's
    finalizer runs when the saved variable is freed, after the node's
    backward or with its graph -- so on CPU the peak is exact. Parameters and
    buffers (model state) and the iteration's input data (resident anyway) are not
    counted: ``graphpipe.frontend.capture`` charges neither to an op's ``act_bytes``.

    A re-materializing stage runs under ``torch.utils.checkpoint``, whose
    own hooks take its saves: :meth:`hold` counts the inputs the checkpoint
    keeps (the stash), and :meth:`add` / ``add(-n)`` the working set its B
    rebuilds, measured once per stage by :meth:`probe` (the same forward
    under these hooks, outside the timed region).

    >>> import torch
    >>> meter = SavedBytesMeter(())
    >>> x = torch.ones(4, 8, requires_grad=True)
    >>> with meter.hooks():
    ...     y = (x * x).sum()           # mul saves both operands: one storage, counted once
    >>> meter.live, meter.peak
    (128, 128)
    >>> y.backward(); del y
    >>> meter.live
    0
    """

    def __init__(self, exclude: Iterable[Any]) -> None:
        self._params = frozenset(t.untyped_storage().data_ptr() for t in exclude)
        self._excluded = set(self._params)
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def reset(self, resident: Iterable[Any] = ()) -> None:
        """Start a new iteration's peak at what is live now; ``resident`` tensors (the iteration's input
        data, alive anyway) are not counted when saved."""
        self.peak = self.live
        # replaced, not accumulated: a freed input's address may hold an activation next iteration
        self._excluded = self._params | {t.untyped_storage().data_ptr() for t in resident
                                         if hasattr(t, "untyped_storage")}

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def hold(self, tensor: Any) -> Any:
        """Count ``tensor`` as saved until the returned handle is dropped (a parameter, or autocast's copy of
        one, :func:`graphpipe.frontend.capture.is_weight_copy`: not counted)."""
        if is_weight_copy(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return tensor
        if key not in self._count:
            self._count[key] = 0
            self._size[key] = storage.nbytes()
            self.add(storage.nbytes())
        self._count[key] += 1
        return _Held(tensor, self, key)

    def _release(self, key: int) -> None:
        self._count[key] -= 1
        if not self._count[key]:
            del self._count[key]
            self.live -= self._size.pop(key)

    @contextlib.contextmanager
    def hooks(self):
        import torch

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Held) else packed

        with torch.autograd.graph.saved_tensors_hooks(self.hold, unpack):
            yield self

    def probe(self, fn, *args) -> int:
        """Peak saved bytes of ``fn(*args)`` under autograd, counted apart and then discarded."""
        import torch

        probe = SavedBytesMeter(())
        probe._excluded = self._excluded
        with torch.enable_grad(), probe.hooks():
            out = fn(*args)
        del out
        return probe.peak


class NoMeter:
    """Stands in for :class:`SavedBytesMeter` where nothing is measured (training through the API): no hooks,
    nothing held, peak 0."""

    live = 0
    peak = 0

    def reset(self, resident: Iterable[Any] = ()) -> None:
        pass

    def add(self, nbytes: int) -> None:
        pass

    def hold(self, tensor: Any) -> Any:
        return tensor

    def hooks(self):
        return _NO_HOOKS  # one shared do-nothing context: entered per forward, it should cost nothing

    def probe(self, fn, *args) -> int:
        return 0


_NO_HOOKS = contextlib.nullcontext()


class _Held:
    """A saved tensor and the meter counting it; the count drops when autograd frees the saved variable."""

    __slots__ = ("tensor", "_meter", "_key", "__weakref__")

    def __init__(self, tensor: Any, meter: SavedBytesMeter, key: int) -> None:
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self) -> None:
        self._meter._release(self._key)


def measured_timeline(plan: Plan, records: Iterable[Mapping[str, Any]], iteration_time_s: float | None = None):
    """Timeline of one measured iteration from the executor's per-rank records (dicts of ``TimedAction``)."""
    from graphpipe.sched import ActionRecord, AllReduceRecord, build_timeline

    sg = plan.stage_graph
    actions, allreduces = [], []
    seen_ar = {}
    for r in records:
        if r["kind"] == "AR":
            stage = sg.stages[r["stage_id"]]
            # One record per replica; the stage's all-reduce ends when its last replica is done.
            prev = seen_ar.get(stage.id)
            start = r["start"] if prev is None else min(prev[0], r["start"])
            end = r["end"] if prev is None else max(prev[1], r["end"])
            seen_ar[stage.id] = (start, end)
        else:
            actions.append(ActionRecord(r["rank"], Action(r["stage_id"], r["kind"], r["mb_id"]), r["start"], r["end"]))
    for stage_id, (start, end) in sorted(seen_ar.items()):
        stage = sg.stages[stage_id]
        allreduces.append(AllReduceRecord(stage_id, stage.devices, start, end, sg.param_bytes(stage_id)))
    return build_timeline(sg, plan.cluster, plan.schedule.name, actions, (), allreduces, source="measured",
                          iteration_time_s=iteration_time_s)


def summarize(plan: Plan, result: RunResult) -> RunSummary:
    """A run beside its plan's prediction (what ``--json`` prints): measured and predicted figures, the check."""
    from graphpipe.runtime.results import PlanInfo, Predicted, RunSummary

    predicted = dict(plan.predicted)
    if not predicted or "peak_activation_bytes" not in predicted:  # plans from older versions lack it
        from graphpipe.sched import predicted_figures, simulate

        from graphpipe.search.tied import charge_plan

        predicted = charge_plan(predicted_figures(simulate(plan.stage_graph, plan.schedule, plan.cluster)), plan)
    measured = result.measured
    figures = {k: predicted[k] for k in ("iteration_time_s", "throughput", "bubble_fraction", "peak_memory_bytes",
                                         "peak_activation_bytes", "stashed_weight_bytes") if k in predicted}
    if measured.peak_rss_bytes:  # beside what the launcher expected each rank to hold (runtime/memory.py)
        from graphpipe.runtime.memory import rank_memory

        expected = [r.total_bytes for r in rank_memory(plan)]
        figures["host_memory_bytes"] = expected + [0.0] * (len(measured.peak_rss_bytes) - len(expected))
    prediction_error = memory = None
    if "iteration_time_s" in predicted and measured.iteration_time_s:
        prediction_error = abs(predicted["iteration_time_s"] - measured.iteration_time_s) / measured.iteration_time_s
    if measured.peak_activation_bytes and predicted.get("peak_activation_bytes"):
        memory = memory_error(measured.peak_activation_bytes, predicted["peak_activation_bytes"])
    return RunSummary(
        plan=PlanInfo(model=plan.model, strategy=plan.strategy, schedule=plan.schedule.name,
                      num_devices=plan.cluster.num_devices, batch_size=plan.batch_size,
                      num_stages=plan.stage_graph.num_stages),
        measured=measured, predicted=Predicted(**figures), losses=result.losses, backend=result.backend,
        precision=result.precision or "fp32", plan_precision=plan.search.get("precision"),
        rank_cpus=result.rank_cpus or None, prediction_error=prediction_error, memory_error=memory,
        check=result.check, resumed_from_step=result.resumed_from_step,
        restarts=(result.restarts or 0) if result.resumed_from_step is not None else None,
        async_run=result.async_run, baseline=result.baseline, check_skipped=result.check_skipped)


def memory_error(measured: Iterable[float], predicted: Iterable[float]) -> float:
    """Worst relative error of measured activation bytes against predicted, over devices with a prediction.

    >>> memory_error([90.0, 0.0], [100.0, 0.0])
    0.1
    """
    errors = [abs(m - p) / p for m, p in zip(measured, predicted) if p > 0]
    return max(errors, default=0.0)


def format_summary(summary: RunSummary) -> str:
    """The human-readable lines of a run's summary (:func:`summarize`): measured, predicted, losses, check."""
    m, p, info = summary.measured, summary.predicted, summary.plan
    lines = [f"plan: {info.model} strategy={info.strategy} schedule={info.schedule} devices={info.num_devices} "
             f"batch={info.batch_size} backend={summary.backend} precision={summary.precision}"
             + (f" baseline={summary.baseline}" if summary.baseline else ""),
             f"measured:  iteration {m.iteration_time_s * 1e3:.3f} ms  throughput {m.throughput:.1f} samples/s"
             f"  (median of {len(m.step_times_s)} steps after {m.warmup_steps} warm-up)"]
    if summary.resumed_from_step:
        lines.append(f"resumed:   from the checkpoint of step {summary.resumed_from_step}"
                     + (f" after {summary.restarts} restart(s)" if summary.restarts else ""))
    if p.iteration_time_s is not None:
        error = summary.prediction_error if summary.prediction_error is not None else float("nan")
        lines.append(f"predicted: iteration {p.iteration_time_s * 1e3:.3f} ms  throughput {p.throughput:.1f} samples/s"
                     f"  (error {error * 100:.1f}% of measured)")
    if summary.memory_error is not None:
        lines.append("activations (MB per device, measured / predicted): "
                     + " ".join(f"{a / 1e6:.3g}/{b / 1e6:.3g}" for a, b in zip(m.peak_activation_bytes,
                                                                          p.peak_activation_bytes))
                     + f"  (worst error {summary.memory_error * 100:.1f}% of predicted)")
    if m.peak_rss_bytes is not None and p.host_memory_bytes is not None:
        lines.append("host memory (MB per rank, peak RSS measured / expected): "
                     + " ".join(f"{a / 1e6:.4g}/{b / 1e6:.4g}" for a, b in zip(m.peak_rss_bytes, p.host_memory_bytes)))
    if m.stashed_weight_bytes is not None:
        pp = m.stashed_weight_bytes_predicted
        if pp is None:
            pp = [float("nan")] * len(m.stashed_weight_bytes)
        lines.append("stashed weights (bytes per device, measured / predicted for this run): "
                     + " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(m.stashed_weight_bytes, pp))
                     + f"  (steady-state iteration; whole stream {m.stream_time_s * 1e3:.3f} ms)")
    if summary.losses:
        lines.append(loss_line(summary.losses))
    if summary.check_skipped:
        lines.append(summary.check_skipped)
    if summary.check is not None:
        c = summary.check
        lines.append(f"check: {'PASSED' if c.passed else 'FAILED'}  max_abs_diff {c.max_abs_diff:.3g}  "
                     f"loss {c.loss:.6g} vs {c.reference_loss:.6g}  params {c.num_params_checked}/{c.num_params}"
                     f"  mismatches {c.num_mismatches} (rtol {c.rtol:g}, atol {c.atol:g})")
    return "\n".join(lines) + "\n"


LOSSES_SHOWN = 12
"""Most losses ``loss per step:`` lists one by one; a longer run shows its first and last few (``--json`` has all)."""


def loss_line(losses) -> str:
    """``loss per step: ...``, every loss of a short run; of a long one the first and last
    ``LOSSES_SHOWN // 2``, the count, and the mean of the last tenth, so 27,000 steps stay one short line.

    >>> loss_line([0.5, 0.25])
    'loss per step: 0.5 0.25'
    >>> loss_line([float(k) for k in range(100, 0, -1)])
    'loss per step: 100 99 98 97 96 95 ... 6 5 4 3 2 1 (100 steps; mean of the last 10 5.5; --json lists all)'
    """
    losses = list(losses)
    if len(losses) <= LOSSES_SHOWN:
        return "loss per step: " + " ".join(f"{x:.6g}" for x in losses)
    half = LOSSES_SHOWN // 2
    tail = losses[-max(1, len(losses) // 10):]
    return ("loss per step: " + " ".join(f"{x:.6g}" for x in losses[:half]) + " ... "
            + " ".join(f"{x:.6g}" for x in losses[-half:])
            + f" ({len(losses)} steps; mean of the last {len(tail)} {sum(tail) / len(tail):.6g}; --json lists all)")
