"""``plan --virtual-stages``: K x V stages taking the strategy's device groups in turn, for interleaved schedules.

Oracles: the balanced cut equals brute force over every cut of a small chain
(per-group times, groups of different sizes); every plan's figures equal the
simulator's on its own stages and schedule, with stage ``s`` on group
``s mod K``; ``auto`` equals the best of the explicit counts; the numerics
(loss and every gradient equal to one process) are in the slow test at the end.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from graphpipe.frontend import zoo
from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.errors import InputError
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import looped_chain, make_schedule, simulate, validate_plan
from graphpipe.search.common import SearchOptions
from graphpipe.search.planner import TIMING_KEYS, make_plan

from conftest import chain_graph


def _error_line(err: str) -> str:
    """The one error line of a refused command (progress notes, such as a first capture's, may precede it)."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("graphpipe: capturing")]
    assert len(lines) == 1 and lines[0].startswith("graphpipe: error: ") and "Traceback" not in err, err
    return lines[0]


def _random_chain(seed: int, n: int) -> OpGraph:
    rng = random.Random(seed)
    ops = [Op(f"l{i}", "x", Affine(rng.uniform(0, 1e-4), rng.uniform(1e-4, 1e-3)),
              Affine(rng.uniform(0, 1e-4), rng.uniform(1e-4, 2e-3)), 1e6, 1e4, 1e3) for i in range(n)]
    return OpGraph.build(f"r{seed}", ops, [(f"l{i}", f"l{i + 1}", 1e3) for i in range(n - 1)])


@pytest.mark.parametrize("seed", range(6))
def test_looped_cut_equals_brute_force(seed):
    """The cut's slowest stage (its time per micro-batch on its group's replicas) is the least over every cut."""
    rng = random.Random(seed)
    n = rng.randint(5, 8)
    graph = _random_chain(seed, n)
    groups = [(0, 1), (2,)] if seed % 2 else [(0,), (1,)]
    virtual, mb = 2, 4
    sg = looped_chain(graph, groups, virtual, 8, mb, num_devices=3)
    k = len(groups)

    def slowest(bounds):
        return max(sum(graph.fwd_time((i,), mb / len(groups[s % k])) + graph.bwd_time((i,), mb / len(groups[s % k]))
                       for i in range(bounds[s], bounds[s + 1])) for s in range(len(bounds) - 1))

    best = min(slowest((0, *cuts, n)) for cuts in itertools.combinations(range(1, n), k * virtual - 1))
    got = slowest([0] + [st.op_ids[0] for st in sg.stages[1:]] + [n])
    assert got == pytest.approx(best, rel=1e-6)
    assert [st.devices for st in sg.stages] == [tuple(groups[s % k]) for s in range(k * virtual)]
    assert sorted(i for st in sg.stages for i in st.op_ids) == list(range(n))
    assert sg.is_chain() and sg.sequential


@pytest.mark.parametrize("strategy", ["gpipe", "pipedream", "piper", "gpp"])
@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb"])
def test_plans_take_the_groups_in_turn_and_simulate_as_predicted(strategy, schedule):
    graph = chain_graph(8)
    cluster = preset("v100", 2)
    plan = make_plan("chain.json", graph, cluster, 16, strategy, SearchOptions(micro_batch_size=2), schedule=schedule,
                     virtual_stages=2)
    validate_plan(plan)
    sg = plan.stage_graph
    assert plan.schedule.name == schedule and sg.num_stages == 4 and plan.search["virtual_stages"] == 2
    groups = [st.devices for st in sg.stages[:2]]
    assert len(set(groups)) == 2 and [st.devices for st in sg.stages] == groups * 2
    assert {st.micro_batch_size for st in sg.stages} == {2}
    tl = simulate(sg, make_schedule(schedule, sg, cluster), cluster)
    assert plan.predicted.iteration_time_s == pytest.approx(tl.iteration_time_s, rel=1e-12)
    assert max(tl.peak_memory_bytes) <= cluster.memory_bytes


def test_auto_is_the_best_of_the_explicit_counts_and_says_why():
    graph = chain_graph(8)
    cluster = preset("v100", 2)
    options = SearchOptions(micro_batch_size=1)
    auto = make_plan("chain.json", graph, cluster, 16, "gpipe", options, virtual_stages="auto")
    tried = auto.search["virtual_stages_tried"]
    assert sorted(tried) == ["1", "2", "4"]  # 8 ops: at most 4 stages per group of 2
    flat = make_plan("chain.json", graph, cluster, 16, "gpipe", options)
    throughputs = {1: flat.predicted.throughput}
    for v in (2, 4):
        throughputs[v] = make_plan("chain.json", graph, cluster, 16, "gpipe", options, virtual_stages=v).predicted.throughput
    best = max(throughputs.values())
    winner = min(v for v, t in throughputs.items() if t >= best * (1 - 1e-9))
    assert auto.search["virtual_stages"] == winner and tried[str(winner)].startswith("won: ")
    assert auto.predicted.throughput == pytest.approx(best, rel=1e-12)
    # naming the schedule asks for virtual stages: one per group is not tried
    named = make_plan("chain.json", graph, cluster, 16, "gpipe", options, schedule="interleaved")
    assert sorted(named.search["virtual_stages_tried"]) == ["2", "4"] and named.stage_graph.num_stages >= 4


def test_plans_are_deterministic():
    graph = chain_graph(8)
    runs = [make_plan("chain.json", graph, preset("v100", 4), 32, "pipedream", virtual_stages="auto",
                      schedule="interleaved-zb") for _ in range(2)]
    from graphpipe.plan import plan_to_dict

    docs = [plan_to_dict(p) for p in runs]
    for doc in docs:
        for key in TIMING_KEYS:
            doc["search"].pop(key, None)
    assert docs[0] == docs[1]


def test_a_plan_that_leaves_devices_idle_interleaves_over_all_of_them():
    """On a small model the strategy's fastest flat plan may use one of two devices; the user asked for two."""
    graph = zoo.load_graph("transformer:small")
    plan = make_plan("transformer:small", graph, preset("v100", 2), 8, "gpipe", SearchOptions(micro_batch_size=2),
                     schedule="interleaved", virtual_stages=2)
    assert [st.devices for st in plan.stage_graph.stages] == [(0,), (1,), (0,), (1,)]


def test_refusals_name_the_cause():
    graph = chain_graph(3)
    with pytest.raises(InputError, match="3 ops cannot make 4 stages"):
        make_plan("chain.json", graph, preset("v100", 2), 8, "gpipe", schedule="interleaved", virtual_stages=2)
    with pytest.raises(InputError, match="--virtual-stages 2 places stages in turn for the interleaved"):
        make_plan("chain.json", chain_graph(8), preset("v100", 2), 8, "gpipe", schedule="1f1b", virtual_stages=2)
    with pytest.raises(InputError, match="--schedule interleaved runs 2 or more virtual stages"):
        make_plan("chain.json", chain_graph(8), preset("v100", 2), 8, "gpipe", schedule="interleaved", virtual_stages=1)
    # between the flat 1F1B plan's peak and the interleaved one's (more micro-batches in flight on device 0)
    small = preset("v100", 2)
    options = SearchOptions(recompute="none", micro_batch_size=1)
    flat = make_plan("chain.json", chain_graph(8), small, 8, "pipedream", options, monotone=False)
    looped = make_plan("chain.json", chain_graph(8), small, 8, "pipedream", options, schedule="interleaved",
                       virtual_stages=2, monotone=False)
    assert flat.predicted.max_peak_memory_bytes < looped.predicted.max_peak_memory_bytes
    from dataclasses import replace

    memory = (flat.predicted.max_peak_memory_bytes + looped.predicted.max_peak_memory_bytes) / 2
    tight = replace(small, device=replace(small.device, memory_bytes=memory))
    with pytest.raises(InputError, match=r"V=2: needs [\d.]+ GB on a device at best \(micro-batch 1\)"):
        make_plan("chain.json", chain_graph(8), tight, 8, "pipedream", options, schedule="interleaved",
                  virtual_stages=2, monotone=False)
    auto = make_plan("chain.json", chain_graph(8), tight, 8, "pipedream", options, virtual_stages="auto",
                     monotone=False)  # what fits wins, and the table says why the others lost
    assert auto.search["virtual_stages"] in (1, 4) and "needs" in auto.search["virtual_stages_tried"]["2"]


@pytest.mark.parametrize("argv,message", [
    (["--virtual-stages", "0"], "--virtual-stages must be a positive integer or auto, got '0'"),
    (["--virtual-stages", "two"], "--virtual-stages must be a positive integer or auto"),
    (["--virtual-stages", "2", "--schedule", "zbv"], "--schedule zbv runs its own layout"),
    (["--virtual-stages", "2", "--compare"], "--compare runs every strategy with its own schedule; drop --virtual-stages"),
    (["--virtual-stages", "2"], "gpp's plan runs stages side by side (stages 0, 1 all feed stage 2)"),
])
def test_cli_refusals_are_one_line_exit_2(capsys, argv, message):
    assert main(["plan", "mmt:small", "--devices", "4", "--batch-size", "8", *argv]) == 2
    assert message in _error_line(capsys.readouterr().err)


def test_cli_table_and_json_say_which_count_won(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["plan", "transformer:small,layers=6", "--devices", "2", "--batch-size", "8", "--strategy", "pipedream",
                 "--virtual-stages", "auto", "--out", out]) == 0
    table = capsys.readouterr().out
    line = next(l for l in table.splitlines() if l.startswith("virtual stages"))
    doc = json.load(open(out))
    v = doc["search"]["virtual_stages"]
    assert line.startswith(f"virtual stages  {v} per device group; tried: V=1: ") and "won: " in line
    assert doc["schedule"]["name"] == ("interleaved" if v > 1 else "1f1b")
    assert len(doc["stages"]) == 2 * v


@pytest.mark.slow
def test_interleaved_plans_train_as_one_process_in_both_runtimes():
    """`plan --virtual-stages` plans, interleaved and interleaved-zb, run under --check in graphpipe's runtime
    and in torch's (ScheduleInterleaved1F1B; interleaved-zb from its CSV in _PipelineScheduleRuntime); a plan
    whose groups are replicated runs in graphpipe's."""
    from graphpipe.runtime import RunOptions, run_plans

    graph = zoo.load_graph("transformer:small,layers=6")
    plans = [make_plan(zoo.canonical_spec("transformer:small,layers=6"), graph, preset("v100", 2), 8, strategy,
                       SearchOptions(micro_batch_size=2, recompute="none"), schedule=schedule, virtual_stages=v)
             for strategy, schedule, v in (("pipedream", "interleaved", 2), ("gpipe", "interleaved-zb", 2),
                                           ("piper", "interleaved", 4))]
    assert [p.stage_graph.num_stages for p in plans] == [4, 4, 8]
    jobs = [(p, RunOptions(steps=2, check=True, timeout_s=120, baseline=baseline)) for p in plans
            for baseline in (None, "torch")]
    results = run_plans(jobs, 2)
    for (plan, options), result in zip(jobs, results):
        check = result.check
        assert check.passed and check.num_params_checked == check.num_params > 0, (plan.schedule.name, check)
        if options.baseline:
            expected = "ScheduleInterleaved1F1B" if plan.schedule.name == "interleaved" else "CSV of interleaved-zb"
            assert expected in result.baseline, result.baseline

    # PipeDream's groups of two replicas each (split micro-batches), on a model with two towers relayed
    # along the chain: graphpipe's runtime (torch's has no replicas)
    mmt = make_plan(zoo.canonical_spec("mmt:small"), zoo.load_graph("mmt:small"), preset("v100", 4), 16, "pipedream",
                    SearchOptions(micro_batch_size=4), schedule="interleaved", virtual_stages=2)
    assert [len(st.devices) for st in mmt.stage_graph.stages] == [2, 2, 2, 2]
    (result,) = run_plans([(mmt, RunOptions(steps=2, check=True, timeout_s=120))], 4)
    assert result.check.passed and result.check.num_params_checked == result.check.num_params > 0


def test_a_v_layout_takes_a_smaller_micro_batch_when_the_strategys_is_too_large(tmp_path, capsys):
    """DualPipeV needs a micro-batch per stage: at batch 10 on 4 devices (8 stages) the V is cut at micro-batch 1,
    the largest size that gives it 8, with a note; a forced size is kept and refused in one line."""
    out = str(tmp_path / "v.json")
    args = ["plan", "transformer:small,layers=6", "--devices", "4", "--batch-size", "10", "--schedule", "dualpipev"]
    assert main(args + ["--out", out]) == 0
    assert "at micro-batch size 1 (gpp's 10 is too large for it)" in capsys.readouterr().err
    doc = json.load(open(out))
    assert {st["micro_batch_size"] for st in doc["stages"]} == {1} and len(doc["stages"]) == 8
    assert main(args + ["--micro-batch-size", "5", "--tp", "1", "--shard", "none"]) == 2
    assert "dualpipev needs at least as many micro-batches as stages (8)" in _error_line(capsys.readouterr().err)


def test_auto_keeps_a_graph_plan_flat_and_says_why():
    """gpp's plan of two branches side by side cannot take groups in turn: auto keeps it (V = 1) with the
    reason, where an explicit count is refused."""
    graph = zoo.load_graph("mmt:small")
    cluster = preset("v100", 4)
    flat = make_plan("mmt:small", graph, cluster, 8, "gpp")
    auto = make_plan("mmt:small", graph, cluster, 8, "gpp", virtual_stages="auto")
    assert not flat.stage_graph.is_chain()
    assert auto.stage_graph == flat.stage_graph and auto.search["virtual_stages"] == 1
    assert "side by side" in auto.search["virtual_stages_tried"]["2"]
    with pytest.raises(InputError, match="side by side"):
        make_plan("mmt:small", graph, cluster, 8, "gpp", virtual_stages=2)


MLP = '''import torch, torch.nn as nn

def build():
    layers = []
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 4)), (torch.randn(8, 16),), lambda out: out.pow(2).mean()
'''


@pytest.mark.slow
def test_a_factory_model_plans_interleaved_and_trains_as_one_process_in_torchs_runtime(tmp_path):
    """A model of the user's own (a factory with no target) through the CLI: `plan --schedule interleaved`, then
    `run --check` in graphpipe's runtime and with --baseline torch (whose reference runs the module on the
    inputs alone)."""
    (tmp_path / "mlp.py").write_text(MLP)
    out = str(tmp_path / "p.json")
    assert main(["plan", f"{tmp_path / 'mlp.py'}:build", "--devices", "2", "--batch-size", "8",
                 "--micro-batch-size", "2", "--schedule", "interleaved", "--out", out]) == 0
    from graphpipe.plan import read_plan
    from graphpipe.runtime import RunOptions, run_plans

    plan = read_plan(out)
    assert plan.stage_graph.num_stages >= 4 and plan.schedule.name == "interleaved"
    results = run_plans([(plan, RunOptions(steps=2, check=True, timeout_s=120, baseline=b)) for b in (None, "torch")],
                        2)
    for result in results:
        assert result.check.passed and result.check.num_params_checked == result.check.num_params > 0
