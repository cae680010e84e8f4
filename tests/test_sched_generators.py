"""Schedule generators against closed-form bubbles, in-flight bounds, brute-force linearisations and torch."""

from __future__ import annotations

import pytest

from graphpipe.errors import InputError, ScheduleError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.stages import Stage, StageGraph
from graphpipe.sched import (gpipe, graph_1f1b, interleaved_1f1b, make_schedule, one_f_one_b, round_robin_chain,
                             simulate, validate_schedule, warmup_counts)

from conftest import branches_graph
from test_sched_common import (free_cluster, linearisations, one_stage_per_op, random_stage_graph, uniform_chain,
                               latency_cluster)

GRID = [(k, m) for k in (2, 4, 8) for m in (k, 2 * k, 4 * k)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "graph-1f1b"])
@pytest.mark.parametrize("k,m", GRID)
def test_chain_bubble_matches_gpipe_formula(name, k, m):
    """K equal stages, M micro-batches, free links: bubble = (K-1)/(M+K-1) on every device (GPipe §2.2)."""
    sg = uniform_chain(k, m)
    tl = simulate(sg, make_schedule(name, sg), free_cluster(k))
    for d in range(k):
        assert tl.bubble_fraction[d] == pytest.approx((k - 1) / (m + k - 1))
    assert tl.iteration_time_s == pytest.approx((m + k - 1) * 3.0)


@pytest.mark.parametrize("k,m", GRID)
def test_in_flight_bounds(k, m):
    """1F1B keeps at most K-i micro-batches alive on stage i (PipeDream); GPipe keeps all M."""
    sg = uniform_chain(k, m)
    assert simulate(sg, one_f_one_b(sg), free_cluster(k)).in_flight == tuple(min(k - i, m) for i in range(k))
    assert simulate(sg, gpipe(sg), free_cluster(k)).in_flight == (m,) * k


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_graph_1f1b_reduces_to_1f1b_on_chains(k, m):
    sg = uniform_chain(k, m, mb=1)
    assert graph_1f1b(sg).device_actions == one_f_one_b(sg).device_actions
    assert warmup_counts(sg) == tuple(min(k - i, m) for i in range(k))


@pytest.mark.parametrize("k,v,m", [(k, v, m) for k in (2, 4) for v in (2, 3) for m in (k, 2 * k, 4 * k)])
def test_interleaved_bubble_time_is_megatron_formula(k, v, m):
    """Megatron-LM §2.2: with v virtual stages per device the bubble time is (K-1)(f+b)/v.

    Each device holds the whole model's 1/K split into v chunks of time f/v, b/v;
    iteration = M(f+b) + (K-1)(f+b)/v exactly with equal chunks and free links.
    """
    f, b = 1.0, 2.0
    n = k * v
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0.0, f / v), Affine(0.0, b / v)) for i in range(n)],
                      [(f"l{i}", f"l{i + 1}", 1e4) for i in range(n - 1)])
    sg = round_robin_chain(g, k, v, m, 1)
    tl = simulate(sg, make_schedule("interleaved", sg), free_cluster(k))
    assert tl.iteration_time_s - m * (f + b) == pytest.approx((k - 1) * (f + b) / v)
    plain = simulate(uniform_chain(k, m, f, b), one_f_one_b(uniform_chain(k, m, f, b)), free_cluster(k))
    assert max(tl.bubble_fraction) < min(plain.bubble_fraction)


def test_round_robin_chain_places_balanced_convex_pieces():
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0.0, t), Affine(0.0, 2 * t))
                            for i, t in enumerate([1, 1, 1, 1, 4, 1, 1, 1, 1, 4])],
                      [(f"l{i}", f"l{i + 1}", 1) for i in range(9)])
    sg = round_robin_chain(g, 2, 2, 4, 1)
    assert [s.devices for s in sg.stages] == [(0,), (1,), (0,), (1,)]
    assert sorted(i for s in sg.stages for i in s.op_ids) == list(range(10))
    times = [sg.fwd_time(s) + sg.bwd_time(s) for s in range(4)]
    # Brute force over all 3-cut positions: the chosen bottleneck is optimal.
    cost = [3 * t for t in [1, 1, 1, 1, 4, 1, 1, 1, 1, 4]]
    best = min(max(sum(cost[a:b]) for a, b in zip((0, i, j, l), (i, j, l, 10)))
               for i in range(1, 10) for j in range(i + 1, 10) for l in range(j + 1, 10))
    assert max(times) == pytest.approx(best)
    with pytest.raises(InputError, match="cannot cut 10 ops into 12"):
        round_robin_chain(g, 4, 3, 4, 1)


def _diamond_stages():
    return one_stage_per_op(branches_graph(2, 1, name="diamond"), 16, [1] * 4)


def _four_branch_stages():
    g = branches_graph(4, 2)
    groups = [("in",), *[(f"b{b}_0", f"b{b}_1") for b in range(4)], ("out",)]
    stages = [Stage(i, tuple(g.op_id(n) for n in names), (i,), 1) for i, names in enumerate(groups)]
    return StageGraph.build(g, stages, 16, len(groups))


@pytest.mark.parametrize("build", [_diamond_stages, _four_branch_stages])
def test_graph_1f1b_beats_every_linearisation(build):
    """GraphPipe §5: fewer micro-batches in flight at the source than 1F1B on any linearisation, never slower."""
    sg = build()
    cluster = free_cluster(sg.num_devices)
    ours = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    source = 0
    assert ours.in_flight[source] == sg.depth()
    orders = list(linearisations(sg))
    assert len(orders) >= 2
    for order in orders:
        schedule = one_f_one_b(sg, order)
        validate_schedule(sg, schedule)
        spp = simulate(sg, schedule, cluster)
        assert ours.in_flight[source] < spp.in_flight[source]
        assert ours.iteration_time_s <= spp.iteration_time_s + 1e-9
        assert max(ours.peak_memory_bytes) <= max(spp.peak_memory_bytes)


def test_graph_1f1b_warmup_covers_longest_branch_and_mb_ratio():
    # in -> (a -> a2 | b) -> out: the source must cover the longer branch.
    ops = [Op(n, "x", Affine(0, 1.0), Affine(0, 2.0)) for n in ("in", "a", "a2", "b", "out")]
    g = OpGraph.build("uneven", ops, [("in", "a", 1), ("a", "a2", 1), ("a2", "out", 1), ("in", "b", 1), ("b", "out", 1)])
    sg = one_stage_per_op(g, 32, [2] * 5)
    by_name = {g.ops[sg.stages[s].op_ids[0]].name: w for s, w in enumerate(warmup_counts(sg))}
    assert by_name == {"in": 4, "a": 3, "a2": 2, "b": 2, "out": 1}
    # Consumer micro-batch 4 needs two producer micro-batches of 2: producer warm-up ceil(1*4/2)+1 = 3.
    chain = OpGraph.build("pc", [Op("p", "x", Affine(0, 1.0), Affine(0, 2.0)), Op("c", "x", Affine(0, 1.0), Affine(0, 2.0))],
                          [("p", "c", 1)])
    assert warmup_counts(one_stage_per_op(chain, 16, [2, 4])) == (3, 1)
    assert warmup_counts(one_stage_per_op(chain, 16, [4, 2])) == (2, 1)


@pytest.mark.parametrize("seed", range(12))
def test_generators_valid_on_random_dags_with_mixed_micro_batches(seed):
    """Every generator's output passes the one validator (deadlock-free) on random stage DAGs."""
    sg = random_stage_graph(seed, num_ops=6 + seed % 3)
    cluster = latency_cluster(sg.num_devices, 1e-4)
    for name in ("gpipe", "1f1b", "graph-1f1b"):
        schedule = make_schedule(name, sg, cluster)
        tl = simulate(sg, schedule, cluster)
        # A stage's B_k ends before its next F starts (same device), so the warm-up is exactly its peak.
        if name == "graph-1f1b":
            assert tl.in_flight == warmup_counts(sg)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("uniform", [True, False])
def test_graph_1f1b_warmup_is_minimal_without_stretching(seed, uniform):
    """Lowering any one stage's warm-up by one deadlocks or stretches the iteration (free links).

    With equal stage times every stage is on a critical path, so the stretch is
    strict; with random times a stage with slack may keep the same iteration
    time — but never a shorter one (the rule is structural, not time-aware).
    """
    from graphpipe.actions import Schedule
    from graphpipe.errors import DeadlockError
    from graphpipe.sched.graph1f1b import one_f_one_b_sequence

    sg = random_stage_graph(seed, num_ops=5, batch_size=8, mixed=False)
    if uniform:
        g = sg.graph.with_ops([Op(o.name, o.kind, Affine(0, 1.0), Affine(0, 2.0)) for o in sg.graph.ops])
        sg = StageGraph.build(g, list(sg.stages), sg.batch_size, sg.num_devices)
    cluster = free_cluster(sg.num_devices)
    warm = list(warmup_counts(sg))
    base = simulate(sg, graph_1f1b(sg), cluster).iteration_time_s
    for s in range(sg.num_stages):
        if warm[s] <= 1:
            continue
        trial = list(warm)
        trial[s] -= 1
        lists = [one_f_one_b_sequence(t, sg.num_micro_batches(t), trial[t]) for t in range(sg.num_stages)]
        schedule = Schedule.from_lists("trial", [lists[sg.stages_on_device(d)[0]] for d in range(sg.num_devices)])
        try:
            t = simulate(sg, schedule, cluster).iteration_time_s
        except DeadlockError:
            continue
        assert t > base + 1e-9 if uniform else t >= base - 1e-9


def test_make_schedule_refusals():
    sg = uniform_chain(2, 4)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        make_schedule("zb", sg)
    with pytest.raises(ScheduleError, match="cpsat"):
        make_schedule("cpsat", sg)
    g4 = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0)) for i in range(4)],
                       [(f"l{i}", f"l{i + 1}", 1) for i in range(3)])
    mirrored = StageGraph.build(g4, [Stage(i, (i,), (d,), 1) for i, d in enumerate((0, 1, 1, 0))], 4, 2,
                                allow_shared_devices=True)
    with pytest.raises(ScheduleError, match="stage 2 is on \\[1\\], expected \\[0\\]"):
        make_schedule("interleaved", mirrored)
    three = StageGraph.build(g4, [Stage(i, (i,), (d,), 1) for i, d in enumerate((0, 1, 2, 0))], 4, 3,
                             allow_shared_devices=True)
    with pytest.raises(ScheduleError, match="not a multiple"):
        make_schedule("interleaved", three)
    with pytest.raises(ScheduleError, match="several virtual stages per device group; all 4 stages are on different"):
        make_schedule("interleaved", _diamond_stages())
    with pytest.raises(ScheduleError, match="not a permutation"):
        one_f_one_b(sg, [0])
    with pytest.raises(ScheduleError, match="before its producer"):
        one_f_one_b(sg, [1, 0])
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0)) for i in range(4)],
                      [(f"l{i}", f"l{i + 1}", 1) for i in range(3)])
    rr = round_robin_chain(g, 2, 2, 4, 1)
    with pytest.raises(ScheduleError, match="one stage per device"):
        make_schedule("1f1b", rr)
    validate_schedule(rr, gpipe(rr))  # fill-drain works with virtual stages too


@pytest.mark.parametrize("k,v,m", [(2, 2, 2), (2, 2, 3), (4, 2, 6), (4, 3, 4), (3, 2, 2), (2, 4, 8)])
def test_interleaved_valid_over_grid(k, v, m):
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0)) for i in range(k * v)],
                      [(f"l{i}", f"l{i + 1}", 1) for i in range(k * v - 1)])
    sg = round_robin_chain(g, k, v, m, 1)
    validate_schedule(sg, interleaved_1f1b(sg))


# --------------------------------------------------------------------------- torch.distributed.pipelining orders
def _torch_orders(schedule_obj, num_ranks):
    """Per rank: the F/B actions of torch's pipeline_order as (stage, kind, mb), comm/None dropped."""
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    out = []
    for r in range(num_ranks):
        acts = []
        for a in schedule_obj.pipeline_order[r]:
            if a is None:
                continue
            name = getattr(a.computation_type, "name", str(a.computation_type))
            if name in kinds:
                acts.append((a.stage_index, kinds[name], a.microbatch_index))
        out.append(acts)
    return out


def _ours(schedule):
    return [[(a.stage_id, a.kind, a.mb_id) for a in acts] for acts in schedule.device_actions]


@pytest.mark.parametrize("k,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_gpipe_and_1f1b_orders_match_torch(k, m):
    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    stage = SimpleNamespace(num_stages=k, stage_index=0, group_size=k, group_rank=0)
    sg = uniform_chain(k, m)
    assert _ours(gpipe(sg)) == _torch_orders(S.ScheduleGPipe(stage, m), k)
    torch_1f1b = _torch_orders(S.Schedule1F1B(stage, m), k)
    # torch 2.13's Schedule1F1B._get_pipeline_order labels the last rank's forwards 1..M instead of
    # 0..M-1 (its warm-up count there is 0 and it pre-increments the forward id); the executed
    # order (_step_microbatches: min(M, K - i) warm-up forwards, then 1B1F) uses 0..M-1. Correct it.
    last = torch_1f1b[k - 1]
    if sorted(mb for _, kind, mb in last if kind == "F") == list(range(1, m + 1)):
        torch_1f1b[k - 1] = [(s, kind, mb - 1 if kind == "F" else mb) for s, kind, mb in last]
    assert _ours(one_f_one_b(sg)) == torch_1f1b


@pytest.mark.parametrize("k,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (2, 3, 6), (4, 2, 6)])
def test_interleaved_order_matches_torch(k, v, m):
    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0)) for i in range(k * v)],
                      [(f"l{i}", f"l{i + 1}", 1) for i in range(k * v - 1)])
    sg = round_robin_chain(g, k, v, m, 1)
    stages = [SimpleNamespace(num_stages=k * v, stage_index=c * k, group_size=k, group_rank=0) for c in range(v)]
    torch_orders = _torch_orders(S.ScheduleInterleaved1F1B(stages, m), k)
    assert _ours(interleaved_1f1b(sg)) == torch_orders


def _replicated(graph: OpGraph, replicas, batch_size: int, mb: int = 1, mode: str = "round-robin") -> StageGraph:
    """One stage per op of ``graph``; stage ``i`` on ``replicas[i]`` consecutive devices (``mode`` where > 1)."""
    stages, first = [], 0
    for i, r in enumerate(replicas):
        stages.append(Stage(i, (i,), tuple(range(first, first + r)), mb, replica_mode=mode if r > 1 else "split"))
        first += r
    return StageGraph.build(graph, stages, batch_size, first)


def _most_open(actions) -> int:
    """Most forwards one device list holds before their backwards (its in-flight micro-batches)."""
    open_, most = 0, 0
    for a in actions:
        open_ += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
        most = max(most, open_)
    return most


@pytest.mark.parametrize("seed", range(10))
def test_graph_1f1b_is_1f1b_rr_on_round_robin_chains(seed):
    """On a chain, graph-1F1B reduces to 1F1B, round-robin replicas (PipeDream's 1F1B-RR) included."""
    import random

    rng = random.Random(seed)
    k = rng.randint(1, 4)
    replicas = [rng.choice((1, 2, 3)) for _ in range(k)]
    sg = _replicated(uniform_chain(k, 12).graph, replicas, 12)
    assert graph_1f1b(sg).device_actions == one_f_one_b(sg).device_actions


def test_round_robin_replicas_each_keep_their_depth_in_flight():
    """Two stages of two round-robin replicas: each replica of the first holds 2 micro-batches, as 1F1B-RR,
    instead of the stage's 2 shared between them (1 each: the replica idles through every round trip)."""
    from graphpipe.sched.graph1f1b import assemble, one_f_one_b_sequence

    sg = _replicated(uniform_chain(2, 8).graph, [2, 2], 8)
    cluster = latency_cluster(4, 0.1)
    schedule = graph_1f1b(sg)
    assert [_most_open(acts) for acts in schedule.device_actions] == [2, 2, 1, 1]
    shared = assemble(sg, "shared", [one_f_one_b_sequence(s, 8, w) for s, w in enumerate(warmup_counts(sg))])
    assert [_most_open(acts) for acts in shared.device_actions] == [1, 1, 1, 1]
    fast, slow = (simulate(sg, s, cluster).iteration_time_s for s in (schedule, shared))
    assert fast == pytest.approx(simulate(sg, one_f_one_b(sg), cluster).iteration_time_s)
    assert fast < slow


@pytest.mark.parametrize("seed", range(8))
def test_graph_schedules_on_round_robin_dags_are_valid_and_give_each_replica_its_depth(seed):
    """Random SP stage DAGs with round-robin replicas: graph-1F1B and graph-ZB pass the validator (make_schedule
    validates), and each replica of a stage holds min(its stage's depth, its own micro-batches) in flight."""
    import random

    from conftest import random_sp_graph

    rng = random.Random(seed)
    graph = random_sp_graph(5 + seed % 3, seed)
    replicas = [rng.choice((1, 2, 2, 3)) for _ in range(graph.num_ops)]
    sg = _replicated(graph, replicas, 12)
    depth = {}
    for s in reversed(range(sg.num_stages)):   # stage ids are topological
        depth[s] = 1 + max((depth[c] for c in sg.succs(s)), default=0)
    cluster = latency_cluster(sg.num_devices, 1e-3)
    for name in ("graph-1f1b", "graph-zb"):
        schedule = make_schedule(name, sg, cluster)
        simulate(sg, schedule, cluster)
        for st in sg.stages:
            for d in st.devices:
                own = len([j for j in range(sg.num_micro_batches(st.id)) if d in st.replica_of(j)])
                assert _most_open(schedule.device_actions[d]) >= min(depth[st.id], own), (name, st, d)


# ------------------------------------------------------------------ the registry
def _layout_for(spec, graph, devices=2, batch=8):
    """A stage graph of the layout the registry entry says its schedule runs on."""
    from graphpipe.sched.generators import looped_chain, v_shape_chain

    if spec.layout == "v":
        return v_shape_chain(graph, devices, batch, 1)
    if spec.layout == "looped":
        return looped_chain(graph, [(d,) for d in range(devices)], 2, batch, 1)
    per = graph.num_ops // devices
    return StageGraph.build(graph, [Stage(i, tuple(range(per * i, per * i + per)), (i,), 1) for i in range(devices)],
                            batch, devices)


def _chain(n=8):
    return OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3), 1e6, 1e4, 1e4) for i in range(n)],
                         [(f"l{i}", f"l{i + 1}", 1e4) for i in range(n - 1)])


@pytest.mark.parametrize("name", list(__import__("graphpipe.sched.generators", fromlist=["SCHEDULES"]).SCHEDULES))
def test_each_registry_entry_says_what_its_schedule_does(name):
    """The entry's fields are the generated schedule's properties: split backward iff I/W actions, the
    layout it accepts, asynchrony as async_pipe knows it, one micro-batch size where it says so."""
    from graphpipe.sched.async_pipe import ASYNC_SCHEDULES
    from graphpipe.sched.generators import get_schedule

    spec = get_schedule(name.upper())
    assert spec.name == name and spec.summary
    sg = _layout_for(spec, _chain())
    schedule = make_schedule(name, sg, free_cluster(sg.num_devices))
    kinds = {a.kind for actions in schedule.device_actions for a in actions}
    assert spec.split_backward == ({"I", "W"} <= kinds), kinds
    assert spec.asynchronous == (name in ASYNC_SCHEDULES)
    assert (spec.base is not None) == (spec.asynchronous or spec.layout == "v")
    if spec.layout != "plan":  # the strategy's own layout (one stage per device, a chain) is refused
        with pytest.raises(ScheduleError):
            make_schedule(name, _layout_for(get_schedule("1f1b"), _chain()))
    if spec.one_micro_batch_size:
        mixed = StageGraph.build(sg.graph, [s if s.id else Stage(0, s.op_ids, s.devices, 2) for s in sg.stages],
                                 sg.batch_size, sg.num_devices, allow_shared_devices=True)
        with pytest.raises(ScheduleError):
            make_schedule(name, mixed)


def test_an_unknown_schedule_is_refused_with_the_known_names():
    from graphpipe.sched.generators import SCHEDULE_NAMES, get_schedule

    with pytest.raises(ScheduleError, match="known: " + ", ".join(SCHEDULE_NAMES).replace("(", r"\(")):
        get_schedule("zigzag")
    with pytest.raises(ScheduleError, match="optimize_plan"):
        get_schedule("cpsat")
