"""1F1B-RR on real ranks: a 3-replica round-robin stage (PipeDream's replicated stage, micro-batch i on
replica i mod 3) plus one stage, 4 CPU ranks; gpp's round-robin layout (micro-batch 1, 2 replicas then 3,
ZB-H1's split backward), 5 ranks; round-robin replicas that are tp 2 groups, 5 ranks; and round-robin groups
of 2 replicas that split each micro-batch, 6 ranks; each against a single-process run of the same model (``graphpipe run
--check``: the loss and every gradient, assert_close's fp32 tolerances)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan, plan_to_dict, write_plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

pytestmark = pytest.mark.slow


def _two_stages(first: dict, rest: dict, batch: int, num_devices: int, schedule: str,
                sequential: bool = False) -> Plan:
    """transformer:small as embed..layer1 then layer2..head, each stage's remaining ``Stage`` fields given."""
    graph = zoo.load_graph("transformer:small")
    ops = [tuple(graph.op_id(n) for n in names) for names in (("embed", "layer0", "layer1"),
                                                              ("layer2", "layer3", "head"))]
    cluster = preset("v100", num_devices)
    stages = [Stage(i, op_ids, **fields) for i, (op_ids, fields) in enumerate(zip(ops, (first, rest)))]
    sg = StageGraph.build(graph, stages, batch, num_devices, sequential=sequential, cluster=cluster)
    return Plan(model="transformer:small", stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


def three_plus_one() -> Plan:
    # micro-batch 2 on 3 replicas: split replicas could not hold it (3 does not divide 2)
    return _two_stages(dict(devices=(0, 1, 2), micro_batch_size=2, replica_mode="round-robin"),
                       dict(devices=(3,), micro_batch_size=2), 12, 4, "1f1b", sequential=True)


def two_then_three() -> Plan:
    """gpp's round-robin layout in small: micro-batch 1, replica counts that differ, zero bubble's I and W."""
    return _two_stages(dict(devices=(0, 1), micro_batch_size=1, replica_mode="round-robin"),
                       dict(devices=(2, 3, 4), micro_batch_size=1, replica_mode="round-robin"), 12, 5, "zb-h1")


def tensor_parallel_turns() -> Plan:
    """Round-robin replicas that are tensor-parallel groups: 2 replicas of tp 2 take micro-batches in turn."""
    return _two_stages(dict(devices=(0, 1, 2, 3), micro_batch_size=1, replica_mode="round-robin", tp=2),
                       dict(devices=(4,), micro_batch_size=1), 6, 5, "graph-1f1b")


def groups_that_split() -> Plan:
    """Round-robin groups of 2 replicas (``split``): micro-batch i goes to group i mod 2, whose replicas take
    one sample each, as gpp's round-robin layout past 1,024 units plans them; then a 2-replica split stage."""
    return _two_stages(dict(devices=(0, 1, 2, 3), micro_batch_size=2, replica_mode="round-robin", split=2),
                       dict(devices=(4, 5), micro_batch_size=2), 12, 6, "zb-h1")


@pytest.mark.parametrize("make", [three_plus_one, two_then_three, tensor_parallel_turns, groups_that_split])
def test_round_robin_stage_matches_single_process(tmp_path, make):
    plan = make()
    if make is three_plus_one:
        assert [str(a) for a in plan.schedule.device_actions[1]] == ["0F1", "0F4", "0B1", "0B4"]
    elif make is two_then_three:  # replica 0 of stage 0 runs the even micro-batches, W after each I
        assert [str(a) for a in plan.schedule.device_actions[0]][:5] == ["0F0", "0F2", "0F4", "0I0", "0W0"]
    elif make is groups_that_split:  # devices 0 and 1 (group 0) run the even micro-batches, 2 and 3 the odd
        acts = [[str(a) for a in acts] for acts in plan.schedule.device_actions[:4]]
        assert acts[0] == acts[1] and acts[2] == acts[3] and {int(a[2:]) % 2 for a in acts[0]} == {0}
        assert {int(a[2:]) % 2 for a in acts[2]} == {1} and plan_to_dict(plan)["stages"][0]["split"] == 2
    else:  # both devices of a tp group run their replica's micro-batches, the even ones on devices 0 and 1
        acts = [[str(a) for a in acts] for acts in plan.schedule.device_actions[:4]]
        assert acts[0] == acts[1] == ["0F0", "0F2", "0B0", "0F4", "0B2", "0B4"] and acts[2] == acts[3] != acts[0]
    path = str(tmp_path / "rr.json")
    write_plan(path, plan)
    out = subprocess.run([sys.executable, "-m", "graphpipe", "run", path, "--check", "--steps", "2", "--json",
                          "--timeout", "120"], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    check = doc["check"]
    # Every replica compares its gradients, and each saw only its own micro-batches (0, 3 / 1, 4 / 2, 5): they
    # equal the single-process gradients only once the replicas' gradients were all-reduced at the flush.
    assert check["passed"] and check["num_params_checked"] == check["num_params"] > 0, check
