"""Plans and the ``graphpipe.plan/1`` file format (docs/design.md#plan-files).

A :class:`Plan` is everything needed to simulate or run one training
iteration: the op graph, the cluster, the stage graph (with batch size and
per-stage micro-batch sizes), the strategy that produced it, the schedule,
the simulator's predicted figures (:class:`Predicted`) and the search
statistics (:class:`SearchStats`).

The JSON is self-contained: the graph is inlined in the graph-JSON shape,
the cluster in the cluster-file shape, so ``graphpipe simulate plan.json``
needs nothing else. Keys may be added in later versions of ``/1``; none of
the keys below change meaning. Unknown ``format`` values are refused.

Structural checks happen here (every :class:`StageGraph` invariant); the
schedule itself is checked by :func:`graphpipe.sched.validate_schedule`,
which every reader of a plan file must call (the CLI does).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Literal, Mapping, get_args

from graphpipe.actions import Schedule
from graphpipe import files
from graphpipe.cluster import Cluster, cluster_from_dict, cluster_to_dict
from graphpipe.errors import FormatError, InputError, PlanError, some
from graphpipe.graph import OpGraph, graph_from_dict, graph_to_dict, read_json_file, write_json_atomic
from graphpipe.stages import Stage, StageGraph

__all__ = ["Plan", "Predicted", "SearchStats", "PLAN_FORMAT", "BatchnormMode", "BATCHNORM_MODES", "plan_to_dict",
           "plan_from_dict", "read_plan", "write_plan", "torchrun_flags"]

PLAN_FORMAT = "graphpipe.plan/1"

BatchnormMode = Literal["per-micro-batch", "sync"]
BATCHNORM_MODES: tuple[BatchnormMode, ...] = get_args(BatchnormMode)
"""How BatchNorm normalises under micro-batching: each replica's rows, or each micro-batch across replicas."""


class _Figures(Mapping[str, Any]):
    """A typed record that still reads as the plan file's object: ``record.throughput`` and
    ``record["throughput"]`` are the same value, and ``dict(record)`` is the object, keys in file order.

    The typed fields are the figures graphpipe itself writes and reads; any
    other key (a partitioner's own statistics, a schedule's extra figures) is
    kept in ``extra``. ``keys_order`` is the object's keys as written, so a
    plan file reads and writes back byte for byte.
    """

    __slots__ = ()

    @classmethod
    def _typed(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls)) - {"extra", "keys_order"}

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any] | None):
        """The record of a plan file's object (or of another record: returned as it is)."""
        if isinstance(doc, cls):
            return doc
        doc = dict(doc or {})
        typed = cls._typed()
        return cls(**{k: v for k, v in doc.items() if k in typed},
                   extra={k: v for k, v in doc.items() if k not in typed}, keys_order=tuple(doc))

    def __post_init__(self) -> None:
        if not self.keys_order:  # built field by field: the fields that are set, then the extra keys
            present = tuple(f.name for f in fields(self) if f.name in self._typed() and getattr(self, f.name) is not None)
            object.__setattr__(self, "keys_order", present + tuple(k for k in self.extra if k not in present))

    def updated(self, **changes: Any):
        """A copy with ``changes`` (new keys go last, as in a dict update)."""
        return self.from_mapping({**self, **changes})

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys_order:
            raise KeyError(key)
        return self.extra[key] if key in self.extra else getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_order)

    def __len__(self) -> int:
        return len(self.keys_order)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Predicted(_Figures):
    """The simulator's figures for one iteration of a plan (the plan file's ``predicted`` object).

    Lists have one entry per device of the cluster, except ``in_flight``
    (per stage). A field is None when the object does not have it (plans
    written by older versions, or asynchronous schedules, which report a
    steady state instead of one iteration).

    >>> p = Predicted.from_mapping({"iteration_time_s": 0.5, "throughput": 64.0, "note": "x"})
    >>> p.throughput, p["throughput"], p.extra, dict(p)
    (64.0, 64.0, {'note': 'x'}, {'iteration_time_s': 0.5, 'throughput': 64.0, 'note': 'x'})
    """

    iteration_time_s: float | None = None
    """Seconds of one training iteration (one mini-batch, forward and backward, all-reduces included)."""
    throughput: float | None = None
    """Samples per second: ``batch_size / iteration_time_s``."""
    bubble_fraction: list[float] | None = None
    """Per device, the share of the iteration it is idle."""
    peak_memory_bytes: list[float] | None = None
    """Per device, the simulated peak: weights, gradients, optimizer state, activations, buffers."""
    peak_activation_bytes: list[float] | None = None
    """Per device, the activation part of the peak (what the runtime measures beside it)."""
    in_flight: list[int] | None = None
    """Per stage, the most micro-batches alive at once (forward run, backward not yet)."""
    busy_s: list[float] | None = None
    """Per device, seconds of compute and transfers in the iteration."""
    mean_bubble_fraction: float | None = None
    """Mean of ``bubble_fraction`` over the devices that hold a stage."""
    max_peak_memory_bytes: float | None = None
    """Largest ``peak_memory_bytes``: what must fit in one device's memory."""
    devices_used: list[int] | None = None
    """Devices that hold a stage."""
    schedule: str | None = None
    """Name of the schedule simulated."""
    source: str | None = None
    """What produced the timeline (the simulator, or a measured run)."""
    shared_params_allreduce_s: float | None = None
    """Tied parameters split over stages: seconds of their gradient all-reduce, included in the iteration."""
    shared_params_copy_bytes: float | None = None
    """Tied parameters split over stages: bytes of the extra copies, included in the peaks."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Other figures (e.g. the stashed weights of asynchronous schedules), by name."""
    keys_order: tuple[str, ...] = ()
    """The object's keys in file order."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class SearchStats(_Figures):
    """How the plan was found (the plan file's ``search`` object).

    The planner's own statistics are fields; a partitioner's statistics
    (e.g. ``bottleneck_tps``, ``cut_link``, ``num_downsets``) are kept in
    ``extra``. Wall-clock times are the only figures two runs of the same
    search may differ in.

    >>> s = SearchStats.from_mapping({"strategy": "gpp", "time_s": 0.25, "bottleneck_tps": 1e-3})
    >>> s.strategy, s.time_s, s["bottleneck_tps"], s.space is None
    ('gpp', 0.25, 0.001, True)
    """

    strategy: str | None = None
    """The strategy asked for (a gpp plan whose stages came from a candidate says gpp; see ``space``)."""
    recompute: str | None = None
    """Re-materialization asked for: ``none``, ``all`` or ``auto``."""
    precision: str | None = None
    """Number format the costs assume (e.g. ``fp32``)."""
    precision_from: str | None = None
    """Where ``precision`` came from: ``cluster`` or ``profile``."""
    recompute_stages: list[int] | None = None
    """Stages that re-materialize."""
    recompute_segments: Mapping[str, int] | None = None
    """Re-materializing stage id (as a string) -> number of checkpointed segments."""
    partition_time_s: float | None = None
    """Seconds spent partitioning."""
    schedule: str | None = None
    """The schedule of the plan."""
    schedule_time_s: float | None = None
    """Seconds spent scheduling, simulating and (CP-SAT) co-optimising."""
    time_s: float | None = None
    """Seconds of the whole search."""
    device_counts_tried: list[int] | None = None
    """Device counts searched (largest first)."""
    space: str | None = None
    """Whose search space the winning stages came from: the strategy itself or one of its candidates."""
    gpp_throughput: float | None = None
    """When a candidate won: the throughput of gpp's own best plan."""
    unused_devices: int | None = None
    """Devices of the cluster that hold no stage."""
    host_devices_used: int | None = None
    """Shared host: the number of ranks the fastest plan uses."""
    host_slowdown: list[list[float]] | None = None
    """Shared host: its slowdown curve (concurrent ranks, slowdown)."""
    lower_bound_s: float | None = None
    """CP-SAT: a lower bound of the iteration time."""
    gap: float | None = None
    """CP-SAT: ``(makespan - lower_bound) / makespan``."""
    cpsat_status: str | None = None
    """CP-SAT: OPTIMAL, FEASIBLE, or what the solver reported."""
    cpsat_time_s: float | None = None
    """CP-SAT: seconds in the solver."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The partitioner's and the co-optimiser's other statistics, by name."""
    keys_order: tuple[str, ...] = ()
    """The object's keys in file order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    model: str
    """How to rebuild the module: zoo spec (``mmt:small``), ``file.py:factory``, or a file path."""
    stage_graph: StageGraph
    cluster: Cluster
    strategy: str
    """Partitioner that produced the stages: gpp, pipedream, piper, gpipe, or custom."""
    schedule: Schedule
    predicted: Predicted = field(default_factory=Predicted)
    """Simulator figures (a plain mapping given here becomes a :class:`Predicted`)."""
    search: SearchStats = field(default_factory=SearchStats)
    """Search statistics (a plain mapping given here becomes a :class:`SearchStats`)."""
    merged: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Ops created by contracting non-series-parallel regions -> original op names."""
    batchnorm: BatchnormMode = "per-micro-batch"
    """BatchNorm semantics under micro-batching (:data:`BATCHNORM_MODES`; see :mod:`graphpipe.runtime.batchnorm`)."""
    asynchrony: Mapping[str, Any] = field(default_factory=dict)
    """Asynchronous schedules only (``1f1b-async``, ``2bw``): ``vertical_sync``, ``update_every``, ``stash``
    (:class:`graphpipe.sched.async_pipe.AsyncSpec`); written as the plan's ``async`` key."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "predicted", Predicted.from_mapping(self.predicted))
        object.__setattr__(self, "search", SearchStats.from_mapping(self.search))
        if self.stage_graph.num_devices != self.cluster.num_devices:
            raise PlanError(f"stage graph is for {self.stage_graph.num_devices} devices, cluster has {self.cluster.num_devices}")
        if self.schedule.num_devices != self.cluster.num_devices:
            raise PlanError(f"schedule lists {self.schedule.num_devices} devices, cluster has {self.cluster.num_devices}")
        if self.batchnorm not in BATCHNORM_MODES:
            raise InputError(f"--batchnorm must be one of {', '.join(BATCHNORM_MODES)}, got {self.batchnorm!r}")
        for stage in self.stage_graph.stages:  # tensor parallelism all-reduces per layer: never across nodes
            for group in stage.tp_groups:
                nodes = sorted({self.cluster.node_of(d) for d in group})
                if len(nodes) > 1:
                    raise PlanError(f"stage {stage.id}: tp group {list(group)} spans nodes {nodes} "
                                    f"({self.cluster.devices_per_node} devices per node); a tp group must sit in "
                                    f"one node: align the stage's devices to nodes or lower its tp")
        if self.stage_graph.cluster is None and any(s.parallel for s in self.stage_graph.stages):
            # the collectives of stages parallel inside themselves are priced on this plan's cluster
            object.__setattr__(self, "stage_graph", replace(self.stage_graph, cluster=self.cluster))

    @property
    def graph(self) -> OpGraph:
        return self.stage_graph.graph

    @property
    def batch_size(self) -> int:
        return self.stage_graph.batch_size

    @property
    def num_ranks(self) -> int:
        """The ranks a job running this plan starts: one per device up to the last device holding a stage.

        A plan may leave the cluster's last devices idle (``plan`` says "uses
        3 of 4 devices"); a job runs it on the devices it uses, so
        ``graphpipe.Pipeline`` refuses any other world size before its first
        collective (:func:`torchrun_flags` gives the flag to start it with).
        """
        return max(self.stage_graph.devices_used()) + 1

    def with_schedule(self, schedule: Schedule, predicted: Mapping[str, Any] | None = None) -> "Plan":
        return replace(self, schedule=schedule, predicted=dict(predicted or {}))


def torchrun_flags(plan: Plan) -> str:
    """The torchrun flags that start :attr:`Plan.num_ranks` ranks on the plan's nodes: ``--nproc-per-node 3``
    for a plan on devices 0-2 of one node, ``--nnodes 2 --nproc-per-node 8`` for one on two whole 8-device
    nodes, ``--nnodes 2 --nproc-per-node 8 (4 on the last node)`` when its last node is not full."""
    ranks, per_node = plan.num_ranks, plan.cluster.devices_per_node
    if ranks <= per_node:
        return f"--nproc-per-node {ranks}"
    nodes, rest = -(-ranks // per_node), ranks % per_node
    return f"--nnodes {nodes} --nproc-per-node {per_node}" + (f" ({rest} on the last node)" if rest else "")


def _layout_to_dict(stage: Stage) -> dict[str, Any]:
    """A stage's parallelism inside itself: ``tp`` and ``shard`` (and FSDP's ``reshard_after_forward``, TP's
    ``sequence_parallel`` and ``keep_gathered`` where set)."""
    return {"tp": stage.tp, "shard": stage.shard,
            **({"sequence_parallel": True} if stage.sequence_parallel else {}),
            **({"keep_gathered": True} if stage.keep_gathered else {}),
            **({"reshard_after_forward": stage.reshard_after_forward} if stage.shard == "fsdp" else {})}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan file's object. Stages carry ``tp``/``shard`` when any stage of the plan is parallel inside
    itself; a plan whose stages are all whole copies (tp 1, shard none) writes neither key, byte for byte
    as before those keys existed, and reads back the same."""
    sg = plan.stage_graph
    layouts = any(s.parallel for s in sg.stages)
    return {
        "format": PLAN_FORMAT,
        "model": plan.model,
        "graph": graph_to_dict(plan.graph),
        "cluster": cluster_to_dict(plan.cluster),
        "batch_size": sg.batch_size,
        "strategy": plan.strategy,
        "stages": [
            {"id": s.id, "ops": [plan.graph.ops[i].name for i in s.op_ids], "devices": list(s.devices),
             "micro_batch_size": s.micro_batch_size, "recompute": s.recompute, "replica_mode": s.replica_mode,
             **({"checkpoints": [plan.graph.ops[i].name for i in s.checkpoints]} if s.checkpoints else {}),
             **({"split": s.split} if s.split > 1 else {}),
             **(_layout_to_dict(s) if layouts else {})}
            for s in sg.stages
        ],
        "stage_edges": [list(e) for e in sg.edges],
        "sequential": sg.sequential,
        "schedule": plan.schedule.to_dict(),
        "predicted": dict(plan.predicted),
        "search": dict(plan.search),
        "merged": {k: list(v) for k, v in plan.merged.items()},
        "batchnorm": plan.batchnorm,
        **({"async": dict(plan.asynchrony)} if plan.asynchrony else {}),
    }


def plan_from_dict(doc: Any, where: str = "plan", complete: Callable[..., Any] | None = None) -> Plan:
    """Parse a plan document; structural invariants are checked, the schedule is parsed only.

    A document without ``schedule`` (a hand-written or edited plan) needs ``complete``:
    ``complete(stage_graph, cluster, strategy) -> (schedule, predicted)`` gives the strategy's default schedule
    and its simulated prediction (:func:`graphpipe.sched.complete.completion`, which ``simulate``, ``run`` and
    ``Pipeline`` pass); ``predicted`` is then the simulation's whatever the document says. Without ``complete``
    such a document is refused in one line."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object")
    fmt = doc.get("format")
    if fmt != PLAN_FORMAT:
        raise FormatError(f"{where}: unsupported format {fmt!r}; expected {PLAN_FORMAT!r}")
    for key in ("graph", "cluster", "batch_size", "stages") + (() if complete is not None else ("schedule",)):
        if key not in doc:
            raise FormatError(f"{where}: missing key {key!r}")
    graph = graph_from_dict(doc["graph"], where=f"{where}.graph")
    cluster = cluster_from_dict(doc["cluster"], where=f"{where}.cluster")
    batch_size = doc["batch_size"]
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise PlanError(f"{where}: batch_size must be a positive integer, got {batch_size!r}")
    stages = []
    try:
        for i, s in enumerate(files.array(doc["stages"], f"{where}.stages")):
            at = f"{where}.stages[{i}]"
            files.mapping(s, at)
            stages.append(Stage(files.integer(s["id"], f"{at}.id", 0),
                                tuple(_op_id(graph, files.string(name, f"{at}.ops[{k}]"), f"{at}.ops[{k}]")
                                      for k, name in enumerate(files.array(s["ops"], f"{at}.ops"))),
                                tuple(files.integer(d, f"{at}.devices[{k}]", 0, cluster.num_devices - 1)
                                      for k, d in enumerate(files.array(s["devices"], f"{at}.devices"))),
                                files.integer(s["micro_batch_size"], f"{at}.micro_batch_size", 1),
                                s.get("recompute", False), replica_mode=s.get("replica_mode", "split"),
                                tp=files.integer(s.get("tp", 1), f"{at}.tp", 1),
                                shard=s.get("shard", "none"),
                                reshard_after_forward=s.get("reshard_after_forward", True),
                                sequence_parallel=s.get("sequence_parallel", False),
                                keep_gathered=s.get("keep_gathered", False),
                                split=files.integer(s.get("split", 1), f"{at}.split", 1),
                                checkpoints=tuple(graph.op_id(files.string(name, f"{at}.checkpoints[{k}]"))
                                                  for k, name in enumerate(files.array(s.get("checkpoints", []),
                                                                                       f"{at}.checkpoints")))))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise FormatError(f"{where}: malformed stage entry ({type(exc).__name__}: {exc})") from None
    _check_stage_ops(graph, [(files.integer(s["id"], f"{where}.stages[{i}].id", 0), list(s["ops"]))
                             for i, s in enumerate(doc["stages"])], where)
    stages.sort(key=lambda s: s.id)
    schedule = (Schedule.from_dict(doc["schedule"], cluster.num_devices, where=f"{where}.schedule")
                if "schedule" in doc else None)
    shared = (schedule is not None and schedule.name.startswith("interleaved")) or _devices_shared(stages)
    edges = tuple(_stage_edge(e, f"{where}.stage_edges[{i}]")
                  for i, e in enumerate(files.array(doc.get("stage_edges", []), f"{where}.stage_edges")))
    sequential = doc.get("sequential", False)
    if not isinstance(sequential, bool):
        raise FormatError(f"{where}.sequential must be true or false, got {sequential!r}")
    try:
        sg = StageGraph(graph, tuple(stages), batch_size, cluster.num_devices, edges=edges,
                        allow_shared_devices=shared, sequential=sequential, cluster=cluster)
    except PlanError as exc:  # say which file broke the invariant
        raise PlanError(f"{where}: {exc}") from None
    merged = {k: tuple(files.string(n, f"{where}.merged.{k}[]") for n in files.array(v, f"{where}.merged.{k}"))
              for k, v in files.mapping(doc.get("merged") or {}, f"{where}.merged").items()}
    predicted = _figures(doc.get("predicted"), f"{where}.predicted")
    if schedule is None:  # the strategy's default schedule, and what the simulator predicts for it
        schedule, predicted = complete(sg, cluster, files.string(doc.get("strategy", "custom"), f"{where}.strategy"))
    return Plan(model=files.string(doc.get("model", graph.name), f"{where}.model"), stage_graph=sg, cluster=cluster,
                strategy=files.string(doc.get("strategy", "custom"), f"{where}.strategy"), schedule=schedule,
                predicted=predicted,
                search=_figures(doc.get("search"), f"{where}.search"), merged=merged,
                batchnorm=_batchnorm(doc.get("batchnorm", "per-micro-batch"), f"{where}.batchnorm"),
                asynchrony=_asynchrony(doc.get("async"), f"{where}.async"))


def _op_id(graph: OpGraph, name: str, at: str) -> int:
    """The id of a stage's op, or the refusal naming the file, the stage and the op (a hand edit's typo)."""
    try:
        return graph.op_id(name)
    except InputError:
        raise PlanError(f"{at}: op {name!r} is not in the plan's graph {graph.name!r} "
                        f"({graph.num_ops} ops: {some([op.name for op in graph.ops])}); stages list the graph's "
                        "op names") from None


def _check_stage_ops(graph: OpGraph, stages: list[tuple[int, list[str]]], where: str) -> None:
    """Refuse, in the file's own terms, stages that do not partition the ops: a stage id used twice, an op
    listed twice in one stage, an op in two stages, ops in no stage. ``stages``: each stage's id and op names as
    the file lists them. Each message names the op, the stage(s) as the file numbers them, and what to change;
    :class:`StageGraph` would only see op ids."""
    first: dict[int, int] = {}
    for i, (stage_id, _) in enumerate(stages):
        if stage_id in first:
            raise PlanError(f"{where}: stages[{first[stage_id]}] and stages[{i}] both have id {stage_id}; "
                            f"number the {len(stages)} stages 0..{len(stages) - 1}, each once")
        first[stage_id] = i
    stage_of: dict[str, int] = {}
    for stage_id, names in stages:
        seen: dict[str, int] = {}
        for k, name in enumerate(names):
            if name in seen:
                raise PlanError(f"{where}: stage {stage_id} lists op {name!r} twice (its ops[{seen[name]}] and "
                                f"ops[{k}]); remove one: each op is listed once")
            seen[name] = k
            if name in stage_of:
                raise PlanError(f"{where}: op {name!r} is listed in stage {stage_of[name]} and in stage {stage_id}; "
                                f"an op runs in exactly one stage: remove it from one of them")
            stage_of[name] = stage_id
    missing = [op.name for op in graph.ops if op.name not in stage_of]
    if missing:
        names = ", ".join(repr(n) for n in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise PlanError(f"{where}: {'op' if len(missing) == 1 else 'ops'} {names} {'is' if len(missing) == 1 else 'are'} "
                        f"in no stage; add each to the stage that runs it (every op of the graph runs in exactly "
                        f"one stage)")


def _asynchrony(value: Any, where: str) -> dict[str, Any]:
    """The ``async`` object: ``vertical_sync`` / ``stash`` booleans, ``update_every`` a positive integer."""
    doc = dict(files.mapping(value if value is not None else {}, where))
    for key, v in doc.items():
        if key in ("vertical_sync", "stash") and not isinstance(v, bool):
            raise FormatError(f"{where}.{key} must be true or false, got {v!r}")
        if key == "update_every":
            files.integer(v, f"{where}.{key}", 1)
    return doc


def _batchnorm(value: Any, where: str) -> str:
    if value not in BATCHNORM_MODES:
        raise FormatError(f"{where} must be one of {', '.join(BATCHNORM_MODES)}, got {value!r}")
    return value


def _stage_edge(value: Any, where: str) -> tuple[int, int]:
    pair = files.array(value, where)
    if len(pair) != 2:
        raise FormatError(f"{where} must be [from_stage, to_stage], got {value!r}")
    return files.integer(pair[0], f"{where}[0]", 0), files.integer(pair[1], f"{where}[1]", 0)


# Figures whose type readers rely on (others pass through as they are).
_NUMBERS = ("iteration_time_s", "throughput", "max_peak_memory_bytes", "mean_bubble_fraction", "time_s",
            "lower_bound_s", "gap")
_NUMBER_LISTS = ("peak_memory_bytes", "bubble_fraction", "in_flight")


def _figures(doc: Any, where: str) -> dict[str, Any]:
    """``predicted`` or ``search``: an object (or null); known figures must be numbers or lists of numbers."""
    figures = dict(files.mapping(doc if doc is not None else {}, where))
    for key, value in figures.items():
        if key in _NUMBERS and value is not None:
            files.number(value, f"{where}.{key}")
        elif key in _NUMBER_LISTS:
            for i, v in enumerate(files.array(value, f"{where}.{key}")):
                files.number(v, f"{where}.{key}[{i}]")
    return figures


def _devices_shared(stages: list[Stage]) -> bool:
    """Virtual stages: several stages on exactly the same device set."""
    sets = [s.devices for s in stages]
    return len(set(sets)) < len(sets) and all(
        a == b or not set(a) & set(b) for i, a in enumerate(sets) for b in sets[i + 1:])


def read_plan(path: str, complete: Callable[..., Any] | None = None) -> Plan:
    """The plan file at ``path`` (``complete``: see :func:`plan_from_dict`)."""
    return plan_from_dict(read_json_file(path, "file"), where=path, complete=complete)


def write_plan(path: str, plan: Plan) -> None:
    """Write atomically (temporary file + rename)."""
    write_json_atomic(path, plan_to_dict(plan))
