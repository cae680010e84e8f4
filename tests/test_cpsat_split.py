"""CP-SAT with zero bubble's split backward (I/W): the brute force over split orders is its oracle, and it is
never worse than the unsplit model (an unsplit schedule is a split one with each W right after its I)."""

from __future__ import annotations

import pytest

pytest.importorskip("ortools")

from graphpipe.actions import Action  # noqa: E402
from graphpipe.cluster import preset  # noqa: E402
from graphpipe.errors import InputError  # noqa: E402
from graphpipe.plan import Plan  # noqa: E402
from graphpipe.sched import graph_1f1b, make_schedule, simulate  # noqa: E402
from graphpipe.search.cpsat import optimize_plan, solve  # noqa: E402
from graphpipe.stages import Stage, StageGraph  # noqa: E402

from test_cpsat import TIME_LIMIT, brute_force, chain, check_result, diamond, one_stage_per_op  # noqa: E402


def split_stage_orders(stage_id: int, num_mbs: int):
    """Every order of a stage's F, I, W tasks with I after its F and W after its I."""
    def rec(prefix, done):
        if len(prefix) == 3 * num_mbs:
            yield tuple(prefix)
            return
        for j in range(num_mbs):
            step = done.get(j, 0)
            if step < 3:
                yield from rec(prefix + [Action(stage_id, "FIW"[step], j)], {**done, j: step + 1})
    yield from rec([], {})


def split_brute_force(sg: StageGraph, cluster) -> float:
    """test_cpsat's brute force over every F/I/W order of each stage."""
    return brute_force(sg, cluster, orders=split_stage_orders)


@pytest.mark.parametrize("tight", [False, True])
def test_split_optimum_equals_brute_force(tight):
    """Two stages, two micro-batches: every F/I/W order of each stage (20 each); with tight memory only one
    micro-batch's activations fit beside the model state, so W can no longer be deferred past the next F."""
    sg = one_stage_per_op(chain(2), 2, 1)
    cluster = preset("v100", 2)
    if tight:
        cluster = cluster.with_memory(cluster.state_bytes(4e6) + 2e7 + 1.5e6)  # state, buffers, 1.5 micro-batches
    res = solve(sg, cluster, time_limit_s=TIME_LIMIT, num_workers=1, split_backward=True)
    check_result(res, cluster)
    best = split_brute_force(sg, cluster)
    assert res.status == "OPTIMAL"
    assert res.makespan_s == pytest.approx(best, rel=1e-9)
    assert res.lower_bound_s <= best + 1e-15
    assert {a.kind for acts in res.schedule.device_actions for a in acts} == {"F", "I", "W"}


@pytest.mark.parametrize("name,sg,num_devices", [
    ("chain3", one_stage_per_op(chain(3), 4, 1), 3),
    ("diamond", one_stage_per_op(diamond(), 4, 1), 4),
    ("diamond-mb2", one_stage_per_op(diamond(), 8, 2), 4),
])
def test_split_never_worse_than_unsplit(name, sg, num_devices):
    """Up to the model's time rounding (each of I and W rounds up on its own), and strictly better on these:
    the producers wait for I only and W fills idle time. The split bound never exceeds the unsplit optimum."""
    cluster = preset("v100", num_devices)
    plain = solve(sg, cluster, time_limit_s=TIME_LIMIT, num_workers=1)
    split = solve(sg, cluster, time_limit_s=TIME_LIMIT, num_workers=1, split_backward=True)
    check_result(split, cluster)
    assert split.makespan_s <= plain.makespan_s + split.rounding_slack_s
    assert split.lower_bound_s <= plain.makespan_s + 1e-15
    zb = simulate(sg, make_schedule("graph-zb", sg, cluster), cluster)
    assert split.makespan_s <= zb.iteration_time_s * (1 + 1e-12)  # never worse than its warm start
    assert split.makespan_s < plain.makespan_s


def test_optimize_plan_splits_by_default_where_allowed():
    sg = one_stage_per_op(chain(3), 4, 1)
    cluster = preset("v100", 3)
    plan = Plan(model="chain3", stage_graph=sg, cluster=cluster, strategy="custom", schedule=graph_1f1b(sg, cluster),
                search={"strategy": "custom", "time_s": 0.0})
    new = optimize_plan(plan, time_limit_s=TIME_LIMIT, per_stage_micro_batch=False)
    assert new.search["cpsat_split_backward"] is True
    assert {a.kind for acts in new.schedule.device_actions for a in acts} == {"F", "I", "W"}
    off = optimize_plan(plan, time_limit_s=TIME_LIMIT, per_stage_micro_batch=False, split_backward=False)
    assert {a.kind for acts in off.schedule.device_actions for a in acts} == {"F", "B"}
    assert new.predicted["iteration_time_s"] <= off.predicted["iteration_time_s"]
    recomputing = StageGraph.build(sg.graph, [Stage(s.id, s.op_ids, s.devices, s.micro_batch_size, True)
                                              for s in sg.stages], 4, 3)
    plan_rc = Plan(model="chain3", stage_graph=recomputing, cluster=cluster, strategy="custom",
                   schedule=graph_1f1b(recomputing, cluster), search={"strategy": "custom", "time_s": 0.0})
    kept = optimize_plan(plan_rc, time_limit_s=TIME_LIMIT, per_stage_micro_batch=False)
    assert kept.search["cpsat_split_backward"] is False  # re-materializing stages are modelled unsplit
    with pytest.raises(InputError, match="re-materialization"):
        solve(recomputing, cluster, time_limit_s=TIME_LIMIT, split_backward=True)
