"""A schedule provably slower than a bound is not timed to the end (engine give_up_after, gpp's idle-device pass).

Oracles: the full simulation (score without a limit) and the idle-device pass / whole gpp search with every
trial timed to the end.
"""

from __future__ import annotations

import os

import pytest

from graphpipe.cluster import preset
from graphpipe.errors import GraphpipeError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import make_schedule
from graphpipe.sched import simulator
from graphpipe.sched.simulator import score
from graphpipe.search import gpp
from graphpipe.search.common import SearchOptions
from graphpipe.search.gpp import _Candidate, _score_best, _spread_idle, _to_stage_graph, partition
from graphpipe.search.gpp_solve import min_bottleneck

from test_sched_simulator import SCORED_SCHEDULES, _plans_to_score


def _scored_schedules():
    """(plan name, stage graph, cluster, schedule name, schedule) of every schedule the search scores, on the
    simulator tests' plans."""
    for name, sg, cluster in _plans_to_score():
        for schedule_name in SCORED_SCHEDULES:
            try:
                yield name, sg, cluster, schedule_name, make_schedule(schedule_name, sg, cluster)
            except GraphpipeError:
                continue


def test_score_gives_up_only_on_a_schedule_ending_after_the_limit():
    """Every answer with a limit is the full answer, or None when the full iteration really ends later."""
    gave_up = compared = 0
    for name, sg, cluster, schedule_name, schedule in _scored_schedules():
        full = score(sg, schedule, cluster)
        for factor in (0.3, 0.9, 0.999, 1.0, 1.001, 2.0):
            limit = full.iteration_time_s * factor
            simulator._LAST_RUN.clear()  # the kept run would answer without the engine
            got = score(sg, schedule, cluster, give_up_after=limit)
            if got is None:
                assert full.iteration_time_s > limit, (name, schedule_name, factor)
                gave_up += 1
            else:
                assert got == full, (name, schedule_name, factor)
            if factor >= 1.0:
                assert got == full, (name, schedule_name, factor)
            compared += 1
    assert compared >= 300 and gave_up >= 50  # the limit bites well before the end on most schedules


def test_drain_tails_are_at_most_what_each_device_waits_for_after_its_last_action():
    """The oracle is the full timeline: every device's last action ends at least its tail before the last action
    of the iteration, on every scored schedule (zero-bubble ones included, whose W ends a device with no tail)."""
    from graphpipe.sched.engine import drain_tails
    from graphpipe.sched.simulator import _engine_inputs, simulate

    checked = positive = 0
    for name, sg, cluster, schedule_name, schedule in _scored_schedules():
        _, duration, _ = _engine_inputs(sg, cluster)
        timeline = simulate(sg, schedule, cluster)
        last = {}
        for rec in timeline.actions:
            last[rec.device] = max(last.get(rec.device, 0.0), rec.end)
        end = max(last.values())
        tails = drain_tails(sg, schedule.device_actions, duration)
        for d, acts in enumerate(schedule.device_actions):
            if acts:
                assert last[d] + tails[d] <= end * (1 + 1e-12), (name, schedule_name, d)
                checked += 1
                positive += tails[d] > 0
    assert checked >= 300 and positive >= 100


def _best_timing_both(sg, cluster, host=None, above=None):
    """_score_best's rule with both schedules simulated to the end: the faster that fits, ties to graph-1F1B."""
    from graphpipe.search.common import simulated_fitting

    best = None
    for schedule in (gpp.STRATEGY.default_schedule, gpp.FILL_DRAIN):
        simulator._LAST_RUN.clear()
        throughput = simulated_fitting(sg, cluster, schedule, host)
        if throughput is not None and (best is None or throughput > best[0] * (1 + 1e-12)):
            best = (throughput, schedule)
    return best


def _timed_to_the_end(monkeypatch):
    """gpp with every idle-device trial, and both schedules of each, simulated to the end (the unpruned search)."""
    monkeypatch.setattr(gpp, "_score_best", _best_timing_both)


def test_score_best_equals_both_schedules_timed_to_the_end():
    """Fill-drain stops as soon as it provably cannot beat graph-1F1B; the answer is the one timing both fully,
    and with a floor ``above`` it is that answer, or None only when that answer is provably below the floor."""
    compared = 0
    for name, sg, cluster in _plans_to_score():
        want = _best_timing_both(sg, cluster)
        simulator._LAST_RUN.clear()
        assert _score_best(sg, cluster) == want, name
        for factor in (0.5, 0.999, 1.0, 1.001, 1.5):
            if want is None:
                continue
            simulator._LAST_RUN.clear()
            got = _score_best(sg, cluster, above=want[0] * factor)
            if got is None:
                assert want[0] < want[0] * factor, (name, factor)
            else:
                assert got == want, (name, factor)
            compared += 1
    assert compared >= 50


def _spread(graph, cluster, batch, micro_batch):
    start = min_bottleneck(graph, cluster, batch, micro_batch)
    cand = _Candidate(micro_batch, start.stages, start.bottleneck_tps, start.source_in_flight, 0.0)
    sg = _to_stage_graph(graph, graph, {}, cand, cluster, batch)
    before, schedule = _score_best(sg, cluster)
    return _spread_idle(sg, cluster, None, before, schedule)


@pytest.mark.parametrize("devices,batch,micro_batch", [(32, 64, 16), (48, 256, 32)])
def test_idle_pass_equals_the_pass_timing_every_trial(profiles_dir, monkeypatch, devices, batch, micro_batch):
    from graphpipe.importers.pipedream_txt import read_pipedream

    graph = read_pipedream(os.path.join(profiles_dir, "alexnet", "graph.txt"))
    cluster = preset("v100", devices)
    pruned = _spread(graph, cluster, batch, micro_batch)
    _timed_to_the_end(monkeypatch)
    full = _spread(graph, cluster, batch, micro_batch)
    assert full[3] >= 1 and pruned[:3] == full[:3]  # the same stage graph, throughput and schedule


def _llm_chain(num_layers: int, scale: float = 1.0, head: float = 1.0) -> OpGraph:
    """A decoder-only LM's shape (Llama-3-70B's per-sample costs on an H100): embedding, identical layers, head
    (``head`` times its compute: a large vocabulary's)."""
    ops = [Op("embed", "embedding", Affine(8e-6, 0.0), Affine(1.6e-5, 0.0), 4.2e9 * scale, 0.0, 4194304.0)]
    ops += [Op(f"layer{i}", "decoder", Affine(8e-6, 4.44e-4), Affine(1.6e-5, 8.88e-4), 3.42e9 * scale, 1.0e8,
               4194304.0) for i in range(num_layers)]
    ops += [Op("head", "linear", Affine(8e-6, 5.44e-4 * head), Affine(1.6e-5, 1.088e-3 * head), 4.2e9 * scale,
               7.0e7, 6.6e7)]
    names = [op.name for op in ops]
    return OpGraph.build("llm", ops, [(a, b, 4194304.0) for a, b in zip(names, names[1:])])


@pytest.mark.parametrize("num_layers,devices,batch,scale,recompute", [
    (8, 64, 256, 1.0, "none"), (12, 48, 128, 0.5, "all"), (16, 96, 512, 1.0, "none"), (8, 32, 128, 1.0, "all")])
def test_gpp_plans_equal_the_search_timing_every_trial(monkeypatch, num_layers, devices, batch, scale, recompute):
    """Models whose idle-device pass runs trials (the DP's plan leaves devices idle; the pass tries 2-8 splits)."""
    graph, cluster, options = _llm_chain(num_layers, scale), preset("h100", devices), SearchOptions(recompute=recompute)
    pruned = partition(graph, cluster, batch, options)
    _timed_to_the_end(monkeypatch)
    full = partition(graph, cluster, batch, options)
    assert pruned.stage_graph == full.stage_graph and pruned.schedule_name == full.schedule_name
    assert pruned.stats["throughput_estimate"] == full.stats["throughput_estimate"]


def test_gpipe_time_bound_is_at_most_the_simulated_iteration():
    """The fill-drain bound (gpp skips a fill-drain run it proves slower than the floor) never exceeds the
    simulated iteration, and is that iteration where nothing waits on a transfer (within rounding)."""
    from graphpipe.sched.generators import gpipe_time_bound_s

    bounded = tight = 0
    heavy_head = [(f"llm{n}-head{h}", *_llm_stage_graph(n, h)) for n in (4, 8) for h in (3.0, 20.0)]
    for name, sg, cluster in _plans_to_score() + [(f"llm{n}", *_llm_stage_graph(n)) for n in (2, 4, 8)] + heavy_head:
        bound = gpipe_time_bound_s(sg, cluster)
        if bound is None:
            continue
        simulator._LAST_RUN.clear()
        full = score(sg, make_schedule("gpipe", sg, cluster), cluster).iteration_time_s
        assert bound <= full * (1 + 1e-9), name
        bounded += 1
        tight += bound >= full * (1 - 1e-9)
        if name.startswith("llm"):  # a chain on one node: the slowest stage's backwards, then the drain to stage 0
            assert bound >= full * (1 - 1e-6), name
    assert bounded >= 12 and tight >= 1


def _llm_stage_graph(num_stages: int, head: float = 1.0):
    """A chain of stages on one device each, on devices of one node (transfers nearly free): identical layers
    two per stage, the first stage with the embedding and the last with the head (``head`` times its compute)."""
    graph = _llm_chain(2 * num_stages - 2, head=head)
    cluster = preset("h100", num_stages)
    stages = tuple(gpp.DPStage((2 * i, 2 * i + 1), 1, 1, 0.0) for i in range(num_stages))
    cand = _Candidate(8, stages, 0.0, 1, 0.0)
    return _to_stage_graph(graph, graph, {}, cand, cluster, 64), cluster
