"""What splitting tied parameters across stages costs a plan.

When ops sharing parameters (:class:`~graphpipe.graph.SharedParams`, found
by the capture: a GPT's embedding and output head) land in different
stages, the runtime keeps the parameter in the first of those stages and a
copy in every other one, and sums the copies' gradients once per iteration
before the optimizer step (Megatron's tied-embedding all-reduce; see
:mod:`graphpipe.runtime.stage_modules`). Every partitioner's plan is thus
runnable whatever it does with tied ops; the plan's prediction is charged

* memory: model state (:meth:`~graphpipe.cluster.Cluster.state_bytes`) of
  the shared bytes on every device of every stage holding a copy;
* time: a ring all-reduce of the shared bytes over the devices of every
  owning stage, on the iteration's tail (after the last backward, as the
  runtime does it), and what each copy adds to its stage's own gradient
  all-reduce over its replicas (:func:`copy_sync_s`), added to the simulated
  iteration time.

The plain searches do not see these terms (the DPs cost stages one at a
time, and a tie couples two stages); the layout searches see a copy's
memory (:func:`with_copies`), not the all-reduce, which is small beside a
stage's time for the models we know (one embedding matrix per iteration).
The memory check of :func:`~graphpipe.search.planner.make_plan` runs on the
charged figures, so a plan whose copies do not fit is refused.

Every command that predicts a plan's iteration charges it the same way
(:func:`charge_plan`): ``graphpipe plan``, ``graphpipe simulate`` (flushing
and asynchronous schedules), CP-SAT's re-timed plans and ``graphpipe run``'s
predicted column, so one plan has one prediction whichever prints it.

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, SharedParams
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("lm", [Op("embed", "x", param_bytes=4e6), Op("head", "x")], [("embed", "head", 1.0)],
...                   [SharedParams(("embed", "head"), 4e6)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], 8, 2)
>>> seconds, extra = shared_params_cost(sg, g.shared, {}, preset("v100", 2))
>>> seconds > 0, extra == {1: preset("v100", 2).state_bytes(4e6)}
(True, True)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from graphpipe.cluster import Cluster
from graphpipe.graph import OpGraph, SharedParams
from graphpipe.stages import StageGraph

__all__ = ["shared_params_cost", "charge_shared_params", "charge_plan", "with_copies"]


def _stage_of_name(sg: StageGraph, name: str, merged: Mapping[str, Sequence[str]]) -> int | None:
    for op_id, op in enumerate(sg.graph.ops):
        if op.name == name or name in merged.get(op.name, ()):
            return sg.stage_of(op_id)
    return None


def _split_ties(sg: StageGraph, shared: Sequence[SharedParams], merged: Mapping[str, Sequence[str]]):
    """``(tie, its stages in order)`` of each tie whose ops ``sg`` puts in two stages or more."""
    for group in shared:
        stages = sorted({s for s in (_stage_of_name(sg, name, merged) for name in group.ops) if s is not None})
        if len(stages) >= 2:
            yield group, stages


def with_copies(graph: OpGraph) -> OpGraph:
    """``graph`` as a layout search plans it: every op of a tie but the first (graph order) carries the tied
    bytes among its own parameters, the copy it holds when a plan splits the tie (conservative when one stage
    holds them all), and no ties are left to charge. The searches cost stages one at a time and do not see
    ties; without this a layout whose head stage holds a copy of a large embedding (Command-R+'s 12.6 GB at a
    vocabulary of 256,000) planned past device memory and was refused after its search.

    >>> from graphpipe.graph import Op, OpGraph, SharedParams
    >>> g = OpGraph.build("lm", [Op("embed", "x", param_bytes=4e6), Op("head", "x")], [("embed", "head", 1.0)],
    ...                   [SharedParams(("embed", "head"), 4e6)])
    >>> [op.param_bytes for op in with_copies(g).ops], with_copies(g).shared
    ([4000000.0, 4000000.0], ())
    """
    extra: dict[str, float] = {}
    for group in graph.shared:
        for name in group.ops[1:]:
            extra[name] = extra.get(name, 0.0) + group.bytes
    ops = tuple(replace(op, param_bytes=op.param_bytes + extra[op.name]) if op.name in extra else op
                for op in graph.ops)
    return replace(graph, ops=ops, shared=())


def shared_params_cost(sg: StageGraph, shared: Sequence[SharedParams], merged: Mapping[str, Sequence[str]],
                       cluster: Cluster) -> tuple[float, dict[int, float]]:
    """``(all-reduce seconds per iteration, extra bytes per device)`` of the ties ``sg`` splits.

    ``merged`` maps ops of ``sg.graph`` made by contraction to the original
    names (``Plan.merged``), so ties of the original graph are found in them.
    """
    seconds, extra = 0.0, {}
    for group, stages in _split_ties(sg, shared, merged):
        devices = sorted({d for s in stages for d in sg.stages[s].devices})
        if len(devices) > 1:
            seconds += cluster.allreduce_time(devices, group.bytes)
        for s in stages[1:]:  # the first stage keeps the parameter; each other one holds a copy
            copy = copy_state_bytes(sg, s, group, cluster)
            for d in sg.stages[s].devices:
                extra[d] = extra.get(d, 0.0) + copy
            seconds += copy_sync_s(sg, s, group, cluster)
    return seconds, extra


def copy_sync_s(sg: StageGraph, stage_id: int, group: SharedParams, cluster: Cluster) -> float:
    """Seconds a tie's copy adds to stage ``stage_id``'s own step-end gradient collective over its replicas
    (the copy is one of the stage's parameters, so the runtime reduces it with the rest before the copies are
    summed): the bandwidth term of a ring over the replicas on the stage's link for the whole copy on each tp
    rank (:func:`copy_state_bytes` says why; the stage's collective pays the latency); nothing for one replica
    or FSDP resharding after forward (its collectives run per micro-batch)."""
    from graphpipe import costs

    st = sg.stages[stage_id]
    if st.num_replicas < 2 or (st.shard == "fsdp" and st.reshard_after_forward):
        return 0.0
    link = cluster.allreduce_link(st.devices[::st.tp])
    return float(costs.ring_allreduce_s(st.num_replicas, 0.0, link.bandwidth_Bps, group.bytes))


def copy_state_bytes(sg: StageGraph, stage_id: int, group: SharedParams, cluster: Cluster) -> float:
    """Model-state bytes of a tie's copy on one device of stage ``stage_id``, laid out as the stage is: sharded
    over the replicas under FSDP (:func:`graphpipe.costs.layout_state_bytes`), whole on every tp rank (the op
    reading a copy holds no parameters of its own in the graph, so the cost model runs it replicated in a tp
    group, :func:`graphpipe.costs.tp_rule`: nothing to split); whole copies as
    :meth:`~graphpipe.cluster.Cluster.state_bytes`.

    >>> from graphpipe.cluster import preset
    >>> from graphpipe.graph import Op, OpGraph, SharedParams
    >>> from graphpipe.stages import Stage, StageGraph
    >>> g = OpGraph.build("lm", [Op("embed", "embedding", param_bytes=4e6), Op("head", "linear")],
    ...                   [("embed", "head", 1.0)], [SharedParams(("embed", "head"), 4e6)])
    >>> c = preset("h100", 8)
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 4), Stage(1, (1,), (4, 5, 6, 7), 4, tp=2)], 8, 8, cluster=c)
    >>> copy_state_bytes(sg, 1, g.shared[0], c) == c.state_bytes(4e6)
    True
    >>> fsdp = StageGraph.build(g, [Stage(0, (0,), (0,), 4), Stage(1, (1,), (4, 5, 6, 7), 4, shard="fsdp",
    ...                                                                 reshard_after_forward=False)], 8, 8, cluster=c)
    >>> copy_state_bytes(fsdp, 1, g.shared[0], c) == 2 * 4e6 + (c.state_bytes(4e6) - 2 * 4e6) / 4
    True
    """
    from graphpipe import costs

    st = sg.stages[stage_id]
    if not st.parallel:
        return cluster.state_bytes(group.bytes)
    return float(costs.layout_state_bytes(group.bytes, group.bytes, st.num_replicas, st.shard, st.reshard_after_forward,
                                          cluster.bytes_per_param))


def charge_shared_params(predicted: Mapping[str, Any], sg: StageGraph, shared: Sequence[SharedParams],
                         merged: Mapping[str, Sequence[str]], cluster: Cluster) -> dict[str, Any]:
    """The simulator's ``predicted`` figures with :func:`shared_params_cost` added (unchanged when no tie is split)."""
    seconds, extra = shared_params_cost(sg, shared, merged, cluster)
    out = dict(predicted)
    if not seconds and not extra:
        return out
    if "iteration_time_s" in out:
        out["iteration_time_s"] = float(out["iteration_time_s"]) + seconds
        out["throughput"] = sg.batch_size / out["iteration_time_s"]
    if "peak_memory_bytes" in out:
        peaks = [float(b) + extra.get(d, 0.0) for d, b in enumerate(out["peak_memory_bytes"])]
        out["peak_memory_bytes"] = peaks
        out["max_peak_memory_bytes"] = max(peaks) if peaks else 0.0
    out["shared_params_allreduce_s"] = seconds
    out["shared_params_copy_bytes"] = sum(extra.values())
    return out


def charge_plan(figures: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """``figures`` simulated for ``plan`` (a :class:`~graphpipe.plan.Plan`) charged for the ties its stages split
    (:func:`charge_shared_params` over the plan's own graph and ``merged`` names): what every command prints."""
    graph = plan.stage_graph.graph
    if not graph.shared:
        return dict(figures)
    return charge_shared_params(figures, plan.stage_graph, graph.shared, plan.merged or {}, plan.cluster)
