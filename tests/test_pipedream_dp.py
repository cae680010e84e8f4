"""--strategy pipedream against the real optimizer (msr-fiddle/pipedream optimizer_graph_hierarchical.py).

The constants are the real optimizer's output on the PipeDream profiles in data/
(``-n N -b BW --activation_compression_ratio 1``): per-stage
replica counts and "Time per stage in pipeline" (seconds per profiled batch
of 128). Ours must give the same replica counts and
``search.model_bottleneck_tps * 128`` within 1%. A brute force over the
optimizer's own formulas checks the DP on small chains.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np
import pytest

from conftest import branches_graph, chain_graph
from graphpipe.cluster import cluster_from_dict, preset
from graphpipe.errors import InfeasibleError
from graphpipe.importers.pipedream_txt import read_pipedream
from graphpipe.search.common import SearchOptions
from graphpipe.search.pipedream import cluster_levels, partition, pipedream_micro_batch
from graphpipe.search.pipedream_dp import antichain_states, solve_levels

PROFILE_BATCH = 128

# (model, devices, bandwidth B/s) -> (replicas per stage, the real optimizer's time per stage, s per 128 samples)
REAL_ONE_LEVEL = {
    ("vgg16", 4, 1e9): ([3, 1], 0.205520896),
    ("vgg16", 4, 12.5e9): ([3, 1], 1.3286e-3 * 128),
    ("alexnet", 4, 1e9): ([3, 1], 0.2673e-3 * 128),
    ("alexnet", 4, 12.5e9): ([2, 1, 1], 0.1733e-3 * 128),
    ("resnet50", 8, 1e9): ([5, 3], 0.7188e-3 * 128),
    ("resnet50", 8, 12.5e9): ([2, 2, 1, 1, 1, 1], 0.4368e-3 * 128),
}
# Two levels, -n 4 2 -b 12.5e9 1.25e9: replicas per (flattened) stage and time per stage.
REAL_TWO_LEVEL = {
    "vgg16": ([4, 1, 1, 1, 1], 0.15736246),
    "resnet50": ([2, 2, 2, 2], 0.0761941256),
}


def cluster_file(tmp_path, devices_per_node, intra, inter, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps({
        "devices_per_node": devices_per_node,
        "device": {"name": "test", "memory_bytes": 1e12, "peak_flops": 1e14, "op_overhead_s": 0.0},
        "intra_node": {"latency_s": 0.0, "bandwidth_Bps": intra},
        "inter_node": {"latency_s": 0.0, "bandwidth_Bps": inter}}))
    return str(path)


def plan_json(capsys, profile, devices, cluster):
    from graphpipe.cli import main

    assert main(["plan", profile, "--devices", str(devices), "--batch-size", str(PROFILE_BATCH * devices),
                 "--strategy", "pipedream", "--cluster", cluster, "--json",
                 "--tp", "1", "--shard", "none"]) == 0  # PipeDream's own optimizer plans whole copies
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("key", sorted(REAL_ONE_LEVEL), ids=lambda k: f"{k[0]}@{k[1]}-{k[2]:g}")
def test_one_level_matches_real_optimizer(profiles_dir, tmp_path, capsys, key):
    model, devices, bandwidth = key
    replicas, real_time = REAL_ONE_LEVEL[key]
    plan = plan_json(capsys, os.path.join(profiles_dir, model), devices,
                     cluster_file(tmp_path, devices, bandwidth, bandwidth))
    assert [len(s["devices"]) for s in plan["stages"]] == replicas
    assert plan["search"]["model_bottleneck_tps"] * PROFILE_BATCH == pytest.approx(real_time, rel=0.01)
    assert plan["search"]["replica_mode"] == "round-robin"
    assert all(s["replica_mode"] == ("round-robin" if len(s["devices"]) > 1 else "split") for s in plan["stages"])
    # pipeline order: stage i's devices follow stage i-1's; together they are all N devices
    flat = [d for s in plan["stages"] for d in s["devices"]]
    assert flat == list(range(devices))


def test_vgg16_split_points_are_the_real_optimizers(profiles_dir):
    """Real: node1-18 x3 | node19-41 x1 at 1 GB/s, node1-16 x3 | node17-41 x1 at 12.5 GB/s."""
    g = read_pipedream(os.path.join(profiles_dir, "vgg16"))
    states = antichain_states(g)
    for bandwidth, last_of_first in ((1e9, "node18"), (12.5e9, "node16")):
        sol = solve_levels(states, g, PROFILE_BATCH, ((4, bandwidth),))
        first = {g.ops[i].name for i in sol.stages[0][0]}
        assert first == {f"node{i}" for i in range(1, int(last_of_first[4:]) + 1)}


@pytest.mark.parametrize("model", sorted(REAL_TWO_LEVEL))
def test_two_level_cluster_matches_real_optimizer(profiles_dir, tmp_path, capsys, model):
    """2 nodes of 4 devices, 12.5 GB/s inside a node, 1.25 GB/s between (-n 4 2 -b 12.5e9 1.25e9)."""
    replicas, real_time = REAL_TWO_LEVEL[model]
    plan = plan_json(capsys, os.path.join(profiles_dir, model), 8, cluster_file(tmp_path, 4, 12.5e9, 1.25e9))
    assert [len(s["devices"]) for s in plan["stages"]] == replicas
    assert plan["search"]["model_bottleneck_tps"] * PROFILE_BATCH == pytest.approx(real_time, rel=0.01)
    devices = [s["devices"] for s in plan["stages"]]
    if model == "vgg16":
        # level 2: one node each for the two halves; level 1: node 0 replicates x4, node 1 is 4 stages
        assert devices == [[0, 1, 2, 3], [4], [5], [6], [7]]
    else:
        # one stage over both nodes, each node a 4-stage pipeline: stage s on device s of each node
        assert devices == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_levels_from_the_cluster_and_refusal(tmp_path):
    assert cluster_levels(preset("v100", 4)) == ((4, 50e9),)
    assert cluster_levels(preset("v100", 8)) == ((4, 50e9), (2, 12.5e9))
    flat = cluster_from_dict(json.load(open(cluster_file(tmp_path, 4, 1e9, 1e9))), num_devices=6)
    assert cluster_levels(flat) == ((6, 1e9),)     # equal links: one flat level
    with pytest.raises(InfeasibleError, match="cannot hold 6 devices"):
        cluster_levels(preset("v100", 6))


def test_cluster_that_cannot_hold_n_devices_exits_2(profiles_dir, capsys):
    from graphpipe.cli import main

    code = main(["plan", os.path.join(profiles_dir, "vgg16"), "--devices", "6", "--batch-size", "768",
                 "--strategy", "pipedream", "--cluster", "v100"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot hold 6 devices" in err


def test_micro_batch_is_the_data_parallel_share():
    assert pipedream_micro_batch(512, 4, SearchOptions()) == 128
    assert pipedream_micro_batch(30, 4, SearchOptions()) == 6
    assert pipedream_micro_batch(32, 4, SearchOptions(micro_batch_size=2)) == 2


# ------------------------------------------------------------- brute force over the optimizer's formulas
def brute_chain(compute, params, out, machines, bandwidth):
    """Every split of a chain into contiguous stages and every replica count summing to ``machines``,
    scored with the optimizer's one-level terms: a stage of ``r`` replicas costs
    ``(T + 4 (r-1) P / (B r)) / r``, the cut after a stage ``2 a / (B r')`` for the receiving ``r'`` and,
    for all but the last stage, ``2 a_out / (B r)`` for its own output."""
    n = len(compute)
    best = math.inf
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0,) + cuts + (n,)
            for rs in itertools.product(range(1, machines + 1), repeat=k):
                if sum(rs) != machines:
                    continue
                worst = 0.0
                for q in range(k):
                    a, b, r = bounds[q], bounds[q + 1], rs[q]
                    T, P = sum(compute[a:b]), sum(params[a:b])
                    worst = max(worst, (T + 4 * (r - 1) * P / (bandwidth * r)) / r)
                    if q > 0:
                        worst = max(worst, 2 * out[a - 1] / (bandwidth * r))
                    if q < k - 1:
                        worst = max(worst, 2 * out[b - 1] / (bandwidth * r))
                best = min(best, worst)
    return best


@pytest.mark.parametrize("n,machines", [(3, 2), (4, 3), (5, 4), (6, 3)])
def test_flat_dp_equals_brute_force_on_chains(n, machines):
    g = chain_graph(n)
    b = 4
    states = antichain_states(g)
    assert len(states.members) == n          # a chain's antichains are its ops
    sol = solve_levels(states, g, b, ((machines, 1e8),))
    compute = [op.fwd(b) + op.bwd(b) for op in g.ops]
    params = [op.param_bytes for op in g.ops]
    out = [op.out_bytes * b for op in g.ops]
    assert sol.time_per_batch == pytest.approx(brute_chain(compute, params, out, machines, 1e8), rel=1e-9)
    assert sum(r for _, r, _ in sol.stages) == machines


def test_antichain_stages_are_convex_downset_differences():
    g = branches_graph(3, 2)
    states = antichain_states(g)
    for j, members in enumerate(states.members):
        assert all(p in members for v in members for p in g.preds(v))          # each state is a downset
        for k in range(len(states.members)):
            if states.ancestors[j, k]:
                assert states.members[k] < members
    result = partition(g, preset("v100", 4), 16, SearchOptions())
    assert sorted(op for s in result.stage_graph.stages for op in s.op_ids) == list(range(g.num_ops))


# ------------------------------------------------------------- 1F1B-RR in the simulator
def test_round_robin_3_plus_1_simulated_by_hand():
    """Stage 0 on 3 round-robin replicas (F 3, B 6 per micro-batch), stage 1 on one device (F 1, B 2),
    6 micro-batches of 1 sample, free transfers, no weights. Warm-ups: stage 1 one micro-batch, stage 0
    r (K - 0) = 6, i.e. two of its own per replica. Replica k runs micro-batches k and k + 3.
    By hand:
      dev0: F0 [0,3] F3 [3,6] B0 [6,12]  B3 [15,21]
      dev1: F1 [0,3] F4 [3,6] B1 [9,15]  B4 [18,24]
      dev2: F2 [0,3] F5 [3,6] B2 [12,18] B5 [21,27]
      dev3: F0 [3,4] B0 [4,6] F1 [6,7] B1 [7,9] F2 [9,10] B2 [10,12] F3 [12,13] B3 [13,15]
            F4 [15,16] B4 [16,18] F5 [18,19] B5 [19,21]
    so the iteration takes 27 (split replicas could not even hold this layout: 3 does not divide 1)."""
    from graphpipe.graph import Affine, Op, OpGraph
    from graphpipe.sched import make_schedule, simulate, validate_schedule
    from graphpipe.stages import Stage, StageGraph

    g = OpGraph.build("two", [Op("a", "x", Affine(0, 3.0), Affine(0, 6.0)), Op("b", "x", Affine(0, 1.0), Affine(0, 2.0))],
                      [("a", "b", 0.0)])
    sg = StageGraph.build(g, [Stage(0, (0,), (0, 1, 2), 1, replica_mode="round-robin"), Stage(1, (1,), (3,), 1)],
                          batch_size=6, num_devices=4, sequential=True)
    cluster = preset("v100", 4)
    schedule = make_schedule("1f1b", sg, cluster)
    validate_schedule(sg, schedule)
    assert [[str(a) for a in acts] for acts in schedule.device_actions] == [
        ["0F0", "0F3", "0B0", "0B3"], ["0F1", "0F4", "0B1", "0B4"], ["0F2", "0F5", "0B2", "0B5"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3", "1F4", "1B4", "1F5", "1B5"]]
    timeline = simulate(sg, schedule, cluster)
    ends = {(r.device, str(r.action)): (r.start, r.end) for r in timeline.actions}
    assert ends[(0, "0B3")] == (15.0, 21.0) and ends[(2, "0B5")] == (21.0, 27.0) and ends[(3, "1B5")] == (19.0, 21.0)
    assert timeline.iteration_time_s == pytest.approx(27.0)


def test_round_robin_validator_rejects_wrong_replica():
    from graphpipe.actions import Action, Schedule
    from graphpipe.graph import Affine, Op, OpGraph
    from graphpipe.sched import validate_schedule
    from graphpipe.sched.validate import ScheduleError
    from graphpipe.stages import Stage, StageGraph

    g = OpGraph.build("one", [Op("a", "x", Affine(0, 1.0), Affine(0, 1.0))], [])
    sg = StageGraph.build(g, [Stage(0, (0,), (0, 1), 1, replica_mode="round-robin")], batch_size=2, num_devices=2)
    good = Schedule.from_lists("x", [[Action(0, "F", 0), Action(0, "B", 0)], [Action(0, "F", 1), Action(0, "B", 1)]])
    validate_schedule(sg, good)
    bad = Schedule.from_lists("x", [[Action(0, "F", 1), Action(0, "B", 1)], [Action(0, "F", 0), Action(0, "B", 0)]])
    with pytest.raises(ScheduleError, match="replica i mod 2"):
        validate_schedule(sg, bad)


def test_cpsat_schedule_refuses_round_robin_stages(profiles_dir, tmp_path, capsys):
    from graphpipe.cli import main

    code = main(["plan", os.path.join(profiles_dir, "vgg16"), "--devices", "4", "--batch-size", "512",
                 "--strategy", "pipedream", "--cluster", cluster_file(tmp_path, 4, 1e9, 1e9), "--schedule", "cpsat"])
    err = capsys.readouterr().err
    assert code == 2 and "round-robin" in err and err.count("\n") == 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "graph-1f1b"])
def test_every_schedule_dispatches_round_robin(schedule):
    """Each generator gives replica i mod r the micro-batches i of a round-robin stage, and nothing else."""
    from graphpipe.graph import Affine, Op, OpGraph
    from graphpipe.sched import make_schedule, simulate, validate_schedule
    from graphpipe.stages import Stage, StageGraph

    g = OpGraph.build("two", [Op("a", "x", Affine(0, 3.0), Affine(0, 6.0)), Op("b", "x", Affine(0, 1.0), Affine(0, 2.0))],
                      [("a", "b", 1.0)])
    sg = StageGraph.build(g, [Stage(0, (0,), (0, 1, 2), 2, replica_mode="round-robin"), Stage(1, (1,), (3,), 2)],
                          batch_size=14, num_devices=4, sequential=True)
    cluster = preset("v100", 4)
    sched = make_schedule(schedule, sg, cluster)
    validate_schedule(sg, sched)
    for d in range(3):
        assert sorted({a.mb_id for a in sched.device_actions[d]}) == list(range(d, 7, 3))
    assert simulate(sg, sched, cluster).iteration_time_s > 0


@pytest.mark.parametrize("spec,devices,batch", [("candle-uno:branches=2", 16, 256), ("mmt:small", 12, 32)])
def test_an_antichain_answer_that_is_not_a_partition_falls_back_to_the_linearisation(spec, devices, batch):
    """On these branchy graphs the optimizer's antichain order is not nested and its DP answer names an
    empty stage or an op in two stages; the plan is then PipeDream's DP over the linearisation, a valid
    sequential partition that says so."""
    pytest.importorskip("torch")
    from graphpipe.models import load_model
    from graphpipe.search.planner import make_plan

    cluster = preset("v100", devices)
    graph = load_model(spec, cluster.device).graph
    plan = make_plan(spec, graph, cluster, batch, "pipedream")
    assert plan.search["states"].startswith("linearised")
    owners = sorted(v for stage in plan.stage_graph.stages for v in stage.op_ids)
    assert owners == list(range(graph.num_ops))   # every op in exactly one stage
    assert all(stage.op_ids for stage in plan.stage_graph.stages)


def _dense_rows(compute, act, params, output, ancestors, M, within, bw, memory, state_per_byte, num_mbs, outside):
    """The optimizer's loops over every row i, end j, split k and machines m' (k outer, then m'; strict
    improvement), on the dense (j, k) square: the oracle of the split-pair row sweep."""
    from graphpipe.search.pipedream_dp import _in_flight

    rows, s = compute.shape
    time = np.full((rows, s, M), np.nan)
    split = np.full(time.shape, -1)
    rest = np.full(time.shape, -1)
    replicas = np.broadcast_to(np.arange(1, M + 1), time.shape).copy()
    for i in range(rows):
        for j in range(s):
            for m in range(M):
                t = (compute[i, j] + 4 * m * params[i, j] / (bw * (m + 1)) / within) / (m + 1)
                held = _in_flight(M, m + 1, m + 1, num_mbs, outside) * act[i, j] + state_per_byte * params[i, j]
                time[i, j, m] = np.nan if held > memory or np.isnan(t) else t
    for i in range(min(rows, s - 1)):
        for j in range(i + 1, s):
            for m in range(1, M):
                for k in range(s):
                    if not ancestors[j, k] or (i > 0 and ancestors[i - 1, k]):
                        continue
                    for mp in range(1, m + 1):
                        prev = time[i, k, m - mp]
                        last = (compute[k + 1, j] + 4 * (mp - 1) * params[k + 1, j] / (bw * mp)) / mp
                        last = max(last, 2.0 * output[k] / (bw * mp))
                        if j < s - 1:
                            last = max(last, 2.0 * output[j] / (bw * mp))
                        held = _in_flight(M, m + 1, mp, num_mbs, outside) * act[k + 1, j] \
                            + state_per_byte * params[k + 1, j]
                        if np.isnan(prev) or np.isnan(last) or held > memory:
                            continue
                        cand = max(prev, last)
                        if np.isnan(time[i, j, m]) or time[i, j, m] > cand:
                            time[i, j, m], split[i, j, m] = cand, k
                            rest[i, j, m], replicas[i, j, m] = m - mp, mp
    return time, split, rest, replicas


@pytest.mark.parametrize("spec,memory", [("twobranch:layers=3", math.inf), ("mmt:branches=3,layers=2", math.inf),
                                         ("mmt:branches=3,layers=2", 2.2e9), ("candle-uno:branches=2", 1.5e9)])
def test_split_pair_rows_equal_the_optimizers_dense_loops(spec, memory):
    """Every row of a lower level (the top one reads row 0 only), swept over the split pairs ``(j, k)``
    with ``k`` an ancestor of ``j``, gives the tables of the optimizer's loops over every ``(i, j, k, m, m')``:
    the same times and the same choices (first of equal times), memory binding or not."""
    from graphpipe.frontend import zoo
    from graphpipe.search.pipedream_dp import _level, _ranges, state_sums

    g = zoo.load_graph(spec, preset("v100", 4).device)
    states = antichain_states(g)
    sums = state_sums(states, g, 4)
    compute, act, params = _ranges(sums.compute), _ranges(sums.activation), _ranges(sums.params)
    args = (compute, act, params, sums.output, states.ancestors)
    M, bw, spb, num_mbs, outside = 4, 1.25e10, 16.0, 8, 4
    ours = _level(*args, M, 1, bw, False, memory, spb, num_mbs, outside)
    dense = _dense_rows(*args, M, 1, bw, memory, spb, num_mbs, outside)
    assert np.isfinite(ours.time).any()
    np.testing.assert_allclose(ours.time, dense[0], rtol=1e-12, equal_nan=True)
    finite = np.isfinite(dense[0])
    for got, want in zip((ours.split, ours.rest, ours.replicas), dense[1:]):
        assert (got[finite] == want[finite]).all()
