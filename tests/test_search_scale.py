"""Search at scale: the memory guard, and what keeps large device counts cheap without moving any plan.

Behaviour only (timings live in evals/bench_scale.py): the guard stops a search past its budget with one
line naming the strategy; the cheaper forms of the searches give the answers the plain forms give; past
:data:`~graphpipe.search.planner.CANDIDATE_MAX_DEVICES` gpp says it ranked no candidates; Piper's seed past
32 devices changes nothing but speed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import branches_graph, chain_graph
from test_reliability import in_process
from graphpipe.cluster import preset
from graphpipe.errors import InputError
from graphpipe.search import linear_dp, piper
from graphpipe.search.common import SearchOptions
from graphpipe.search.memory_guard import MemoryBudgetError, memory_guard, resident_bytes, stage
from graphpipe.search.planner import CANDIDATE_MAX_DEVICES, compare, make_plan
from graphpipe.sched import make_schedule, validate_schedule
from graphpipe.stages import Stage, StageGraph


_run = in_process  # graphpipe ARGV in this process: (exit code, stdout, stderr)


# ------------------------------------------------------------------ the guard
def test_guard_stops_a_growing_block_and_names_it():
    held = []
    with pytest.raises(MemoryBudgetError) as info:
        with memory_guard("piper", resident_bytes() + 64 * 2**20):
            for _ in range(400):  # up to 4 GB, in steps the watcher sees between
                held.append(np.ones(10 * 2**20 // 8))
    held.clear()
    message = str(info.value)
    assert message.startswith("piper search stopped: the process holds ") and "--max-memory-gb" in message
    assert "\n" not in message and "--strategy gpp or pipedream" in message
    assert info.value.resident > info.value.limit


def test_guard_names_the_stage_that_runs():
    with pytest.raises(MemoryBudgetError, match=r"^gpp \(ranking piper's plan\) search stopped"):
        with memory_guard("gpp", resident_bytes() + 64 * 2**20):
            with stage("gpp (ranking piper's plan)"):
                held = [np.ones(10 * 2**20 // 8) for _ in range(400)]
                del held


def test_guard_lets_a_small_block_finish_and_nests():
    with memory_guard("gpp", resident_bytes() + 2**30):
        with memory_guard("inner", 1.0):  # inside a guard: relabels only, the outer budget stands
            total = sum(range(10_000))
    assert total == 49_995_000


def test_guard_over_budget_on_entry_fails_at_once():
    with pytest.raises(MemoryBudgetError, match="^gpipe search stopped"):
        with memory_guard("gpipe", 1.0):
            pytest.fail("the block must not run")


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_max_memory_gb_is_checked(bad):
    with pytest.raises(InputError, match="--max-memory-gb"):
        SearchOptions(max_memory_gb=bad)


@pytest.mark.parametrize("strategy", ["gpp", "pipedream", "piper", "gpipe"])
def test_tiny_budget_is_one_line_exit_2_naming_the_strategy(capsys, strategy):
    code, out, err = _run(capsys, "plan", "transformer", "--devices", "8", "--batch-size", "128", "--strategy",
                          strategy, "--max-memory-gb", "0.001")
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith(f"graphpipe: error: {strategy} search stopped: "), err
    assert "--max-memory-gb" in lines[0]


def test_tiny_budget_makes_stopped_rows_in_compare(capsys):
    rows = compare("t", chain_graph(6), preset("v100", 4), 32, SearchOptions(max_memory_gb=0.001))
    assert [r["strategy"] for r in rows] == ["gpp", "pipedream", "piper", "gpipe"]
    assert all(not r["feasible"] and "search stopped" in r["error"] for r in rows)


def test_bad_max_memory_gb_flag(capsys):
    code, _, err = _run(capsys, "plan", "transformer", "-n", "8", "-b", "128", "--max-memory-gb", "-2")
    assert code == 2 and err.strip().splitlines() == ["graphpipe: error: --max-memory-gb must be a positive "
                                                      "number of GB, got -2.0"]


def test_a_roomy_budget_changes_no_plan():
    g, cluster = branches_graph(3, 2), preset("v100", 8)
    plain = make_plan("b", g, cluster, 64)
    roomy = make_plan("b", g, cluster, 64, options=SearchOptions(max_memory_gb=1024.0))
    assert roomy.stage_graph == plain.stage_graph and roomy.predicted.throughput == plain.predicted.throughput


# ------------------------------------------------- cheaper, same answers
def _linear_reference(graph, cluster, batch_size, b, power_of_two=False, link=None):
    """linear_dp.solve's recursion over every replica count 1..N, the slow way (the oracle of its pruning)."""
    from graphpipe.costs import range_received_saved
    from graphpipe.search.common import cut_tps
    from graphpipe.search.sequential import OpArrays, ReplicaCosts, linear_cut_bytes, replica_mask

    n, num_devices, num_mbs = graph.num_ops, cluster.num_devices, batch_size // b
    max_k = min(num_devices, n, num_mbs)
    arrays, costs = OpArrays.of(graph), ReplicaCosts.of(cluster)
    ok = replica_mask(num_devices, b, power_of_two)
    cut = cut_tps(linear_cut_bytes(graph, tuple(range(n))), link, b)
    memo = {}

    def value(i, m, k):  # best bottleneck of ops i..n-1 on at most m devices as exactly k stages (k = max_k: >=)
        if i == n:
            return 0.0 if k == 0 else math.inf
        if k == 0:
            return math.inf
        key = (i, m, k)
        if key not in memo:
            best = math.inf
            for j in range(i, n):
                ops = list(range(i, j + 1))
                sa, sb = arrays.compute_alpha[ops].sum(), arrays.compute_beta[ops].sum()
                sp = arrays.params[ops].sum()
                sact = arrays.act[ops].sum() + range_received_saved(graph, tuple(range(n)), i)[j - i]
                for r in range(1, m + 1):
                    if not ok[r - 1] or costs.memory(sp, sact, r, b, k) > costs.memory_bytes:
                        continue
                    tps = max(float(costs.tps(sa, sb, sp, r, b, batch_size)), float(cut[j]))
                    follow = [value(j + 1, m - r, k - 1)]
                    if k == max_k and num_mbs == max_k:
                        follow.append(value(j + 1, m - r, max_k))
                    best = min(best, max(tps, min(follow)))
            memo[key] = best
        return memo[key]

    return min(value(0, num_devices, k) for k in range(1, max_k + 1))


@pytest.mark.parametrize("graph, devices, b", [(chain_graph(5), 6, 6), (chain_graph(4), 12, 12),
                                                (branches_graph(2, 2), 8, 4), (chain_graph(6), 10, 2)])
def test_linear_dp_over_allowed_replicas_matches_every_count(graph, devices, b):
    """Only replica counts dividing ``b`` are searched now; the optimum over every count 1..N is the same."""
    for memory in (16e9, 2e8):
        cluster = preset("v100", devices).with_memory(memory)
        got = linear_dp.solve(graph, cluster, 48, b)
        want = _linear_reference(graph, cluster, 48, b)
        if math.isinf(want):
            assert got is None
        else:
            assert got is not None and got.bottleneck_tps == pytest.approx(want, rel=1e-12)
            assert all(b % r == 0 for _, r in got.stages) and sum(r for _, r in got.stages) <= devices


def test_linear_dp_in_chunks_equals_one_chunk(monkeypatch):
    graph, cluster = branches_graph(3, 3), preset("v100", 16)
    whole = [linear_dp.solve(graph, cluster, 64, b) for b in (1, 4, 16)]
    monkeypatch.setattr(linear_dp, "CHUNK_CELLS", 1)  # one stage end at a time
    assert [linear_dp.solve(graph, cluster, 64, b) for b in (1, 4, 16)] == whole


@pytest.mark.parametrize("devices", [40, 64])
def test_piper_prefix_seed_finds_the_same_optimum(devices):
    """Past 32 devices Piper starts from the best prefix chain; the optimum is the one it finds unseeded."""
    graph, cluster = branches_graph(2, 3), preset("v100", devices).with_memory(4e9)
    for b in (1, 2, 8):
        seeded = piper.solve(graph, cluster, 4 * devices, b)
        unseeded = piper.solve(graph, cluster, 4 * devices, b, seed=np.inf)
        assert (seeded is None) == (unseeded is None)
        if seeded is not None:
            assert seeded.bottleneck_tps == pytest.approx(unseeded.bottleneck_tps, rel=1e-8)


def test_piper_prefix_lattice_is_the_chains_of_the_order():
    graph = branches_graph(2, 2)
    lat = piper.Lattice.prefixes(graph)
    assert lat.num_downsets == graph.num_ops + 1
    assert lat.num_pairs == (graph.num_ops + 1) * graph.num_ops // 2
    assert [lat.ops_of(0, d) for d in range(1, lat.num_downsets)] == [tuple(range(k)) for k in
                                                                       range(1, graph.num_ops + 1)]


@pytest.mark.parametrize("replicas, num_mbs", [(3, 7), (4, 4), (2, 9)])
def test_round_robin_replicas_get_their_own_micro_batches_in_order(replicas, num_mbs):
    g = chain_graph(2)
    stages = [Stage(0, (0,), tuple(range(replicas)), 2, replica_mode="round-robin"), Stage(1, (1,), (replicas,), 2)]
    sg = StageGraph.build(g, stages, 2 * num_mbs, replicas + 1, sequential=True)
    sched = make_schedule("1f1b", sg, preset("v100", replicas + 1))
    validate_schedule(sg, sched)
    for d in range(replicas):
        acts = sched.device_actions[d]
        assert {a.mb_id % replicas for a in acts} <= {d}
        assert sorted(a.mb_id for a in acts if a.kind == "F") == list(range(d, num_mbs, replicas))


# ------------------------------------------------------------- candidates
def test_gpp_ranks_candidates_up_to_the_limit_and_says_when_it_does_not():
    g = chain_graph(6)
    within = make_plan("c", g, preset("v100", CANDIDATE_MAX_DEVICES), 16 * CANDIDATE_MAX_DEVICES)
    assert "candidates_skipped" not in within.search
    past = make_plan("c", g, preset("v100", 2 * CANDIDATE_MAX_DEVICES), 32 * CANDIDATE_MAX_DEVICES)
    assert past.search["space"] == "gpp" and "past 32 devices" in past.search["candidates_skipped"]


def test_plans_at_scale_are_deterministic():
    g = branches_graph(3, 3)
    one, two = (make_plan("b", g, preset("v100", 256), 4096) for _ in range(2))
    assert one.stage_graph == two.stage_graph and one.predicted.throughput == two.predicted.throughput


@pytest.mark.parametrize("strategy", ["gpp", "piper"])
def test_transformer_on_1024_devices_plans(strategy):
    """Piper on the zoo's transformer at 1024 devices: was a linear-DP seed of tens of GB, now a plan."""
    from graphpipe.models import load_model

    graph = load_model("transformer", preset("v100", 1).device).graph
    plan = make_plan("transformer", graph, preset("v100", 1024), 16 * 1024, strategy)
    assert plan.predicted.throughput > 0 and plan.predicted.max_peak_memory_bytes <= 16e9 + 1
    validate_schedule(plan.stage_graph, plan.schedule)


def test_piper_past_32_devices_refuses_work_it_cannot_finish(capsys):
    """mmt-shaped: 4 branches of 8 ops, ~4 million downset pairs x 11 micro-batch sizes at 64 devices."""
    graph = branches_graph(4, 8, name="mmt-like")
    with pytest.raises(InputError, match=r"downset pairs x 11 micro-batch sizes to score on 64 devices, more than "
                                         r"the 10,000,000 Piper searches past 32 devices.*at most 32 devices"):
        piper.partition(graph, preset("v100", 64), 1024, SearchOptions())
    rows = compare("mmt-like", graph, preset("v100", 64), 1024)
    assert [r["feasible"] for r in rows] == [True, True, False, True]
    assert "Piper searches past 32 devices" in rows[2]["error"]


# ------------------------------------------------------------------ the eval
def test_bench_scale_rows_say_how_each_search_ended(tmp_path):
    from graphpipe.evals import bench_scale
    from graphpipe.evals.common import write_result
    from graphpipe.evals.report import TABLE_COLUMNS, _rows_for_table, build_report, fmt

    g = chain_graph(6)
    ok = bench_scale.run_point(g, "chain", "gpp", 64, repeat=2, timeout_s=120)
    assert ok["outcome"] == "ok" and ok["runs"] == 2 and ok["throughput"] > 0 and ok["peak_rss_gb"] > 0
    assert ok["min_search_s"] <= ok["median_search_s"] <= ok["max_search_s"]
    slow = bench_scale.run_point(g, "chain", "gpp", 64, repeat=3, timeout_s=0.001)
    assert slow["outcome"] == "timeout" and slow["runs"] == 1   # a run that times out is not repeated
    refused = bench_scale.run_point(branches_graph(4, 8, name="mmt-like"), "mmt-like", "piper", 64, 1, 120)
    assert refused["outcome"] == "refused" and "Piper searches past 32 devices" in refused["error"]
    write_result(str(tmp_path), "bench_scale", {"load_average": [1.0, 1.0, 1.0]}, [ok, refused])
    report = build_report(str(tmp_path))
    assert "## bench_scale" in report and "1 plans, 1 one-line refusals, 0 timeouts" in report
    rows = _rows_for_table("bench_scale", {"rows": [ok, refused]})
    assert "| " + " | ".join(fmt(rows[0].get(k)) for _, k in TABLE_COLUMNS["bench_scale"]) + " |" in report
