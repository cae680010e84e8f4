"""Round-robin replicas in gpp's layout search (graphpipe.search.layouts.ROUND_ROBIN): stages on any whole number
of nodes, their replicas taking whole micro-batches of one sample in turn.

Oracles: iteration times counted by hand from the ops' per-sample times (a replica runs its micro-batches one
after another; nothing else costs), the split-replica formula the round-robin tables must equal, and fill-drain's
simulated iteration for graph-1F1B's round-robin warm-ups.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from graphpipe.cluster import Cluster, DeviceSpec, Link
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import make_schedule
from graphpipe.sched.simulator import simulate
from graphpipe.search.common import SearchOptions
from graphpipe.search.gpp_blocks import BlockCosts, round_robin_counts
from graphpipe.search.gpp_tree import chain_tree
from graphpipe.search.planner import make_plan
from graphpipe.stages import Stage, StageGraph

F, B = 1e-3, 2e-3  # seconds per sample of one layer's forward and backward


def cluster(n: int, per_node: int = 8) -> Cluster:
    link = Link(latency_s=0.0, bandwidth_Bps=1e12)
    return Cluster(name="t", num_devices=n, devices_per_node=per_node,
                   device=DeviceSpec(name="x", memory_bytes=1e12, peak_flops=1e15, op_overhead_s=0.0),
                   intra_node=link, inter_node=link)


def layers(n: int) -> OpGraph:
    """``n`` equal layers in a chain, no parameters and no bytes between them: only compute costs."""
    ops = [Op(f"l{i}", "linear", Affine(0.0, F), Affine(0.0, B), 0.0, 0.0, 0.0) for i in range(n)]
    return OpGraph.build("chain", ops, [(f"l{i}", f"l{i + 1}", 0.0) for i in range(n - 1)])


def test_round_robin_tables_equal_split_replicas_of_one_sample_each():
    """d round-robin replicas of micro-batch 1 cost what d split replicas of micro-batch d cost: one sample per
    action, d actions at once: (F + B) / d per sample of the whole block."""
    g = layers(3)
    cl = cluster(24)
    blocks = BlockCosts(chain_tree(g), cl, batch_size=1024, micro_batch_size=1, round_robin=True)
    assert blocks.device_counts == (1, 2, 4, 8, 16, 24) == round_robin_counts(24, 8)
    root = blocks.tree.root
    for c, d in enumerate(blocks.device_counts):
        for lo, hi in ((0, 1), (0, 3), (1, 3)):
            assert blocks.stage_tps(root)[lo, hi, c] == pytest.approx((hi - lo) * (F + B) / d, rel=1e-12)
    plain = BlockCosts(chain_tree(g), cl, batch_size=1024, micro_batch_size=1)
    assert plain.device_counts == (1,)  # off: micro-batch 1 has one replica


def test_round_robin_layout_uses_the_devices_powers_of_two_leave_idle():
    """Two equal layers on 24 devices (3 nodes), batch 1,024: a replica count must divide a power-of-two
    micro-batch, so whole copies use 16 devices, 64 samples each (1 stage of 16, or 2 of 8: 128 layer-samples on
    the busiest device); round-robin replicas use all 24 as one stage: ceil(1024 / 24) = 43 samples of both
    layers on the busiest, 86 layer-samples."""
    g = layers(2)
    cl = cluster(24)
    auto = make_plan("chain", g, cl, 1024, "gpp", SearchOptions(tp="auto", shard="auto"))
    pp_only = make_plan("chain", g, cl, 1024, "gpp", SearchOptions(tp=1, shard="none"))
    assert auto.predicted.iteration_time_s == pytest.approx(math.ceil(1024 / 24) * 2 * (F + B), rel=1e-9)
    assert len(auto.stage_graph.devices_used()) == 24
    assert all(st.round_robin and st.micro_batch_size == 1 for st in auto.stage_graph.stages)
    assert auto.search["layout"] == {"tp": 1, "shard": "none", "replica_group": 1, "round_robin": True}
    assert pp_only.predicted.iteration_time_s >= 128 * (F + B) * (1 - 1e-9)
    assert len(pp_only.stage_graph.devices_used()) == 16
    assert not any(st.round_robin for st in pp_only.stage_graph.stages)
    # the layout search planned whole copies first, then again with round-robin replicas, and kept the latter
    # only because it simulated faster
    tried = auto.search["layouts_tried"]
    plain = next(row for row in tried if row == {**row, "tp": 1, "shard": "none"} and "round_robin" not in row)
    again = next(row for row in tried if row.get("round_robin"))
    assert tried.index(plain) < tried.index(again) and again["throughput"] > plain["throughput"]


def _chain(counts: tuple[int, ...], work: tuple[float, ...], batch: int) -> tuple[StageGraph, Cluster]:
    ops = [Op(f"o{i}", "x", Affine(0.0, 1.0 * w), Affine(0.0, 2.0 * w)) for i, w in enumerate(work)]
    g = OpGraph.build("c", ops, [(f"o{i}", f"o{i + 1}", 0.0) for i in range(len(ops) - 1)])
    stages, nxt = [], 0
    for i, r in enumerate(counts):
        stages.append(Stage(i, (i,), tuple(range(nxt, nxt + r)), 1, replica_mode="round-robin" if r > 1 else "split"))
        nxt += r
    cl = cluster(nxt, per_node=nxt)
    return StageGraph.build(g, stages, batch, nxt), cl


@pytest.mark.parametrize("counts,work,batch", [((2, 3), (2, 3), 60), ((6, 13), (6, 13), 156), ((13, 6), (13, 6), 156),
                                               ((2, 3, 3, 3), (2, 3, 3, 3), 60), ((2, 2), (2, 2), 60)])
def test_graph_1f1b_round_robin_warmups_keep_up_with_fill_drain(counts, work, batch):
    """Balanced chains of round-robin stages whose replica counts differ: graph-1F1B (and ZB-H1, its split
    backward) run no longer than fill-drain, which never waits on a replica's turn. With each stage admitting
    only its replicas times its depth, (2, 3) took 234 time units against fill-drain's 190."""
    sg, cl = _chain(counts, work, batch)
    fill_drain = simulate(sg, make_schedule("gpipe", sg, cl), cl).iteration_time_s
    for name in ("graph-1f1b", "zb-h1"):
        assert simulate(sg, make_schedule(name, sg, cl), cl).iteration_time_s <= fill_drain * (1 + 1e-9), name
    # and both are within the fill and drain of the busiest replica's work: M / r micro-batches of 3 units each
    steady = max(math.ceil(batch / r) * 3.0 * w for r, w in zip(counts, work))
    assert fill_drain <= steady + 3.0 * sum(work) * 2


def test_round_robin_replicas_may_be_tp_groups_but_not_fsdp_shards():
    """A tp group is one replica and takes its micro-batches whole (its devices run the same actions); FSDP
    shards would have to gather weights together while their replicas run different micro-batches: refused."""
    g = layers(2)
    cl = cluster(6)
    stages = [Stage(0, (0,), (0, 1, 2, 3), 1, replica_mode="round-robin", tp=2), Stage(1, (1,), (4, 5), 1,
                                                                                    replica_mode="round-robin")]
    sg = StageGraph.build(g, stages, 8, 6, cluster=cl)
    assert sg.stages[0].replica_of(5) == (2, 3) and sg.stages[1].replica_of(5) == (5,)
    schedule = make_schedule("graph-1f1b", sg, cl)
    assert schedule.device_actions[0] == schedule.device_actions[1] != schedule.device_actions[2]
    assert {a.mb_id for a in schedule.device_actions[2]} == {1, 3, 5, 7}
    with pytest.raises(Exception, match="cannot gather FSDP-sharded weights together"):
        Stage(0, (0,), (0, 1, 2, 3), 1, replica_mode="round-robin", shard="fsdp")


def test_round_robin_groups_split_their_micro_batches_and_are_checked():
    """``split`` replicas per round-robin group: micro-batch i to group i mod g, each of its replicas one
    ``1/split`` share; inconsistent fields are refused in one line."""
    st = Stage(0, (0,), tuple(range(6)), 2, replica_mode="round-robin", split=2)
    assert (st.num_groups, st.samples_per_replica, st.replica_of(4), st.replica_of(5)) == (3, 1.0, (2, 3), (4, 5))
    assert Stage(0, (0,), tuple(range(8)), 2, replica_mode="round-robin", split=2, tp=2).replica_of(1) == (4, 5, 6, 7)
    for fields, message in ((dict(devices=(0, 1), micro_batch_size=2, split=2), "split stage already splits"),
                            (dict(devices=(0, 1, 2), micro_batch_size=2, split=2, replica_mode="round-robin"),
                             "must divide its 3 replicas"),
                            (dict(devices=(0, 1), micro_batch_size=3, split=2, replica_mode="round-robin"),
                             "micro-batch size 3")):
        with pytest.raises(Exception, match=message):
            Stage(0, (0,), **fields)


def test_round_robin_groups_simulate_as_counted_by_hand():
    """Stage 0: 2 groups of 2 replicas (micro-batch 2, a sample per replica), stage 1: 2 split replicas, batch 8
    (4 micro-batches), GPipe, free links, F = 1 and B = 2 units per sample. By hand: group A runs F0 [0, 1], F2
    [1, 2], group B F1, F3 alike; stage 1 F0..F3 over [1, 5], B0..B3 over [5, 13]; then A: B0 [7, 9], B2 [11, 13],
    B: B1 [9, 11], B3 [13, 15]. Iteration 15 units."""
    g = layers(2)
    cl = cluster(6)
    stages = [Stage(0, (0,), (0, 1, 2, 3), 2, replica_mode="round-robin", split=2), Stage(1, (1,), (4, 5), 2)]
    sg = StageGraph.build(g, stages, 8, 6, cluster=cl)
    schedule = make_schedule("gpipe", sg, cl)
    assert schedule.device_actions[0] == schedule.device_actions[1] != schedule.device_actions[2]
    assert simulate(sg, schedule, cl).iteration_time_s == pytest.approx(15 * F, rel=1e-9)


def test_a_round_robin_groups_message_goes_over_its_groups_links():
    """A micro-batch leaves one group whole: a group of 2 replicas sends its 2 samples over 2 links, a
    one-replica round-robin replica over 1 (latency + bytes / (bandwidth x links))."""
    from graphpipe.sched.simulator import edge_delay

    link = Link(latency_s=1e-6, bandwidth_Bps=1e9)
    cl = Cluster(name="t", num_devices=8, devices_per_node=8,
                 device=DeviceSpec(name="x", memory_bytes=1e12, peak_flops=1e15, op_overhead_s=0.0),
                 intra_node=link, inter_node=link)
    g = OpGraph.build("c", [Op("a", "x", Affine(0.0, F), Affine(0.0, B)), Op("b", "x", Affine(0.0, F), Affine(0.0, B))],
                      [("a", "b", 1000.0)])
    for split, lanes in ((2, 2), (1, 1)):
        stages = [Stage(0, (0,), (0, 1, 2, 3), 2, replica_mode="round-robin", split=split), Stage(1, (1,), (4, 5), 2)]
        sg = StageGraph.build(g, stages, 8, 8, cluster=cl)
        assert edge_delay(sg, cl, 0, 1) == pytest.approx(1e-6 + 2 * 1000.0 / (1e9 * lanes), rel=1e-12)


def test_round_robin_groups_use_the_devices_past_1024_units():
    """Two equal layers on 1,536 devices, batch 4,096: past 1,024 units the layout search takes replicas 2 at a
    time. Whole copies split power-of-two micro-batches: 1,024 devices, 4 samples of both layers each (8
    layer-samples on the busiest); round-robin groups of 2 replicas take micro-batches of 2 in turn, a sample per
    replica: all 1,536 devices as one stage, ceil(2048 / 768) = 3 micro-batches of both layers, 6 layer-samples."""
    g = layers(2)
    cl = cluster(1536)
    auto = make_plan("chain", g, cl, 4096, "gpp", SearchOptions(tp="auto", shard="auto"))
    assert auto.predicted.iteration_time_s == pytest.approx(6 * (F + B), rel=1e-9)
    assert len(auto.stage_graph.devices_used()) == 1536
    assert all(st.round_robin and st.split == 2 and st.micro_batch_size == 2 for st in auto.stage_graph.stages)
    assert auto.search["layout"] == {"tp": 1, "shard": "none", "replica_group": 2, "round_robin": True}
    plain = next(row for row in auto.search["layouts_tried"] if "throughput" in row and "round_robin" not in row)
    assert plain["devices_used"] == 1024 and plain["throughput"] == pytest.approx(4096 / (8 * (F + B)), rel=1e-9)


def test_the_devices_of_a_round_robin_group_must_list_its_micro_batches_in_one_order():
    """The devices of one group split each of the group's micro-batches, so they run them in one order (the
    simulator advances a group as one): a group whose second device swaps two micro-batches is refused in one
    line naming both devices, as split replicas that disagree are."""
    from graphpipe.actions import Action, Schedule
    from graphpipe.errors import ScheduleError
    from graphpipe.sched.validate import validate_schedule

    g, cl = layers(2), cluster(6)
    stages = [Stage(0, (0,), (0, 1, 2, 3), 2, replica_mode="round-robin", split=2), Stage(1, (1,), (4, 5), 2)]
    sg = StageGraph.build(g, stages, 8, 6, cluster=cl)
    good = make_schedule("gpipe", sg, cl)
    validate_schedule(sg, good)
    acts = [list(a) for a in good.device_actions]
    first = acts[1]  # group (0, 1) runs micro-batches 0 and 2; device 1 lists them the other way round
    i0, i2 = first.index(Action(0, "F", 0)), first.index(Action(0, "F", 2))
    first[i0], first[i2] = first[i2], first[i0]
    with pytest.raises(ScheduleError, match=r"devices of a round-robin group of stage 0 disagree: device 0 runs 0F0 "
                                            r"where device 1 runs 0F2"):
        validate_schedule(sg, Schedule(good.name, tuple(tuple(a) for a in acts)))


def test_the_per_stage_re_pick_skips_layouts_with_more_groups_than_micro_batches():
    """A round-robin stage of tp 2 groups of 2 on 8 devices runs 2 groups; at tp 1 it would run 4, and a
    batch of 4 at micro-batch 2 has only 2 micro-batches, so a group would never run: the re-pick does not
    offer that layout (it raised the stage graph's own error before)."""
    from graphpipe.search import layouts

    g, cl = layers(2), cluster(10)
    stages = [Stage(0, (0,), tuple(range(8)), 2, replica_mode="round-robin", split=2, tp=2), Stage(1, (1,), (8, 9), 2)]
    sg = StageGraph.build(g, stages, 4, 10, cluster=cl)
    options = layouts.stage_layouts(sg.stages[0], cl, [1, 2], ["none"], sg.batch_size)
    assert [(s.tp, s.keep_gathered) for s in options] == [(2, False), (2, True)]  # tp 2: inputs re-gathered or kept
    assert [s.tp for s in layouts.stage_layouts(sg.stages[0], cl, [1, 2], ["none"])] == [1, 2, 2]
    out = layouts.per_stage_layouts(sg, cl, [1, 1], [1, 2], ["none"])
    assert (out.stages[0].tp, out.stages[0].num_groups) == (2, 2)


def test_round_robin_is_also_tried_where_powers_of_two_use_every_device_unevenly(monkeypatch):
    """Four equal layers of 1 GB of fp32 weights on 24 devices (6 nodes of 4) of 10 GB, which hold two layers'
    Adam state (8 GB; three need 12): split replicas of a power-of-two micro-batch come in powers of two, so the best such
    plan cuts 2 + 1 + 1 layers onto 8 devices each and uses every device, but its busiest device runs 128
    samples of 2 layers against an even share of 1024 x 4 / 24 layer-samples: balance 2/3. The round-robin
    retry, run before only where devices sat idle, now also runs under a balance of 0.85: one layer per stage
    on 6 devices each, ceil(1024 / 6) = 171 samples on the busiest, plus at most one pass of each stage's
    work of fill and drain."""
    import graphpipe.search.planner as planner
    from graphpipe.search.layouts import efficiency_factors

    g = OpGraph.build("chain", [Op(f"l{i}", "x", Affine(0.0, F), Affine(0.0, B), 1e9, 0.0, 0.0) for i in range(4)],
                      [(f"l{i}", f"l{i + 1}", 0.0) for i in range(3)])
    base = cluster(24, per_node=4)
    cl = Cluster(name="t", num_devices=24, devices_per_node=4, device=DeviceSpec(name="x", memory_bytes=10e9,
                 peak_flops=1e15, op_overhead_s=0.0), intra_node=base.intra_node, inter_node=base.inter_node)
    options = SearchOptions(tp=1, shard="auto")
    new = make_plan("chain", g, cl, 1024, "gpp", options)
    monkeypatch.setattr(planner, "ROUND_ROBIN_BALANCE", 0.0)  # the retry's rule before
    old = make_plan("chain", g, cl, 1024, "gpp", options)
    assert sorted((len(s.op_ids), len(s.devices)) for s in old.stage_graph.stages) == [(1, 8), (1, 8), (2, 8)]
    assert efficiency_factors(old, 24)["balance"] == pytest.approx(2 / 3)
    assert [(len(s.op_ids), len(s.devices), s.round_robin) for s in new.stage_graph.stages] == [(1, 6, True)] * 4
    busiest = math.ceil(1024 / 6) * (F + B)
    assert busiest <= new.predicted.iteration_time_s <= busiest + 4 * (F + B)
    assert new.predicted.iteration_time_s < 0.7 * old.predicted.iteration_time_s


def test_a_chain_with_a_small_parallel_part_still_gets_the_round_robin_retry():
    """OPT's token and position embeddings run side by side before its chain of layers: a parallel part of two
    ops keeps the graph a chain for the round-robin retry (OPT-66B at 8,192 devices: 0.58 -> 0.71 of perfect
    scaling with it), where a branch of more ops beside the rest (T5's encoder beside its decoder's embedding)
    does not. On the four memory-bound layers of the uneven case above with such a side op, the retry runs
    and wins: one layer per stage on 6 devices each."""
    import graphpipe.search.planner as planner

    def graph(side: int) -> OpGraph:
        ops = [Op("pos", "x", Affine(0.0, 1e-6), Affine(0.0, 1e-6), 0.0, 0.0, 0.0)] if side else []
        ops += [Op(f"s{i}", "x", Affine(0.0, 1e-6), Affine(0.0, 1e-6), 0.0, 0.0, 0.0) for i in range(side - 1)]
        ops += [Op(f"l{i}", "x", Affine(0.0, F), Affine(0.0, B), 1e9, 0.0, 0.0) for i in range(4)]
        edges = [(f"l{i}", f"l{i + 1}", 0.0) for i in range(3)]
        names = ["pos"] + [f"s{i}" for i in range(side - 1)] if side else []
        edges += list(zip(names, names[1:], [0.0] * len(names))) + ([(names[-1], "l1", 0.0)] if side else [])
        return OpGraph.build("chain", ops, edges)

    assert planner._layer_chain(graph(0)) and planner._layer_chain(graph(1))
    assert not planner._layer_chain(graph(planner.SMALL_PARALLEL + 1))
    base = cluster(24, per_node=4)
    cl = Cluster(name="t", num_devices=24, devices_per_node=4, device=DeviceSpec(name="x", memory_bytes=10e9,
                 peak_flops=1e15, op_overhead_s=0.0), intra_node=base.intra_node, inter_node=base.inter_node)
    plan = make_plan("chain", graph(1), cl, 1024, "gpp", SearchOptions(tp=1, shard="auto"))
    assert plan.search["layout"].get("round_robin")
    sg = plan.stage_graph
    assert sorted(len(s.devices) for s in sg.stages if any(sg.graph.ops[i].name.startswith("l") for i in s.op_ids)) \
        == [6, 6, 6, 6]


def test_the_plan_table_says_which_stages_take_micro_batches_in_turn():
    """``graphpipe plan``'s table gains its layout column where replicas take micro-batches in turn, one by one
    or in groups that split each (``round-robin by 2``); a plan of split whole copies prints no such column."""
    from graphpipe.cli.plan_cmd import format_plan
    from graphpipe.plan import Predicted
    from graphpipe.sched.predict import predict

    auto = make_plan("chain", layers(2), cluster(24), 1024, "gpp", SearchOptions(tp="auto", shard="auto"))
    table = format_plan(auto).splitlines()
    assert table[1].split()[-1] == "layout" and table[2].endswith("24 x copy, round-robin")
    plain = make_plan("chain", layers(2), cluster(24), 1024, "gpp", SearchOptions(tp=1, shard="none"))
    assert "layout" not in format_plan(plain).splitlines()[1]
    g, cl = layers(2), cluster(6)
    stages = [Stage(0, (0,), (0, 1, 2, 3), 2, replica_mode="round-robin", split=2), Stage(1, (1,), (4, 5), 2)]
    sg = StageGraph.build(g, stages, 8, 6, cluster=cl)
    grouped = replace(auto, stage_graph=sg, cluster=cl, schedule=make_schedule("gpipe", sg, cl))
    grouped = replace(grouped, predicted=Predicted(**predict(grouped)[1]))
    rows = format_plan(grouped).splitlines()
    assert rows[2].endswith("4 x copy, round-robin by 2") and rows[3].endswith("2 x copy")


def _rr_chain(counts, params, per_node=8, bandwidth=1e10, mode="round-robin"):
    """Round-robin stages of one layer each on ``counts`` devices, layer ``i`` holding ``params[i]`` bytes; a
    cluster whose links are ``bandwidth`` bytes/s with no latency. ``mode="split"``: each stage's replicas
    split micro-batches of one sample per replica instead."""
    link = Link(latency_s=0.0, bandwidth_Bps=bandwidth)
    n = sum(counts)
    cl = Cluster(name="t", num_devices=n, devices_per_node=per_node,
                 device=DeviceSpec(name="x", memory_bytes=1e12, peak_flops=1e15, op_overhead_s=0.0),
                 intra_node=link, inter_node=link)
    ops = [Op(f"l{i}", "linear", Affine(0.0, F), Affine(0.0, B), p, 0.0, 0.0) for i, p in enumerate(params)]
    g = OpGraph.build("chain", ops, [(f"l{i}", f"l{i + 1}", 0.0) for i in range(len(params) - 1)])
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = [Stage(i, (i,), tuple(range(a, a + c)), 1 if mode == "round-robin" else c, replica_mode=mode)
              for i, (a, c) in enumerate(zip(starts, counts))]
    return StageGraph.build(g, stages, 64, n, cluster=cl), cl


def _rr_shard_cost(sg, cl, chosen, finish):
    """The choice's cost by definition: the longest gather the fill (one forward of one sample per layer before
    the stage) leaves exposed, plus the latest stage end (finish + reduce-scatter if sharded, else all-reduce);
    ring collectives by their steps (tests/test_sched_common.py)."""
    from test_sched_common import oracle_collective_link, oracle_ring_allreduce, oracle_ring_gather

    exposed, ends = 0.0, []
    for st in sg.stages:
        link = oracle_collective_link(cl, st.devices)
        p = sg.graph.ops[st.op_ids[0]].param_bytes
        gather = oracle_ring_gather(len(st.devices), link, p)
        if st.id in chosen:
            exposed = max(exposed, gather - st.id * F)
            ends.append(finish[st.id] + gather)
        else:
            ends.append(finish[st.id] + oracle_ring_allreduce(len(st.devices), link, p))
    return exposed + max(ends)


@pytest.mark.parametrize("mode", ["round-robin", "split"])
def test_stages_to_shard_equal_brute_force(mode):
    """Which whole-copy stages (round-robin, or splitting micro-batches of a sample per replica) to FSDP-shard
    (gathered for the step): the threshold on the exposed gather that :func:`shard_stages` searches gives the
    least cost over all 2^n subsets, the cost counted here, on 30 random chains of 5 stages; the picks there
    are none, some and all of the stages."""
    import itertools
    import random

    from graphpipe.search.layouts import shard_stages

    sizes = set()
    for seed in range(30):
        rng = random.Random(seed)
        counts = [rng.choice((2, 4, 8, 16)) for _ in range(5)]
        sg, cl = _rr_chain(counts, [rng.choice((1e6, 4e6, 1e7, 2e7, 4e7)) for _ in counts], mode=mode)
        finish = [rng.uniform(0.0, 0.004) for _ in counts]
        picked = shard_stages(sg, cl, [1] * len(counts), finish)
        chosen = {st.id for st in picked.stages if st.shard == "fsdp"}
        assert all(not st.reshard_after_forward and st.replica_mode == mode for st in picked.stages
                   if st.shard == "fsdp")
        brute = min(_rr_shard_cost(sg, cl, set(subset), finish)
                    for k in range(len(counts) + 1) for subset in itertools.combinations(range(len(counts)), k))
        assert _rr_shard_cost(sg, cl, chosen, finish) == pytest.approx(brute, rel=1e-12, abs=1e-15), seed
        sizes.add(len(chosen))
    assert {0, 5} < sizes


def test_round_robin_fsdp_stage_gathers_behind_the_fill_by_oracle():
    """Stage 1's 40 MB: an all-reduce of 7 ms after its last backward, or a gather of 3.5 ms from the step's
    start (of which stage 0's first 1 ms forward hides 1 ms) and a reduce-scatter of 3.5 ms; stage 0's last
    backward comes 2 ms after stage 1's, so stage 1's collective ends the step: sharding it is worth
    7 - 3.5 - 2.5 = 1 ms by the pick's count. Stage 0's 10 kB gather exposes 0.9 us, under that threshold, so
    it is sharded too. The relaxation oracle (which knows the gathers as the stages' releases) agrees with the
    simulator, and the step is faster."""
    from test_sched_common import oracle_iteration, oracle_ring_allreduce, oracle_ring_gather

    from graphpipe.search.layouts import shard_stages

    sg, cl = _rr_chain([8, 8], [1e4, 4e7], per_node=16)
    link = Link(latency_s=0.0, bandwidth_Bps=1e10)
    gather, allreduce = oracle_ring_gather(8, link, 4e7), oracle_ring_allreduce(8, link, 4e7)
    assert (gather, allreduce) == pytest.approx((3.5e-3, 7e-3), rel=1e-12)
    whole = simulate(sg, make_schedule("1f1b", sg, cl), cl)
    finish = [max(r.end for r in whole.actions if r.action.stage_id == s) for s in (0, 1)]
    assert finish[0] - finish[1] == pytest.approx(B, rel=1e-9)
    assert whole.iteration_time_s == pytest.approx(finish[1] + allreduce, rel=1e-12)
    picked = shard_stages(sg, cl, [1, 1], finish)
    assert [st.shard for st in picked.stages] == ["fsdp", "fsdp"]
    sched = make_schedule("1f1b", picked, cl)
    tl = simulate(picked, sched, cl)
    assert tl.iteration_time_s == pytest.approx(oracle_iteration(picked, sched, cl), rel=1e-12)
    assert tl.iteration_time_s < whole.iteration_time_s - 0.5e-3


def test_round_robin_stages_sharing_devices_are_not_sharded():
    """The runtime refuses a round-robin FSDP stage whose devices run another stage after its last backward
    (a replica's reduce-scatter holds its device until every replica arrives): the pick leaves stages that
    share a device whole, where it shards the same stage on devices of its own."""
    from graphpipe.search.layouts import shard_stages

    sg, cl = _rr_chain([8, 8], [1e4, 4e7], per_node=16)
    finish = [0.02, 0.018]
    assert [st.shard for st in shard_stages(sg, cl, [1, 1], finish).stages] == ["fsdp", "fsdp"]
    shared = StageGraph.build(sg.graph, [replace(sg.stages[0], devices=tuple(range(8))),
                                         replace(sg.stages[1], devices=tuple(range(8)))], 64, 16,
                              allow_shared_devices=True, cluster=cl)
    assert [st.shard for st in shard_stages(shared, cl, [1, 1], finish).stages] == ["none", "none"]
