"""The sequential baselines (PipeDream, Piper, GPipe) against brute-force oracles.

On graphs of <= 8 ops and 1-4 devices every DP is compared with an
exhaustive enumeration of its own search space, scored with the shared
cost definitions (``stage_tps`` on the placed devices, ``stage_memory`` with
1F1B / fill-drain in-flight counts). Beyond that: defining properties of
every answer (convex stages, disjoint devices, memory within capacity,
Piper never worse than PipeDream) and Piper's downset guard.
"""

from __future__ import annotations

import itertools
import math

import pytest

from conftest import branches_graph, chain_graph, make_op, nested_sp_graph, non_sp_graph, random_sp_graph
from graphpipe.cluster import preset
from graphpipe.errors import InfeasibleError, InputError
from graphpipe.graph import OpGraph
from graphpipe.search import gpipe, linear_dp, pipedream, piper, sequential
from graphpipe.search.common import SearchOptions, stage_memory, stage_tps
from graphpipe.search.downsets import (PAIRS_PER_DOWNSET, DownsetLimitError, count_downset_pairs, count_downsets,
                                       enumerate_downsets)

BATCH = 8
GRAPHS = [chain_graph(5), branches_graph(2, 1, name="diamond"), nested_sp_graph(), non_sp_graph(),
          branches_graph(2, 3)] + [random_sp_graph(n, seed) for n, seed in
                                   [(5, 0), (6, 1), (7, 2), (8, 3), (8, 4), (8, 5)]]
IDS = [g.name for g in GRAPHS]
# 16 GB (nothing binds) and 40 MB (about two of conftest's ops per device: memory binds).
MEMORIES = (16e9, 40e6)


def cluster_of(num_devices: int, memory: float):
    return preset("v100", num_devices).with_memory(memory)


# ------------------------------------------------------------------ oracles
def score(graph: OpGraph, cluster, stages, b: int, in_flight) -> float:
    """Bottleneck of a stage sequence placed on contiguous devices; inf if invalid or over memory."""
    if sum(r for _, r in stages) > cluster.num_devices:
        return math.inf
    worst, start = 0.0, 0
    for q, (ops, r) in enumerate(stages):
        if b % r:
            return math.inf
        if stage_memory(graph, ops, r, b, in_flight(q, len(stages)), cluster) > cluster.memory_bytes:
            return math.inf
        worst = max(worst, stage_tps(graph, ops, tuple(range(start, start + r)), b, BATCH, cluster))
        start += r
    return worst


def one_f_one_b(b):
    return lambda q, k: min(k - q, BATCH // b)


def replica_tuples(num_stages: int, num_devices: int):
    return [rs for rs in itertools.product(range(1, num_devices + 1), repeat=num_stages) if sum(rs) <= num_devices]


def compositions(n: int, k: int):
    """All ways to cut range(n) into k non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield [tuple(range(bounds[i], bounds[i + 1])) for i in range(k)]


def brute_pipedream(graph, cluster, b) -> float:
    best = math.inf
    for k in range(1, min(graph.num_ops, cluster.num_devices) + 1):
        for split in compositions(graph.num_ops, k):
            for rs in replica_tuples(k, cluster.num_devices):
                best = min(best, score(graph, cluster, list(zip(split, rs)), b, one_f_one_b(b)))
    return best


def all_downsets(graph) -> list[frozenset]:
    """Every subset closed under predecessors, by testing all 2^n subsets."""
    out = []
    for bits in range(1 << graph.num_ops):
        members = {v for v in range(graph.num_ops) if bits >> v & 1}
        if all(p in members for v in members for p in graph.preds(v)):
            out.append(frozenset(members))
    return out


def downset_chains(graph, num_devices: int):
    """Every chain of downsets from the empty set to the whole graph with at most ``num_devices`` stages."""
    downsets = all_downsets(graph)
    full = frozenset(range(graph.num_ops))

    def extend(chain):
        if chain[-1] == full:
            yield chain
            return
        if len(chain) > num_devices:
            return
        for d in downsets:
            if chain[-1] < d:
                yield from extend(chain + [d])

    return extend([frozenset()])


def brute_piper(graph, cluster, b) -> float:
    best = math.inf
    for chain in downset_chains(graph, cluster.num_devices):
        stages = [tuple(sorted(b2 - a)) for a, b2 in zip(chain, chain[1:])]
        for rs in replica_tuples(len(stages), cluster.num_devices):
            best = min(best, score(graph, cluster, list(zip(stages, rs)), b, one_f_one_b(b)))
    return best


def brute_gpipe(graph, cluster, b) -> float:
    k = min(graph.num_ops, cluster.num_devices)
    return min(score(graph, cluster, [(ops, 1) for ops in split], b, lambda q, kk: BATCH // b)
               for split in compositions(graph.num_ops, k))


def assert_partition_matches(part, graph, cluster, b, in_flight, expected):
    if math.isinf(expected):
        assert part is None
        return
    assert part is not None
    assert part.bottleneck_tps == pytest.approx(expected, rel=1e-7)
    # The returned stages achieve the value they claim, under the oracle's own scoring.
    assert score(graph, cluster, part.stages, b, in_flight) == pytest.approx(part.bottleneck_tps, rel=1e-7)


# -------------------------------------------------------------------- DPs
@pytest.mark.parametrize("graph", GRAPHS, ids=IDS)
def test_pipedream_equals_brute_force(graph):
    for num_devices, memory, b in itertools.product((1, 2, 3, 4), MEMORIES, (1, 2, 4)):
        cluster = cluster_of(num_devices, memory)
        part = linear_dp.solve(graph, cluster, BATCH, b)
        assert_partition_matches(part, graph, cluster, b, one_f_one_b(b), brute_pipedream(graph, cluster, b))
        if part is not None:
            flat = [op for ops, _ in part.stages for op in ops]
            assert flat == list(sequential.linear_order(graph))   # contiguous ranges of the linearisation


def piper_score(graph, cluster, stages, b, batch=BATCH) -> float:
    """algo.cpp's objective of a stage chain, per sample; inf if a replica count does not divide the
    micro-batches, devices run out, or memory (ours: 1F1B in-flight counts) does not fit."""
    num_mbs = batch // b
    if sum(r for _, r in stages) > cluster.num_devices:
        return math.inf
    worst = 0.0
    for q, (ops, r) in enumerate(stages):
        if num_mbs % r:
            return math.inf
        if stage_memory(graph, ops, r, b, min(len(stages) - q, num_mbs), cluster) > cluster.memory_bytes:
            return math.inf
        members = set(ops)
        compute = sum(graph.ops[v].fwd(b) + graph.ops[v].bwd(b) for v in ops)
        boundary = sum(e.bytes for e in graph.edges if (e.src in members) != (e.dst in members))
        params = sum(graph.ops[v].param_bytes for v in ops)
        worst = max(worst, piper.stage_time(compute, boundary * b, params, r, num_mbs,
                                            piper.piper_bandwidth(cluster)) / b)
    return worst


def brute_piper_real(graph, cluster, b) -> float:
    """Every chain of downsets and every replica tuple, scored by :func:`piper_score`."""
    best = math.inf
    for chain in downset_chains(graph, cluster.num_devices):
        stages = [tuple(sorted(b2 - a)) for a, b2 in zip(chain, chain[1:])]
        for rs in replica_tuples(len(stages), cluster.num_devices):
            best = min(best, piper_score(graph, cluster, list(zip(stages, rs)), b))
    return best


@pytest.mark.parametrize("graph", GRAPHS, ids=IDS)
def test_piper_equals_brute_force_of_its_objective(graph):
    lattice = piper.Lattice.of(graph, 10_000)
    for num_devices, memory, b in itertools.product((1, 2, 3, 4), MEMORIES, (1, 2, 4)):
        cluster = cluster_of(num_devices, memory)
        part = piper.solve(graph, cluster, BATCH, b, lattice=lattice)
        expected = brute_piper_real(graph, cluster, b)
        if math.isinf(expected):
            assert part is None
            continue
        assert part is not None and part.bottleneck_tps == pytest.approx(expected, rel=1e-7)
        assert piper_score(graph, cluster, part.stages, b) == pytest.approx(part.bottleneck_tps, rel=1e-7)


def test_piper_matches_the_real_planner_on_aligned_inputs(tmp_path):
    """A chain a -> b -> c given to algo.cpp as nodes with one TMPC each (t = 1, sync times 0):
    timePerSample (per micro-batch) a 3, b 1, c 2; parameterSize a 0, b 0, c 2; communicationCost
    (bytes per micro-batch) a->b 0.5, b->c 0.25; bandwidth 1 B/s, maxDevices 2, mbsInBatch 2, memory
    unbounded. Ours: the same graph at micro-batch 1 (batch 2) on 2 devices with 1 B/s links.

    By hand from getAllTPSsForIdealPair, T(S, d) = C/d + (2 sum_boundary c / d + 4 (d-1) P / (d M)) / B:
      {a,b,c} d=1: 6                      {a,b,c} d=2: 3 + 4*1*2/(2*2) = 5
      {a} | {b,c}: max(3 + 2*0.5, 3 + 2*0.5) = 4     {a,b} | {c}: max(4 + 2*0.25, 2 + 2*0.25 + 0) = 4.5
    (a stage of d = 2 leaves no device for another). runDP's optimum: 4, stages {a} | {b,c}, d = 1 each."""
    from graphpipe.cluster import cluster_from_dict
    from graphpipe.graph import Affine, Op

    ops = [Op("a", "x", Affine(0, 1.0), Affine(0, 2.0)), Op("b", "x", Affine(0, 0.5), Affine(0, 0.5)),
           Op("c", "x", Affine(0, 1.0), Affine(0, 1.0), param_bytes=2.0)]
    g = OpGraph.build("abc", ops, [("a", "b", 0.5), ("b", "c", 0.25)])
    link = {"latency_s": 0.0, "bandwidth_Bps": 1.0}
    cluster = cluster_from_dict({"devices_per_node": 2, "device": {"name": "t", "memory_bytes": 1e15,
                                 "peak_flops": 1e12, "op_overhead_s": 0.0}, "intra_node": link,
                                 "inter_node": link}, num_devices=2)
    part = piper.solve(g, cluster, 2, 1)
    assert [(ops, r) for ops, r in part.stages] == [((0,), 1), ((1, 2), 1)]
    assert part.bottleneck_tps == pytest.approx(4.0, rel=1e-3)
    result = piper.partition(g, cluster, 2, SearchOptions(micro_batch_size=1))
    assert result.stats["model_bottleneck_tps"] == pytest.approx(4.0, rel=1e-3)
    # data parallelism wins once c carries no weights: {a,b,c} d=2 costs 3
    g2 = OpGraph.build("abc", ops[:2] + [Op("c", "x", Affine(0, 1.0), Affine(0, 1.0))],
                       [("a", "b", 0.5), ("b", "c", 0.25)])
    part = piper.solve(g2, cluster, 2, 1)
    assert [(ops, r) for ops, r in part.stages] == [((0, 1, 2), 2)] and part.bottleneck_tps == pytest.approx(3.0)


def test_piper_refuses_past_the_ideal_limit():
    """algo.cpp fails past IDEALS_LIMIT = 40,000 ideals; so does partition, whatever max_downsets says."""
    g = branches_graph(8, 3)                       # 4^8 + 2 = 65,538 downsets
    with pytest.raises(DownsetLimitError):
        piper.partition(g, preset("v100", 4), 8, SearchOptions(max_downsets=200_000))


@pytest.mark.parametrize("graph", GRAPHS, ids=IDS)
def test_gpipe_equals_brute_force(graph):
    for num_devices, memory, b in itertools.product((1, 2, 3, 4), MEMORIES, (1, 4)):
        cluster = cluster_of(num_devices, memory)
        part = gpipe.solve(graph, cluster, BATCH, b, recompute=False)  # the brute force keeps every activation
        assert_partition_matches(part, graph, cluster, b, lambda q, k: BATCH // b, brute_gpipe(graph, cluster, b))
        if part is not None:
            assert len(part.stages) == min(num_devices, graph.num_ops)
            assert all(r == 1 for _, r in part.stages)


def test_piper_strictly_beats_pipedream_on_branches():
    """Two branches interleaved in the op order on 2 devices: one branch per stage is a downset
    chain (6.1 ms/sample each) but no cut of the linearisation s,a1,b1,a2,b2,t does better than 7.1.
    (Our objective, linear DP vs brute force; Piper's own objective below, against its brute force.)"""
    ops = [make_op("s", 1e-4), make_op("a1", 3e-3), make_op("b1", 1e-3), make_op("a2", 3e-3), make_op("b2", 5e-3),
           make_op("t", 1e-4)]
    g = OpGraph.build("uneven", ops, [("s", "a1", 1), ("a1", "a2", 1), ("s", "b1", 1), ("b1", "b2", 1),
                                      ("a2", "t", 1), ("b2", "t", 1)])
    cluster = preset("v100", 2).with_memory(16e9)
    # Force pipelining (no data parallelism: micro-batch 1 cannot be split over 2 replicas).
    seq = linear_dp.solve(g, cluster, BATCH, 1)
    assert seq.bottleneck_tps == pytest.approx(brute_pipedream(g, cluster, 1), rel=1e-9)
    assert brute_piper(g, cluster, 1) == pytest.approx(3 * 6.1e-3) and seq.bottleneck_tps == pytest.approx(3 * 7.1e-3)
    # Piper's objective: the branch-per-stage chain is better than any prefix chain of the linearisation
    dag = piper.solve(g, cluster, BATCH, 1)
    linear = min(piper_score(g, cluster, [(ops, 1) for ops in split], 1) for k in (1, 2)
                 for split in compositions(g.num_ops, k))
    assert dag.bottleneck_tps == pytest.approx(brute_piper_real(g, cluster, 1), rel=1e-9)
    assert dag.bottleneck_tps < linear


# -------------------------------------------------------------- downsets
@pytest.mark.parametrize("graph", GRAPHS, ids=IDS)
def test_downsets_match_subset_enumeration(graph):
    expected = sorted(sum(1 << v for v in d) for d in all_downsets(graph))
    got = enumerate_downsets(graph)
    assert sorted(got) == expected and len(set(got)) == len(got)
    assert count_downsets(graph) == len(expected)
    downsets = all_downsets(graph)
    assert count_downset_pairs(graph) == sum(1 for a in downsets for b in downsets if a < b)
    assert piper.Lattice.of(graph, 1000).num_pairs == count_downset_pairs(graph)


def test_downset_count_closed_form_for_parallel_chains():
    # in -> k chains of n ops -> out: (n + 1)^k downsets of the branches, plus {} and the full set.
    for k, n in [(2, 3), (3, 2), (4, 8)]:
        assert count_downsets(branches_graph(k, n)) == (n + 1) ** k + 2


def candle_uno_like(num_branches: int = 7, layers: int = 4) -> OpGraph:
    """CANDLE-Uno's paper shape (Appendix A.2): 7 feature encoders (input + 4 FF layers), concat, MLP."""
    ops, edges = [], []
    for b in range(num_branches):
        ops.append(make_op(f"in{b}"))
        for j in range(layers):
            ops.append(make_op(f"enc{b}_{j}"))
            edges.append((f"in{b}" if j == 0 else f"enc{b}_{j - 1}", f"enc{b}_{j}", 1e4))
        edges.append((f"enc{b}_{layers - 1}", "concat", 1e4))
    ops += [make_op("concat"), make_op("head")]
    edges.append(("concat", "head", 1e4))
    return OpGraph.build("candle-uno-like", ops, edges)


def _zoo_graph(name):
    zoo = pytest.importorskip("graphpipe.frontend.zoo", reason="graphpipe.frontend.zoo not present")
    return zoo.load_graph(name)


def test_piper_guard_refuses_candle_uno_shape():
    g = candle_uno_like()
    expected = 6 ** 7 + 2   # six prefixes per encoder, plus the concat and head downsets
    assert count_downsets(g) == expected
    with pytest.raises(DownsetLimitError) as info:
        piper.partition(g, preset("v100", 8), 64, SearchOptions())
    assert isinstance(info.value, InputError)
    message = str(info.value)
    assert str(expected) in message and str(piper.IDEALS_LIMIT) in message and "gpp" in message


def test_piper_guard_on_zoo_candle_uno():
    """The zoo's CANDLE-Uno (7 x 4 encoders) has 5^7 + 4 downsets: past algo.cpp's 40,000 ideals,
    so Piper refuses it, as it finds no strategy in the paper."""
    g = _zoo_graph("candle-uno")
    num = count_downsets(g)
    assert piper.IDEALS_LIMIT < num <= SearchOptions().max_downsets
    with pytest.raises(DownsetLimitError) as info:
        piper.partition(g, preset("v100", 32), 128, SearchOptions())
    assert str(num) in str(info.value) and str(piper.IDEALS_LIMIT) in str(info.value)


def test_piper_guard_on_zoo_dlrm():
    g = _zoo_graph("dlrm")
    with pytest.raises(DownsetLimitError, match=f"has {count_downsets(g)} downsets, more than the limit of 40000"):
        piper.partition(g, preset("v100", 32), 128, SearchOptions())


def test_mmt_shape_is_within_the_guard():
    # MMT paper config: 4 branches x 8 layers -> 9^4 branch-prefix combinations.
    limits = (SearchOptions().max_downsets, PAIRS_PER_DOWNSET * SearchOptions().max_downsets)
    g = branches_graph(4, 8)
    assert count_downsets(g) <= limits[0] and count_downset_pairs(g) <= limits[1]
    g = _zoo_graph("mmt")
    assert count_downsets(g) <= limits[0] and count_downset_pairs(g) <= limits[1]


# ------------------------------------------------------------ partitions
STRATEGIES = [(pipedream, "1f1b"), (piper, "1f1b"), (gpipe, "gpipe")]


def _in_flight(sg, schedule):
    num_mbs = sg.batch_size // sg.stages[0].micro_batch_size
    k = sg.num_stages
    return {s.id: (num_mbs if schedule == "gpipe" else min(k - s.id, num_mbs)) for s in sg.stages}


def _max_open(actions):
    """Most micro-batches a device holds at once: forwards run minus backwards run, at its peak."""
    open_, peak = 0, 0
    for a in actions:
        open_ += 1 if a.kind == "F" else -1
        peak = max(peak, open_)
    return peak


def _is_convex(graph, ops):
    members = set(ops)
    frontier = [w for v in members for w in graph.succs(v) if w not in members]
    seen = set(frontier)
    while frontier:
        v = frontier.pop()
        for w in graph.succs(v):
            if w in members:
                return False
            if w not in seen:
                seen.add(w)
                frontier.append(w)
    return True


@pytest.mark.parametrize("module,schedule", STRATEGIES, ids=["pipedream", "piper", "gpipe"])
@pytest.mark.parametrize("graph", [branches_graph(3, 3), random_sp_graph(12, 7), chain_graph(10)],
                         ids=["branches3x3", "random12", "chain10"])
def test_partition_properties(module, schedule, graph):
    cluster = preset("v100", 8).with_memory(2e8)
    result = module.partition(graph, cluster, 32, SearchOptions())
    sg = result.stage_graph
    assert result.schedule_name == schedule
    for key in ("time_s", "bottleneck_tps", "micro_batch_size", "devices_used"):
        assert key in result.stats
    assert sorted(op for s in sg.stages for op in s.op_ids) == list(range(graph.num_ops))
    assert all(_is_convex(graph, s.op_ids) for s in sg.stages)
    devices = [d for s in sg.stages for d in s.devices]
    assert len(devices) == len(set(devices)) == result.stats["devices_used"] <= cluster.num_devices
    assert all(a < b for a, b in sg.edges)       # stage ids are the pipeline (topological) order
    in_flight = _in_flight(sg, schedule)
    for s in sg.stages:
        assert stage_memory(graph, s.op_ids, s.num_replicas, s.micro_batch_size, in_flight[s.id], cluster,
                            s.recompute) <= cluster.memory_bytes
    placed = max(stage_tps(graph, s.op_ids, s.devices, s.micro_batch_size, 32, cluster, s.recompute)
                 for s in sg.stages)
    assert result.stats["bottleneck_tps"] == pytest.approx(placed, rel=1e-12)
    again = module.partition(graph, cluster, 32, SearchOptions())
    assert again.stage_graph.stages == sg.stages    # deterministic
    if module is piper:
        assert result.stats["num_downsets"] == count_downsets(graph)


def test_forced_micro_batch_and_power_of_two():
    g = random_sp_graph(10, 1)
    cluster = preset("v100", 6)
    result = pipedream.partition(g, preset("v100", 4), 24, SearchOptions(micro_batch_size=6))
    assert result.stats["micro_batch_size"] == 6 and result.stats["replica_mode"] == "round-robin"
    # 1F1B-RR: whole micro-batches go to the replicas, so the count need not divide the micro-batch
    assert all(s.micro_batch_size == 6 and s.replica_mode == ("round-robin" if s.num_replicas > 1 else "split")
               for s in result.stage_graph.stages)
    result = piper.partition(g, cluster, 32, SearchOptions(power_of_two=True))
    assert all(s.num_replicas & (s.num_replicas - 1) == 0 for s in result.stage_graph.stages)


@pytest.mark.parametrize("module", [pipedream, piper, gpipe], ids=["pipedream", "piper", "gpipe"])
def test_nothing_fits_raises_infeasible(module):
    cluster = preset("v100", 2).with_memory(1e6)     # less than one op's model state
    with pytest.raises(InfeasibleError, match="fits in 0.001 GB"):
        module.partition(chain_graph(4), cluster, 8, SearchOptions())


def test_piper_on_mmt_like_graph_matches_or_beats_pipedream():
    g = branches_graph(4, 3, name="mmt-like")
    cluster = preset("v100", 8).with_memory(1e8)
    seq = pipedream.partition(g, cluster.with_memory(16e9), 32, SearchOptions())
    dag = piper.partition(g, cluster, 32, SearchOptions())
    for b in (1, 2, 4, 8):  # the linearisation's chains are among Piper's (its objective on both)
        a, c = piper.solve(g, cluster, 32, b), linear_dp.solve(g, cluster, 32, b)
        if c is not None and a is not None and all((32 // b) % r == 0 for _, r in c.stages) and \
                math.isfinite(piper_score(g, cluster, c.stages, b, 32)):
            assert a.bottleneck_tps <= piper_score(g, cluster, c.stages, b, 32) * (1 + 1e-9)
    assert dag.stats["num_downsets"] == 4 ** 4 + 2
    assert seq.stats["bottleneck_tps"] > 0 and dag.stats["bottleneck_tps"] > 0


@pytest.mark.parametrize("strategy", ["pipedream", "piper", "gpipe"])
def test_plans_simulate_within_the_memory_the_partitioner_assumed(strategy):
    """Through the planner (schedule, validate, simulate): the simulated peak memory of every
    device stays within the partitioner's in-flight estimate, hence within capacity."""
    planner = pytest.importorskip("graphpipe.search.planner", reason="planner not present")
    graph = random_sp_graph(12, 11)
    # PipeDream's levels hold 1-4 or a multiple of 4 V100s
    cluster = preset("v100", 4 if strategy == "pipedream" else 6).with_memory(1.5e8)
    plan = planner.make_plan(graph.name, graph, cluster, 24, strategy)
    sg = plan.stage_graph
    schedule = "gpipe" if strategy == "gpipe" else "1f1b"
    in_flight = _in_flight(sg, schedule)
    peaks = plan.predicted["peak_memory_bytes"]
    for s in sg.stages:
        if strategy in ("pipedream", "piper"):  # 1F1B-RR warm-ups: count what each device's list holds at once
            held = max(_max_open(plan.schedule.device_actions[d]) for d in s.devices)
            estimate = stage_memory(graph, s.op_ids, 1 if s.round_robin else s.num_replicas, s.micro_batch_size,
                                    held, cluster)
        else:
            estimate = stage_memory(graph, s.op_ids, s.num_replicas, s.micro_batch_size, in_flight[s.id], cluster)
        for d in s.devices:
            assert peaks[d] <= estimate * (1 + 1e-9) <= cluster.memory_bytes * (1 + 1e-9)
    assert plan.predicted["throughput"] > 0


@pytest.mark.parametrize("module", [piper, gpipe], ids=["piper", "gpipe"])
def test_plan_choice_is_the_best_simulated(module):
    """The plan kept is the fastest simulated over every micro-batch size, cut costing and layout.
    (PipeDream keeps its optimizer's own objective instead: tests/test_pipedream_dp.py.)"""
    from graphpipe.sched import make_schedule, predicted_figures, simulate

    graph = branches_graph(2, 3)
    cluster = preset("v100", 8)  # two nodes: cuts costed on no link, NVLink and the inter-node link
    links = (None,)   # piper: one bandwidth (piper_bandwidth); gpipe: cuts not costed
    result = module.partition(graph, cluster, 16, SearchOptions())
    throughputs = {}
    for b in (1, 2, 4, 8, 16):
        for link in links:
            part = module.solve(graph, cluster, 16, b)
            part = piper._round_robin(part) if module is piper else part
            for sg in sequential.layouts(graph, cluster, 16, part):
                schedule = make_schedule(result.schedule_name, sg, cluster)
                throughputs[(b, link, sg.stages)] = predicted_figures(simulate(sg, schedule, cluster))["throughput"]
    best = max(throughputs.values())
    assert result.stats["throughput_estimate"] == pytest.approx(best, rel=1e-12)
    chosen = [t for (b, _, stages), t in throughputs.items() if stages == result.stage_graph.stages]
    assert chosen and max(chosen) == pytest.approx(best, rel=1e-12)


def test_pipedream_fit_check_decides_as_the_timed_simulation():
    """PipeDream tries smaller micro-batches while its plan's simulated peak does not fit. The check reads the
    peak from the action order; oracle: the timed simulation's peaks, swapped in. Across budgets from roomy to
    refused, both give the same micro-batch and the same plan (or the same refusal)."""
    from graphpipe.sched import make_schedule, simulate

    def timed_peaks(sg, cluster, schedule_name):
        return list(simulate(sg, make_schedule(schedule_name, sg, cluster), cluster).peak_memory_bytes)

    graph = random_sp_graph(12, 11)
    roomy = pipedream.partition(graph, preset("v100", 4), 48, SearchOptions())
    peak = max(timed_peaks(roomy.stage_graph, preset("v100", 4), "1f1b"))
    chosen = set()
    for fraction in (2.0, 1.0, 0.6, 0.45, 0.4, 0.35, 0.3, 0.2, 0.1):
        cluster = preset("v100", 4).with_memory(peak * fraction)
        answers = []
        for peaks in (None, timed_peaks):
            patch = pytest.MonkeyPatch()
            if peaks is not None:
                patch.setattr(pipedream, "simulated_peaks", peaks)
            try:
                got = pipedream.partition(graph, cluster, 48, SearchOptions())
                answers.append((got.stats["micro_batch_size"],
                                [(s.op_ids, s.devices, s.micro_batch_size) for s in got.stage_graph.stages]))
            except InfeasibleError as exc:
                answers.append(("refused", str(exc)))
            finally:
                patch.undo()
        assert answers[0] == answers[1], fraction
        chosen.add(answers[0][0])
    assert len(chosen) >= 3  # the sweep reaches smaller micro-batches and a refusal, not one answer throughout
