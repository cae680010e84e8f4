"""PipeDream's asynchronous pipelines: the stream, the weight-version schedule, steady state (docs/design.md#schedules-and-the-simulator).

Flushing schedules (``1f1b`` is PipeDream-Flush) run one mini-batch of ``M``
micro-batches, then every stage steps its optimizer. The asynchronous ones
never flush: micro-batches stream through the 1F1B order of
:func:`~graphpipe.sched.generators.one_f_one_b` and each stage updates its
own weights while later micro-batches are still in flight.

* ``1f1b-async`` (PipeDream, Narayanan et al. SOSP'19 §3.3): stage ``s``
  applies an SGD step after every micro-batch's backward. *Weight stashing*:
  a micro-batch's backward on ``s`` uses the version its forward used. With
  *vertical sync* every stage uses the version the input stage used for that
  micro-batch (older than the stage's latest: more versions kept).
* ``2bw`` (PipeDream-2BW, Narayanan et al. ICML'21 §3.1): gradients of ``m``
  consecutive micro-batches are summed and applied at once; window ``k``
  (micro-batches ``km .. km+m-1``) runs on version ``k-1`` on every stage, so
  ``W(k+1) = W(k) - lr * grad(W(k-1))``, and with ``m`` at least the
  in-flight count only two versions ever live.

The **version schedule** ``v(s, i)``: which version (0 = the initial weights,
``k`` = after the stage's ``k``-th update) micro-batch ``i``'s forward *and*
backward use on stage ``s``. It is a pure function of the stream's per-device
order (:func:`version_table`); the runtime and the single-process replay
oracle both obey it. Updates of stage ``s`` apply the summed gradients of a
group of ``update_every`` consecutive micro-batches to the *latest* version.

Counting an **iteration** of a stream: one mini-batch, i.e. ``M`` micro-batches
(``batch_size`` samples). Its steady-state time is the marginal cost of ``M``
more micro-batches, ``(T(4M) - T(2M)) / 2``, where ``T(n)`` is the simulated
makespan of the stream of ``n`` micro-batches: the fill and drain bubbles,
paid once per run, drop out. Replicated ("split") stages all-reduce their
gradients at every update; each such all-reduce is added to the iteration
whole (blocking, not overlapped).

**Memory**: the flushing figures of the stream (activations of the same
in-flight counts) plus stashed weight versions: the most versions of stage
``s`` alive at once other than the latest, times the stage's weight bytes
(:func:`graphpipe.costs.weight_versions_bytes`). Version ``k`` stays alive
while a micro-batch with ``v(s, i) = k`` has not finished its backward.

Stage graphs: the stream and the version rule need only a topological order
and a per-stage order of forwards and backwards, so they work on any stage
graph whose stages share one micro-batch size; vertical sync takes the
version of stage 0 (the first source). Replicated stages keep one version
history for all replicas: their gradients are all-reduced at every update;
round-robin replicas (1F1B-RR) each bring their own micro-batches, so on
1f1b-async ``r`` consecutive micro-batches make one update (PipeDream's
data-parallel stages all-reduce after each backward).

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("c", [Op(n, "x", Affine(0, 1.0), Affine(0, 2.0), 8) for n in "ab"], [("a", "b", 0.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 4, 2)
>>> table = version_table(sg, AsyncSpec(name="1f1b-async"), 1)
>>> table.version[0], table.version[1], table.peak_stashed
((0, 0, 1, 2), (0, 1, 2, 3), ((1,), (0,)))
>>> version_table(sg, AsyncSpec(name="2bw", update_every=2), 2).version[0]
(0, 0, 0, 0, 1, 1, 2, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from graphpipe import costs
from graphpipe.actions import Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import InputError, ScheduleError
from graphpipe.stages import StageGraph

from graphpipe.sched.generators import SCHEDULES, make_schedule

__all__ = ["ASYNC_SCHEDULES", "AsyncSpec", "VersionTable", "stream_graph", "stream_schedule", "version_table",
           "async_figures", "group_sizes", "check_async_stage_graph", "async_spec_for", "with_async", "plan_spec"]

ASYNC_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.asynchronous)
"""Schedules that never flush (module docstring; :attr:`ScheduleSpec.asynchronous`); ``1f1b`` is PipeDream-Flush."""

STEADY_WINDOWS = (2, 4)
"""Stream lengths (in mini-batches) whose makespan difference is the steady-state time of ``4 - 2`` iterations."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncSpec:
    """How an asynchronous schedule versions the weights."""

    name: str
    """``1f1b-async`` or ``2bw``."""
    vertical_sync: bool = False
    """1f1b-async only: every stage uses the version the input stage (stage 0) used for the micro-batch."""
    update_every: int = 1
    """Micro-batches per weight update (``m``): 1 for 1f1b-async; 2bw's ``m`` (>= 1)."""
    stash: bool = True
    """False: no weight stashing, a backward runs on whatever weights are latest (PipeDream's ablation)."""

    def __post_init__(self) -> None:
        if self.name not in ASYNC_SCHEDULES:
            raise InputError(f"asynchronous schedule must be one of {', '.join(ASYNC_SCHEDULES)}, got {self.name!r}")
        if isinstance(self.update_every, bool) or not isinstance(self.update_every, int) or self.update_every < 1:
            raise InputError(f"2bw's --update-every (micro-batches per weight version) must be an integer >= 1, "
                             f"got {self.update_every!r}")
        if self.name == "1f1b-async" and self.update_every != 1:
            raise InputError(f"1f1b-async updates after every micro-batch; --update-every {self.update_every} is "
                             f"for 2bw")
        if self.vertical_sync and self.name != "1f1b-async":
            raise InputError(f"--vertical-sync is for 1f1b-async; {self.name} already uses one version per window "
                             f"on every stage")

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``async`` object."""
        return {"vertical_sync": self.vertical_sync, "update_every": self.update_every, "stash": self.stash}


def async_spec_for(name: str, sg: StageGraph, vertical_sync: bool = False, update_every: int | None = None,
                   stash: bool = True) -> AsyncSpec:
    """The spec of schedule ``name`` on ``sg``; 2bw's ``update_every`` defaults to ``M`` (one version per mini-batch;
    the least common multiple of ``M`` and the round-robin replica counts, so every replica takes part).

    ``--vertical-sync`` or ``--update-every`` with a flushing schedule is refused (one line).

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage, StageGraph
    >>> sg = StageGraph.build(OpGraph.build("o", [Op("a", "x")], []), [Stage(0, (0,), (0,), 2)], 8, 1)
    >>> async_spec_for("2bw", sg).update_every
    4
    """
    if name not in ASYNC_SCHEDULES:
        if vertical_sync:
            raise InputError(f"--vertical-sync needs an asynchronous schedule ({', '.join(ASYNC_SCHEDULES)}); "
                             f"{name!r} flushes, so every micro-batch already sees one version")
        if update_every is not None:
            raise InputError(f"--update-every is 2bw's m; schedule {name!r} flushes every mini-batch")
        raise InputError(f"{name!r} is not an asynchronous schedule ({', '.join(ASYNC_SCHEDULES)})")
    if update_every is None:  # 2bw: one version per mini-batch, rounded up to bring every round-robin replica
        rr = math.lcm(*(st.num_replicas for st in sg.stages if st.round_robin))
        update_every = math.lcm(sg.num_micro_batches(0), rr) if name == "2bw" else 1
    return AsyncSpec(name=name, vertical_sync=vertical_sync, update_every=update_every, stash=stash)


def check_async_stage_graph(sg: StageGraph) -> None:
    """Refuse what the asynchronous schedules do not cover: mixed micro-batch sizes, round-robin groups of
    several replicas (PipeDream's round-robin replicas are one device each)."""
    grouped = [st.id for st in sg.stages if st.round_robin and st.split > 1]
    if grouped:
        raise InputError(f"asynchronous schedules take round-robin replicas one at a time; stage {grouped[0]} has "
                         f"groups of {sg.stages[grouped[0]].split} (split): use a synchronous schedule")
    sizes = sorted({st.micro_batch_size for st in sg.stages})
    if len(sizes) > 1:
        raise InputError(f"asynchronous schedules stream one micro-batch size through every stage; this plan has "
                         f"{sizes} — re-plan with --micro-batch-size")


def stream_graph(sg: StageGraph, num_windows: int) -> StageGraph:
    """``sg`` for ``num_windows`` mini-batches in one stream (``num_windows * M`` micro-batches)."""
    return replace(sg, batch_size=sg.batch_size * num_windows)


def stream_schedule(sg: StageGraph, name: str, num_windows: int) -> Schedule:
    """The 1F1B order of :func:`one_f_one_b` over ``num_windows * M`` micro-batches, without a flush."""
    from graphpipe.sched.generators import one_f_one_b  # generators registers this module's names

    check_async_stage_graph(sg)
    stream = one_f_one_b(stream_graph(sg, num_windows))
    return Schedule(name, stream.device_actions)


@dataclass(frozen=True, slots=True)
class VersionTable:
    """The version schedule of a stream: ``version[s][i]``, update groups, and the stashed versions it needs."""

    spec: AsyncSpec
    num_micro_batches: int
    """Micro-batches in the stream (``windows * M``)."""
    version: tuple[tuple[int, ...], ...]
    """``version[s][i]``: the version micro-batch ``i`` runs on at stage ``s`` (forward and backward)."""
    group_size: tuple[int, ...]
    """Per stage: micro-batches whose summed gradients make one update (``m``; x replicas for 1F1B-RR 1f1b-async)."""
    peak_stashed: tuple[tuple[int, ...], ...]
    """``peak_stashed[s][q]``: most versions alive at once on replica ``q`` of stage ``s`` besides the latest
    (0 without stashing)."""

    def group_of(self, stage_id: int, mb_id: int) -> int:
        """The update a micro-batch's gradient belongs to (update ``k`` makes version ``k + 1``)."""
        return mb_id // self.group_size[stage_id]

    def closes_group(self, stage_id: int, mb_id: int, replica_mbs: int = 1) -> bool:
        """True when ``mb_id`` is the last of its update group that a replica holding every ``replica_mbs``-th
        micro-batch runs: that replica steps (after the replicas' all-reduce) once its backward ends."""
        g = self.group_size[stage_id]
        return mb_id % g >= g - replica_mbs


def group_sizes(sg: StageGraph, spec: AsyncSpec) -> tuple[int, ...]:
    """Micro-batches per update on each stage; round-robin replicas (1F1B-RR) each bring theirs to every update.

    1f1b-async: one micro-batch, or one per replica on a round-robin stage
    (PipeDream's replicas all-reduce after every backward, so ``r``
    consecutive micro-batches make one update). 2bw: ``m``, which must then
    be a multiple of ``r``.
    """
    out = []
    for st in sg.stages:
        r = st.num_replicas if st.round_robin else 1
        if spec.name == "1f1b-async":
            out.append(r)
        elif spec.update_every % r:
            raise InputError(f"2bw's --update-every {spec.update_every} must be a multiple of stage {st.id}'s {r} "
                             f"round-robin replicas (each brings its micro-batches to every update)")
        else:
            out.append(spec.update_every)
    return tuple(out)


def version_table(sg: StageGraph, spec: AsyncSpec, num_windows: int) -> VersionTable:
    """The version schedule of ``num_windows`` mini-batches streamed under ``spec`` (module docstring).

    Raises :class:`ScheduleError` when a version a micro-batch needs is not yet
    made when its forward runs (2bw with ``m`` below the in-flight count), or
    when the replicas' per-update all-reduces would deadlock the stream.
    """
    check_async_stage_graph(sg)
    stream = stream_schedule(sg, spec.name, num_windows)
    n = sg.num_micro_batches(0) * num_windows
    if n % spec.update_every:
        raise InputError(f"2bw with --update-every {spec.update_every} needs a multiple of {spec.update_every} "
                         f"micro-batches; the run streams {n} ({num_windows} steps x {sg.num_micro_batches(0)}) — "
                         f"pick --steps or m so that m divides steps x micro-batches")
    sizes = group_sizes(sg, spec)
    made_before = [[0] * n for _ in sg.stages]  # updates done on the replica running i when its forward starts
    for st in sg.stages:
        per_replica = sizes[st.id] // st.num_replicas if st.round_robin else sizes[st.id]
        for d in st.devices:
            for i, done in _updates_before_forwards(stream.device_actions[d], st.id, per_replica).items():
                made_before[st.id][i] = done
    if spec.name == "2bw":
        wanted = [[max(0, i // spec.update_every - 1) for i in range(n)] for _ in sg.stages]
    elif spec.vertical_sync:
        wanted = [list(made_before[0]) for _ in sg.stages]
    else:
        wanted = made_before
    for st in sg.stages:
        late = [i for i in range(n) if wanted[st.id][i] > made_before[st.id][i]]
        if late:
            i = late[0]
            raise ScheduleError(f"{spec.name}: micro-batch {i} needs version {wanted[st.id][i]} on stage {st.id}, "
                                f"but only {made_before[st.id][i]} update(s) are done when its forward runs; "
                                f"use --update-every >= the stage's in-flight count")
    table = VersionTable(spec, n, tuple(tuple(v) for v in wanted), sizes, ())
    _check_allreduce_order(sg, stream, table)
    peak = tuple(tuple(_peak_stashed(stream.device_actions[d], st, table) if spec.stash else 0 for d in st.devices)
                 for st in sg.stages)
    return replace(table, peak_stashed=peak)


def _updates_before_forwards(actions, stage_id: int, per_update: int) -> dict[int, int]:
    """For each forward of the stage on this device: updates done before it (``per_update`` of its backwards each)."""
    out = {}
    backwards = 0
    for a in actions:
        if a.stage_id != stage_id:
            continue
        if a.kind == "F":
            out[a.mb_id] = backwards // per_update  # backwards run in micro-batch order: groups close in order
        else:
            backwards += 1
    return out


def _peak_stashed(actions, stage, table: VersionTable) -> int:
    """Most versions alive besides the latest on one device, sweeping its order (the runtime's bookkeeping).

    Version ``k`` stays alive while it is the latest or a micro-batch ``i`` of
    this device with ``version[i] == k`` has not finished its backward.
    """
    version = table.version[stage.id]
    per_replica = stage.num_replicas if stage.round_robin else 1
    mine = [a.mb_id for a in actions if a.stage_id == stage.id and a.kind == "F"]
    pending: dict[int, int] = {}
    for i in mine:
        pending[version[i]] = pending.get(version[i], 0) + 1
    latest, peak = 0, 0
    for a in actions:
        if a.stage_id != stage.id or a.kind != "B":
            continue
        pending[version[a.mb_id]] -= 1
        if table.closes_group(stage.id, a.mb_id, per_replica):
            latest += 1
        peak = max(peak, sum(1 for k, left in pending.items() if left > 0 and k < latest))
    return peak


def _check_allreduce_order(sg: StageGraph, stream: Schedule, table: VersionTable) -> None:
    """Refuse a stream whose per-update all-reduces deadlock: zero-time replay of every device's list where the
    action after a replica's group-closing backward waits for every replica's closing backward of that group."""
    lists = stream.device_actions
    pos = [0] * len(lists)
    done: set[tuple[int, str, int]] = set()
    closed: dict[tuple[int, int], int] = {}  # (stage, group) -> replicas through their closing backward
    waiting: list[tuple[int, int] | None] = [None] * len(lists)
    progress = True
    while progress:
        progress = False
        for d, acts in enumerate(lists):
            while pos[d] < len(acts):
                if waiting[d] is not None:
                    s, g = waiting[d]
                    if closed.get((s, g), 0) < sg.stages[s].num_replicas:
                        break
                    waiting[d] = None
                a = acts[pos[d]]
                if not all((p, "F", j) in done for p in sg.preds(a.stage_id) for j in
                           sg.consumed_mbs(p, a.stage_id, a.mb_id)) if a.kind == "F" else not (
                        (a.stage_id, "F", a.mb_id) in done and all((c, "B", a.mb_id) in done
                                                                   for c in sg.succs(a.stage_id))):
                    break
                st = sg.stages[a.stage_id]
                done.add((a.stage_id, a.kind, a.mb_id))
                pos[d] += 1
                progress = True
                per_replica = st.num_replicas if st.round_robin else 1
                if a.kind == "B" and st.num_replicas > 1 and table.closes_group(st.id, a.mb_id, per_replica):
                    key = (st.id, table.group_of(st.id, a.mb_id))
                    closed[key] = closed.get(key, 0) + 1
                    waiting[d] = key
    stuck = [(d, lists[d][pos[d]]) for d in range(len(lists)) if pos[d] < len(lists[d])]
    if stuck:
        raise ScheduleError(f"{table.spec.name}: the replicas' per-update gradient all-reduces deadlock the stream "
                            f"(blocked: " + ", ".join(f"device {d} at {a}" for d, a in stuck[:4]) + ")")


def async_figures(sg: StageGraph, cluster: Cluster, spec: AsyncSpec, host=None) -> dict[str, Any]:
    """The ``predicted`` figures of an asynchronous schedule: steady-state time and memory (module docstring)."""
    from graphpipe.sched.simulator import predicted_figures, simulate

    check_async_stage_graph(sg)
    short, long = (simulate(stream_graph(sg, w), stream_schedule(sg, spec.name, w), cluster, host=host)
                   for w in STEADY_WINDOWS)
    pipeline_s = (long.iteration_time_s - short.iteration_time_s) / (STEADY_WINDOWS[1] - STEADY_WINDOWS[0])
    # enough mini-batches for whole update groups: a multiple of m / gcd(m, M), at least the longer stream
    unit = spec.update_every // math.gcd(spec.update_every, sg.num_micro_batches(0))
    table = version_table(sg, spec, unit * -(-STEADY_WINDOWS[1] // unit))
    # per update a stage's gradients are reduced (and an FSDP stage gathered for the step gathers its
    # parameters again: the release it has once per stream cancels in the difference above)
    allreduce_s = max((sg.num_micro_batches(0) / table.group_size[st.id]
                       * (sg.sync_time(st.id, cluster) + sg.gather_time(st.id, cluster))
                       for st in sg.stages if st.num_replicas > 1), default=0.0)  # per iteration
    iteration_s = pipeline_s + allreduce_s
    stash = [0.0] * sg.num_devices
    for st in sg.stages:
        for q, d in enumerate(st.devices):
            stash[d] += costs.weight_versions_bytes(sg.param_bytes(st.id), table.peak_stashed[st.id][q])
    figures = predicted_figures(long)
    peak = [p + s for p, s in zip(long.peak_memory_bytes, stash)]
    figures.update({
        "iteration_time_s": iteration_s, "throughput": sg.batch_size / iteration_s if iteration_s > 0 else 0.0,
        "peak_memory_bytes": peak, "max_peak_memory_bytes": max(peak, default=0.0),
        "stashed_weight_bytes": stash, "stashed_versions": [list(v) for v in table.peak_stashed],
        "schedule": spec.name, "iteration": f"steady state: (T({STEADY_WINDOWS[1]}M) - T({STEADY_WINDOWS[0]}M)) / "
                                            f"{STEADY_WINDOWS[1] - STEADY_WINDOWS[0]} + per-update all-reduces",
        "async": spec.to_dict()})
    busy = long.busy_s
    used = long.devices_used()
    figures["bubble_fraction"] = [1.0 - min(1.0, busy[d] / STEADY_WINDOWS[1] / iteration_s) if d in used else 1.0
                                  for d in range(sg.num_devices)]
    figures["mean_bubble_fraction"] = (sum(figures["bubble_fraction"][d] for d in used) / len(used)) if used else 1.0
    return figures


def with_async(plan, spec: AsyncSpec, host=None):
    """``plan`` under the asynchronous schedule ``spec``: renamed 1F1B window, ``async`` options, predicted figures.

    The stage graph is unchanged (a sequential plan stays sequential); the
    predicted figures are the steady state of :func:`async_figures`.
    """
    check_async_stage_graph(plan.stage_graph)
    schedule = make_schedule(spec.name, plan.stage_graph, plan.cluster)
    figures = async_figures(plan.stage_graph, plan.cluster, spec, host=host)
    return replace(plan, schedule=schedule, predicted=figures, asynchrony=spec.to_dict())


def plan_spec(plan) -> AsyncSpec | None:
    """The :class:`AsyncSpec` of a plan whose schedule is asynchronous, else None (its window is checked)."""
    if plan.schedule.name not in ASYNC_SCHEDULES:
        return None
    check_async_stage_graph(plan.stage_graph)
    window = stream_schedule(plan.stage_graph, plan.schedule.name, 1)
    if window.device_actions != plan.schedule.device_actions:
        raise InputError(f"schedule {plan.schedule.name!r} is generated, not edited: the plan's actions differ from "
                         f"the 1F1B window graphpipe streams — regenerate it with --schedule {plan.schedule.name}")
    a = plan.asynchrony
    return AsyncSpec(name=plan.schedule.name, vertical_sync=bool(a.get("vertical_sync", False)),
                     update_every=a.get("update_every", plan.stage_graph.num_micro_batches(0)
                                        if plan.schedule.name == "2bw" else 1),
                     stash=bool(a.get("stash", True)))
