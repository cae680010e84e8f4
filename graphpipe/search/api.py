"""Planning from Python: ``graphpipe.plan(model, devices=N, batch_size=B) -> Plan`` (docs/api.md).

What ``graphpipe plan`` computes, as a function: the CLI parses its flags and
calls :func:`plan`, so the two give byte-identical plan files and the same
prediction for every strategy and schedule (tests/test_plan_api.py).

* ``model`` is a zoo spec (``"mmt"``, ``"mmt:small"``), a ``"file.py:factory"``
  spec, a graph JSON or PipeDream profile path, or what a factory returns:
  ``(module, example_inputs, loss_fn[, example_target])`` (captured here, on
  the cluster's device costs).
* The keyword arguments are the CLI's flags (``strategy``, ``schedule``,
  ``cluster``, ``micro_batch_size``, ``recompute``, ``virtual_stages``, ...);
  any other keyword is a field of the planner's options record
  (:class:`~graphpipe.search.common.SearchOptions`), passed through as given.
* :meth:`Plan.simulate` is ``graphpipe simulate``'s prediction of the plan;
  :meth:`Plan.save` writes the plan file; :func:`load_plan` reads one back.

Example
-------
>>> import graphpipe
>>> plan = graphpipe.plan("data/synthetic/mmt-shaped-2x8.json", devices=4, batch_size=32, schedule="1f1b")
>>> plan.schedule.name, plan.strategy
('1f1b', 'gpp')
>>> prediction = plan.simulate()
>>> prediction.iteration_time_s == plan.predicted.iteration_time_s, prediction.throughput > 0
(True, True)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping

from graphpipe.cluster import Cluster, load_cluster
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.models import ModelSource, load_model
from graphpipe.plan import Plan as PlanRecord
from graphpipe.plan import read_plan, write_plan
from graphpipe.search.common import SearchOptions
from graphpipe.search.layouts import parse_shard, parse_tp

__all__ = ["plan", "load_plan", "Plan", "Prediction", "PlanInputs", "plan_inputs", "plan_with", "recorded", "search_options"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """The simulator's prediction of one plan (``graphpipe simulate``'s figures)."""

    iteration_time_s: float
    """Seconds per iteration (one mini-batch); the steady state for asynchronous schedules."""
    throughput: float
    """Samples per second."""
    peak_memory_bytes: tuple[float, ...]
    """Simulated peak memory per device."""
    max_peak_memory_bytes: float
    mean_bubble_fraction: float
    """Idle share of the devices in use."""
    figures: Mapping[str, Any]
    """Every figure, as ``graphpipe simulate --json`` prints them (bubbles, in-flight counts, schedule...)."""
    timeline: Any = field(default=None, repr=False, compare=False)
    """The simulated :class:`~graphpipe.sched.simulator.Timeline` (for a trace or a Gantt chart)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(PlanRecord):
    """A :class:`graphpipe.plan.Plan` with :meth:`simulate` and :meth:`save` (what :func:`plan` returns)."""

    notes: tuple[str, ...] = field(default=(), compare=False)
    """What planning did that a person should know (a V layout's micro-batch size); not in the plan file."""

    @classmethod
    def of(cls, record: PlanRecord, notes: tuple[str, ...] = ()) -> "Plan":
        """``record`` (a plain :class:`graphpipe.plan.Plan`) as a :class:`Plan`."""
        return cls(**{f.name: getattr(record, f.name) for f in fields(PlanRecord)}, notes=tuple(notes))

    def simulate(self, *, host_cores: int | None = None) -> Prediction:
        """Validate the plan's schedule and simulate it: ``graphpipe simulate PLAN.json``'s figures.

        ``host_cores``: the devices time-share that many cores of one host (``--host-cores``).
        """
        from graphpipe.sched.predict import predict
        from graphpipe.search.tied import charge_plan

        timeline, figures = predict(self, _host(host_cores))
        figures = charge_plan(figures, self)  # tied weights split over stages: as graphpipe plan charges them
        return Prediction(iteration_time_s=figures["iteration_time_s"], throughput=figures["throughput"],
                          peak_memory_bytes=tuple(figures["peak_memory_bytes"]),
                          max_peak_memory_bytes=figures["max_peak_memory_bytes"],
                          mean_bubble_fraction=figures["mean_bubble_fraction"], figures=figures, timeline=timeline)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan file (``graphpipe.plan/1``, atomically): what ``graphpipe plan --out`` writes."""
        write_plan(os.fspath(path), self)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan file (``graphpipe plan --out``, :meth:`Plan.save`), checked on reading."""
    return Plan.of(read_plan(os.fspath(path)))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """What planning starts from, resolved: the model's op graph, the cluster, the planner's options."""

    source: ModelSource
    graph: OpGraph
    """The model's op graph, with a profile's measured costs when one is given."""
    cluster: Cluster
    options: SearchOptions
    profile: Any = None
    """The :class:`~graphpipe.frontend.profile.Profile` applied, or None."""
    precision: str | None = None
    """The capture's precision when one was asked for (the plan records it)."""
    granularity: str | None = None
    """The capture's granularity when one was asked for (the plan records it)."""
    max_shape: int | None = None
    """``--max-shape``: the longest length the plan's memory was checked at (the plan records it)."""


def search_options(*, micro_batch_size: int | None = None, recompute: str | None = None,
                   per_stage_micro_batch: bool = False, power_of_two: bool = False, host_cores: int | None = None,
                   max_memory_gb: float | None = None, **options: Any) -> SearchOptions:
    """The planner's options record; ``options`` are any further :class:`SearchOptions` fields, by name."""
    known = {f.name for f in fields(SearchOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InputError(f"unknown planning option {unknown[0]!r}; known: {', '.join(sorted(known - {'host'}))}")
    return SearchOptions(micro_batch_size=micro_batch_size, per_stage_micro_batch=per_stage_micro_batch,
                         recompute=recompute, power_of_two=power_of_two, host=_host(host_cores),
                         max_memory_gb=max_memory_gb, **options)


def plan_inputs(model: Any, *, devices: int, cluster: str | Cluster = "v100", memory_gb: float | None = None,
                precision: str | None = None, granularity: str | None = None, profile: Any = None,
                max_shape: int | None = None, **options: Any) -> PlanInputs:
    """Resolve ``model``, the cluster and the options as :func:`plan` does (``graphpipe plan --compare`` too)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InputError(f"--devices must be >= 1, got {devices}")
    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, devices, memory_gb)
    if precision == "bf16":  # autocast keeps a bf16 copy of every weight for the step: model state
        cluster = replace(cluster, bytes_per_param=cluster.bytes_per_param + 2.0)
    search = search_options(**options)
    if isinstance(profile, (str, os.PathLike)):
        from graphpipe.frontend.profile import read_profile

        profile = read_profile(os.fspath(profile))  # a bad profile fails before the model is built
    source = _source(model, cluster, precision or "fp32", granularity)
    graph = source.graph
    if profile is not None:
        from graphpipe.frontend.profile import apply_profile

        graph = apply_profile(graph, profile, model=source.model_id if source.kind in ("zoo", "factory") else None)
    if max_shape is not None:
        graph = at_max_shape(graph, max_shape)
    return PlanInputs(source=source, graph=graph, cluster=cluster, options=search, profile=profile,
                      precision=precision, granularity=granularity, max_shape=max_shape)


def at_max_shape(graph: OpGraph, length: int) -> OpGraph:
    """``graph`` with the activations it saves scaled from the example's longest length to ``length``
    (``--max-shape``): the memory a plan fits is then the memory of the longest step training will give, while
    the times stay those of the example's shape. A shorter ``length`` leaves the graph as it is (the example
    already is the largest step). Saved bytes grow at least linearly with the length (attention scores
    quadratically: a long-context model should be planned at its real length, not scaled to it).
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise InputError(f"--max-shape must be a positive length, got {length!r}")
    if not graph.lengths:
        raise InputError(f"--max-shape {length}: {graph.name} has no input dim that varies per step (token ids, "
                         "masks and labels' lengths do; a graph file or a float-only model has none)")
    ratio = length / max(graph.lengths)
    if ratio <= 1.0:
        return graph
    ops = [replace(op, act_bytes=op.act_bytes * ratio) for op in graph.ops]
    edges = [(graph.ops[e.src].name, graph.ops[e.dst].name, e.bytes, e.saved * ratio) for e in graph.edges]
    return OpGraph.build(graph.name, ops, edges, graph.shared, graph.lengths)


def plan(model: Any, *, devices: int, batch_size: int, strategy: str = "gpp", schedule: str | None = None,
         cluster: str | Cluster = "v100", micro_batch_size: int | None = None, memory_gb: float | None = None,
         recompute: str | None = None, per_stage_micro_batch: bool = False, power_of_two: bool = False,
         host_cores: int | None = None, virtual_stages: int | str | None = None, vertical_sync: bool = False,
         update_every: int | None = None, stash: bool = True, time_limit_s: float = 10.0, profile: Any = None,
         precision: str | None = None, granularity: str | None = None, max_memory_gb: float | None = None,
         progress: Callable[[float, float], None] | None = None, notes: Callable[[str], None] | None = None,
         tp: int | str = "auto", shard: str = "auto", max_shape: int | None = None, **options: Any) -> Plan:
    """Search, schedule and simulate a plan of ``model`` on ``devices`` devices: ``graphpipe plan``.

    ``strategy``: gpp (GraphPipe), pipedream, piper or gpipe. ``schedule``: None (the strategy's own) or a
    name of :data:`graphpipe.sched.generators.SCHEDULES` (zbv and dualpipev cut the model into a V;
    1f1b-async and 2bw stream the 1F1B partition with ``vertical_sync`` / ``update_every`` / ``stash``), or
    ``"cpsat"`` (``time_limit_s``, ``progress``). ``cluster``: a preset (v100, a100, h100), a cluster JSON
    path or a :class:`~graphpipe.cluster.Cluster`; ``memory_gb`` overrides its device memory.
    ``tp`` (auto, 1, 2, 4, 8) and ``shard`` (auto, none, fsdp): each stage's parallelism inside itself, searched
    with the stages when ``auto`` (``--tp``, ``--shard``; 1 and none plan whole-copy stages only).
    ``max_shape``: the longest sequence length training will give; memory is fitted at it (:func:`at_max_shape`).
    ``profile``: measured per-op costs (a path or a :class:`~graphpipe.frontend.profile.Profile`). ``notes(text)``
    receives what a person should know (also kept in :attr:`Plan.notes`). Further keywords are
    :class:`~graphpipe.search.common.SearchOptions` fields.

    Raises a :class:`~graphpipe.errors.GraphpipeError` (one line, the value and the fix) for bad input and for
    a model with no plan that fits.
    """
    inputs = plan_inputs(model, devices=devices, cluster=cluster, memory_gb=memory_gb, precision=precision,
                         granularity=granularity, profile=profile, micro_batch_size=micro_batch_size,
                         recompute=recompute, per_stage_micro_batch=per_stage_micro_batch,
                         power_of_two=power_of_two, host_cores=host_cores, max_memory_gb=max_memory_gb,
                         tp=parse_tp(tp), shard=parse_shard(shard), max_shape=max_shape, **options)
    return plan_with(inputs, batch_size=batch_size, strategy=strategy, schedule=schedule, time_limit_s=time_limit_s,
                     progress=progress, virtual_stages=virtual_stages, vertical_sync=vertical_sync,
                     update_every=update_every, stash=stash, notes=notes)


def plan_with(inputs: PlanInputs, *, batch_size: int, strategy: str = "gpp", schedule: str | None = None,
              time_limit_s: float = 10.0, progress: Callable[[float, float], None] | None = None,
              virtual_stages: int | str | None = None, vertical_sync: bool = False, update_every: int | None = None,
              stash: bool = True, notes: Callable[[str], None] | None = None) -> Plan:
    """:func:`plan` of resolved :class:`PlanInputs` (the CLI resolves them once, for its messages too)."""
    from graphpipe.search.planner import PlanRequest, plan_request

    said: list[str] = []

    def note(text: str) -> None:
        said.append(text)
        if notes is not None:
            notes(text)

    log.info("%s: %d ops, %d edges; searching (%s)", inputs.source.model_id, inputs.graph.num_ops,
             inputs.graph.num_edges, strategy)
    record = plan_request(PlanRequest(model_id=inputs.source.model_id, graph=inputs.graph, cluster=inputs.cluster,
                                      batch_size=batch_size, strategy=strategy, options=inputs.options,
                                      schedule=schedule, time_limit_s=time_limit_s, progress=progress,
                                      virtual_stages=virtual_stages, vertical_sync=vertical_sync,
                                      update_every=update_every, stash=stash, notes=note))
    return Plan.of(recorded(record, inputs), tuple(said))


def recorded(record: PlanRecord, inputs: PlanInputs, capture: bool = True) -> PlanRecord:
    """``record`` noting the profile's precision when its measured costs are the plan's, and (``capture``) how
    the module was captured: the runtime re-captures it the same way, and warns at another precision."""
    changes: dict[str, Any] = {}
    if inputs.profile is not None:
        changes.update(precision=inputs.profile.precision, precision_from="profile",
                       profile_device=inputs.profile.device)  # run compares like with like on it
    if capture and inputs.precision:  # a capture's precision asked for wins over the profile's
        changes.update(precision=inputs.precision, precision_from="capture")
    if capture and inputs.granularity:
        changes["granularity"] = inputs.granularity
    if inputs.max_shape is not None:  # the memory guard of Pipeline and run reads both
        changes.update(max_shape=inputs.max_shape, example_length=max(inputs.source.graph.lengths))
    return replace(record, search={**record.search, **changes}) if changes else record


def _host(host_cores: int | None):
    """``host_cores`` as a :class:`~graphpipe.sched.simulator.SharedHost` (None when not given)."""
    if host_cores is None:
        return None
    if isinstance(host_cores, bool) or not isinstance(host_cores, int) or host_cores < 1:
        raise InputError(f"--host-cores must be at least 1, got {host_cores}")
    from graphpipe.sched.simulator import SharedHost

    return SharedHost.cores(host_cores)


def _source(model: Any, cluster: Cluster, precision: str, granularity: str | None) -> ModelSource:
    """``model`` resolved: a spec through :func:`graphpipe.models.load_model`, a factory's tuple captured here."""
    if isinstance(model, (str, os.PathLike)):
        log.info("building %s for %d x %s", model, cluster.num_devices, cluster.device.name)
        return load_model(os.fspath(model), cluster.device, precision=precision, granularity=granularity)
    if isinstance(model, tuple):
        from graphpipe.frontend.capture import Granularity, factory_result
        from graphpipe.frontend.capture_repeats import capture_graph

        made = factory_result(model, "model")
        name = type(made.module).__name__
        graph = capture_graph(made.module, made.example_inputs, name=name, device=cluster.device,
                              loss_fn=made.loss_fn, example_target=made.example_target,
                              granularity=Granularity.parse(granularity), precision=precision)
        return ModelSource(graph, name, "module")
    raise InputError(f"model must be a zoo spec ('mmt:small'), a 'file.py:factory' spec, a graph file or a "
                     f"factory's (module, example_inputs, loss_fn[, example_target]) tuple, got "
                     f"{type(model).__name__}")
