"""Zero bubble (split backward I/W): cost split, simulator semantics, ZB-H1 on chains, graph-ZB on stage graphs."""

from __future__ import annotations

import pytest

from graphpipe import costs
from graphpipe.actions import Action, Schedule
from graphpipe.errors import ScheduleError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import (graph_zb, make_schedule, one_f_one_b, round_robin_chain, simulate, v_shape_chain,
                             validate_schedule, zb_h1)
from graphpipe.sched.graph1f1b import warmup_counts
from graphpipe.stages import Stage, StageGraph

from conftest import branches_graph
from test_sched_common import free_cluster, latency_cluster, one_stage_per_op, oracle_times, uniform_chain
from test_sched_generators import _diamond_stages, _four_branch_stages


def test_split_backward_times_follow_the_cost_model():
    """W is half of a parameterised op's backward, nothing of a parameter-free op's; I the rest, re-run
    forward included; I + W = B always."""
    ops = [Op("w", "linear", Affine(0.5, 1.0), Affine(1.0, 2.0), param_bytes=8.0),
           Op("relu", "act", Affine(0.0, 1.0), Affine(0.0, 3.0))]
    g = OpGraph.build("g", ops, [("w", "relu", 1.0)])
    for recompute in (False, True):
        sg = StageGraph.build(g, [Stage(0, (0, 1), (0,), 4, recompute)], 8, 1)
        i, w = sg.split_backward_times(0)
        assert w == pytest.approx(0.5 * (1.0 + 2.0 * 4))
        assert i + w == pytest.approx(sg.bwd_time(0))
        assert i == pytest.approx(0.5 * 9.0 + 3.0 * 4 + recompute * sg.fwd_time(0))


def test_measured_weight_gradient_replaces_the_share():
    """An op with a measured W (``Op.wgrad``) splits by it exactly; the others keep the share."""
    ops = [Op("w", "linear", Affine(0.5, 1.0), Affine(1.0, 2.0), param_bytes=8.0, wgrad=Affine(0.25, 0.5)),
           Op("v", "linear", Affine(0.5, 1.0), Affine(2.0, 4.0), param_bytes=8.0),
           Op("relu", "act", Affine(0.0, 1.0), Affine(0.0, 3.0))]
    g = OpGraph.build("g", ops, [("w", "v", 1.0), ("v", "relu", 1.0)])
    assert costs.weight_grad_time(g, (0,), 4) == 0.25 + 0.5 * 4  # measured, exactly
    assert costs.weight_grad_time(g, (1, 2), 4) == 0.5 * (2.0 + 4.0 * 4)  # the share; nothing for relu
    assert costs.weight_grad_time(g, (0, 1, 2), 4) == 2.25 + 9.0
    sg = StageGraph.build(g, [Stage(0, (0, 1, 2), (0,), 4)], 8, 1)
    i, w = sg.split_backward_times(0)
    assert w == 11.25 and i + w == sg.bwd_time(0) == 9.0 + 18.0 + 12.0
    # a measured W larger than the op's B (two fits crossing) is capped at B: I is never negative
    big = OpGraph.build("big", [Op("w", "linear", bwd=Affine(1.0, 0.0), param_bytes=8.0, wgrad=Affine(0.0, 1.0))], [])
    assert costs.weight_grad_time(big, (0,), 0.5) == 0.5 and costs.weight_grad_time(big, (0,), 4) == 1.0


def test_contracted_ops_keep_the_measured_weight_gradient():
    """Merging ops (non-SP contraction) sums their W models: measured ones as measured, the rest at the share."""
    from graphpipe.sp import contract

    ops = [Op("a", "linear", bwd=Affine(1.0, 2.0), param_bytes=8.0, wgrad=Affine(0.25, 0.5)),
           Op("b", "linear", bwd=Affine(2.0, 4.0), param_bytes=8.0), Op("c", "act", bwd=Affine(0.0, 3.0))]
    g = OpGraph.build("g", ops, [("a", "b", 1.0), ("b", "c", 1.0)])
    merged, _ = contract(g, [{0, 1, 2}])
    assert merged.ops[0].wgrad == Affine(1.25, 2.5)
    assert contract(OpGraph.build("u", ops[1:], [("b", "c", 1.0)]), [{0, 1}])[0].ops[0].wgrad is None


def _split_in_place(schedule: Schedule) -> Schedule:
    return Schedule.from_lists("split", [[x for a in acts for x in ((Action(a.stage_id, "I", a.mb_id),
                                                                     Action(a.stage_id, "W", a.mb_id))
                                                                    if a.kind == "B" else (a,))]
                                         for acts in schedule.device_actions])


def test_split_in_place_keeps_memory_and_never_delays():
    """B -> (I, W) in place: the same device order and busy time, activations held until W ends (so the same
    in-flight counts and peak), and producers wait for I instead of the whole B (never later)."""
    sg = uniform_chain(4, 8)
    cluster = latency_cluster(4, 0.1)
    plain = simulate(sg, one_f_one_b(sg), cluster)
    split = simulate(sg, _split_in_place(one_f_one_b(sg)), cluster)
    assert split.in_flight == plain.in_flight
    assert split.peak_memory_bytes == pytest.approx(plain.peak_memory_bytes)
    assert split.busy_s == pytest.approx(plain.busy_s)
    assert split.iteration_time_s < plain.iteration_time_s


def test_activations_live_until_w():
    """Brute force: live activation bytes at every instant, a micro-batch alive on [F start, W end)."""
    sg = uniform_chain(3, 6)
    tl = simulate(sg, zb_h1(sg), free_cluster(3))
    at = {(r.action.stage_id, r.action.kind, r.action.mb_id): (r.start, r.end) for r in tl.actions}
    for s in range(3):
        stash = sg.act_bytes_per_sample(s) * sg.stages[s].samples_per_replica
        spans = [(at[(s, "F", j)][0], at[(s, "W", j)][1]) for j in range(6)]
        peak = max(sum(1 for lo, hi in spans if lo <= t < hi) for t, _ in spans)
        assert tl.in_flight[s] == peak
        assert tl.activation_peak_bytes[s] == pytest.approx(peak * stash)


@pytest.mark.parametrize("name", ["zb-h1", "graph-zb"])
def test_split_schedules_agree_with_the_oracle(name):
    sg = uniform_chain(4, 8)
    cluster = latency_cluster(4, 0.3)
    schedule = make_schedule(name, sg, cluster)
    tl = simulate(sg, schedule, cluster)
    oracle = oracle_times(sg, schedule, cluster)
    ours = {(r.device, str(r.action)): (r.start, r.end) for r in tl.actions}
    assert sorted(ours) == sorted(oracle)
    assert [t for key in sorted(ours) for t in ours[key]] == pytest.approx([t for key in sorted(oracle)
                                                                            for t in oracle[key]])


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_zb_h1_idle_is_a_third_of_1f1b(k, ratio):
    """ZB-H1's idle time per device is (K-1)(F+I-W), 1F1B's (K-1)(F+I+W); F = I = W: a third.

    Derivation (K equal stages, M >= K micro-batches, free communication, every device busy M(F+I+W)):

    * 1F1B with B = I + W: the last device starts at (K-1)F; the first gradient comes back to device 0 after
      the forward has crossed K stages and the backward K-1 more, so device 0's first B starts at
      K F + (K-1) B and it then alternates B, F without waiting; its last B ends at (M+K-1)(F+B)
      (the classic bubble, GPipe's (K-1)/(M+K-1) fraction): idle (K-1)(F+B) = (K-1)(F+I+W) on every device.
    * ZB-H1: the last device K-1 starts at (K-1)F and never waits again: its I_k needs only its own F_k, its
      W's have no dependents, and each F_k was sent (K-2 runs F_k one step ahead in the same F, I, W
      rhythm). So it ends at (K-1)F + M(F+I+W) and that is the iteration time, provided no other device ends
      later. Device i runs its last I, I_{M-1}, (K-1-i) I-hops after device K-1 ran it, and then still has
      its ``lag = i`` trailing W's and W_{M-1-i}... left: with W = I each trailing W covers exactly one I-hop
      of the device below, so every device ends at the same instant. Idle per device: (K-1)F, which with
      I = W is (K-1)(F+I-W), the paper's ZB-H1 bubble; with F = I = W it is (K-1)F against 1F1B's 3(K-1)F.

    Memory: stage i warms up with K-i forwards (1F1B's) and holds up to i more micro-batches, whose W is
    deferred; so every stage holds at most K, stage 0's 1F1B count: the peak over devices equals 1F1B's.
    """
    m = ratio * k
    f = i = w = 1.0
    sg = uniform_chain(k, m, fwd=f, bwd=i + w)  # one parameterised op per stage: I = W = B/2
    assert sg.split_backward_times(0) == pytest.approx((i, w))
    cluster = free_cluster(k)
    zb = simulate(sg, make_schedule("zb-h1", sg, cluster), cluster)
    base = simulate(sg, make_schedule("1f1b", sg, cluster), cluster)
    busy = m * (f + i + w)
    for d in range(k):
        assert base.iteration_time_s - base.busy_s[d] == pytest.approx((k - 1) * (f + i + w))
        assert zb.busy_s[d] == pytest.approx(busy)
        assert zb.iteration_time_s - zb.busy_s[d] == pytest.approx((k - 1) * (f + i - w))
        assert zb.iteration_time_s - zb.busy_s[d] < base.iteration_time_s - base.busy_s[d]
    assert max(zb.in_flight) == max(base.in_flight) == k
    assert max(zb.activation_peak_bytes) == pytest.approx(max(base.activation_peak_bytes))


def test_zb_h1_with_slower_forward():
    """F = 2, I = W = 1: idle (K-1)F = (K-1)(F+I-W) per device, against 1F1B's (K-1)(F+I+W)."""
    k, m = 4, 8
    sg = uniform_chain(k, m, fwd=2.0, bwd=2.0)
    cluster = free_cluster(k)
    zb = simulate(sg, zb_h1(sg), cluster)
    for d in range(k):
        assert zb.iteration_time_s - zb.busy_s[d] == pytest.approx((k - 1) * (2.0 + 1.0 - 1.0))


def test_zb_h1_refuses_a_stage_graph_with_branches():
    with pytest.raises(ScheduleError, match="zb-h1 needs a chain of stages .* use 'graph-zb'"):
        make_schedule("zb-h1", _diamond_stages())


@pytest.mark.parametrize("build", [_diamond_stages, _four_branch_stages])
@pytest.mark.parametrize("latency", [0.0, 2e-4])
def test_graph_zb_never_slower_than_graph_1f1b(build, latency):
    """On the schedule tests' diamond and 4-branch stage graphs: never slower, no stage holds more micro-batches
    than graph-1F1B's source (the depth), and the peak activation bytes over devices stay within graph-1F1B's."""
    sg = build()
    cluster = latency_cluster(sg.num_devices, latency) if latency else free_cluster(sg.num_devices)
    g1 = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    zb = simulate(sg, make_schedule("graph-zb", sg, cluster), cluster)
    assert zb.iteration_time_s <= g1.iteration_time_s + 1e-12
    assert max(zb.in_flight) <= sg.depth() == max(warmup_counts(sg))
    assert max(zb.activation_peak_bytes) <= max(g1.activation_peak_bytes) * (1 + 1e-12)


def test_graph_zb_strictly_faster_somewhere_and_equals_zb_h1_on_chains():
    faster = []
    for build in (_diamond_stages, _four_branch_stages):
        sg = build()
        cluster = free_cluster(sg.num_devices)
        g1 = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
        zb = simulate(sg, make_schedule("graph-zb", sg, cluster), cluster)
        faster.append(zb.iteration_time_s < g1.iteration_time_s * (1 - 1e-6))
    assert any(faster)
    sg = uniform_chain(4, 8)
    cluster = free_cluster(4)
    assert simulate(sg, graph_zb(sg, cluster), cluster).iteration_time_s == pytest.approx(
        simulate(sg, zb_h1(sg), cluster).iteration_time_s)


def test_graph_zb_fills_a_short_branch_with_its_weight_gradients():
    """in -> (a -> a2 | b) -> out: branch b waits for the join; deferring its W's pays off (lag > 0 chosen)."""
    ops = [Op(n, "x", Affine(0, 1.0), Affine(0, 2.0), 4.0) for n in ("in", "a", "a2", "b", "out")]
    g = OpGraph.build("uneven", ops, [("in", "a", 1), ("a", "a2", 1), ("a2", "out", 1), ("in", "b", 1),
                                      ("b", "out", 1)])
    sg = one_stage_per_op(g, 16, [1] * 5)
    cluster = free_cluster(5)
    schedule = graph_zb(sg, cluster)
    validate_schedule(sg, schedule)
    g1 = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    zb = simulate(sg, schedule, cluster)
    assert zb.iteration_time_s < g1.iteration_time_s
    assert max(zb.in_flight) <= sg.depth()


def test_graph_zb_mixed_micro_batch_sizes_validate():
    from test_sched_common import random_stage_graph

    for seed in range(8):
        sg = random_stage_graph(seed, num_ops=6)
        validate_schedule(sg, graph_zb(sg, latency_cluster(sg.num_devices, 1e-4)))


def _layers(n: int) -> OpGraph:
    return OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 4.0, 10.0) for i in range(n)],
                         [(f"l{i}", f"l{i + 1}", 0.0) for i in range(n - 1)])


def torch_schedule(class_name: str, k: int, m: int, v: int = 2, rank: int = 0):
    """torch's ``class_name`` schedule for ``k`` ranks and ``m`` micro-batches as rank ``rank`` builds it, on
    stand-in stages: ZBV's V (stages ``r`` and ``2K-1-r`` on rank ``r``) or the loop layout (``r + jK``)."""
    torch = pytest.importorskip("torch")
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stage_mod = pytest.importorskip("torch.distributed.pipelining.stage")
    if not hasattr(schedules, class_name):
        pytest.skip(f"this torch has no {class_name}")

    class StandIn(stage_mod._PipelineStageBase):  # what the schedule's constructor reads, nothing more
        def __init__(self, stage_index):
            self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, v * k, k, rank
            self.submod = torch.nn.Identity()
            self.stage_index_to_group_rank = {}

        def _create_grad_recv_info(self, *args, **kwargs):
            return ()

        def _prepare_forward_infra(self, *args, **kwargs):
            return ()

        def _prepare_backward_infra(self, *args, **kwargs):
            return None

    v_shaped = class_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    ids = [rank, 2 * k - 1 - rank] if v_shaped else [rank + j * k for j in range(v)]
    return getattr(schedules, class_name)([StandIn(i) for i in ids], m)


def _torch_orders(class_name: str, k: int, m: int, v: int = 2) -> list[list[str]]:
    """Per-rank actions of torch's ``class_name`` schedule (its ``pipeline_order``, bubbles dropped)."""
    return [[str(a) for a in torch_schedule(class_name, k, m, v, rank).pipeline_order[rank] if a is not None]
            for rank in range(k)]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_zbv_per_rank_orders_equal_torch(k):
    """The actions each rank executes, F/I/W, in order: ours (on v_shape_chain's layout) and torch 2.13's."""
    for m in (1, k, 2 * k - 1, 2 * k, 4 * k):
        sg = v_shape_chain(_layers(2 * k), k, m, 1)
        ours = make_schedule("zbv", sg)
        assert [[str(a) for a in acts] for acts in ours.device_actions] == _torch_orders("ScheduleZBVZeroBubble", k, m)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_dualpipev_per_rank_orders_equal_torch(k):
    """DualPipeV on the V layout: each rank's actions in order equal torch 2.13's ScheduleDualPipeV (its
    OVERLAP_F_B pairs read as their forward then their backward), for every M from 2K to 4K; each one valid."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    for m in range(2 * k, 4 * k + 1):
        sg = v_shape_chain(_layers(2 * k), k, m, 1)
        ours = make_schedule("dualpipev", sg)
        state = SimpleNamespace(pp_group_size=k, _n_microbatches=m)  # all the order generator reads
        theirs = [[str(sub) for a in ScheduleDualPipeV._calculate_single_rank_operations(state, r)
                   for sub in (a.sub_actions or (a,))] for r in range(k)]
        assert [[str(a) for a in acts] for acts in ours.device_actions] == theirs, (k, m)
        kinds = {a.kind for acts in ours.device_actions for a in acts}
        assert {"F", "B", "I", "W"} <= kinds, kinds


def test_dualpipev_refuses_too_few_micro_batches_and_non_v_layouts():
    with pytest.raises(ScheduleError, match=r"dualpipev needs at least as many micro-batches as stages \(4\)"):
        make_schedule("dualpipev", v_shape_chain(_layers(4), 2, 3, 1))
    with pytest.raises(ScheduleError, match="dualpipev needs stage 2 on the devices of stage 1"):
        make_schedule("dualpipev", round_robin_chain(_layers(4), 2, 2, 4, 1))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_zb_per_rank_orders_equal_torch_and_beat_interleaved(k, v):
    """On the loop layout both use (stage s on rank s % K): torch 2.13's ScheduleInterleavedZeroBubble orders;
    and with F = I = W and free communication, faster than interleaved 1F1B on the same stages."""
    cluster = free_cluster(k)
    for m in (k, k + 1, 2 * k, 4 * k):
        if m % max(1, m // k):
            continue  # rounds of about K must divide M (both refuse)
        sg = round_robin_chain(_layers(v * k), k, v, m, 1)
        ours = make_schedule("interleaved-zb", sg)
        assert [[str(a) for a in acts] for acts in ours.device_actions] == _torch_orders(
            "ScheduleInterleavedZeroBubble", k, m, v), (k, v, m)
        base = simulate(sg, make_schedule("interleaved", sg), cluster)
        assert simulate(sg, ours, cluster).iteration_time_s < base.iteration_time_s


@pytest.mark.parametrize("k", [2, 4])
def test_zbv_bubble_and_memory(k):
    """F = I = W per chunk, free communication, M >= 2K: each device idles (K-1)F (1F1B on the same layers in K
    stages idles (K-1)(F+I+W) of its two-chunk stage, 6(K-1)F), and no device holds more activation bytes
    than 1F1B's first stage (paper §6: ZB-V keeps 1F1B's activation memory)."""
    g = _layers(2 * k)
    cluster = free_cluster(k)
    for m in (2 * k, 4 * k):
        tl = simulate(v_shape := v_shape_chain(g, k, m, 1), make_schedule("zbv", v_shape), cluster)
        chain = StageGraph.build(g, [Stage(i, (2 * i, 2 * i + 1), (i,), 1) for i in range(k)], m, k)
        base = simulate(chain, make_schedule("1f1b", chain), cluster)
        for d in range(k):
            assert tl.iteration_time_s - tl.busy_s[d] == pytest.approx((k - 1) * 1.0)
            assert base.iteration_time_s - base.busy_s[d] == pytest.approx((k - 1) * 6.0)
        assert max(tl.activation_peak_bytes) <= max(base.activation_peak_bytes)


def test_zbv_refuses_a_layout_that_is_not_a_v():
    g = _layers(8)
    with pytest.raises(ScheduleError, match="zbv needs stage 2 on the devices of stage 1"):
        make_schedule("zbv", round_robin_chain(g, 2, 2, 4, 1))
    with pytest.raises(ScheduleError, match="zbv needs 2K stages"):
        make_schedule("zbv", uniform_chain(3, 4))


def test_trace_and_gantt_colour_i_and_w_apart(tmp_path):
    from graphpipe.sched import plot_gantt, trace_document

    sg = uniform_chain(2, 4)
    tl = simulate(sg, zb_h1(sg), free_cluster(2))
    events = [e for e in trace_document(tl)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in "FIW"]
    colours = {e["cat"]: e.get("cname") for e in events}
    assert set(colours) == {"F", "I", "W"} and colours["I"] != colours["W"] and colours["I"] and colours["W"]
    path = tmp_path / "zb.png"
    plot_gantt(tl, str(path))
    assert path.stat().st_size > 5000


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_plan_schedule_cuts_the_model_into_a_v(tmp_path, capsys, name):
    """`plan --schedule zbv|dualpipev` re-cuts the strategy's plan into the V those schedules need (stage d and
    2K-1-d on device d, the strategy's micro-batch size); a branchy model is refused in one line."""
    from graphpipe.cli import main
    from graphpipe.plan import read_plan
    from graphpipe.sched import validate_plan

    out = str(tmp_path / "v.json")
    assert main(["plan", "transformer:small,layers=6", "--devices", "4", "--batch-size", "16", "--strategy", "gpipe",
                 "--micro-batch-size", "2", "--schedule", name, "--out", out]) == 0
    plan = read_plan(out)
    validate_plan(plan)
    sg = plan.stage_graph
    assert plan.schedule.name == name and sg.num_stages == 8
    assert [st.devices for st in sg.stages] == [(0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]
    assert {st.micro_batch_size for st in sg.stages} == {2}
    assert plan.predicted["iteration_time_s"] == simulate(sg, plan.schedule, plan.cluster).iteration_time_s
    capsys.readouterr()
    # whole-copy stages: one device per stage of the V (a tp 2 layout makes the pair one unit, a V of one device)
    assert main(["plan", "mmt:small", "--devices", "2", "--batch-size", "8", "--schedule", name,
                 "--tp", "1", "--shard", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no V layout" in err, err
