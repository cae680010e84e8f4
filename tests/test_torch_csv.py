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

from graphpipe.frontend import zoo
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
    capsys.readouterr()  # a first capture's progress note, if building the plan captured the model
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
        assert result.check.passed, result.check
        assert result.check.num_params_checked == result.check.num_params > 0
        assert "CSV of torch-csv" in result.baseline, result.baseline


# ------------------------------------------------------------------ torch's own files, written by torch's classes
def _layers(n: int):
    from graphpipe.graph import Affine, Op, OpGraph

    return OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1.0), Affine(0, 2.0), 4.0, 10.0) for i in range(n)],
                         [(f"l{i}", f"l{i + 1}", 1.0) for i in range(n - 1)])


V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
def torch_written(path, class_name: str, k: int, m: int, form: str, v: int = 2) -> str:
    """``class_name``'s schedule for ``k`` ranks and ``m`` micro-batches as torch itself writes it
    (``_dump_csv``; every rank's row), on the loop layout (stage ``s`` on rank ``s % k``) or the V."""
    from test_zero_bubble import torch_schedule

    torch_schedule(class_name, k, m, v)._dump_csv(str(path), format=form)
    return str(path)


def _layout(class_name: str, graph, k: int, m: int, mb: int = 1, v: int = 2) -> StageGraph:
    from graphpipe.sched import looped_chain, v_shape_chain

    if class_name in V_SHAPED:
        return v_shape_chain(graph, k, m * mb, mb)
    return looped_chain(graph, [(r,) for r in range(k)], v, m * mb, mb)


OURS = {"ScheduleInterleaved1F1B": "interleaved", "ScheduleInterleavedZeroBubble": "interleaved-zb",
        "ScheduleZBVZeroBubble": "zbv", "ScheduleDualPipeV": "dualpipev"}


@pytest.mark.parametrize("class_name", sorted(OURS))
@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("k,m", [(2, 4), (4, 8)])
def test_torchs_own_files_read_as_our_generators(tmp_path, class_name, form, k, m):
    """torch's compute-only and compute-and-comms files (DualPipeV's with OVERLAP_F_B pairs) read against a plan
    of the same layout give our generator's schedule, action for action, and its simulated time."""
    path = torch_written(tmp_path / "t.csv", class_name, k, m, form)
    sg = _layout(class_name, _layers(2 * k), k, m)
    cluster = preset("v100", k)
    theirs = read_torch_csv(path, sg)
    ours = make_schedule(OURS[class_name], sg, cluster)
    assert theirs.device_actions == ours.device_actions
    assert simulate(sg, theirs, cluster).iteration_time_s == simulate(sg, ours, cluster).iteration_time_s
    if class_name == "ScheduleDualPipeV":
        assert "OVERLAP_F_B" in open(path).read()
    if form == "compute_comms":
        assert "SEND_F" in open(path).read()


def test_a_file_with_merged_backwards_reads_as_whole_backwards(tmp_path):
    """torch's lowering merges an I followed at once by its W into one B (``_merge_bw``; its stored test files
    are written so): such a file is the same schedule with B there, valid, and no slower (I + W = B)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    path = torch_written(tmp_path / "zb.csv", "ScheduleInterleavedZeroBubble", 2, 8, "compute_only")
    with open(path, newline="") as f:
        rows = [[schedules._Action.from_str(c) for c in row] for row in csv.reader(f)]
    merged = [[str(a) for a in schedules._merge_bw(list(row))] for row in rows]
    sg = _layout("ScheduleInterleavedZeroBubble", _layers(4), 2, 8)
    cluster = preset("v100", 2)
    got = read_torch_csv(_write(tmp_path / "merged.csv", merged), sg)
    assert any(a.kind == "B" for acts in got.device_actions for a in acts)
    full = read_torch_csv(path, sg)
    assert simulate(sg, got, cluster).iteration_time_s <= simulate(sg, full, cluster).iteration_time_s + 1e-12


def test_the_files_micro_batch_count_travels_with_its_schedule(tmp_path, capsys):
    """A CSV written with CP-SAT's micro-batch sizes simulates on the plan it started from (sizes follow the file,
    with a note); a count the batch does not split into is refused naming it."""
    plan_path = str(tmp_path / "plan.json")
    write_plan(plan_path, chain_plan(batch=16, mb=2))
    coarse = chain_plan(batch=16, mb=8)  # what CP-SAT may choose: 2 micro-batches instead of 8
    out_csv = str(tmp_path / "coarse.csv")
    from graphpipe.sched.torch_csv import write_torch_csv

    write_torch_csv(out_csv, coarse.stage_graph, coarse.schedule)
    capsys.readouterr()
    assert main(["simulate", plan_path, "--schedule-csv", out_csv, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["iteration_time_s"] == simulate(coarse.stage_graph, coarse.schedule,
                                                                   coarse.cluster).iteration_time_s
    assert "coarse.csv runs 2 micro-batches of batch 16: micro-batch size 2 -> 8 on every stage" in captured.err
    odd = chain_plan(batch=3, mb=1)
    odd_csv = str(tmp_path / "three.csv")
    write_torch_csv(odd_csv, odd.stage_graph, odd.schedule)
    assert main(["simulate", plan_path, "--schedule-csv", odd_csv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "three.csv runs 3 micro-batches of stage 0; the plan's batch of 16 does not " \
                                      "split into 3 micro-batches" in err, err


@pytest.mark.slow
def test_torchs_runtime_runs_torchs_own_files_as_written(tmp_path):
    """Files as torch writes them, run by torch's _PipelineScheduleRuntime from the file itself under --check:
    interleaved zero bubble with comms and no REDUCE_GRAD cells (as torch's stored test files), DualPipeV's
    compute-only file with OVERLAP_F_B pairs, and a coarser-micro-batch CSV on the plan it started from."""
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.sched.torch_csv import plan_with_torch_csv, torch_file_rows, write_torch_csv

    spec = "transformer:small,layers=6"  # 8 ops: 4 stages on 2 ranks, or a V of 8 on 4
    graph = zoo.load_graph(spec)
    plans = []
    comms = torch_written(tmp_path / "zb.csv", "ScheduleInterleavedZeroBubble", 2, 8, "compute_comms")
    with open(comms, newline="") as f:
        rows = [[c for c in row if not any(x in c for x in ("REDUCE_GRAD", "UNSHARD", "RESHARD"))]
                for row in csv.reader(f)]
    for name, path, k, m in (("ScheduleInterleavedZeroBubble", _write(tmp_path / "zb-legacy.csv", rows), 2, 8),
                             ("ScheduleDualPipeV", torch_written(tmp_path / "dp.csv", "ScheduleDualPipeV", 4, 8,
                                                                 "compute_only"), 4, 8)):
        sg = _layout(name, graph, k, m)
        cluster = preset("v100", k)
        base = Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster, strategy="custom",
                    schedule=make_schedule(OURS[name], sg, cluster))
        plans.append(plan_with_torch_csv(base, path))
    start, coarse = chain_plan(batch=16, mb=2), chain_plan(batch=16, mb=8)
    coarse_csv = str(tmp_path / "coarse.csv")
    write_torch_csv(coarse_csv, coarse.stage_graph, coarse.schedule)
    plans.append(plan_with_torch_csv(start, coarse_csv))
    assert [torch_file_rows(p)[1] for p in plans] == ["compute_comms", "compute_only", "compute_only"]
    results = run_plans([(p, RunOptions(steps=2, check=True, baseline="torch", timeout_s=120)) for p in plans], 4)
    for plan, result in zip(plans, results):
        check = result.check
        assert check.passed and check.num_params_checked == check.num_params > 0, check
        assert "as written" in result.baseline, result.baseline
