"""The simulator against hand-computed timelines, an independent relaxation oracle, and brute-force memory."""

from __future__ import annotations

import pytest

from graphpipe.actions import Schedule
from graphpipe.errors import DeadlockError, GraphpipeError, ScheduleError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.stages import Stage, StageGraph
from graphpipe.cluster import preset
from graphpipe.sched import make_schedule, predicted_figures, simulate
from graphpipe.sched.simulator import simulate_figures

from test_sched_common import (free_cluster, latency_cluster, make_op_graph_diamond, one_stage_per_op, oracle_times,
                               random_stage_graph, uniform_chain)


def _times(tl):
    return {(r.device, str(r.action)): (r.start, r.end) for r in tl.actions}


def _flat(times):
    """``{(device, action): (start, end)}`` -> ``{(device, action, 0|1): value}`` for pytest.approx."""
    return {(*key, i): value[i] for key, value in times.items() for i in (0, 1)}


def test_diamond_with_producer_mb2_consumer_mb4_hand_computed():
    """in(mb 2) -> a, b (mb 2) -> out (mb 4), batch 4, per-sample F 1 s / B 2 s, 0.5 s per message.

    Worked by hand (graph-1F1B warm-ups are 2, 2, 2, 1 here, i.e. fill-drain):
    in:  F0 [0,2]  F1 [2,4]                         B0 [24,28]  B1 [28,32]
    a,b: F0 [2.5,4.5]  F1 [4.5,6.5]                 B0 [19.5,23.5]  B1 [23.5,27.5]
    out: F0 waits for a,b F0 and F1 (+0.5): [7,11]; B0 [11,19]
    in.B0 waits for a.B0 and b.B0 (+0.5) = 24; in.B1 = max(28, 27.5 + 0.5) = 28.
    """
    g = make_op_graph_diamond(edge_bytes=0.5)  # 0.5 B/sample * 2 samples / 2 B/s = 0.5 s
    sg = StageGraph.build(g, [Stage(i, (i,), (i,), b) for i, b in enumerate((2, 2, 2, 4))], 4, 4)
    cluster = latency_cluster(4, 0.0, bandwidth=2.0)
    schedule = make_schedule("graph-1f1b", sg, cluster)
    tl = simulate(sg, schedule, cluster)
    expected = {
        (0, "0F0"): (0, 2), (0, "0F1"): (2, 4), (0, "0B0"): (24, 28), (0, "0B1"): (28, 32),
        (1, "1F0"): (2.5, 4.5), (1, "1F1"): (4.5, 6.5), (1, "1B0"): (19.5, 23.5), (1, "1B1"): (23.5, 27.5),
        (2, "2F0"): (2.5, 4.5), (2, "2F1"): (4.5, 6.5), (2, "2B0"): (19.5, 23.5), (2, "2B1"): (23.5, 27.5),
        (3, "3F0"): (7, 11), (3, "3B0"): (11, 19),
    }
    assert _flat(_times(tl)) == pytest.approx(_flat(expected))
    assert tl.iteration_time_s == 32
    assert tl.throughput == pytest.approx(4 / 32)
    # Messages: one per producer micro-batch, forward from the F end, backward from the last covering B.
    fwd = {(t.src_stage, t.dst_stage, t.src_mbs): (t.start, t.end, t.dst_mbs) for t in tl.transfers if t.direction == "fwd"}
    assert fwd[(1, 3, (1,))] == (6.5, 7.0, (0,))
    bwd = {(t.src_stage, t.dst_stage, t.dst_mbs): (t.start, t.end, t.src_mbs) for t in tl.transfers if t.direction == "bwd"}
    assert bwd[(3, 1, (1,))] == (19.0, 19.5, (0,))
    assert tl.in_flight == (2, 2, 2, 1)
    # Device 0 holds 4e6 param bytes -> 16e6 state bytes, plus 2 mbs x 2 samples x 1e5 act bytes.
    assert tl.peak_memory_bytes[0] == pytest.approx(16e6 + 4e5)
    assert tl.peak_memory_bytes[3] == pytest.approx(16e6 + 4e5)


def test_replicated_stage_splits_micro_batch_and_all_reduces():
    """Stage 0 on devices 0,1 (mb 2 -> 1 sample each), stage 1 on device 2; ring all-reduce of 4e6 bytes."""
    ops = [Op("a", "x", Affine(0, 1.0), Affine(0, 2.0), param_bytes=4e6, act_bytes=1e5),
           Op("b", "x", Affine(0, 1.0), Affine(0, 2.0), param_bytes=4e6, act_bytes=1e5)]
    g = OpGraph.build("r", ops, [("a", "b", 0.0)])
    sg = StageGraph.build(g, [Stage(0, (0,), (0, 1), 2), Stage(1, (1,), (2,), 2)], 4, 3)
    cluster = latency_cluster(3, 0.25, bandwidth=4e6)  # all-reduce: 2*(2-1)*0.25 + 2*(1/2)*4e6/4e6 = 1.5 s
    tl = simulate(sg, make_schedule("1f1b", sg, cluster), cluster)
    t = _times(tl)
    # Stage 0: F 1 s per replica (1 sample); stage 1: F 2 s, B 4 s. Edge bytes 0: free messages.
    assert t[(0, "0F0")] == t[(1, "0F0")] == (0, 1)
    assert t[(2, "1F0")] == (1, 3) and t[(2, "1B0")] == (3, 7)
    assert t[(2, "1F1")] == (7, 9) and t[(2, "1B1")] == (9, 13)
    assert t[(0, "0B1")] == (13, 15)
    (ar,) = tl.allreduces
    assert (ar.stage_id, ar.devices, ar.start, ar.end) == (0, (0, 1), 15, 16.5)
    assert tl.iteration_time_s == 16.5
    assert tl.bubble_fraction[0] == pytest.approx(1 - 6 / 16.5)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "graph-1f1b", "graph-zb"])
def test_simulator_agrees_with_relaxation_oracle(seed, name):
    sg = random_stage_graph(seed, num_ops=5 + seed % 3)
    cluster = preset("v100", sg.num_devices)
    schedule = make_schedule(name, sg, cluster)
    tl = simulate(sg, schedule, cluster)
    oracle = oracle_times(sg, schedule, cluster)
    assert oracle is not None
    assert _flat(_times(tl)) == pytest.approx(_flat(oracle))
    assert tl.iteration_time_s == pytest.approx(max(e for _, e in oracle.values()))


@pytest.mark.parametrize("seed", range(6))
def test_peak_memory_and_in_flight_by_brute_force(seed):
    """Live memory evaluated at every allocation instant (an activation lives on [F start, B end))."""
    sg = random_stage_graph(seed, num_ops=6)
    cluster = latency_cluster(sg.num_devices, 1e-4)
    tl = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    t = {(r.device, r.action.stage_id, r.action.kind, r.action.mb_id): (r.start, r.end) for r in tl.actions}
    for d in range(sg.num_devices):
        state = sum(cluster.state_bytes(sg.param_bytes(s)) for s in sg.stages_on_device(d))
        # communication buffers (graphpipe.costs): one micro-batch of inputs and of output gradients
        state += sum((sg.input_bytes_per_sample(s) + sg.output_bytes_per_sample(s)) * sg.stages[s].samples_per_replica
                     for s in sg.stages_on_device(d))
        lives = [(s, t[(d, s, "F", j)][0], t[(d, s, "B", j)][1]) for s in sg.stages_on_device(d)
                 for j in range(sg.num_micro_batches(s))]
        peak, most = state, {}
        for _, at, _ in lives:
            alive = [s for s, lo, hi in lives if lo <= at < hi]
            per_sample = {s: sg.act_bytes_per_sample(s) * sg.stages[s].samples_per_replica for s in alive}
            peak = max(peak, state + sum(per_sample[s] for s in alive))
            for s in set(alive):
                most[s] = max(most.get(s, 0), alive.count(s))
        assert tl.peak_memory_bytes[d] == pytest.approx(peak)
        assert tl.state_bytes[d] + tl.buffer_bytes[d] == pytest.approx(state)
        for s, n in most.items():
            assert tl.in_flight[s] == n


def test_transfer_delay_uses_link_class_and_lanes():
    """Crossing nodes costs the inter-node link; chain of 2 stages with latency only."""
    sg = uniform_chain(2, 1)
    same = latency_cluster(2, 0.5)
    cross = latency_cluster(2, 0.5, per_node=1)
    t_same = simulate(sg, make_schedule("1f1b", sg, same), same).iteration_time_s
    t_cross = simulate(sg, make_schedule("1f1b", sg, cross), cross).iteration_time_s
    assert t_same == pytest.approx(6 + 2 * 0.5)
    assert t_cross == pytest.approx(6 + 2 * 1.0)


def test_deterministic_and_pure():
    sg = random_stage_graph(3, num_ops=7)
    cluster = preset("v100", sg.num_devices)
    schedule = make_schedule("graph-1f1b", sg, cluster)
    assert simulate(sg, schedule, cluster) == simulate(sg, schedule, cluster)


def test_deadlock_raises_with_blocked_actions():
    sg = uniform_chain(2, 2)
    schedule = Schedule.from_text("bad", "0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1", 2)
    with pytest.raises(DeadlockError, match="device 0 blocked at 0B0 waiting for 1B0"):
        simulate(sg, schedule, free_cluster(2))


def test_cluster_must_match():
    sg = uniform_chain(2, 2)
    with pytest.raises(ScheduleError, match="cluster has 3 devices, the stage graph 2"):
        simulate(sg, make_schedule("1f1b", sg), free_cluster(3))


def test_predicted_figures_cover_every_device():
    """A device without a stage is idle all iteration: bubble 1.0, memory 0; the mean skips it."""
    g = OpGraph.build("c", [Op("a", "x", Affine(0, 1.0), Affine(0, 2.0)), Op("b", "x", Affine(0, 1.0), Affine(0, 2.0))],
                      [("a", "b", 0.0)])
    sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (2,), 1)], 2, 3)
    tl = simulate(sg, make_schedule("gpipe", sg), free_cluster(3))
    fig = predicted_figures(tl)
    assert fig["bubble_fraction"][1] == 1.0 and fig["peak_memory_bytes"][1] == 0.0
    assert len(fig["bubble_fraction"]) == len(fig["peak_memory_bytes"]) == 3
    assert fig["mean_bubble_fraction"] == pytest.approx(1 / 3)
    assert fig["iteration_time_s"] == 9.0 and fig["throughput"] == pytest.approx(2 / 9)
    assert fig["in_flight"] == [2, 2] and fig["devices_used"] == [0, 2]
    import json

    json.dumps(fig)  # JSON-ready


def test_one_stage_per_op_mixed_sizes_simulates_on_presets():
    g = make_op_graph_diamond()
    for sizes in ((2, 2, 2, 4), (4, 2, 2, 4), (1, 2, 4, 8), (8, 4, 2, 1)):
        sg = one_stage_per_op(g, 16, list(sizes))
        cluster = preset("a100", 4)
        for name in ("gpipe", "1f1b", "graph-1f1b"):
            schedule = make_schedule(name, sg, cluster)
            assert _flat(_times(simulate(sg, schedule, cluster))) == pytest.approx(_flat(oracle_times(sg, schedule, cluster)))


SCORED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "graph-1f1b", "zb-h1", "graph-zb", "zbv", "interleaved-zb")


def _plans_to_score():
    """Plans with replicated, round-robin, re-materializing and single-replica stages, from every strategy."""
    from dataclasses import replace as dc_replace

    from graphpipe.models import load_model
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    out = []
    for model, n in (("mmt", 8), ("dlrm", 8), ("candle-uno", 16), ("transformer", 4)):
        cluster = preset("v100", n)
        graph = load_model(model, cluster.device).graph
        for strategy in ("gpp", "pipedream", "gpipe") + (("piper",) if model == "transformer" else ()):
            plan = make_plan(model, graph, cluster, 16 * n, strategy, SearchOptions(recompute="none"), monotone=False)
            out.append((f"{model}/{strategy}", plan.stage_graph, cluster))
        sg = out[-1][1]  # one stage re-materializing beside ones that do not
        stages = tuple(dc_replace(s, recompute=s.id % 2 == 0) for s in sg.stages)
        out.append((f"{model}/mixed-recompute", dc_replace(sg, stages=stages), cluster))
    for seed in range(6):
        sg = random_stage_graph(seed)
        out.append((f"random{seed}", sg, latency_cluster(sg.num_devices, 0.01, 1e6)))
    return out


def test_score_equals_simulate_on_every_schedule():
    """score() (one device per lockstep class, no timeline) gives simulate()'s iteration time and peak memory,
    and peak_memory_in_order() (action order, no timing) every device's peak."""
    from graphpipe.errors import GraphpipeError
    from graphpipe.sched.simulator import peak_memory_in_order, score

    compared = 0
    for name, sg, cluster in _plans_to_score():
        for schedule_name in SCORED_SCHEDULES:
            try:
                schedule = make_schedule(schedule_name, sg, cluster)
            except GraphpipeError:
                continue  # a schedule this stage graph cannot have (e.g. zb-h1 on branches)
            full = predicted_figures(simulate(sg, schedule, cluster))
            got = score(sg, schedule, cluster)
            assert got.iteration_time_s == pytest.approx(full["iteration_time_s"], rel=1e-12), (name, schedule_name)
            assert got.throughput == pytest.approx(full["throughput"], rel=1e-12), (name, schedule_name)
            assert got.max_peak_memory_bytes == pytest.approx(full["max_peak_memory_bytes"], rel=1e-12), \
                (name, schedule_name)
            assert peak_memory_in_order(sg, schedule, cluster) == pytest.approx(full["peak_memory_bytes"], rel=1e-12), \
                (name, schedule_name)
            assert simulate_figures(sg, schedule, cluster) == full, (name, schedule_name)  # same sums, same order
            compared += 1
    assert compared >= 60


def test_a_kept_engine_run_serves_only_the_same_cluster_and_actions():
    """The simulator keeps its last engine run for the search's winner; on another cluster (slower links) or
    under another schedule the same stage graph is simulated afresh: each answer equals a run with nothing kept."""
    from dataclasses import replace as dc_replace

    from graphpipe.sched import simulator

    name, sg, cluster = next(p for p in _plans_to_score() if p[0] == "mmt/gpp")
    slow = dc_replace(cluster, intra_node=dc_replace(cluster.intra_node, bandwidth_Bps=cluster.intra_node.bandwidth_Bps / 50))
    cases = [(sg, make_schedule("1f1b", sg, cluster), slow), (sg, make_schedule("gpipe", sg, cluster), cluster)]
    for other_sg, schedule, other_cluster in cases:
        simulator.score(sg, make_schedule("1f1b", sg, cluster), cluster)  # kept: sg, cluster, 1f1b's actions
        got = simulate_figures(other_sg, schedule, other_cluster)
        simulator._LAST_RUN.clear()
        assert got == simulate_figures(other_sg, schedule, other_cluster)
    assert cases[0][0] is sg and simulate_figures(sg, cases[0][1], slow) != simulate_figures(sg, cases[0][1], cluster)


def test_simulate_times_every_replica_as_the_every_device_oracle():
    """simulate() runs the engine on one device per lockstep class and copies its times to the class's other
    devices: every device's action times still equal the fixpoint oracle's, which relaxes every device on its
    own (and the engine run on every device). Diamonds with split replicas (2 and 3 devices per stage), round-robin replicas (lists that differ),
    round-robin groups of 2 replicas (lists shared within a group) and mixed micro-batch sizes, under every
    schedule they admit."""
    from dataclasses import replace as dc_replace

    from graphpipe.sched.engine import lockstep_classes, run_engine
    from graphpipe.sched.simulator import _engine_inputs

    g = make_op_graph_diamond()
    layouts = {((0, 1), (2,), (3, 4, 5), (6, 7)): ((2, 2, 6, 2), (4, 2, 6, 8), (2, 4, 12, 4)),
               ((0,), (1, 2), (3, 4), (5, 6, 7)): ((2, 2, 2, 6), (4, 2, 4, 12), (1, 8, 2, 3)),
               ((0,), (1, 2, 3, 4), (5,), (6, 7)): ((2, 2, 2, 2), (2, 4, 2, 4))}
    compared = 0
    for devices, size_sets in layouts.items():
        for sizes in size_sets:
            for mode in ("split", "round-robin", "groups"):
                stages = [Stage(i, (i,), devices[i], sizes[i]) for i in range(4)]
                if mode == "round-robin":  # the replicated middle stages take whole micro-batches in turn
                    stages = [dc_replace(st, replica_mode=mode) if i in (1, 2) and len(st.devices) > 1 else st
                              for i, st in enumerate(stages)]
                if mode == "groups":  # a 4-device middle stage as 2 round-robin groups of 2 splitting replicas
                    if len(devices[1]) != 4:
                        continue
                    stages[1] = dc_replace(stages[1], replica_mode="round-robin", split=2)
                try:
                    sg = StageGraph.build(g, stages, 24, 8)
                except GraphpipeError:
                    continue  # fewer micro-batches than round-robin replicas
                cluster = latency_cluster(8, 0.01, 1e6)
                for schedule_name in ("gpipe", "1f1b", "graph-1f1b", "zb-h1"):
                    try:
                        schedule = make_schedule(schedule_name, sg, cluster)
                    except GraphpipeError:
                        continue  # a schedule this stage graph cannot have
                    reps, _, _ = lockstep_classes(sg, schedule)
                    compared += len(reps) < 8
                    got = _flat(_times(simulate(sg, schedule, cluster)))
                    _, duration, delay = _engine_inputs(sg, cluster)
                    every = run_engine(sg, schedule.device_actions, duration, delay, delay)
                    assert got == pytest.approx(_flat({(d, str(a)): (every.starts[d][k], every.ends[d][k])
                                                       for d, acts in enumerate(schedule.device_actions)
                                                       for k, a in enumerate(acts)}), rel=1e-12)
                    if mode != "round-robin":  # the oracle does not model one-replica round-robin's messages
                        assert got == pytest.approx(_flat(oracle_times(sg, schedule, cluster)), rel=1e-12), \
                            (devices, sizes, mode, schedule_name)
    assert compared >= 20  # most of these have replicas standing for one another


def test_score_raises_deadlock_on_the_real_devices():
    from graphpipe.sched.simulator import score

    sg = uniform_chain(2, 1)
    bad = Schedule.from_text("bad", "0: 0F0 0B0\n1: 1B0 1F0", 2)
    with pytest.raises((DeadlockError, ScheduleError)):
        score(sg, bad, free_cluster(2))
