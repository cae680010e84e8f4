"""Parallelism inside stages, searched with the graph of stages (docs/design.md#parallelism-inside-a-stage).

A *layout* is how every stage of a plan is parallel inside itself: tensor
parallelism over groups of ``tp`` devices of one node (Megatron-LM §3, always
with sequence parallelism, Korthikanti et al. 2022: :attr:`Stage.sequence_parallel
<graphpipe.stages.Stage.sequence_parallel>`) and
FSDP / ZeRO-3 sharding over its replicas (:mod:`graphpipe.costs`, "parallelism
inside a stage"). The planner searches a layout without touching the
partitioners: a plan with layout ``(tp, shard)`` on ``N`` devices is planned
as a whole-copy plan of a *reduced* problem and then expanded.

* The reduced graph (:func:`reduced_graph`) is the op graph as one device of a
  tp group runs it (:func:`graphpipe.costs.tp_layer`: split compute, the
  group's collectives, a tp rank's weights and activations); FSDP's
  per-micro-batch gathers are added to the ops' per-call times.
* The reduced cluster (:func:`reduced_cluster`) has one *unit* per
  ``tp * group`` devices: a tp group, times ``group`` replicas taken together
  when ``N / tp`` is more than :data:`MAX_UNITS` (the searches' device axes
  stay at most that long, whatever ``N``). A unit's replicas process one
  micro-batch of the reduced problem each, so the reduced batch is ``B / group``.
  FSDP's sharded model state is priced by a lower ``bytes_per_param``.
* :func:`expand` turns the reduced plan's stages back: unit ``u`` is devices
  ``u*tp*group .. (u+1)*tp*group - 1``, a stage on ``r`` units has ``r * group``
  replicas of ``tp`` devices, its micro-batch ``group`` times larger (the same
  samples per replica), and the full stage graph prices it exactly
  (:class:`graphpipe.stages.StageGraph`), so the simulator, not the reduced
  problem, has the last word.

The planner tries :func:`candidates` and keeps the fastest simulated plan;
the PP-only layout (tp 1, whole copies) is always one of them when allowed, so
a layout search is never worse than ``--tp 1 --shard none`` by construction.
Where the fastest plan leaves devices idle, gpp tries its two fastest
whole-copy layouts again with round-robin replicas (:attr:`Layout.round_robin`:
micro-batch 1, a stage on any power of two up to a node or whole nodes, its
replicas taking micro-batches in turn; past :data:`MAX_UNITS` a unit's
``group`` replicas are one round-robin group splitting its micro-batches),
which uses the devices power-of-two stages leave idle.

Example
-------
>>> [(layout.tp, layout.shard, layout.group) for layout in candidates(8, 512, 8, "auto", "auto", 2048)[:3]]
[(1, 'none', 1), (1, 'fsdp', 1), (2, 'none', 1)]
>>> candidates(16384, 16384, 8, 8, "none", 32768)
(Layout(tp=8, shard='none', group=2, round_robin=False, keep_gathered=False),)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from graphpipe import costs
from graphpipe.cluster import Cluster
from graphpipe.errors import InputError
from graphpipe.graph import Affine, OpGraph
from graphpipe.stages import Stage, StageGraph

__all__ = ["Layout", "PP_ONLY", "ROUND_ROBIN_MAX_BATCH", "MAX_UNITS", "TP_CHOICES", "SHARD_CHOICES",
           "parse_tp", "parse_shard", "candidates",
           "group_for", "reduced_graph", "reduced_cluster", "expand", "splittable_ops"]

MAX_UNITS = 1024
"""Most units (device groups) a partitioner sees: past it, replicas are taken ``group`` at a time. 1,024 is the
device count the searches were sized for (graphpipe.cluster's old limit)."""

TP_CHOICES = (1, 2, 4, 8)
"""``--tp`` values: powers of two up to a node of 8 (Megatron keeps tensor parallelism inside NVLink)."""

SHARD_CHOICES = ("auto", "none", "fsdp")
"""``--shard`` values."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One uniform layout: every stage tp ``tp``, sharded ``shard`` (FSDP keeps its parameters gathered for the
    step: ``reshard_after_forward`` false, torchtitan's setting under pipelining), replicas in groups of ``group``."""

    tp: int = 1
    shard: str = "none"
    group: int = 1
    round_robin: bool = False
    """Whole copies at micro-batch size 1 in the reduced problem, a stage's units taking whole micro-batches in
    turn, so that its device count need not divide a micro-batch (:attr:`SearchOptions.round_robin
    <graphpipe.search.common.SearchOptions.round_robin>`; gpp only, shard none): a unit of ``group`` replicas
    becomes one round-robin group that splits its micro-batches of ``group`` samples (:func:`expand`)."""
    keep_gathered: bool = False
    """tp > 1 only: every stage keeps sequence parallelism's gathered inputs whole for backward
    (:attr:`Stage.keep_gathered <graphpipe.stages.Stage.keep_gathered>`) instead of gathering them again."""

    @property
    def pp_only(self) -> bool:
        return self.tp == 1 and self.shard == "none"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tp": self.tp, "shard": self.shard, "replica_group": self.group}
        if self.round_robin:
            out["round_robin"] = True
        if self.keep_gathered:
            out["keep_gathered"] = True
        return out


ROUND_ROBIN_MAX_BATCH = 4096
"""The round-robin layout is tried up to this many micro-batches, ``B / group``: it has a micro-batch per
sample of a unit, and the simulator's work grows with the micro-batches (2,048 of them on 30 stages simulate
in about a second)."""


PP_ONLY = Layout()


def parse_tp(value: Any) -> int | str:
    """``--tp``: ``auto`` or one of :data:`TP_CHOICES`; anything else is a one-line :class:`InputError`."""
    if value in (None, "auto"):
        return "auto"
    try:
        tp = int(value)
    except (TypeError, ValueError):
        tp = None
    if isinstance(value, bool) or tp not in TP_CHOICES or str(value).strip() != str(tp) and not isinstance(value, int):
        raise InputError(f"--tp must be auto or one of {', '.join(map(str, TP_CHOICES))}, got {value!r}")
    return tp


def parse_shard(value: Any) -> str:
    """``--shard``: one of :data:`SHARD_CHOICES`."""
    value = "auto" if value is None else value
    if value not in SHARD_CHOICES:
        raise InputError(f"--shard must be one of {', '.join(SHARD_CHOICES)}, got {value!r}")
    return value


def group_for(num_devices: int, tp: int, batch_size: int) -> int | None:
    """Replicas per unit: 1, or the least power of two keeping ``num_devices / (tp * group)`` at most
    :data:`MAX_UNITS`; None when it does not divide the batch or the devices.

    >>> group_for(512, 8, 2048), group_for(16384, 8, 32768), group_for(16384, 1, 32768), group_for(16384, 8, 3)
    (1, 2, 16, None)
    """
    group = 1
    while num_devices // (tp * group) > MAX_UNITS:
        group *= 2
    if num_devices % (tp * group) or batch_size % group:
        return None
    return group


def candidates(devices_per_node: int, num_devices: int, max_tp: int, tp: int | str, shard: str, batch_size: int
               ) -> tuple[Layout, ...]:
    """The layouts to try, PP-only first: ``tp`` (``auto``: every :data:`TP_CHOICES` value dividing the node and
    at most ``max_tp``) times ``shard`` (``auto``: none and fsdp)."""
    tps = [t for t in TP_CHOICES if t <= max_tp] if tp == "auto" else [tp]
    shards = ["none", "fsdp"] if shard == "auto" else [shard]
    out = []
    for t in tps:
        if t > 1 and (devices_per_node % t or num_devices % t):
            continue
        for s in shards:
            group = group_for(num_devices, t, batch_size)
            if group is not None:
                out.append(Layout(t, s, group))
    return tuple(out)


def splittable_ops(graph: OpGraph) -> int:
    """How many ops tensor parallelism splits (:func:`graphpipe.costs.tp_rule`)."""
    return sum(1 for op in graph.ops if not costs.tp_rule(op.kind, op.param_bytes)[2])


def _fsdp_replicas(layout: Layout) -> int:
    """Replicas the reduced problem assumes an FSDP stage shards over: its unit's, and at least 2."""
    return max(2, layout.group)


def reduced_graph(graph: OpGraph, cluster: Cluster, layout: Layout) -> OpGraph:
    """The op graph as one device of a unit runs it (module docstring); ``graph`` itself for PP-only. TP ops are
    priced sequence parallel with their inputs gathered again in backward (:func:`graphpipe.costs.tp_layer`),
    or kept whole under :attr:`Layout.keep_gathered`; the first also for the stages the search then
    re-materializes, which the runtime runs without that gather and whose rebuild keeps those inputs whole: the
    expanded plan prices them exactly and its memory check refuses a reduced plan that does not fit once they
    are (the layout is then dropped)."""
    if layout.tp == 1:
        return graph
    link = cluster.intra_node
    return replace(graph, ops=tuple(costs.tp_layer(op, layout.tp, link.latency_s, link.bandwidth_Bps, True,
                                                   regather=not layout.keep_gathered) for op in graph.ops))


def reduced_cluster(cluster: Cluster, layout: Layout) -> Cluster:
    """One device per unit (module docstring). FSDP: the optimizer's share of the state (all of it but the
    gathered weights and gradients, 8 of every 16 bytes for Adam) over :func:`_fsdp_replicas`."""
    size = layout.tp * layout.group
    reduced = replace(cluster, num_devices=cluster.num_devices // size,
                      devices_per_node=max(1, cluster.devices_per_node // size))
    if layout.shard == "fsdp":
        kept = min(cluster.bytes_per_param, 8.0)
        reduced = replace(reduced, bytes_per_param=kept + (cluster.bytes_per_param - kept) / _fsdp_replicas(layout))
    return reduced


def expand(sg: StageGraph, graph: OpGraph, cluster: Cluster, layout: Layout, batch_size: int) -> StageGraph:
    """The reduced plan's stage graph ``sg`` on the full ``cluster`` (module docstring), over ``graph`` (the
    same ops by name). A stage of ``r`` units is round-robin under the round-robin layouts
    (:attr:`Layout.round_robin`) and where the reduced plan made it so (PipeDream's space, which gpp ranks):
    over ``r`` groups of ``group`` replicas (``split``), each group taking whole micro-batches of ``group`` times
    the reduced size in turn and splitting them (as the reduced problem's unit runs its micro-batch); other
    stages split every micro-batch over their tp groups; a round-robin stage, or one left with one replica, is
    not sharded (its replicas are whole copies; FSDP over one replica is a whole copy)."""
    size = layout.tp * layout.group
    stages = []
    for st in sg.stages:
        devices = tuple(d for u in st.devices for d in range(u * size, (u + 1) * size))
        op_ids = tuple(graph.op_id(sg.graph.ops[i].name) for i in st.op_ids)
        checkpoints = tuple(graph.op_id(sg.graph.ops[i].name) for i in st.checkpoints)
        replicas = len(devices) // layout.tp
        mode = "round-robin" if (layout.round_robin or st.round_robin) and replicas > 1 else "split"
        shard = layout.shard if replicas > 1 and mode == "split" else "none"  # round-robin replicas: whole copies
        split = layout.group if mode == "round-robin" else 1
        stages.append(_whole_recompute(Stage(st.id, op_ids, devices, st.micro_batch_size * layout.group,
                                             st.recompute, replica_mode=mode, checkpoints=checkpoints, split=split,
                                             tp=layout.tp, shard=shard, sequence_parallel=layout.tp > 1,
                                             keep_gathered=layout.keep_gathered and layout.tp > 1 and not st.recompute,
                                             reshard_after_forward=False if shard == "fsdp" else True)))
    return StageGraph(graph, tuple(stages), batch_size, cluster.num_devices, allow_shared_devices=sg.allow_shared_devices,
                      sequential=sg.sequential, cluster=cluster)


def work_per_sample(graph: OpGraph) -> float:
    """Seconds of forward and backward per sample summed over the ops (the per-sample coefficients, no per-call
    part): the ideal's work, ``efficiency = throughput / (devices / work)``.

    >>> from graphpipe.graph import Op
    >>> work_per_sample(OpGraph.build("a", [Op("a", "x", Affine(1.0, 2.0), Affine(0.0, 4.0))], []))
    6.0
    """
    return float(sum(op.fwd.beta + op.bwd.beta for op in graph.ops))


def efficiency(throughput: float, num_devices: int, graph: OpGraph) -> float:
    """``throughput / (num_devices / work_per_sample)``: the share of perfect scaling a plan reaches."""
    return throughput * work_per_sample(graph) / num_devices if num_devices else math.nan


def efficiency_factors(plan, num_devices: int | None = None) -> dict[str, float] | None:
    """Where a plan's :func:`efficiency` goes: three shares whose product it is (``used_share * balance *
    busy_share``), from the plan's own simulated figures; None without per-device busy times or op costs.

    * ``used_share``: devices the plan uses over ``num_devices`` (default its cluster's): idle devices;
    * ``balance``: the busiest device's compute against the ideal share of the devices used,
      ``(batch / busiest busy seconds) / (used / work per sample)``: stages of unequal load, per-call
      overheads, TP's collectives and FSDP's per-micro-batch gathers (all inside a device's busy time);
    * ``busy_share``: the busiest device's busy seconds over the iteration: fill and drain, waits on
      transfers, step-end gradient collectives.

    >>> from types import SimpleNamespace as NS
    >>> from graphpipe.graph import Op
    >>> g = OpGraph.build("a", [Op("a", "x", Affine(0.0, 1.0), Affine(0.0, 2.0))], [])
    >>> sg = NS(batch_size=8, devices_used=lambda: (0, 1), graph=g)
    >>> f = efficiency_factors(NS(stage_graph=sg, predicted=NS(busy_s=[12.0, 9.0], iteration_time_s=16.0)), 4)
    >>> f, f["used_share"] * f["balance"] * f["busy_share"] == efficiency(8 / 16, 4, g)
    ({'used_share': 0.5, 'balance': 1.0, 'busy_share': 0.75}, True)
    """
    sg = plan.stage_graph
    num_devices = num_devices or plan.cluster.num_devices
    used = len(sg.devices_used())
    busiest = max(plan.predicted.busy_s or [0.0])
    work = work_per_sample(sg.graph)
    if not (used and busiest > 0 and work > 0 and (plan.predicted.iteration_time_s or 0.0) > 0):
        return None
    return {"used_share": used / num_devices, "balance": sg.batch_size / busiest * work / used,
            "busy_share": busiest / plan.predicted.iteration_time_s}


def stage_layouts(stage: Stage, cluster: Cluster, tps: Sequence[int], shards: Sequence[str],
                  batch_size: int | None = None, shard_round_robin: bool = True) -> list[Stage]:
    """``stage`` under every layout of ``tps`` x ``shards`` its devices allow: tp dividing its device count with
    every tp group inside one node, the micro-batch divisible by the replicas (round-robin replicas take whole
    ones, each group at least one of the ``batch_size // micro_batch_size`` micro-batches), FSDP only over 2 or
    more replicas (gathered for the step: ``reshard_after_forward`` false, which round-robin replicas, running
    different micro-batches, can do too: they gather at the step's start and each reduce-scatters after its
    own last backward); each tp
    layout twice for a stage that does not re-materialize, once gathering its column-wise inputs again in
    backward and once keeping them whole (:attr:`Stage.keep_gathered`); a parallel layout re-materializes the
    whole stage where the stage had checkpoint segments. ``shard_round_robin`` false: a round-robin stage is
    not offered FSDP."""
    out = []
    turns = None if batch_size is None else batch_size // stage.micro_batch_size
    for tp in tps:
        n = len(stage.devices)
        if n % tp or (not stage.round_robin and stage.micro_batch_size % (n // tp)) or (n // tp) % stage.split:
            continue
        if stage.round_robin and turns is not None and (n // tp) // stage.split > turns:
            continue  # more groups than micro-batches: a group would never run
        if any(len({cluster.node_of(d) for d in stage.devices[i:i + tp]}) > 1 for i in range(0, n, tp)):
            continue
        for shard in shards:
            if shard == "fsdp" and (n // tp < 2 or (stage.round_robin and not shard_round_robin)):
                continue
            option = _whole_recompute(replace(stage, tp=tp, shard=shard, reshard_after_forward=shard != "fsdp",
                                              sequence_parallel=tp > 1, keep_gathered=False))
            out.append(option)
            if tp > 1 and not option.recompute:
                out.append(replace(option, keep_gathered=True))
    return out


def shard_stages(sg: StageGraph, cluster: Cluster, in_flight: Sequence[int],
                 finish: Sequence[float] | None = None) -> StageGraph:
    """``sg`` with the set of its whole-copy stages (split or round-robin replicas, any tp) FSDP-sharded
    (gathered for the step) that minimizes
    ``max exposed gather + max over stages (finish + step-end collective)``, ``finish[s]`` being when stage
    ``s``'s last backward ends in ``sg``'s simulation (:func:`graphpipe.sched.simulator.stage_finish_times`;
    default 0): a stage gathering its parameters from the step's start delays every stage after it by what the
    pipeline's fill does not hide of that gather (:func:`_fill_times`), while its step-end collective shrinks
    from an all-reduce to a reduce-scatter. So one threshold ``D`` on the exposed gather decides: the stages
    exposing no more than it are sharded, the least ``D + max(finish + collective)`` over the thresholds wins
    if it beats sharding none; stages whose FSDP layout would not fit the device memory at their
    ``in_flight`` micro-batches stay whole, and so do round-robin stages sharing a device with another stage
    (the runtime refuses those: a replica's reduce-scatter holds its device until every replica arrives,
    :func:`graphpipe.runtime.layouts.layout_refusal`)."""
    fill = _fill_times(sg)
    holders: dict[int, int] = {}
    for st in sg.stages:
        for d in st.devices:
            holders[d] = holders.get(d, 0) + 1
    finish = list(finish) if finish is not None else [0.0] * sg.num_stages
    whole_end = [finish[s] + sg.sync_time(s, cluster) for s in range(sg.num_stages)]
    options = {}  # stage -> (exposed gather, its end sharded: finish + reduce-scatter, its FSDP variant)
    for st in sg.stages:
        if st.shard != "none" or st.num_replicas < 2 or (st.round_robin and any(holders[d] > 1 for d in st.devices)):
            continue
        variant = _whole_recompute(replace(st, shard="fsdp", reshard_after_forward=False))
        trial = replace(sg, stages=tuple(variant if x.id == st.id else x for x in sg.stages), cluster=cluster)
        if trial.device_memory(st.id, cluster, max(1, int(in_flight[st.id]))) > cluster.memory_bytes:
            continue
        options[st.id] = (max(0.0, trial.gather_time(st.id, cluster) - fill[st.id]),
                          finish[st.id] + trial.sync_time(st.id, cluster), variant)
    best, best_cost = (), max(whole_end, default=0.0)
    for threshold in sorted({e for e, _, _ in options.values()}):
        chosen = tuple(s for s, (e, _, _) in options.items() if e <= threshold)
        ends = [options[s][1] if s in chosen else whole_end[s] for s in range(sg.num_stages)]
        cost = threshold + max(ends)
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = chosen, cost
    if not best:
        return sg
    return replace(sg, stages=tuple(options[st.id][2] if st.id in best else st for st in sg.stages), cluster=cluster)


def _fill_times(sg: StageGraph) -> list[float]:
    """Per stage, the seconds before its first micro-batch can arrive: the longest path of forwards over the
    stages before it (message delays left out, so a gather is never thought more hidden than it is)."""
    fill = [0.0] * sg.num_stages
    for s in range(sg.num_stages):  # stage ids are a topological order
        fill[s] = max((fill[p] + sg.fwd_time(p) for p in sg.preds(s)), default=0.0)
    return fill


def _whole_recompute(stage: Stage) -> Stage:
    """``stage`` without checkpoint segments where it is parallel inside itself: it re-materializes whole (the
    runtime runs no segments inside FSDP's or DTensor's wrapper), which the plan's memory check then prices."""
    return replace(stage, checkpoints=()) if stage.parallel and stage.checkpoints else stage


def per_stage_layouts(sg: StageGraph, cluster: Cluster, in_flight: Sequence[int], tps: Sequence[int],
                      shards: Sequence[str], shard_round_robin: bool = True) -> StageGraph:
    """Each stage of ``sg`` on its own devices under the layout (:func:`stage_layouts`) that minimizes its
    busy time in one step, ``M (F + B)`` plus its step's collectives (FSDP gathered for the step: the gather
    at its start and the reduce-scatter at its end, an all-reduce's volume, so sharding ties with whole copies
    here), within the device memory at its ``in_flight`` micro-batches (ties: its current layout). What of a
    gather the fill hides, and what an exposed one costs every stage after it, is a choice for the whole plan
    (:func:`shard_stages`), not one stage's. A graph
    of stages may so give a vision tower's stages tp 1 beside a text decoder's tp 4: each branch's stages pick
    for their own layers. The planner keeps the result only when the
    simulation says it is faster. ``shard_round_robin``: :func:`stage_layouts`'s."""
    stages = list(sg.stages)
    for st in sg.stages:
        def busy(trial: StageGraph, stage_id: int = st.id) -> float:
            turns = trial.busiest_replica_micro_batches(stage_id)
            return (turns * (trial.fwd_time(stage_id) + trial.bwd_time(stage_id))
                    + trial.gather_time(stage_id, cluster) + trial.sync_time(stage_id, cluster))

        current = replace(sg, stages=tuple(stages), cluster=cluster)
        best, best_time = stages[st.id], busy(current)
        for option in stage_layouts(st, cluster, tps, shards, sg.batch_size, shard_round_robin):
            trial = replace(current, stages=tuple(option if s.id == st.id else s for s in stages))
            if trial.device_memory(st.id, cluster, max(1, int(in_flight[st.id]))) > cluster.memory_bytes:
                continue
            t = busy(trial)
            if t < best_time * (1 - 1e-9):
                best, best_time = option, t
        stages[st.id] = best
    return replace(sg, stages=tuple(stages), cluster=cluster)


__all__ += ["work_per_sample", "efficiency", "efficiency_factors", "stage_layouts", "per_stage_layouts",
            "shard_stages"]
