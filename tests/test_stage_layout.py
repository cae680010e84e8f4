"""A stage's parallelism inside itself in the plan: ``tp`` and ``shard`` per stage (docs/design.md#plan-files).

Properties: old plans (no keys) read as tp 1 / shard none and write back byte for byte; a layout round-trips;
an inconsistent hand edit is one line naming the stage and the fix; the runtime refuses what it cannot run.
"""

from __future__ import annotations

import json

import pytest

from graphpipe.cluster import preset
from graphpipe.errors import InputError, PlanError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.plan import Plan, plan_from_dict, plan_to_dict
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph


def _plan(layouts: dict[int, dict] | None = None, devices_per_stage: int = 4, devices_per_node: int = 8) -> Plan:
    layouts = layouts or {}
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 400.0, 10.0, 1.0) for i in range(2)],
                      [("l0", "l1", 0.0)])
    stages = [Stage(i, (i,), tuple(range(i * devices_per_stage, (i + 1) * devices_per_stage)), 8, **layouts.get(i, {}))
              for i in range(2)]
    n = 2 * devices_per_stage
    sg = StageGraph.build(g, stages, 32, n)
    cluster = preset("h100", n)
    from dataclasses import replace
    cluster = replace(cluster, devices_per_node=devices_per_node)
    return Plan(model="c", stage_graph=sg, cluster=cluster, strategy="custom", schedule=make_schedule("1f1b", sg, cluster))


def test_whole_copy_plans_write_no_layout_keys_and_read_as_tp1_none():
    doc = plan_to_dict(_plan())
    assert all("tp" not in s and "shard" not in s for s in doc["stages"])
    text = json.dumps(doc)
    back = plan_from_dict(json.loads(text))
    assert all(s.tp == 1 and s.shard == "none" and s.num_replicas == 4 for s in back.stage_graph.stages)
    again = json.dumps(plan_to_dict(back))
    assert json.dumps(plan_to_dict(plan_from_dict(json.loads(again)))) == again


def test_layout_round_trips_and_sets_replicas():
    plan = _plan({0: {"tp": 2}, 1: {"shard": "fsdp", "reshard_after_forward": False}})
    doc = json.loads(json.dumps(plan_to_dict(plan)))
    assert doc["stages"][0]["tp"] == 2 and doc["stages"][0]["shard"] == "none"
    assert "reshard_after_forward" not in doc["stages"][0]
    assert doc["stages"][1]["shard"] == "fsdp" and doc["stages"][1]["reshard_after_forward"] is False
    back = plan_from_dict(doc)
    s0, s1 = back.stage_graph.stages
    assert (s0.tp, s0.num_replicas, s0.tp_groups) == (2, 2, ((0, 1), (2, 3)))
    assert s0.samples_per_replica == 4.0  # 8 per micro-batch over 2 tp groups
    assert (s1.shard, s1.reshard_after_forward, s1.num_replicas) == ("fsdp", False, 4)


@pytest.mark.parametrize("edit, match", [
    ({"tp": 3}, "tp 3 does not divide its 4 devices"),
    ({"tp": 0}, r"stages\[1\]\.tp must be >= 1"),
    ({"shard": "zero2"}, "shard must be one of none, fsdp"),
    ({"shard": "fsdp", "reshard_after_forward": "yes"}, "reshard_after_forward must be true or false"),
])
def test_hand_edits_are_refused_in_one_line(edit, match):
    doc = json.loads(json.dumps(plan_to_dict(_plan())))
    doc["stages"][1].update(edit)
    with pytest.raises(InputError, match=match) as info:
        plan_from_dict(doc)
    assert "\n" not in str(info.value)


def test_tp_group_across_nodes_is_refused():
    with pytest.raises(PlanError, match=r"tp group \[2, 3\] spans nodes \[0, 1\]"):
        _plan({0: {"tp": 2}, 1: {"tp": 2}}, devices_per_stage=2, devices_per_node=3)


def test_round_robin_replicas_are_not_fsdp_shards():
    """Round-robin replicas run different micro-batches at different times: they cannot gather FSDP-sharded
    weights together (a tp group as one replica can take its micro-batches whole: tests/test_round_robin_layout)."""
    with pytest.raises(PlanError, match="round-robin stage"):
        Stage(0, (0,), (0, 1), 2, replica_mode="round-robin", shard="fsdp")
    assert Stage(0, (0,), (0, 1), 2, replica_mode="round-robin", tp=2).num_replicas == 1


def test_runtime_runs_fsdp_tp_and_2d_stages_and_refuses_the_rest_in_one_line():
    from graphpipe.runtime import layout_refusal

    assert layout_refusal(_plan()) is None
    assert layout_refusal(_plan({1: {"shard": "fsdp"}})) is None
    assert layout_refusal(_plan({0: {"tp": 2}, 1: {"shard": "fsdp", "reshard_after_forward": False}})) is None
    assert layout_refusal(_plan({1: {"shard": "fsdp", "tp": 2}})) is None  # 2-D inside a stage runs
    refusal = layout_refusal(_plan({1: {"tp": 2}}), compile=True)
    assert refusal is not None and "stage 1" in refusal and "--compile" in refusal


@pytest.mark.parametrize("layout", [{"tp": 2}, {"shard": "fsdp"}])
def test_a_parallel_stage_re_materializing_in_segments_is_refused(layout):
    """Checkpoint segments run outside the stage's FSDP/DTensor wrapper (a TP stage's segments trained other
    weights than the plan's, --check failed; an FSDP one crashed at a rank): refused by name; whole-stage
    re-materialization runs."""
    from graphpipe.runtime import layout_refusal

    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 400.0, 10.0, 1.0) for i in range(3)],
                      [("l0", "l1", 0.0), ("l1", "l2", 0.0)])

    def plan(**kw):
        stages = [Stage(0, (0,), (0, 1), 8), Stage(1, (1, 2), (2, 3), 8, recompute=True, **layout, **kw)]
        sg = StageGraph.build(g, stages, 32, 4)
        return Plan(model="c", stage_graph=sg, cluster=preset("h100", 4), strategy="custom",
                    schedule=make_schedule("1f1b", sg))

    assert layout_refusal(plan()) is None
    refusal = layout_refusal(plan(checkpoints=(2,)))
    assert refusal is not None and refusal.startswith("stage 1 is ") and "checkpoints at ops [2]" in refusal
    assert "\n" not in refusal


def test_the_planner_gives_a_parallel_stage_whole_re_materialization_not_the_segments_run_refuses():
    """A stage planned with checkpoint segments keeps them as whole copies; under any parallel layout (the
    per-stage search's options, a uniform layout's expansion) it re-materializes whole, which the runtime runs."""
    from graphpipe.runtime import layout_refusal
    from graphpipe.search import layouts

    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 400.0, 10.0, 1.0) for i in range(3)],
                      [("l0", "l1", 0.0), ("l1", "l2", 0.0)])
    cluster = preset("h100", 4)
    stage = Stage(0, (0, 1, 2), (0, 1, 2, 3), 8, recompute=True, checkpoints=(2,))
    options = layouts.stage_layouts(stage, cluster, [1, 2], ["none", "fsdp"])
    assert {(o.tp, o.shard) for o in options} == {(1, "none"), (1, "fsdp"), (2, "none"), (2, "fsdp")}
    for o in options:
        assert o.recompute and o.checkpoints == (() if o.parallel else (2,))
    for layout in (layouts.Layout(2, "none"), layouts.Layout(1, "fsdp"), layouts.Layout(2, "fsdp")):
        units = 4 // layout.tp  # the reduced problem: one unit per tp group
        reduced = StageGraph.build(g, [Stage(0, (0, 1, 2), tuple(range(units)), 8, recompute=True,
                                             checkpoints=(2,))], 32, units)
        (st,) = layouts.expand(reduced, g, cluster, layout, 32).stages
        assert st.parallel and st.recompute and st.checkpoints == () and len(st.devices) == 4
        sg = StageGraph.build(g, [st], 32, 4)
        plan = Plan(model="c", stage_graph=sg, cluster=cluster, strategy="gpp", schedule=make_schedule("1f1b", sg))
        assert layout_refusal(plan) is None
