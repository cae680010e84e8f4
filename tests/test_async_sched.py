"""PipeDream's asynchronous schedules in the plan and simulator: versions, steady state, stashed memory, bad input."""

from __future__ import annotations

import json

import pytest

from graphpipe import costs
from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.errors import InputError, ScheduleError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.plan import Plan, plan_from_dict, plan_to_dict
from graphpipe.sched import make_schedule, predicted_figures, simulate
from graphpipe.sched.async_pipe import (AsyncSpec, async_figures, async_spec_for, plan_spec, stream_graph,
                                        stream_schedule, version_table, with_async)
from graphpipe.stages import Stage, StageGraph

from conftest import branches_graph


def _free_cluster(n: int):
    """A cluster whose links cost nothing: the steady state is then pure compute."""
    from dataclasses import replace

    from graphpipe.cluster import Link

    free = Link(latency_s=0.0, bandwidth_Bps=1e30)
    return replace(preset("v100", n), intra_node=free, inter_node=free)


def _chain_sg(k: int, m: int, b: int = 1, replicas: dict[int, tuple[int, str]] | None = None) -> StageGraph:
    """``k`` equal one-op stages (op time 1 s forward, 2 s backward per sample) on their own devices."""
    replicas = replicas or {}
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 400.0, 10.0, 1.0) for i in range(k)],
                      [(f"l{i}", f"l{i + 1}", 0.0) for i in range(k - 1)])
    stages, d = [], 0
    for i in range(k):
        r, mode = replicas.get(i, (1, "split"))
        stages.append(Stage(i, (i,), tuple(range(d, d + r)), b, replica_mode=mode))
        d += r
    return StageGraph.build(g, stages, m * b, d)


def _versions_from_timeline(sg: StageGraph, name: str, windows: int) -> list[list[int]]:
    """Oracle for 1f1b-async without vertical sync: updates of stage s (its backwards, one per micro-batch) that
    *ended* before each forward of s *started*, read off the simulated timeline of the stream."""
    stream = stream_schedule(sg, name, windows)
    tl = simulate(stream_graph(sg, windows), stream, preset("v100", sg.num_devices))
    out = [[0] * (sg.num_micro_batches(0) * windows) for _ in sg.stages]
    for st in sg.stages:
        recs = [r for r in tl.actions if r.action.stage_id == st.id and r.device == st.devices[0]]
        for r in recs:
            if r.action.kind == "F":
                out[st.id][r.action.mb_id] = sum(1 for q in recs if q.action.kind == "B" and q.end <= r.start)
    return out


@pytest.mark.parametrize("k,m,windows", [(2, 2, 3), (3, 4, 2), (4, 4, 2), (4, 8, 1), (3, 1, 4)])
def test_1f1b_async_versions_are_the_updates_done_before_each_forward(k, m, windows):
    sg = _chain_sg(k, m)
    table = version_table(sg, AsyncSpec(name="1f1b-async"), windows)
    assert [list(v) for v in table.version] == _versions_from_timeline(sg, "1f1b-async", windows)


@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 8)])
def test_weight_stashing_keeps_in_flight_minus_one_versions(k, m):
    """PipeDream §3.3: stage i of K (1F1B, no replication) has K - i micro-batches in flight, each on its own
    version; the newest runs on the live weights, so K - i - 1 are stashed."""
    sg = _chain_sg(k, m)
    table = version_table(sg, AsyncSpec(name="1f1b-async"), 3)
    assert [v[0] for v in table.peak_stashed] == [k - i - 1 for i in range(k)]
    # every micro-batch runs on the version after the updates of the micro-batches K - i before it
    for i in range(k):
        assert list(table.version[i]) == [max(0, j - (k - i) + 1) for j in range(3 * m)]


def test_vertical_sync_uses_the_input_stages_version_and_stashes_more():
    sg = _chain_sg(4, 8)
    plain = version_table(sg, AsyncSpec(name="1f1b-async"), 2)
    vs = version_table(sg, AsyncSpec(name="1f1b-async", vertical_sync=True), 2)
    assert all(vs.version[s] == plain.version[0] for s in range(4))
    assert all(v <= p for s in range(4) for v, p in zip(vs.version[s], plain.version[s]))
    assert [v[0] for v in vs.peak_stashed] >= [v[0] for v in plain.peak_stashed]
    assert vs.peak_stashed[3][0] > 0 == plain.peak_stashed[3][0]  # the last stage now stashes too


@pytest.mark.parametrize("k,m", [(2, 2), (3, 4), (4, 4), (4, 8)])
def test_2bw_window_k_runs_on_version_k_minus_1_with_two_versions(k, m):
    sg = _chain_sg(k, m)
    table = version_table(sg, AsyncSpec(name="2bw", update_every=m), 4)
    for s in range(k):
        assert list(table.version[s]) == [max(0, j // m - 1) for j in range(4 * m)]
        assert table.peak_stashed[s][0] <= 1  # 2BW: the live weights and one buffered version
    assert max(v[0] for v in table.peak_stashed) == 1


def test_2bw_with_m_below_the_in_flight_count_is_refused():
    with pytest.raises(ScheduleError, match="needs version"):
        version_table(_chain_sg(4, 8), AsyncSpec(name="2bw", update_every=1), 2)


@pytest.mark.parametrize("k,m", [(2, 4), (4, 8), (3, 3)])
def test_steady_state_of_equal_stages_is_m_times_f_plus_b(k, m):
    """Analytical: no flush bubble, so one mini-batch costs M (F + B) on the bottleneck; the flush pays (K-1)(F+B)."""
    sg = _chain_sg(k, m)
    cluster = _free_cluster(k)
    figures = async_figures(sg, cluster, AsyncSpec(name="1f1b-async"))
    assert figures["iteration_time_s"] == pytest.approx(m * 3.0)
    flush = simulate(sg, make_schedule("1f1b", sg), cluster)
    assert flush.iteration_time_s == pytest.approx((m + k - 1) * 3.0)
    assert figures["throughput"] >= flush.throughput
    assert figures["mean_bubble_fraction"] == pytest.approx(0.0, abs=1e-9)


def test_stashed_memory_is_versions_times_stage_weights_through_costs():
    sg = _chain_sg(3, 6)
    cluster = _free_cluster(3)
    spec = AsyncSpec(name="1f1b-async")
    figures = async_figures(sg, cluster, spec)
    flush = predicted_figures(simulate(stream_graph(sg, 4), stream_schedule(sg, spec.name, 4), cluster))
    for s in range(3):
        expected = costs.weight_versions_bytes(sg.param_bytes(s), 3 - s - 1)
        assert figures["stashed_weight_bytes"][s] == expected == 400.0 * (2 - s)
        assert figures["peak_memory_bytes"][s] == pytest.approx(flush["peak_memory_bytes"][s] + expected)


def test_round_robin_stage_updates_once_per_round_and_replicas_agree():
    """1F1B-RR: r consecutive micro-batches (one per replica) make one update; every replica holds the same
    history, so micro-batches in one round run on one version."""
    sg = _chain_sg(3, 8, replicas={0: (2, "round-robin")})
    table = version_table(sg, AsyncSpec(name="1f1b-async"), 2)
    assert table.group_size == (2, 1, 1)
    v0 = table.version[0]
    assert all(b >= a for a, b in zip(v0, v0[1:]))  # versions never go back
    assert len(table.peak_stashed[0]) == 2
    with pytest.raises(InputError, match="multiple of stage 0's 2 round-robin replicas"):
        version_table(sg, AsyncSpec(name="2bw", update_every=3), 3)


def test_stage_graphs_stream_too():
    g = branches_graph(2, 2)
    stages = [Stage(i, (i,), (i,), 2) for i in range(g.num_ops)]
    sg = StageGraph.build(g, stages, 8, g.num_ops)
    cluster = preset("v100", g.num_ops)
    figures = async_figures(sg, cluster, AsyncSpec(name="1f1b-async"))
    flush = predicted_figures(simulate(sg, make_schedule("1f1b", sg), cluster))
    assert figures["throughput"] >= flush["throughput"]


def _plan(schedule: str = "1f1b") -> Plan:
    sg = _chain_sg(3, 6)
    cluster = preset("v100", 3)
    sched = make_schedule(schedule, sg, cluster)
    return Plan(model="chain", stage_graph=sg, cluster=cluster, strategy="custom", schedule=sched,
                predicted=predicted_figures(simulate(sg, sched, cluster)))


def test_plan_json_keeps_the_async_options(tmp_path):
    plan = with_async(_plan(), async_spec_for("1f1b-async", _plan().stage_graph, vertical_sync=True))
    doc = json.loads(json.dumps(plan_to_dict(plan)))
    assert doc["async"] == {"vertical_sync": True, "update_every": 1, "stash": True}
    back = plan_from_dict(doc)
    assert plan_spec(back) == AsyncSpec(name="1f1b-async", vertical_sync=True)
    assert "async" not in plan_to_dict(_plan())  # flushing plans are unchanged
    doc["schedule"]["actions"]["0"] = list(reversed(doc["schedule"]["actions"]["0"]))
    with pytest.raises(InputError, match="generated, not edited"):
        plan_spec(plan_from_dict(doc))


def test_cli_simulates_async_and_refuses_bad_flags(tmp_path, capsys):
    from graphpipe.plan import write_plan

    path = str(tmp_path / "p.json")
    write_plan(path, _plan())
    assert main(["simulate", path, "--schedule", "2bw", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "2bw" and out["async"]["update_every"] == 6 and out["stashed_versions"] == [[1]] * 3
    cases = [(["--vertical-sync"], "--vertical-sync is for the asynchronous"),
             (["--schedule", "1f1b", "--vertical-sync"], "schedule '1f1b' flushes"),
             (["--schedule", "2bw", "--update-every", "0"], "must be >= 1"),
             (["--schedule", "2bw", "--vertical-sync"], "--vertical-sync is for 1f1b-async"),
             (["--schedule", "2bw", "--update-every", "1"], "needs version")]
    for flags, message in cases:
        assert main(["simulate", path, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("model", ["transformer", "candle-uno"])
def test_async_steady_state_is_never_below_the_flush_on_pipedream_plans(model):
    """Acceptance: PipeDream's plans at 4/8/16 devices (round-robin replicas among them); the stream drops the
    flush bubble and pays each update's all-reduce, and still beats the flushing 1F1B (PipeDream-Flush)."""
    from graphpipe.frontend import zoo
    from graphpipe.search.planner import make_plan

    graph = zoo.load_graph(model)
    for n in (4, 8, 16):
        plan = make_plan(model, graph, preset("v100", n), 16 * n, "pipedream", schedule="1f1b")
        for name in ("1f1b-async", "2bw"):
            figures = with_async(plan, async_spec_for(name, plan.stage_graph)).predicted
            assert figures["throughput"] >= plan.predicted["throughput"], (model, n, name)
            assert figures["max_peak_memory_bytes"] >= plan.predicted["max_peak_memory_bytes"]


def test_run_refuses_2bw_whose_m_does_not_divide_the_streamed_micro_batches(tmp_path, capsys):
    from graphpipe.frontend import zoo
    from graphpipe.plan import write_plan

    graph = zoo.load_graph("transformer:small")
    sg = StageGraph.build(graph, [Stage(0, tuple(range(3)), (0,), 2), Stage(1, tuple(range(3, graph.num_ops)), (1,), 2)],
                          8, 2)
    cluster = preset("v100", 2)
    plan = Plan(model="transformer:small", stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("1f1b", sg, cluster))
    path = str(tmp_path / "p.json")
    write_plan(path, with_async(plan, async_spec_for("2bw", sg, update_every=8)))
    assert main(["run", path, "--steps", "3"]) == 2  # 3 steps x 4 micro-batches = 12, not a multiple of 8
    err = capsys.readouterr().err
    assert "needs a multiple of 8 micro-batches" in err and err.count("\n") == 1
    # switching back to a flushing schedule drops the async options
    out = str(tmp_path / "flush.json")
    assert main(["simulate", path, "--schedule", "1f1b", "--out", out]) == 0
    assert "async" not in json.loads(open(out).read())
