"""The one cost model (graphpipe.costs): vectorised == scalar, every partitioner's memory estimate against
the simulator (the reference), and re-materialization as a planning decision."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from graphpipe import costs
from graphpipe.cluster import preset
from graphpipe.errors import InfeasibleError, InputError, PlanError
from graphpipe.graph import Edge, OpGraph
from graphpipe.sched import make_schedule, simulate, validate_schedule
from graphpipe.search.common import SearchOptions
from graphpipe.search.sequential import OpArrays, ReplicaCosts
from graphpipe.stages import Stage, StageGraph

from conftest import branches_graph, chain_graph, make_op, random_sp_graph


# ------------------------------------------------------------------ formulas
@pytest.mark.parametrize("seed", range(20))
def test_vectorised_equals_scalar_on_random_stages(seed):
    """CostArrays / ReplicaCosts on arrays of random contiguous stages == the scalar functions, one stage at a time;
    the received saved copies (range_received_saved beside received_saved_bytes) on random saved edges."""
    rng = random.Random(seed)
    graph = random_sp_graph(rng.randint(3, 12), seed)
    graph = OpGraph(graph.name, graph.ops, tuple(Edge(e.src, e.dst, e.bytes, e.bytes * rng.choice((0, 0.5, 1)))
                                                 for e in graph.edges))
    cluster = preset("v100", rng.choice((4, 8, 16)))
    arrays = costs.CostArrays.of(graph, cluster)
    seq, rep = OpArrays.of(graph), ReplicaCosts.of(cluster)
    n = graph.num_ops
    lo = np.array([rng.randrange(n) for _ in range(16)])
    hi = np.array([rng.randrange(int(a), n) + 1 for a in lo])
    r = np.array([rng.choice([d for d in (1, 2, 4, 8) if d <= cluster.num_devices]) for _ in lo])
    rc = np.array([rng.random() < 0.5 for _ in lo])
    b, batch = 8 * rng.choice((1, 2)), 64
    k = np.array([rng.randint(1, 6) for _ in lo])

    def sums(values):
        pre = np.concatenate(([0.0], np.cumsum(values)))
        return pre[hi] - pre[lo]

    act = sums(arrays.act) + np.array([costs.range_received_saved(graph, range(n), a)[z - 1 - a] for a, z in zip(lo, hi)])

    ins = np.array([costs.stage_sums(graph, range(a, z)).inputs for a, z in zip(lo, hi)])
    outs = np.array([costs.stage_sums(graph, range(a, z)).outputs for a, z in zip(lo, hi)])
    tps = arrays.tps(sums(arrays.fwd_alpha), sums(arrays.fwd_beta), sums(arrays.bwd_alpha), sums(arrays.bwd_beta),
                     sums(arrays.params), r, b, batch, rc)
    tps_seq = rep.tps(sums(seq.compute_alpha), sums(seq.compute_beta), sums(seq.params), r, b, batch,
                      sums(seq.fwd_alpha), sums(seq.fwd_beta), rc)
    mem = arrays.memory(sums(arrays.params), act, r, b, k, ins, outs, rc)
    mem_seq = rep.memory(sums(seq.params), act, r, b, k, ins, outs, rc)
    kmax = arrays.max_in_flight(sums(arrays.params), act, r, b, 6, ins, outs, rc)
    for i in range(len(lo)):
        ops, devices = tuple(range(lo[i], hi[i])), tuple(range(r[i]))
        want_t = costs.stage_tps(graph, ops, devices, b, batch, cluster, bool(rc[i]))
        want_m = costs.stage_memory(graph, ops, int(r[i]), b, int(k[i]), cluster, bool(rc[i]))
        assert tps[i] == pytest.approx(want_t, rel=1e-12) and tps_seq[i] == pytest.approx(want_t, rel=1e-12)
        assert mem[i] == pytest.approx(want_m, rel=1e-12) and mem_seq[i] == pytest.approx(want_m, rel=1e-12)
        # max_in_flight is the exact inverse of stage_memory under the capacity
        fits = [j for j in range(1, 7) if costs.stage_memory(graph, ops, int(r[i]), b, j, cluster, bool(rc[i]))
                <= cluster.memory_bytes]
        assert kmax[i] == (max(fits) if fits else -1)


def test_recompute_formulas_by_hand():
    """One more forward inside B; memory keeps inputs per in-flight micro-batch plus one full working set."""
    f, bwd = costs.action_times(1.0, 0.5, 2.0, 1.0, 4, True)
    assert (f, bwd) == (3.0, 9.0)  # F = 1 + 0.5*4, B = 2 + 1*4 + F
    assert costs.activation_bytes(100.0, 10.0, 2, 5, False) == 1000.0
    assert costs.activation_bytes(100.0, 10.0, 2, 5, True) == 5 * 20.0 + 200.0
    assert costs.buffer_bytes(10.0, 30.0, 2) == 80.0
    assert costs.ring_allreduce_s(1, 1.0, 1.0, 5.0) == 0.0
    assert costs.ring_allreduce_s(4, 1e-6, 1e9, 1e9) == pytest.approx(6e-6 + 1.5)


# ----------------------------------------------- the simulator is the reference
def _one_device_per_stage(sg):
    return {s.devices[0]: s.id for s in sg.stages if all(len(sg.stages_on_device(d)) == 1 for d in s.devices)}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "graph-1f1b"])
def test_simulated_peak_equals_the_formula_at_the_simulated_in_flight(recompute, schedule):
    """Per device: simulated peak == costs.stage_memory at the simulator's own in-flight count, with and without
    re-materialization; peak_activation_bytes is the activation term alone."""
    graph = chain_graph(4)
    cluster = preset("v100", 4)
    stages = [Stage(i, (i,), (i,), 2, recompute) for i in range(4)]
    sg = StageGraph.build(graph, stages, 16, 4)
    tl = simulate(sg, make_schedule(schedule, sg, cluster), cluster)
    for d, s in _one_device_per_stage(sg).items():
        st = sg.stages[s]
        want = costs.stage_memory(graph, st.op_ids, 1, 2, tl.in_flight[s], cluster, recompute)
        assert tl.peak_memory_bytes[d] == pytest.approx(want)
        sums = sg.stage_sums(s)
        assert tl.activation_peak_bytes[d] == pytest.approx(
            costs.activation_bytes(sums.act, sums.inputs, 2, tl.in_flight[s], recompute))
    # B carries the re-run forward
    assert sg.bwd_time(0) == pytest.approx(graph.bwd_time((0,), 2) + (graph.fwd_time((0,), 2) if recompute else 0))


def test_recompute_lowers_simulated_memory_and_lengthens_the_iteration():
    graph = chain_graph(4)
    cluster = preset("v100", 4)
    plain = StageGraph.build(graph, [Stage(i, (i,), (i,), 2) for i in range(4)], 16, 4)
    redo = StageGraph.build(graph, [Stage(i, (i,), (i,), 2, True) for i in range(4)], 16, 4)
    a = simulate(plain, make_schedule("gpipe", plain, cluster), cluster)
    b = simulate(redo, make_schedule("gpipe", redo, cluster), cluster)
    assert max(b.activation_peak_bytes) < max(a.activation_peak_bytes)
    assert b.iteration_time_s > a.iteration_time_s


@pytest.mark.parametrize("strategy", ["gpp", "gpipe"])
@pytest.mark.parametrize("recompute", ["none", "all"])
def test_partitioner_memory_estimate_bounds_the_simulator(strategy, recompute):
    """Each partitioner's estimate (costs.stage_memory at the in-flight count its search charges) is at least
    the simulated peak of every device, and equal where the simulated in-flight count is the one charged.
    The search costs whole-stage re-materialization; the checkpoints the planner then places only lower it."""
    from dataclasses import replace

    from graphpipe.sched import predicted_figures, simulate
    from graphpipe.search.planner import make_plan

    graph = branches_graph(3, 3)
    cluster = preset("v100", 8)
    plan = make_plan("branches.json", graph, cluster, 64, strategy, SearchOptions(recompute=recompute))
    placed = plan.predicted
    sg = replace(plan.stage_graph, stages=tuple(replace(s, checkpoints=()) for s in plan.stage_graph.stages))
    p = predicted_figures(simulate(sg, plan.schedule, cluster))
    assert all(a <= b * (1 + 1e-9) for a, b in zip(placed["peak_memory_bytes"], p["peak_memory_bytes"]))
    for d, s in _one_device_per_stage(sg).items():
        st = sg.stages[s]
        # gpipe charges every micro-batch in flight (fill-drain); gpp graph-1F1B's min(depth, M)
        charged = sg.num_micro_batches(s) if plan.schedule.name == "gpipe" else min(_depth_below(sg, s),
                                                                                    sg.num_micro_batches(s))
        sums = sg.stage_sums(s)
        est = costs.memory_bytes(sums.param_bytes, sums.act, sums.inputs, sums.outputs, st.samples_per_replica,
                                 charged, st.recompute, cluster.bytes_per_param)
        assert p["peak_memory_bytes"][d] <= est * (1 + 1e-9)
        if p["in_flight"][s] == charged:
            assert p["peak_memory_bytes"][d] == pytest.approx(est)


@pytest.mark.parametrize("strategy", ["gpp", "pipedream", "piper", "gpipe"])
def test_every_partitioner_charges_a_received_saved_copy(strategy):
    """Four equal ops whose model state fits three to a device: two devices split them in the middle, unless
    the tensor crossing the middle is saved on both sides and its received copy overflows the device. Every
    partitioner must then cut elsewhere, and the plan must fit as simulated."""
    from graphpipe.search.planner import make_plan

    ops = [make_op(f"l{i}", params=1e9) for i in range(4)]  # 4e9 bytes of state each (16 per fp32 parameter)
    edges = [(f"l{i}", f"l{i + 1}", 1e4) for i in range(3)]
    cluster = preset("v100", 2).with_memory(13e9)

    def plan(saved_in_the_middle):
        graph = OpGraph.build("chain", ops, [e + ((saved_in_the_middle,) if e[0] == "l1" else ()) for e in edges])
        return make_plan("chain.json", graph, cluster, 8, strategy, SearchOptions(recompute="none"), monotone=False)

    before = plan(0.0).stage_graph
    assert before.stage_of(1) != before.stage_of(2), "premise: the plain split is in the middle"
    got = plan(6e9)  # per sample: 8e9 of state + one sample's copy > 13e9
    assert got.stage_graph.stage_of(1) == got.stage_graph.stage_of(2)
    assert max(got.predicted["peak_memory_bytes"]) <= 13e9


def _depth_below(sg, s):
    """Stages on the longest path from ``s`` to a sink, ``s`` included (graph-1F1B's in-flight)."""
    depth = [1] * sg.num_stages
    for a in reversed(range(sg.num_stages)):
        for b in sg.succs(a):
            depth[a] = max(depth[a], depth[b] + 1)
    return depth[s]


# ------------------------------------------------- re-materialization decisions
@pytest.mark.parametrize("num_devices", [4, 8, 16, 32])
def test_gpipe_fits_the_mmt_paper_config_on_v100s(num_devices):
    """The issue's acceptance point: GPipe (fill-drain, recompute all) plans MMT (4 x 8 layers, seq 256,
    hidden 1024) on N V100-16GB at batch 16 N, in far less memory than without re-materialization."""
    from graphpipe.models import load_model
    from graphpipe.search.planner import make_plan

    graph = load_model("mmt", preset("v100", 1).device).graph
    cluster = preset("v100", num_devices)
    plan = make_plan("mmt", graph, cluster, 16 * num_devices, "gpipe")
    assert plan.schedule.name == "gpipe"
    assert all(s.recompute for s in plan.stage_graph.stages)
    assert plan.predicted["max_peak_memory_bytes"] <= cluster.memory_bytes
    if num_devices == 8:
        plain = make_plan("mmt", graph, cluster.with_memory(1e12), 16 * num_devices, "gpipe",
                          SearchOptions(recompute="none"))
        assert plan.predicted["max_peak_memory_bytes"] < plain.predicted["max_peak_memory_bytes"] / 4
        assert plan.predicted["throughput"] < plain.predicted["throughput"]  # one more forward per backward


def _tight_case():
    graph = branches_graph(2, 4)
    return graph, preset("v100", 4), 64


def test_auto_never_changes_the_plan_with_ample_memory():
    from graphpipe.plan import plan_to_dict
    from graphpipe.search.planner import make_plan

    graph, cluster, batch = _tight_case()
    for strategy in ("gpp", "gpipe"):
        auto = make_plan("g.json", graph, cluster, batch, strategy, SearchOptions(recompute="auto"))
        none = make_plan("g.json", graph, cluster, batch, strategy, SearchOptions(recompute="none"))
        assert not any(s.recompute for s in auto.stage_graph.stages)
        assert plan_to_dict(auto)["stages"] == plan_to_dict(none)["stages"]
        assert auto.schedule == none.schedule


def test_auto_finds_a_plan_under_tight_memory_where_none_does_not():
    """8 layers whose weights force 2 per device on 4 devices, activations 1 GB per sample: any plan without
    re-materialization holds the whole batch's activations of a stage (8 GB) beside 8 GB of state in 12.5 GB;
    gpp with auto re-materializes and fits (the pipeline stashes only the 10 kB stage inputs)."""
    from graphpipe.graph import OpGraph
    from graphpipe.search.planner import make_plan

    from conftest import make_op

    ops = [make_op(f"l{i}", 1e-3, params=1e9, act=1e9) for i in range(8)]
    graph = OpGraph.build("heavy", ops, [(f"l{i}", f"l{i + 1}", 1e4) for i in range(7)])
    tight = preset("v100", 4).with_memory(12.5e9)
    with pytest.raises(InfeasibleError):
        make_plan("g.json", graph, tight, 4, "gpp", SearchOptions(recompute="none"))
    auto = make_plan("g.json", graph, tight, 4, "gpp", SearchOptions(recompute="auto"))
    assert any(s.recompute for s in auto.stage_graph.stages)
    assert auto.predicted["max_peak_memory_bytes"] <= tight.memory_bytes
    validate_schedule(auto.stage_graph, auto.schedule)


def test_recompute_round_trips_through_plan_json_and_bad_values_are_refused(tmp_path):
    from graphpipe.plan import plan_from_dict, plan_to_dict, read_plan, write_plan
    from graphpipe.search.planner import make_plan

    graph, cluster, batch = _tight_case()
    plan = make_plan("g.json", graph, cluster, batch, "gpipe")
    path = tmp_path / "p.json"
    write_plan(str(path), plan)
    again = read_plan(str(path))
    assert [s.recompute for s in again.stage_graph.stages] == [True] * again.stage_graph.num_stages
    doc = plan_to_dict(plan)
    doc["stages"][0]["recompute"] = "yes"
    with pytest.raises(PlanError, match="recompute must be true or false"):
        plan_from_dict(doc)
    del doc["stages"][0]["recompute"]  # older plan files: no re-materialization
    assert not plan_from_dict(doc).stage_graph.stages[0].recompute


def test_bad_recompute_option_is_one_line_exit_2():
    with pytest.raises(InputError, match="--recompute must be one of none, all, auto"):
        SearchOptions(recompute="some")
    out = subprocess.run([sys.executable, "-m", "graphpipe", "plan", "transformer:small", "--devices", "2",
                          "--batch-size", "8", "--recompute", "some"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "graphpipe: error: --recompute" in out.stderr


def test_cpsat_counts_the_rematerialized_working_set():
    """CP-SAT's memory model (stash from F to B, working set during B) peaks where the simulator does."""
    from graphpipe.search.cpsat_model import memory_peaks, model_data

    graph = chain_graph(3)
    cluster = preset("v100", 3)
    sg = StageGraph.build(graph, [Stage(i, (i,), (i,), 2, True) for i in range(3)], 8, 3)
    tl = simulate(sg, make_schedule("1f1b", sg, cluster), cluster)
    data = model_data(sg, cluster, [(2,)] * 3, reference_s=tl.iteration_time_s)
    unit = data.unit_s
    starts = {(r.action.stage_id, r.action.kind, r.action.mb_id): round(r.start / unit) for r in tl.actions}
    peaks = memory_peaks(data, [2, 2, 2], starts)
    for gi, grp in enumerate(data.groups):
        d = grp[0]
        assert peaks[gi] * data.mem_unit_bytes == pytest.approx(tl.activation_peak_bytes[d] + tl.buffer_bytes[d],
                                                                rel=1e-3)


def test_trace_and_gantt_show_the_recomputed_forward_inside_b(tmp_path):
    from graphpipe.sched.gantt import plot_gantt
    from graphpipe.sched.trace import trace_document

    graph = chain_graph(2)
    cluster = preset("v100", 2)
    sg = StageGraph.build(graph, [Stage(0, (0,), (0,), 2, True), Stage(1, (1,), (1,), 2)], 4, 2)
    tl = simulate(sg, make_schedule("gpipe", sg, cluster), cluster)
    assert tl.recompute_s[0] == pytest.approx(sg.fwd_time(0)) and tl.recompute_s[1] == 0.0
    events = trace_document(tl)["traceEvents"]
    redo = [e for e in events if e.get("cat") == "recompute"]
    backs = {e["name"][2:]: e for e in events if e.get("cat") == "B"}
    assert len(redo) == 2 and all(e["name"].startswith("recompute s0") for e in redo)
    for e in redo:  # nested inside its B: same start, shorter
        b = backs[e["name"][len("recompute "):]]
        assert e["ts"] == b["ts"] and e["dur"] < b["dur"]
    plot_gantt(tl, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 0


def test_recompute_plan_refused_by_the_torch_baseline_one_line_exit_2(tmp_path):
    """torch.distributed.pipelining stages do not re-materialize: refused before launch."""
    from graphpipe.frontend import zoo
    from graphpipe.plan import write_plan
    from graphpipe.search.planner import make_plan

    plan = make_plan("transformer:small", zoo.load_graph("transformer:small"), preset("v100", 2), 8, "gpipe",
                     SearchOptions(micro_batch_size=2))
    assert all(s.recompute for s in plan.stage_graph.stages)
    path = tmp_path / "p.json"
    write_plan(str(path), plan)
    out = subprocess.run([sys.executable, "-m", "graphpipe", "run", str(path), "--baseline", "torch", "--steps", "2"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "re-materialize" in out.stderr


@pytest.mark.parametrize("model,num_devices,memory_gb", [("mmt", 8, 16.0), ("mmt", 8, 1.0), ("transformer", 8, 2.0)])
def test_auto_skipping_sizes_where_memory_never_binds_keeps_the_plan(monkeypatch, model, num_devices, memory_gb):
    """gpp's second ``auto`` search skips micro-batch sizes where no stage fast enough to win is short of memory;
    the plan equals the one the unskipped search gives, with and without re-materialized stages (mmt at 1 GB
    re-materializes three)."""
    from graphpipe.models import load_model
    from graphpipe.plan import plan_to_dict
    from graphpipe.search import gpp
    from graphpipe.search.planner import make_plan

    cluster = preset("v100", num_devices).with_memory(memory_gb * 1e9)
    graph = load_model(model, cluster.device).graph
    options = SearchOptions(recompute="auto")
    skipping = make_plan(model, graph, cluster, 16 * num_devices, "gpp", options, monotone=False)
    search_all = gpp.partition
    monkeypatch.setattr(gpp, "partition", lambda *a, where_memory_binds=False, **k: search_all(*a, **k))
    full = make_plan(model, graph, cluster, 16 * num_devices, "gpp", options, monotone=False)
    assert plan_to_dict(skipping)["stages"] == plan_to_dict(full)["stages"]
    assert skipping.predicted["throughput"] == full.predicted["throughput"]
    if memory_gb == 1.0:
        assert skipping.search["recompute_stages"]


def test_memory_binds_matches_the_stage_memory_of_every_block():
    """BlockCosts.memory_binds against a brute force over blocks with costs.stage_memory at all micro-batches."""
    from graphpipe.search.gpp_blocks import BlockCosts
    from graphpipe.search.gpp_tree import build_tree
    from graphpipe.search.common import stage_memory

    graph = branches_graph(2, 3)
    tree = build_tree(graph)
    answers = set()
    for memory in (1e12, 1e8, 1e7):
        cluster = preset("v100", 4).with_memory(memory)
        blocks = BlockCosts(tree, cluster, 32, 4)
        for below in (1e-6, 1e-3, 1.0):
            short = False
            for x in range(len(tree.kinds)):
                width = tree.width(x)
                inputs, outputs, _ = blocks.boundary_bytes(x)
                for lo in range(width):
                    for hi in range(lo + 1, width + 1):
                        ops = tree.block_ops(x, lo, hi)
                        for c, d in enumerate(blocks.device_counts):
                            if blocks.stage_tps(x)[lo, hi, c] >= below:
                                continue
                            need = stage_memory(graph, ops, d, 4, blocks.num_mbs, cluster,
                                                inputs=float(inputs[lo, hi]), outputs=float(outputs[lo, hi]))
                            short = short or need > cluster.memory_bytes
            assert blocks.memory_binds(below) == short, (memory, below)
            answers.add(short)
    assert answers == {True, False}


# ------------------------------------------------ re-materialization in segments
def _random_dag(rng: random.Random, n: int) -> OpGraph:
    ops = [make_op(f"o{i}", act=float(rng.randint(0, 20))) for i in range(n)]
    edges = []
    for j in range(1, n):
        for i in rng.sample(range(j), min(j, rng.randint(1, 2))):
            edges.append((f"o{i}", f"o{j}", float(rng.randint(1, 6)), float(rng.choice((0, 0, rng.randint(1, 3))))))
    return OpGraph.build("dag", ops, edges)


@pytest.mark.parametrize("seed", range(40))
def test_best_checkpoints_is_the_least_peak_over_every_segmentation(seed):
    """Brute force: every way to cut a random stage (a DAG with received saved copies, ops sent out of it)
    into contiguous segments; the chosen one reaches the least in_flight * stash + working, and none at all
    is chosen only when no cut is strictly lower."""
    rng = random.Random(seed)
    graph = _random_dag(rng, rng.randint(3, 9))
    stage = sorted(rng.sample(range(graph.num_ops), rng.randint(2, graph.num_ops)))
    inputs = float(rng.randint(0, 8))
    for in_flight in (1, 2, 5):
        peaks = []
        for mask in range(2 ** (len(stage) - 1)):
            cuts = [stage[i + 1] for i in range(len(stage) - 1) if mask >> i & 1]
            stash, working = costs.segment_bytes(graph, stage, cuts, inputs)
            peaks.append(in_flight * stash + working)
        chosen = costs.best_checkpoints(graph, stage, inputs, in_flight)
        stash, working = costs.segment_bytes(graph, stage, chosen, inputs)
        assert in_flight * stash + working == pytest.approx(min(peaks))
        if not chosen:
            assert min(peaks) == pytest.approx(peaks[0])


@pytest.mark.parametrize("seed", range(10))
def test_one_segment_is_whole_stage_rematerialization(seed):
    """No checkpoints: stash = the stage's inputs, working = its activations with received copies (the
    formula activation_bytes uses), on random stages of random graphs."""
    rng = random.Random(seed)
    graph = _random_dag(rng, rng.randint(3, 12))
    lo = rng.randrange(graph.num_ops)
    ops = range(lo, rng.randrange(lo, graph.num_ops) + 1)
    sums = costs.stage_sums(graph, ops)
    assert costs.segment_bytes(graph, ops, (), sums.inputs) == pytest.approx((sums.inputs, sums.act))


def test_checkpoints_lower_a_data_parallel_stage_and_the_simulator_charges_them():
    """A chain on one data-parallel stage (round-robin: one micro-batch in flight per device): whole-stage
    re-materialization keeps exactly what none keeps; the planner's checkpoints lower the simulated peak to
    stash + largest segment, and GPipe keeps whole stages, as in its paper."""
    from graphpipe.search.planner import make_plan

    ops = [make_op(f"l{i}", act=1e6) for i in range(6)]
    graph = OpGraph.build("chain", ops, [(f"l{i}", f"l{i + 1}", 1e4) for i in range(5)])
    cluster = preset("v100", 1)
    sg = StageGraph.build(graph, [Stage(0, tuple(range(6)), (0,), 8, recompute=True)], 8, 1)
    none = replace_stage(sg, recompute=False)
    sched = make_schedule("1f1b", sg, cluster)
    act = lambda g: simulate(g, sched, cluster).activation_peak_bytes[0]  # noqa: E731
    assert act(sg) == act(none) == pytest.approx(6e6 * 8)
    cuts = costs.best_checkpoints(graph, range(6), 0.0, 1)
    cut = replace_stage(sg, checkpoints=cuts)
    stash, working = costs.segment_bytes(graph, range(6), cuts, 0.0)
    assert len(cuts) >= 1 and act(cut) == pytest.approx((stash + working) * 8)
    assert act(cut) < act(none)
    plan = make_plan("chain.json", graph, cluster, 8, "gpp", SearchOptions(recompute="all", micro_batch_size=8))
    assert plan.stage_graph.stages[0].checkpoints == cuts
    assert plan.predicted["peak_activation_bytes"][0] == pytest.approx(act(cut))
    gpipe = make_plan("chain.json", graph, cluster, 8, "gpipe", SearchOptions(micro_batch_size=8))
    assert all(s.recompute and not s.checkpoints for s in gpipe.stage_graph.stages)


def replace_stage(sg: StageGraph, **changes) -> StageGraph:
    from dataclasses import replace

    return replace(sg, stages=tuple(replace(s, **changes) for s in sg.stages))


def test_checkpoints_are_validated_and_survive_the_plan_file():
    from graphpipe.plan import plan_from_dict, plan_to_dict
    from graphpipe.search.planner import make_plan

    graph = chain_graph(5)
    with pytest.raises(PlanError, match="need recompute"):
        Stage(0, (0, 1), (0,), 4, checkpoints=(1,))
    with pytest.raises(PlanError, match="other than its first"):
        Stage(0, (0, 1), (0,), 4, recompute=True, checkpoints=(0,))
    with pytest.raises(PlanError, match="other than its first"):
        Stage(0, (0, 1), (0,), 4, recompute=True, checkpoints=(3,))
    plan = make_plan("chain.json", graph, preset("v100", 1), 8, "gpp", SearchOptions(recompute="all",
                                                                                      micro_batch_size=8))
    assert plan.stage_graph.stages[0].checkpoints, "premise: one data-parallel stage gets checkpoints"
    again = plan_from_dict(plan_to_dict(plan))
    assert again.stage_graph.stages == plan.stage_graph.stages
    doc = plan_to_dict(plan)
    doc["stages"][0]["checkpoints"] = ["no-such-op"]
    with pytest.raises(InputError):
        plan_from_dict(doc)
