"""torch.distributed.pipelining schedule CSVs: written from our schedules, read back, run in torch's runtime.

Oracles: a written-then-read schedule is the same action lists and
simulates to the same time; every cell of a written grid waits for its
dependencies (unit steps); bad files name their cell; torch's own
``_PipelineScheduleRuntime`` executing the CSV trains equal to one process
(``--check``).
"""

from __future__ import annotations

import csv
import json

import pytest

from graphpipe import zoo
from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.errors import InputError
from graphpipe.plan import Plan, read_plan, write_plan
from graphpipe.sched import make_schedule, simulate
from graphpipe.sched.torch_csv import from_torch_rows, read_torch_csv, to_torch_rows, torch_chain_refusal
from graphpipe.stages import Stage, StageGraph

SPEC = "transformer:small"
GROUPS = (("embed", "layer0"), ("layer1",), ("layer2",), ("layer3", "head"))


def chain_plan(batch: int = 8, mb: int = 2, schedule: str = "1f1b") -> Plan:
    """transformer:small as a 4-stage chain, stage i on device i."""
    graph = zoo.load_graph(SPEC)
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), (i,), mb) for i, ops in enumerate(GROUPS)]
    sg = StageGraph.build(graph, stages, batch, len(GROUPS))
    cluster = preset("v100", len(GROUPS))
    return Plan(model=zoo.canonical_spec(SPEC), stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "graph-1f1b", "graph-zb"])
@pytest.mark.parametrize("batch,mb", [(8, 2), (16, 2), (8, 8)])
def test_rows_round_trip_and_respect_dependencies(name, batch, mb):
    plan = chain_plan(batch, mb)
    sg = plan.stage_graph
    schedule = make_schedule(name, sg, plan.cluster)
    rows = to_torch_rows(sg, schedule)
    assert len(rows) == sg.num_devices
    back = from_torch_rows(rows, sg)
    assert back.device_actions == schedule.device_actions
    assert simulate(sg, back, plan.cluster).iteration_time_s == simulate(sg, schedule, plan.cluster).iteration_time_s
    # unit steps: a cell's dependencies sit in earlier columns
    column = {cell: c for row in rows for c, cell in enumerate(row) if cell}
    for cell, c in column.items():
        s, kind, j = int(cell[0]), cell[1], int(cell[2:])
        deps = {"F": [f"{s - 1}F{j}"] if s else [],
                "W": [f"{s}I{j}"],
                "B": [f"{s}F{j}"] + ([f"{s + 1}B{j}", f"{s + 1}I{j}"] if s + 1 < sg.num_stages else []),
                "I": [f"{s}F{j}"] + ([f"{s + 1}B{j}", f"{s + 1}I{j}"] if s + 1 < sg.num_stages else [])}[kind]
        assert all(column[d] < c for d in deps if d in column), (cell, rows)
    # every action is one cell, and each row holds only its rank's stage
    assert sorted(column) == sorted(str(a) for acts in schedule.device_actions for a in acts)
    assert all(int(cell[0]) == r for r, row in enumerate(rows) for cell in row if cell)


def test_graph_plans_and_per_stage_sizes_are_refused_with_the_reason():
    graph = zoo.load_graph("twobranch:small")
    tb = (("embed",), ("branch0.layer0", "branch0.layer1"), ("branch1.layer0", "branch1.layer1"), ("concat", "head"))
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), (i,), 2) for i, ops in enumerate(tb)]
    fan_out = StageGraph.build(graph, stages, 8, 4)
    assert "fans out" in torch_chain_refusal(fan_out)
    with pytest.raises(InputError, match="cannot express this plan: stage 0 fans out"):
        to_torch_rows(fan_out, make_schedule("graph-1f1b", fan_out, preset("v100", 4)))
    plan = chain_plan()
    graph = zoo.load_graph(SPEC)
    sizes = StageGraph.build(graph, [Stage(i, tuple(graph.op_id(n) for n in ops), (i,), 2 if i else 4)
                                     for i, ops in enumerate(GROUPS)], 8, 4)
    assert "different micro-batch sizes [2, 4]" in torch_chain_refusal(sizes)
    replicated = StageGraph.build(graph, [Stage(0, tuple(graph.op_id(n) for n in GROUPS[0] + GROUPS[1]), (0, 1), 2),
                                          Stage(1, tuple(graph.op_id(n) for n in GROUPS[2] + GROUPS[3]), (2,), 2)], 8, 3)
    assert "replicated on devices [0, 1]" in torch_chain_refusal(replicated)
    assert torch_chain_refusal(plan.stage_graph) is None


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return str(path)


@pytest.mark.parametrize("edit,message", [
    (lambda rows: rows[1].__setitem__(1, "1X0"), "rank 1 (line 2), step 1: unknown action '1X0'"),
    (lambda rows: rows[2].append("1F3"), "rank 2 (line 3), step"),
    (lambda rows: rows.pop(), "has 3 rows, the plan has 4 devices"),
    (lambda rows: rows[3].__setitem__(rows[3].index("3B1"), ""), "3F1 has no backward (3B1, or 3I1 and 3W1) on any row"),
    (lambda rows: rows[0].append("0F9"), "names micro-batch 9; stage 0 has 4"),
    (lambda rows: rows[0].append("7F0"), "names stage 7; the plan has stages 0-3"),
])
def test_bad_csv_files_name_the_cell_and_exit_2(tmp_path, capsys, edit, message):
    plan = chain_plan()
    write_plan(str(tmp_path / "plan.json"), plan)
    rows = to_torch_rows(plan.stage_graph, plan.schedule)
    edit(rows)
    path = _write(tmp_path / "bad.csv", rows)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_torch_csv(path, plan.stage_graph)
    assert main(["simulate", str(tmp_path / "plan.json"), "--schedule-csv", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad.csv" in err and "Traceback" not in err, err


def test_a_stage_on_two_ranks_names_both(tmp_path):
    plan = chain_plan()
    rows = to_torch_rows(plan.stage_graph, plan.schedule)
    rows[1] = [cell.replace("1F2", "0F2") for cell in rows[1]]
    rows[0] = [cell for cell in rows[0] if cell != "0F2"]
    with pytest.raises(InputError, match=r"stage 0 is also on rank 0 \(step \d+\); a stage runs on one rank"):
        read_torch_csv(_write(tmp_path / "two.csv", rows), plan.stage_graph)


def test_compute_and_comms_files_drop_the_comms_cells(tmp_path):
    plan = chain_plan()
    rows = to_torch_rows(plan.stage_graph, plan.schedule)
    comms = [[c for cell in row for c in ((cell, f"{cell[0]}SEND_F{cell[2:]}") if cell.startswith(f"{r}F") else (cell,))]
             + [f"{r}REDUCE_GRAD"] for r, row in enumerate(rows)]
    assert read_torch_csv(_write(tmp_path / "comms.csv", comms), plan.stage_graph).device_actions \
        == plan.schedule.device_actions


def test_cli_writes_reads_and_simulates_the_same_time(tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    write_plan(plan_path, chain_plan(batch=16))
    for name in ("1f1b", "zb-h1", "cpsat"):
        out_csv, out_plan = str(tmp_path / f"{name}.csv"), str(tmp_path / f"{name}.json")
        args = ["simulate", plan_path, "--schedule", name, "--torch-csv", out_csv, "--out", out_plan, "--json"]
        capsys.readouterr()
        assert main(args + (["--time-limit", "5"] if name == "cpsat" else [])) == 0
        written_time = json.loads(capsys.readouterr().out)["iteration_time_s"]
        written = read_plan(out_plan)
        # CP-SAT may change micro-batch sizes: its CSV goes with the plan it wrote
        back = read_torch_csv(out_csv, written.stage_graph)
        assert back.device_actions == written.schedule.device_actions
        assert main(["simulate", out_plan, "--schedule-csv", out_csv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["iteration_time_s"] == written_time, name


@pytest.mark.slow
def test_torchs_runtime_executes_our_csvs_equal_to_one_process(tmp_path):
    """1F1B, ZB-H1 and a CP-SAT schedule, each as a CSV in torch's _PipelineScheduleRuntime on 4 CPU ranks."""
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.sched.torch_csv import plan_with_torch_csv, write_torch_csv
    from graphpipe.search.cpsat import optimize_plan

    plans = []
    for name in ("1f1b", "zb-h1", "cpsat"):
        plan = chain_plan(batch=16, schedule="1f1b" if name == "cpsat" else name)
        if name == "cpsat":
            plan = optimize_plan(plan, time_limit_s=5)
        path = str(tmp_path / f"{name}.csv")
        write_torch_csv(path, plan.stage_graph, plan.schedule)
        plans.append(plan_with_torch_csv(plan, path))
    results = run_plans([(p, RunOptions(steps=2, check=True, baseline="torch", timeout_s=120)) for p in plans], 4)
    for plan, result in zip(plans, results):
        assert result["check"]["passed"], result["check"]
        assert result["check"]["num_params_checked"] == result["check"]["num_params"] > 0
        assert "CSV of torch-csv" in result["baseline"], result["baseline"]
