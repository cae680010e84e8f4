"""Shortcuts for models of many identical layers: plans equal those found without them (the oracle).

* ``search/repeats.py``: stages of identical layers pose one DP problem, solved once
  (gpp's idle-device split, :func:`graphpipe.search.gpp._spread_idle`);
* ``score(..., memory_limit=)``: a schedule whose peak memory, taken from its action order, is over
  the device's is refused without the timed simulation; the peak from the action order is the timed
  events' peak bit for bit when every action takes time;
* ``score(..., give_up_after=)``: gpp's idle-device pass stops timing a trial once a device provably ends
  after the best so far.
"""

from __future__ import annotations

import pytest

from graphpipe.cluster import preset
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import make_schedule
from graphpipe.sched.simulator import predicted_figures, score, simulate
from graphpipe.search.repeats import cost_signature
from graphpipe.sp import induced_subgraph


def _chain(costs: list[tuple[float, float]]) -> OpGraph:
    ops = [Op(f"op{i}", "layer", Affine(0.0, f), Affine(0.0, b), param_bytes=1e6, act_bytes=1e3, out_bytes=1e3)
           for i, (f, b) in enumerate(costs)]
    return OpGraph.build("chain", ops, [(f"op{i}", f"op{i + 1}", 1e3) for i in range(len(ops) - 1)])


def test_equal_signatures_are_the_same_subgraph_renamed():
    """Property: two op sets with equal signatures induce subgraphs equal once names are dropped; a changed
    cost, kind or edge gives another signature."""
    g = _chain([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 3.0)])
    sets = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 1, 2), (1, 2, 3)]

    def unnamed(ids):
        sub = induced_subgraph(g, list(ids))
        return [(o.kind, o.fwd, o.bwd, o.param_bytes, o.act_bytes, o.out_bytes, o.wgrad) for o in sub.ops], sub.edges

    for a in sets:
        for b in sets:
            assert (cost_signature(g, a) == cost_signature(g, b)) == (unnamed(a) == unnamed(b)), (a, b)
    assert cost_signature(g, (0, 1)) == cost_signature(g, (2, 3))
    assert cost_signature(g, (2, 3)) != cost_signature(g, (3, 4))  # op4's backward differs
    other_kind = OpGraph.build("k", [Op("a", "layer"), Op("b", "norm")], [("a", "b", 1.0)])
    same_kind = OpGraph.build("k", [Op("a", "layer"), Op("b", "layer")], [("a", "b", 1.0)])
    assert cost_signature(other_kind, (0, 1)) != cost_signature(same_kind, (0, 1))
    no_edge = OpGraph.build("k", [Op("a", "layer"), Op("b", "layer")], [])
    assert cost_signature(no_edge, (0, 1)) != cost_signature(same_kind, (0, 1))


def _plans(model: str, graph, cluster, batch_size: int):
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    return make_plan(model, graph, cluster, batch_size, "gpp", SearchOptions())


def _without_shortcuts(monkeypatch):
    """Undo the shortcuts: every stage its own DP problem, every schedule timed to the end before its memory is
    read (no ``memory_limit``, no ``give_up_after``)."""
    import graphpipe.search.gpp as gpp
    import graphpipe.search.planner as planner
    from graphpipe.search.common import simulated

    def timed_fitting(sg, cluster, schedule_name, host=None, above=None):
        throughput, fits = simulated(sg, cluster, schedule_name, host)
        return throughput if fits else None

    monkeypatch.setattr(gpp, "cost_signature", lambda graph, op_ids: tuple(op_ids))
    monkeypatch.setattr(gpp, "simulated_fitting", timed_fitting)
    monkeypatch.setattr(planner, "simulated_fitting", timed_fitting)


def _same_plan(a, b) -> None:
    from graphpipe.plan import plan_to_dict

    da, db = plan_to_dict(a), plan_to_dict(b)
    for d in (da, db):
        d["search"] = {k: v for k, v in d["search"].items() if "time" not in k}  # wall times differ
    assert da == db


def _count_dp_solves(monkeypatch) -> dict[str, int]:
    import graphpipe.search.gpp as gpp

    counts = {"stages": 0, "solves": 0}
    signature, solve = gpp.cost_signature, gpp.min_bottleneck

    def counted_signature(*args):
        counts["stages"] += 1
        return signature(*args)

    def counted_solve(*args, **kwargs):
        counts["solves"] += 1
        return solve(*args, **kwargs)

    monkeypatch.setattr(gpp, "cost_signature", counted_signature)
    monkeypatch.setattr(gpp, "min_bottleneck", counted_solve)
    return counts


@pytest.fixture(scope="module")
def tiny_llama_graph():
    """An 8-layer Llama (meta device: no weights), captured once for the module."""
    import hf_models

    from graphpipe.frontend.capture import capture

    cfg = hf_models.llama_config(layers=8, hidden=1024, heads=8, kv_heads=4, ffn=2816, vocab=32000)
    model, inputs, loss_fn, target = hf_models.llama_meta(cfg)
    return capture(model, inputs, name="tiny-llama", loss_fn=loss_fn, example_target=target,
                   device=preset("h100", 8).device).graph


@pytest.mark.parametrize("devices,per_device", [(48, 4), (48, 8), (56, 16)])
def test_tiny_llama_plan_equals_the_plan_without_shortcuts(tiny_llama_graph, monkeypatch, devices, per_device):
    """Oracle: the same gpp plan with and without the shortcuts, where idle devices make gpp re-split
    stages of identical decoder layers (fewer DP solves than stages tried, so the shortcut is exercised)."""
    cluster = preset("h100", devices)
    with monkeypatch.context() as m:
        counts = _count_dp_solves(m)
        fast = _plans("tiny-llama", tiny_llama_graph, cluster, per_device * devices)
    assert 0 < counts["solves"] < counts["stages"], counts
    with monkeypatch.context() as m:
        _without_shortcuts(m)
        slow = _plans("tiny-llama", tiny_llama_graph, cluster, per_device * devices)
    _same_plan(fast, slow)


def test_zoo_transformer_plan_equals_the_plan_without_shortcuts(monkeypatch):
    """The zoo's GPT-style chain at the paper size: 64 V100s leave devices idle, gpp re-splits its stages."""
    from graphpipe.models import load_model

    cluster = preset("v100", 64)
    graph = load_model("transformer", cluster.device).graph
    with monkeypatch.context() as m:
        counts = _count_dp_solves(m)
        fast = _plans("transformer", graph, cluster, 4 * 64)
    assert 0 < counts["solves"] < counts["stages"], counts
    with monkeypatch.context() as m:
        _without_shortcuts(m)
        slow = _plans("transformer", graph, cluster, 4 * 64)
    _same_plan(fast, slow)


def _scored_cases():
    """Plans of the zoo's small models on 8 devices: replicated, re-materializing and plain stages."""
    from dataclasses import replace

    from graphpipe.models import load_model
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    out = []
    for model in ("mmt:small", "transformer:small", "candle-uno:small"):
        cluster = preset("v100", 8)
        graph = load_model(model, cluster.device).graph
        plan = make_plan(model, graph, cluster, 64, "gpp", SearchOptions(recompute="none"))
        sg = plan.stage_graph
        out.append((model, sg, cluster))
        out.append((f"{model}/recompute", replace(sg, stages=tuple(replace(s, recompute=True) for s in sg.stages)),
                    cluster))
    return out


def test_score_peak_from_action_order_is_the_timed_peak_and_the_limit_only_refuses_what_does_not_fit():
    """score's peak equals simulate's bit for bit (every action here takes time); with a memory limit it
    returns None exactly when that peak is over the limit, else the same Score as without one."""
    compared = 0
    for name, sg, cluster in _scored_cases():
        assert all(sg.fwd_time(s) > 0 and sg.bwd_time(s) > 0 for s in range(sg.num_stages)), name
        for schedule_name in ("gpipe", "1f1b", "graph-1f1b", "zb-h1", "graph-zb"):
            try:
                schedule = make_schedule(schedule_name, sg, cluster)
            except Exception:  # noqa: BLE001 -- a schedule this stage graph cannot have (zb-h1 on branches)
                continue
            full = predicted_figures(simulate(sg, schedule, cluster))
            got = score(sg, schedule, cluster)
            assert got.max_peak_memory_bytes == full["max_peak_memory_bytes"], (name, schedule_name)
            peak = got.max_peak_memory_bytes
            for limit in (peak * 0.5, peak * (1 - 1e-12), peak, peak * 2):
                limited = score(sg, schedule, cluster, memory_limit=limit)
                assert (limited is None) == (peak > limit), (name, schedule_name, limit)
                if limited is not None:
                    assert limited == got
            compared += 1
    assert compared >= 12


def test_a_zero_length_action_falls_back_to_the_timed_peak():
    """An op without cost gives actions of zero length, whose events may reorder at equal times: the peak then
    comes from the timed events, and still equals simulate's."""
    from graphpipe.stages import Stage, StageGraph

    ops = [Op("free", "x", act_bytes=5e3, out_bytes=1e3), Op("work", "x", Affine(0, 1.0), Affine(0, 2.0), act_bytes=1e3)]
    g = OpGraph.build("z", ops, [("free", "work", 1e3)])
    sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1, True), Stage(1, (1,), (1,), 1)], 4, 2)
    cluster = preset("v100", 2)
    for schedule_name in ("gpipe", "1f1b"):
        schedule = make_schedule(schedule_name, sg, cluster)
        full = predicted_figures(simulate(sg, schedule, cluster))
        assert score(sg, schedule, cluster).max_peak_memory_bytes == full["max_peak_memory_bytes"]
        timed = score(sg, schedule, cluster, memory_limit=0.0)  # not refused unseen: timed, and its peak is over
        assert timed is not None and timed.max_peak_memory_bytes == full["max_peak_memory_bytes"] > 0.0
