"""`graphpipe eval all --quick` end to end: results, figures, and a report whose numbers are the results'."""

from __future__ import annotations

import json
import os

import pytest

from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.evals import check_gpp_vs_spp
from graphpipe.models import load_model
from graphpipe.search.planner import make_plan

EXPERIMENTS = ("throughput", "search-time", "branches", "ablation", "case-study", "memory", "fidelity", "zero-bubble",
               "async-throughput", "staleness")
TABLE_ONLY = ("memory-runtime",)  # a table, no figure


def _parse_tables(report: str) -> dict[str, list[list[str]]]:
    """First markdown table of every '## name' section, as rows of cell strings (header first)."""
    tables: dict[str, list[list[str]]] = {}
    section, state = None, "done"
    for line in report.splitlines():
        if line.startswith("## "):
            section, state = line[3:].strip(), "looking"
        elif line.startswith("|") and state in ("looking", "in"):
            state = "in"
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set("".join(cells)) <= {"-"}:
                continue  # the header's separator row
            tables.setdefault(section, []).append(cells)
        elif state == "in":
            state = "done"
    return tables


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evals")
    assert main(["eval", "all", "--quick", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_every_experiment_writes_results_and_a_figure(quick_run):
    for name in EXPERIMENTS:
        with open(os.path.join(quick_run, "results", f"{name}.json")) as fh:
            res = json.load(fh)
        assert res["experiment"] == name
        assert res["rows"], name
        assert res["environment"]["git_sha"]
        assert res["config"]["quick"] is True
        assert os.path.getsize(os.path.join(quick_run, f"{name}.png")) > 5000, name


def test_report_numbers_are_the_result_files_numbers(quick_run):
    from graphpipe.evals.report import TABLE_COLUMNS, fmt, _rows_for_table

    with open(os.path.join(quick_run, "REPORT.md")) as fh:
        report = fh.read()
    tables = _parse_tables(report)
    for name in EXPERIMENTS + TABLE_ONLY:
        with open(os.path.join(quick_run, "results", f"{name}.json")) as fh:
            res = json.load(fh)
        cols = TABLE_COLUMNS[name]
        table = tables[name]
        assert table[0] == [c[0] for c in cols]
        rows = _rows_for_table(name, res)
        assert len(table) - 1 == len(rows), name
        for cells, row in zip(table[1:], rows):
            assert cells == [fmt(row.get(key)) for _, key in cols], (name, cells)
        assert f"![{name}]({name}.png)" in report or name in TABLE_ONLY


def test_quick_memory_runtime_measures_what_the_model_predicts(quick_run):
    """The quick memory-runtime point: --check passes, measured within 10% of predicted on every device,
    and re-materialization lowers the fullest device (mmt's gpp plan keeps several micro-batches in flight)."""
    with open(os.path.join(quick_run, "results", "memory-runtime.json")) as fh:
        res = json.load(fh)
    assert {r["recompute"] for r in res["rows"]} == {"none", "all"}
    for r in res["rows"]:
        assert r["check"] and r["memory_error"] <= 0.10, r
    assert res["summary"]["all_below_none"] == res["summary"]["pairs"] >= 1


def test_quick_throughput_orders_strategies_like_the_simulator(quick_run):
    """The eval ranks the strategies as independent plans ranked by the simulator do, and gpp comes first.

    Each strategy is planned again here (deterministic search) and its plan
    simulated afresh under its own schedule; the throughputs recorded by the
    eval must give the same order (and the same figures), and gpp, whose
    space contains the sequential plans' costs, is never below the best SPP.
    """
    from graphpipe.cluster import preset
    from graphpipe.sched import simulate
    from graphpipe.search.planner import make_plan
    from graphpipe.frontend.zoo import load_graph

    with open(os.path.join(quick_run, "results", "throughput.json")) as fh:
        res = json.load(fh)
    groups: dict[tuple, list] = {}
    for r in res["rows"]:
        groups.setdefault((r["model"], r["devices"], r["batch_size"]), []).append(r)
    assert groups
    for (model, devices, batch), rows in groups.items():
        cluster = preset("v100", devices)
        graph = load_graph(model, device=cluster.device)
        recorded, simulated = {}, {}
        for r in rows:
            if not r["feasible"]:
                continue
            plan = make_plan(model, graph, cluster, batch, r["strategy"])
            timeline = simulate(plan.stage_graph, plan.schedule, plan.cluster)
            recorded[r["strategy"]] = r["throughput"]
            simulated[r["strategy"]] = batch / timeline.iteration_time_s
        assert "gpp" in recorded, (model, devices)
        by_eval = sorted(recorded, key=lambda s: (-round(recorded[s], 6), s))
        by_simulator = sorted(simulated, key=lambda s: (-round(simulated[s], 6), s))
        assert by_eval == by_simulator, (model, devices, recorded, simulated)
        for strategy in recorded:
            assert recorded[strategy] == pytest.approx(simulated[strategy], rel=1e-9)
        assert recorded["gpp"] >= max(recorded.values()) * (1 - 1e-9), (model, devices, recorded)


def test_unknown_experiment_is_refused(capsys):
    assert main(["eval", "nonsense", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("graphpipe: error: unknown experiment 'nonsense'")


@pytest.mark.parametrize("first_s,runs", [(0.5, 5), (61.0, 1)])
def test_search_time_repeats_a_search_unless_one_run_is_long(monkeypatch, first_s, runs):
    """Medians of ``repeats`` searches; a search over ``single_run_over_s`` is timed once (Piper on mmt)."""
    from types import SimpleNamespace

    from graphpipe.evals import experiments

    times = iter([first_s, 0.3, 0.1, 0.2, 0.4])
    calls = []

    def fake_plan(*args):
        calls.append(args)
        return SimpleNamespace(search={"time_s": next(times)}), {"feasible": True}

    monkeypatch.setattr(experiments, "_try_plan", fake_plan)
    row = experiments._search_time("mmt", 8, 128, "piper", 5, single_run_over_s=60.0)
    assert len(calls) == runs and row["repeats"] == runs
    assert row["search_time_s"] == (first_s if runs == 1 else 0.3)


def test_bootstrap_interval_brackets_the_median_and_is_reproducible():
    import random
    import statistics

    from graphpipe.evals.bench_runtime import bootstrap_ci

    rng = random.Random(3)
    values = [rng.gauss(1.0, 0.1) for _ in range(9)]
    lo, hi = bootstrap_ci(values)
    assert min(values) <= lo <= statistics.median(values) <= hi <= max(values)
    assert bootstrap_ci(values) == [lo, hi]
    assert bootstrap_ci([2.0] * 5) == [2.0, 2.0]  # no spread, no width
    wide, narrow = bootstrap_ci(values, level=0.95), bootstrap_ci(values, level=0.5)
    assert wide[0] <= narrow[0] <= narrow[1] <= wide[1]


def test_runtime_prediction_on_a_shared_host():
    """No slowdown: the plain simulator. One core for four ranks: every action's time, back to back."""
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.sched import simulate

    from graphpipe.evals.bench_runtime import plan_for, predict_calibrated

    spec = "candle-uno:small,branches=4,layers=2,hidden=64,features=32"
    graph = zoo.load_graph(spec)
    cluster = preset("v100", 4)
    plan = plan_for(spec, graph, cluster, 32, "gpp")
    alone = simulate(plan.stage_graph, plan.schedule, cluster)
    flat = {"slowdown": {"1": 1.0, "2": 1.0, "4": 1.0}}
    t, slowdown, busy = predict_calibrated(plan, plan.stage_graph.graph, flat)
    assert (t, slowdown) == (pytest.approx(alone.iteration_time_s), pytest.approx(1.0))
    assert busy == pytest.approx(sum(alone.busy_s) / alone.iteration_time_s)
    one_core = {"slowdown": {"1": 1.0, "2": 2.0, "4": 4.0}}
    t1, slowdown1, busy1 = predict_calibrated(plan, plan.stage_graph.graph, one_core)
    assert t1 >= sum(alone.busy_s) * (1 - 1e-9)  # at most one unit of work per second
    assert slowdown1 > 1  # gpp runs branches at once, and they share the core
    assert busy1 / slowdown1 <= 1 + 1e-9  # dedicated-time work per second of the iteration


def _write_sweep(out, rows):
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    with open(os.path.join(out, "results", "gpp_vs_spp.json"), "w") as f:
        json.dump({"rows": rows}, f)


def test_sweep_recheck_passes_on_the_same_plans_and_fails_on_a_moved_one(tmp_path, capsys):
    n = 2
    graph = load_model("twobranch", device=preset("v100", 1).device).graph
    truth = make_plan("twobranch", graph, preset("v100", n), 16 * n, "gpp").predicted["throughput"]
    out = str(tmp_path)
    _write_sweep(out, [{"model": "twobranch", "devices": n, "gpp": truth}])
    assert check_gpp_vs_spp.main(["--recheck", "--out", out]) == 0
    assert "1 points, 0 moved" in capsys.readouterr().out
    _write_sweep(out, [{"model": "twobranch", "devices": n, "gpp": truth * 1.01}])
    assert check_gpp_vs_spp.main(["--recheck", "--out", out]) == 1
    assert "MOVED" in capsys.readouterr().out


def test_saved_bytes_on_cpu_at_fp32_are_what_capture_charges():
    """The diagnostic's reference setting measures the memory model's own input: one forward on CPU at fp32
    saves the graph's summed act_bytes per sample (capture measures them on meta with the CPU kernels' saves).
    At capture's example batch (4): a tensor whose size does not depend on the batch (transformer's position
    ids) is charged per sample as its bytes over that batch."""
    from graphpipe.frontend import zoo
    from graphpipe.evals.saved_bytes import compare, saved_by_op

    for spec in ("mmt:small", "transformer:small", "candle-uno:small"):
        charged = sum(op.act_bytes for op in zoo.load_graph(spec).ops)
        assert sum(saved_by_op(spec, "cpu", "fp32", batch_size=4).values()) == charged * 4, spec
    # bf16: autocast's weight copies are model state (not counted, as in the runtime's meter), so bf16 keeps
    # less, and exactly what capture charges at --precision bf16
    bf16 = compare("candle-uno:small", batch_size=4)
    assert bf16["total_bytes"]["cpu/bf16"] < bf16["total_bytes"]["cpu/fp32"]
    charged = sum(op.act_bytes for op in zoo.load_graph("candle-uno:small", precision="bf16").ops)
    assert bf16["total_bytes"]["cpu/bf16"] == charged * 4
    assert any(key.endswith(":bfloat16") for key in bf16["differs"]["cpu/bf16"])


def test_runtime_bench_compares_torch_on_a_plan_it_runs():
    """(c) of the runtime bench hands one plan to our executor and to torch.distributed.pipelining, which
    refuses re-materializing stages; GPipe's own default (recompute all) once broke the bench there."""
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.runtime import RunOptions, preflight

    from graphpipe.evals.bench_runtime import torch_comparable_plan

    spec = "transformer:small,layers=4,hidden=32,seq=8,heads=2,ffn=64,vocab=64"
    plan = torch_comparable_plan(spec, zoo.load_graph(spec), preset("v100", 4), 32)
    assert plan.schedule.name == "1f1b" and plan.stage_graph.num_stages == 4
    assert not any(s.recompute for s in plan.stage_graph.stages)
    preflight(plan, RunOptions(baseline="torch"))  # raises InputError on a recomputing stage


def test_the_gpu_overlap_check_runs_on_cpu_ranks_and_compares_equal_losses(tmp_path):
    """``evals/overlap_sends.py`` (part 3 of ``evals/gpu_check.sh``) smoke-tested on two gloo ranks: a GPU check
    that breaks is found only when a device is lent, so its CPU mode runs here. Its loss comparison once read
    ``Pipeline.step``'s tensors into a set (tensors hash by identity) and always said the modes differed."""
    import json

    from graphpipe.evals.overlap_sends import main

    assert main(["--out", str(tmp_path), "--model", "transformer:small,layers=2,hidden=32,seq=8,heads=2,ffn=64,vocab=64",
                 "--steps", "2", "--batch-size", "8"]) in (0, None)
    row = json.loads((tmp_path / "results" / "overlap_sends-cpu.json").read_text())["rows"][0]
    assert row["losses_equal"] is True
    assert len(row["early_step_s"]) == len(row["at_use_step_s"]) == 2
