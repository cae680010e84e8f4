"""The core IR's contract: graph JSON, cluster files, StageGraph and plan invariants.

Each invalid input is checked for the specific error *and* the value it names,
so a message that stops naming the culprit fails the test.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace

import pytest

from conftest import branches_graph, chain_graph, make_op, random_sp_graph
from graphpipe.actions import Action, Schedule
from graphpipe.cluster import cluster_from_dict, cluster_to_dict, load_cluster, preset
from graphpipe.errors import FormatError, GraphCycleError, InputError, PlanError
from graphpipe.graph import (Affine, Edge, Op, OpGraph, graph_from_dict, graph_to_dict, read_graph_json,
                             write_json_atomic)
from graphpipe.plan import Plan, plan_from_dict, plan_to_dict, read_plan, write_plan
from graphpipe.stages import Stage, StageGraph


# ------------------------------------------------------------------- graph
@pytest.mark.parametrize("seed", range(5))
def test_graph_json_round_trip(tmp_path, seed):
    graph = random_sp_graph(6 + 3 * seed, seed)
    assert graph_from_dict(graph_to_dict(graph)) == graph
    path = str(tmp_path / "g.json")
    write_json_atomic(path, graph_to_dict(graph))
    back = read_graph_json(path)
    assert back == graph and back.ops[0].fwd.beta == graph.ops[0].fwd.beta
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"], "no temporary file left behind"


def test_edge_saved_bytes_round_trip_and_are_optional():
    """``saved_bytes`` on an edge survives JSON, is absent when 0 (older documents read the same),
    and is checked like every other number."""
    graph = OpGraph.build("g", [make_op("a"), make_op("b"), make_op("c")],
                          [("a", "b", 16.0, 16.0), ("b", "c", 8.0)])
    doc = graph_to_dict(graph)
    assert [e.get("saved_bytes") for e in doc["edges"]] == [16.0, None]
    assert graph_from_dict(doc) == graph and graph.saved_edges == (Edge(0, 1, 16.0, 16.0),)
    old = {**doc, "edges": [{k: v for k, v in e.items() if k != "saved_bytes"} for e in doc["edges"]]}
    assert graph_from_dict(old).saved_edges == ()
    with pytest.raises(FormatError, match=r"edges\[0\]\.saved_bytes must be a finite number >= 0, got -1"):
        graph_from_dict({**doc, "edges": [{**doc["edges"][0], "saved_bytes": -1}]})
    with pytest.raises(InputError, match="saved must be finite and >= 0"):
        Edge(0, 1, 1.0, math.nan)


def test_op_wgrad_round_trips_and_is_optional():
    """A measured weight-gradient model survives JSON as ``wgrad_s``, is absent when not measured
    (older documents read as unmeasured), and a wrong-typed one is one clear error."""
    graph = OpGraph.build("g", [Op("a", "linear", Affine(1e-3, 2e-4), Affine(2e-3, 4e-4), 8.0,
                                   wgrad=Affine(5e-4, 1e-4)), make_op("b")], [("a", "b", 8.0)])
    doc = graph_to_dict(graph)
    assert [o.get("wgrad_s") for o in doc["ops"]] == [[5e-4, 1e-4], None]
    assert graph_from_dict(doc) == graph and graph_from_dict(doc).ops[0].wgrad == Affine(5e-4, 1e-4)
    old = {**doc, "ops": [{k: v for k, v in o.items() if k != "wgrad_s"} for o in doc["ops"]]}
    assert [o.wgrad for o in graph_from_dict(old).ops] == [None, None]
    for bad, message in ((["1e-3", 0.0], r"ops\[0\]\.wgrad_s\[0\] must be a number, got '1e-3'"),
                         ([1e-3], r"ops\[0\]\.wgrad_s must be \[alpha, beta\], got 1 number"),
                         ({"alpha": 0.0}, r"ops\[0\]\.wgrad_s must be a JSON array"),
                         ([-1.0, 0.0], r"ops\[0\]\.wgrad_s\[0\] must be a finite number >= 0")):
        with pytest.raises(FormatError, match=message):
            graph_from_dict({**doc, "ops": [{**doc["ops"][0], "wgrad_s": bad}, doc["ops"][1]]})
    with pytest.raises(InputError, match="wgrad must be an Affine"):
        Op("a", "x", wgrad=(0.0, 1.0))



def test_wrong_typed_wgrad_is_one_line_exit_2(tmp_path, capsys):
    from graphpipe.cli import main

    graph = OpGraph.build("g", [make_op("a"), make_op("b")], [("a", "b", 8.0)])
    doc = graph_to_dict(graph)
    doc["ops"][0]["wgrad_s"] = "fast"
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ops[0].wgrad_s must be a JSON array, got 'fast'" in err


def test_build_renumbers_topologically_and_keeps_edges():
    rng = random.Random(3)
    graph = random_sp_graph(20, 3)
    named = {(graph.ops[e.src].name, graph.ops[e.dst].name): e.bytes for e in graph.edges}
    ops = list(graph.ops)
    rng.shuffle(ops)
    edges = [(s, d, b) for (s, d), b in named.items()]
    rng.shuffle(edges)
    rebuilt = OpGraph.build("shuffled", ops, edges)
    assert all(e.src < e.dst for e in rebuilt.edges)
    assert {(rebuilt.ops[e.src].name, rebuilt.ops[e.dst].name): e.bytes for e in rebuilt.edges} == named
    assert OpGraph.build("shuffled", ops, edges) == rebuilt  # deterministic


def test_cycle_error_names_the_cycle():
    ops = [make_op(n) for n in ("x", "a", "b", "c", "y")]
    edges = [("x", "a", 1), ("a", "b", 1), ("b", "c", 1), ("c", "a", 1), ("c", "y", 1)]
    with pytest.raises(GraphCycleError) as info:
        OpGraph.build("cyc", ops, edges)
    cycle = info.value.cycle
    assert sorted(cycle) == ["a", "b", "c"]
    pairs = {(s, d) for s, d, _ in edges}
    assert all((cycle[i], cycle[(i + 1) % len(cycle)]) in pairs for i in range(len(cycle)))
    assert " -> ".join(cycle + cycle[:1]) in str(info.value)
    with pytest.raises(GraphCycleError, match="a -> a"):
        OpGraph.build("loop", [make_op("a")], [("a", "a", 1)])


def test_duplicates_and_unknown_names():
    with pytest.raises(InputError, match="duplicate op name 'a'"):
        OpGraph.build("d", [make_op("a"), make_op("a")], [])
    with pytest.raises(InputError, match="duplicate edge a->b"):
        OpGraph.build("d", [make_op("a"), make_op("b")], [("a", "b", 1), ("a", "b", 2)])
    with pytest.raises(InputError, match="unknown op 'zz'"):
        OpGraph.build("d", [make_op("a")], [("a", "zz", 1)])
    with pytest.raises(InputError, match="not in topological order"):
        OpGraph("raw", (make_op("a"), make_op("b")), (Edge(1, 0, 1.0),))
    with pytest.raises(InputError, match="has no op named 'q'"):
        chain_graph(2).op_id("q")


@pytest.mark.parametrize("make,fragment", [
    (lambda: Affine(-1.0, 0.0), "-1.0"),
    (lambda: Affine(0.0, math.nan), "nan"),
    (lambda: Affine(0.0, math.inf), "inf"),
    (lambda: Op("a", "x", param_bytes=-4), "param_bytes must be finite and >= 0, got -4"),
    (lambda: Op("a", "x", act_bytes=math.nan), "act_bytes"),
    (lambda: Op("a", "x", out_bytes=-1.0), "out_bytes"),
    (lambda: Op("", "x"), "non-empty"),
    (lambda: OpGraph.build("e", [make_op("a"), make_op("b")], [("a", "b", -5)]), "-5"),
    (lambda: OpGraph.build("e", [make_op("a"), make_op("b")], [("a", "b", math.nan)]), "nan"),
])
def test_negative_and_nan_costs_refused(make, fragment):
    with pytest.raises(InputError) as info:
        make()
    assert fragment in str(info.value)


def test_graph_documents_refused_with_reason(tmp_path):
    doc = graph_to_dict(chain_graph(2))
    with pytest.raises(FormatError, match="unsupported format 'graphpipe.graph/9'"):
        graph_from_dict({**doc, "format": "graphpipe.graph/9"})
    with pytest.raises(FormatError, match="unsupported format None"):
        graph_from_dict({k: v for k, v in doc.items() if k != "format"})
    with pytest.raises(FormatError, match="malformed graph document"):
        graph_from_dict({**doc, "ops": [{"kind": "x"}]})
    with pytest.raises(FormatError, match=r"fwd_s and bwd_s must be \[alpha, beta\]"):
        graph_from_dict({**doc, "ops": [{**doc["ops"][0], "fwd_s": [1.0]}]})
    bad = tmp_path / "bad.json"
    bad.write_text('{\n "format": \n}')
    with pytest.raises(FormatError, match=rf"{bad}:3: not valid JSON"):
        read_graph_json(str(bad))
    with pytest.raises(InputError, match="no such file"):
        read_graph_json(str(tmp_path / "none.json"))


def test_cost_helpers_match_affine_sums():
    g = branches_graph(2, 2)
    ids = (0, 2, 3)
    assert g.fwd_time(ids, 4) == pytest.approx(sum(g.ops[i].fwd.alpha + 4 * g.ops[i].fwd.beta for i in ids))
    assert g.bwd_time(ids, 4) == pytest.approx(sum(g.ops[i].bwd.alpha + 4 * g.ops[i].bwd.beta for i in ids))
    assert g.param_bytes == sum(op.param_bytes for op in g.ops)
    nxg = g.to_networkx()
    assert sorted(nxg.edges) == sorted((e.src, e.dst) for e in g.edges)


# ----------------------------------------------------------------- cluster
CUSTOM = {
    "name": "lab",
    "devices_per_node": 2,
    "device": {"name": "T4", "memory_bytes": 16e9, "peak_flops": 65e12, "op_overhead_s": 1e-5, "mfu": 0.3},
    "intra_node": {"latency_s": 1e-6, "bandwidth_Bps": 10e9},
    "inter_node": {"latency_s": 1e-5, "bandwidth_Bps": 1e9},
    "bytes_per_param": 12,
}


def test_custom_cluster_file_and_cost_formulas(tmp_path):
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(CUSTOM))
    c = load_cluster(str(path), 6)
    assert (c.num_devices, c.devices_per_node, c.device.name) == (6, 2, "T4")
    nbytes = 4e6
    # same node: intra link, one lane
    assert c.transfer_time((0,), (1,), nbytes) == pytest.approx(1e-6 + nbytes / 10e9)
    # across nodes, two lanes in parallel
    assert c.transfer_time((0, 1), (2, 3), nbytes) == pytest.approx(1e-5 + nbytes / (1e9 * 2))
    assert c.transfer_time((0,), (0,), nbytes) == 0.0
    # ring all-reduce over 4 devices on two nodes: 2(r-1) latencies + 2(r-1)/r * bytes / bw, the bandwidth
    # two lanes' (two devices per node each drive their own inter-node lane)
    assert c.allreduce_time((0, 1, 2, 3), nbytes) == pytest.approx(6 * 1e-5 + 1.5 * nbytes / 2e9)
    # one device per node: one lane; two on one node and one on another: still one (the fewest)
    assert c.allreduce_time((0, 2), nbytes) == pytest.approx(2 * 1e-5 + nbytes / 1e9)
    assert c.allreduce_time((0, 1, 2), nbytes) == pytest.approx(4 * 1e-5 + 4 / 3 * nbytes / 1e9)
    # within one node: the intra-node link; many lanes never beat it
    assert c.allreduce_time((2, 3), nbytes) == pytest.approx(2 * 1e-6 + nbytes / 10e9)
    wide = load_cluster(str(path), 64)
    assert wide.allreduce_link(range(0, 64)).bandwidth_Bps == pytest.approx(2e9)
    assert replace(wide, devices_per_node=32).allreduce_link(range(64)).bandwidth_Bps == pytest.approx(10e9)
    assert c.allreduce_time((4,), nbytes) == 0.0
    assert c.state_bytes(400.0) == pytest.approx(100 * 12)
    assert load_cluster(str(path), 6, memory_gb=8).memory_bytes == pytest.approx(8e9)
    assert cluster_from_dict(cluster_to_dict(c)) == c


def test_bad_cluster_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  oops\n}")
    with pytest.raises(FormatError, match=rf"{bad}:2: not valid JSON"):
        load_cluster(str(bad), 2)
    missing = tmp_path / "missing_key.json"
    missing.write_text(json.dumps({k: v for k, v in CUSTOM.items() if k != "inter_node"}))
    with pytest.raises(FormatError, match="malformed cluster.*inter_node"):
        load_cluster(str(missing), 2)
    negative = tmp_path / "neg.json"
    negative.write_text(json.dumps({**CUSTOM, "intra_node": {"latency_s": 0, "bandwidth_Bps": -1}}))
    with pytest.raises(InputError, match="bandwidth_Bps must be > 0, got -1"):
        load_cluster(str(negative), 2)
    with pytest.raises(InputError, match="unknown cluster 'nowhere.json'.*v100"):
        load_cluster("nowhere.json", 2)
    with pytest.raises(InputError, match="unknown cluster preset 'tpu'; known: v100, a100, h100"):
        preset("tpu")
    with pytest.raises(InputError, match="positive integer, got 0"):
        preset("v100", 0)


# ------------------------------------------------------------- stage graph
def diamond_stages(mb: int = 2):
    """diamond in -> (b0_0 | b1_0) -> out as four stages on four devices."""
    g = branches_graph(2, 1)
    ids = {op.name: i for i, op in enumerate(g.ops)}
    stages = [Stage(0, (ids["in"],), (0,), mb), Stage(1, (ids["b0_0"],), (1,), mb),
              Stage(2, (ids["b1_0"],), (2,), mb), Stage(3, (ids["out"],), (3,), mb)]
    return g, stages


def test_valid_stage_graph_edges_and_queries():
    g, stages = diamond_stages()
    sg = StageGraph.build(g, list(reversed(stages)), batch_size=8, num_devices=4)
    assert [s.op_ids for s in sg.stages] == [s.op_ids for s in stages], "renumbered topologically"
    assert sg.edges == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert sg.edge_bytes(0, 1) == g.edge_bytes(g.op_id("in"), g.op_id("b0_0"))
    assert sg.depth() == 3 and not sg.is_chain() and sg.num_micro_batches(0) == 4
    # edge bytes aggregate over op edges between two stages
    two = StageGraph.build(g, [Stage(0, (0, 1), (0,), 2), Stage(1, (2, 3), (1,), 2)], 8, 2)
    assert two.edge_bytes(0, 1) == pytest.approx(sum(e.bytes for e in g.edges if e.src in (0, 1) and e.dst in (2, 3)))


@pytest.mark.parametrize("bp,bc", [(1, 4), (2, 4), (4, 2), (2, 2), (4, 8)])
def test_consumed_mbs_covers_exactly_the_samples(bp, bc):
    g = chain_graph(2)
    sg = StageGraph.build(g, [Stage(0, (0,), (0,), bp), Stage(1, (1,), (1,), bc)], batch_size=16, num_devices=2)
    for j in range(16 // bc):
        samples = set(range(j * bc, (j + 1) * bc))
        expected = tuple(i for i in range(16 // bp) if samples & set(range(i * bp, (i + 1) * bp)))
        assert sg.consumed_mbs(0, 1, j) == expected


def test_covered_mbs_is_the_sample_overlap_for_any_sizes_both_ways():
    from graphpipe.stages import covered_mbs

    def overlap(size_a: int, size_b: int, j: int) -> tuple[int, ...]:
        """Micro-batches of size ``size_a`` sharing a sample with micro-batch ``j`` of size ``size_b`` (batch 6)."""
        samples = set(range(j * size_b, (j + 1) * size_b))
        return tuple(i for i in range(6 // size_a) if samples & set(range(i * size_a, (i + 1) * size_a)))

    for bp, bc in itertools.product((1, 2, 3, 6), repeat=2):  # 2 and 3 do not divide each other
        for j in range(6 // bc):
            assert tuple(covered_mbs(bp, bc, j)) == overlap(bp, bc, j)  # producers a consumer needs
        for i in range(6 // bp):
            assert tuple(covered_mbs(bc, bp, i)) == overlap(bc, bp, i)  # consumers holding a producer's samples


@pytest.mark.parametrize("mutate,fragment", [
    (lambda g, s: (s[:1] + [Stage(5, s[1].op_ids, s[1].devices, 2)] + s[2:], {}), "stage ids must be 0..3 in order"),
    (lambda g, s: (s[:3] + [Stage(3, s[3].op_ids + s[2].op_ids, (3,), 2)], {}), "stages must partition the ops"),
    (lambda g, s: (s[:3], {}), "ops not in any stage: out"),
    (lambda g, s: (s[:3] + [Stage(3, s[3].op_ids, (7,), 2)], {}), "uses device 7, cluster has devices 0..3"),
    (lambda g, s: (s[:3] + [Stage(3, s[3].op_ids, (2,), 2)], {}), "device 2 is used by more than one stage"),
    (lambda g, s: (s[:3] + [Stage(3, s[3].op_ids, (3,), 3)], {}), "micro-batch size 3 does not divide the batch size 8"),
    (lambda g, s: (s[:2] + [Stage(2, s[2].op_ids + s[3].op_ids, (2, 3), 1)], {}), "not divisible by its 2 replicas"),
    (lambda g, s: (s, {"edges": ((0, 1),)}), "do not match the edges implied"),
    (lambda g, s: (s, {"batch_size": 0}), "batch size must be a positive integer, got 0"),
])
def test_stage_graph_invariants_each_named(mutate, fragment):
    g, stages = diamond_stages()
    stages, extra = mutate(g, stages)
    kwargs = {"batch_size": 8, "num_devices": 4, **extra}
    edges = kwargs.pop("edges", ())
    with pytest.raises(PlanError) as info:
        StageGraph(g, tuple(stages), kwargs["batch_size"], kwargs["num_devices"], edges=edges)
    assert fragment in str(info.value)


def test_non_convex_and_backward_stages():
    g = chain_graph(3)  # l0 -> l1 -> l2
    with pytest.raises(PlanError, match="stage 0 is not convex: a path leaves it through op 'l1'"):
        StageGraph(g, (Stage(0, (0, 2), (0,), 1), Stage(1, (1,), (1,), 1)), 4, 2)
    with pytest.raises(PlanError, match="cycle among stages"):
        StageGraph.build(g, [Stage(0, (0, 2), (0,), 1), Stage(1, (1,), (1,), 1)], 4, 2)
    with pytest.raises(PlanError, match="stage edge 1->2 goes backwards|goes backwards"):
        StageGraph(g, (Stage(0, (0,), (0,), 1), Stage(1, (2,), (1,), 1), Stage(2, (1,), (2,), 1)), 4, 3)


@pytest.mark.parametrize("make,fragment", [
    (lambda: Stage(0, (), (0,), 1), "stage 0 has no ops"),
    (lambda: Stage(0, (0,), (), 1), "stage 0 has no devices"),
    (lambda: Stage(0, (0,), (1, 1), 1), "lists a device twice"),
    (lambda: Stage(0, (0,), (0,), 0), "positive integer, got 0"),
])
def test_stage_fields_checked(make, fragment):
    with pytest.raises(PlanError, match=fragment):
        make()


# -------------------------------------------------------------------- plan
def make_plan():
    g, stages = diamond_stages(mb=4)
    sg = StageGraph.build(g, stages, batch_size=8, num_devices=4)
    per_device = [[Action(d, "F", m) for m in range(2)] + [Action(d, "B", m) for m in range(2)] for d in range(4)]
    return Plan(model="diamond.json", stage_graph=sg, cluster=preset("v100", 4), strategy="custom",
                schedule=Schedule.from_lists("gpipe", per_device), predicted={"iteration_time_s": 1.5},
                search={"strategy": "custom", "time_s": 0.0})


def test_plan_round_trip_and_refusals(tmp_path):
    plan = make_plan()
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    back = read_plan(path)
    assert plan_to_dict(back) == plan_to_dict(plan)
    assert back.stage_graph.edges == plan.stage_graph.edges and back.cluster == plan.cluster
    measured_graph = plan.graph.with_ops([replace(o, wgrad=o.bwd.scaled(0.25)) for o in plan.graph.ops])
    measured = replace(plan, stage_graph=StageGraph.build(measured_graph, plan.stage_graph.stages, 8, 4))
    assert plan_from_dict(plan_to_dict(measured)).graph == measured_graph, "a plan keeps its ops' measured W"
    doc = plan_to_dict(plan)
    with pytest.raises(FormatError, match="unsupported format 'graphpipe.plan/0'"):
        plan_from_dict({**doc, "format": "graphpipe.plan/0"})
    with pytest.raises(FormatError, match="missing key 'stages'"):
        plan_from_dict({k: v for k, v in doc.items() if k != "stages"})
    with pytest.raises(PlanError, match="batch_size must be a positive integer, got -8"):
        plan_from_dict({**doc, "batch_size": -8})
    with pytest.raises(FormatError, match="bad action '0X1'"):
        plan_from_dict({**doc, "schedule": {"name": "x", "actions": {"0": ["0X1"]}}})
    with pytest.raises(PlanError, match="stage graph is for 4 devices, cluster has 8"):
        Plan(model="m", stage_graph=plan.stage_graph, cluster=preset("v100", 8), strategy="x", schedule=plan.schedule)


def test_a_large_schedule_writes_each_replicas_list_once_and_reads_back_equal():
    """From COMPACT_FROM_DEVICES devices on, a device whose actions equal an earlier device's is written as
    ``{"same_as": d}`` and read back as that very tuple; smaller schedules list every device in full (hand edits)."""
    from graphpipe.actions import COMPACT_FROM_DEVICES

    n = COMPACT_FROM_DEVICES
    a = tuple(Action.parse(x) for x in ("0F0", "0F1", "0B0", "0B1"))
    b = tuple(Action.parse(x) for x in ("1F0", "1B0", "1F1", "1B1"))
    lists = [a] * (n // 2) + [tuple(b) for _ in range(n // 2 - 1)] + [()]  # equal but distinct tuples too
    sched = Schedule("gpipe", tuple(lists))
    doc = json.loads(json.dumps(sched.to_dict()))
    full = [k for k, v in doc["actions"].items() if isinstance(v, list) and v]
    assert full == ["0", str(n // 2)]
    assert doc["actions"]["1"] == {"same_as": 0} and doc["actions"][str(n - 2)] == {"same_as": n // 2}
    assert doc["actions"][str(n - 1)] == []
    back = Schedule.from_dict(doc, n)
    assert back == sched and back.device_actions[1] is back.device_actions[0]
    small = Schedule("gpipe", tuple(lists[n // 2 - 2:]))
    assert all(isinstance(v, list) for v in small.to_dict()["actions"].values())
    for bad in (n, 1, "0", -1):  # outside, itself a reference, not an int, negative
        wrong = {**doc["actions"], "2": {"same_as": bad}}
        with pytest.raises(FormatError, match="same_as .* must name a device whose actions are listed in full"):
            Schedule.from_dict({"name": "x", "actions": wrong}, n)
