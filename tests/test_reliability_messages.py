"""Issue 35, item 4 and the out-of-memory items: messages in the user's words, one line, and no partial files.

* a plan file whose stages do not partition the ops is refused naming the
  op, the stage(s) as the file numbers them, and what to change;
* a CLI error suggests CLI flags, never a Python function;
* ``MemoryError`` in any command is one line naming the verb, exit 2;
* a writer the kernel kills mid-write (SIGKILL: no Python runs) leaves the
  old file and no partial file under any name.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from graphpipe.cli import main

GRAPHPIPE = [sys.executable, "-m", "graphpipe"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    return code, err.strip()


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    """A 2-stage plan of twobranch:small (embed, branch0.*, branch1.*, concat, head) on 2 devices."""
    from graphpipe.plan import plan_to_dict
    from graphpipe.sched import make_schedule
    from graphpipe.stages import Stage, StageGraph
    from graphpipe.models import load_model
    from graphpipe.cluster import preset
    from graphpipe.plan import Plan

    cluster = preset("v100", 2)
    graph = load_model("twobranch:small", cluster.device).graph
    names = [op.name for op in graph.ops]
    half = len(names) // 2
    stages = [Stage(0, tuple(range(half)), (0,), 2), Stage(1, tuple(range(half, len(names))), (1,), 2)]
    sg = StageGraph.build(graph, stages, 4, 2, sequential=True)
    plan = Plan(model="twobranch:small", stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("1f1b", sg, cluster))
    return plan_to_dict(plan)


def _refused(capsys, tmp_path, doc: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    code, err = _cli(capsys, "simulate", str(path))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("graphpipe: error: "), err
    return err[len("graphpipe: error: "):].replace(str(path), "PLAN")


def test_an_op_listed_twice_in_one_stage(capsys, tmp_path, plan_doc):
    doc = copy.deepcopy(plan_doc)
    ops = doc["stages"][0]["ops"]
    ops.append(ops[0])
    assert _refused(capsys, tmp_path, doc) == (f"PLAN: stage 0 lists op {ops[0]!r} twice (its ops[0] and "
                                               f"ops[{len(ops) - 1}]); remove one: each op is listed once")


def test_an_op_in_two_stages(capsys, tmp_path, plan_doc):
    doc = copy.deepcopy(plan_doc)
    op = doc["stages"][0]["ops"][-1]
    doc["stages"][1]["ops"].insert(0, op)
    assert _refused(capsys, tmp_path, doc) == (f"PLAN: op {op!r} is listed in stage 0 and in stage 1; an op runs "
                                               "in exactly one stage: remove it from one of them")


def test_ops_in_no_stage(capsys, tmp_path, plan_doc):
    doc = copy.deepcopy(plan_doc)
    dropped = doc["stages"][1]["ops"][-2:]
    doc["stages"][1]["ops"] = doc["stages"][1]["ops"][:-2]
    assert _refused(capsys, tmp_path, doc) == (f"PLAN: ops {dropped[0]!r}, {dropped[1]!r} are in no stage; add each "
                                               "to the stage that runs it (every op of the graph runs in exactly "
                                               "one stage)")


def test_a_stage_id_used_twice(capsys, tmp_path, plan_doc):
    doc = copy.deepcopy(plan_doc)
    doc["stages"][1]["id"] = 0
    assert _refused(capsys, tmp_path, doc) == ("PLAN: stages[0] and stages[1] both have id 0; number the 2 stages "
                                               "0..1, each once")


def test_interleaving_error_suggests_flags_not_python(capsys, tmp_path, plan_doc):
    """The plan's 2 stages are on 2 devices of their own: no virtual stages to interleave."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    code, err = _cli(capsys, "simulate", str(path), "--schedule", "interleaved")
    assert code == 2, err
    assert "round_robin_chain" not in err and "(...)" not in err, err
    assert err == ("graphpipe: error: interleaved 1F1B needs several virtual stages per device group; all 2 stages "
                   "are on different devices: use --schedule 1f1b, or plan with --virtual-stages 2 (or auto), whose "
                   "stages take the device groups in turn (stage s on group s % K)")


@pytest.mark.parametrize("verb", ["plan", "simulate", "models"])
def test_memory_error_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, verb, plan_doc):
    """Whatever runs out of memory inside a verb, the command prints one line naming the verb and exits 2."""
    import graphpipe.cli.models_cmd as models_cmd
    import graphpipe.cli.simulate_cmd as simulate_cmd

    def exhausted(*args, **kwargs):
        raise MemoryError()

    import graphpipe.search.api as planning_api

    target = {"plan": (planning_api, "plan_with"), "simulate": (simulate_cmd, "_run"), "models": (models_cmd, "zoo_summary")}[verb]
    monkeypatch.setattr(*target, exhausted)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    argv = {"plan": ["plan", "twobranch:small", "-n", "2", "-b", "4"], "simulate": ["simulate", str(path)],
            "models": ["models"]}[verb]
    code, err = _cli(capsys, *argv)
    assert code == 2, err
    assert err == (f"graphpipe: error: {verb} ran out of memory (MemoryError): this host cannot hold the work; use "
                   "a smaller model, batch or device count, or a host with more memory"), err


KILL_MID_WRITE = """
import os, signal, sys
import graphpipe.files as files
def half_then_killed(fd, data):
    os.write(fd, data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)   # what the out-of-memory killer does: no Python runs after it
files._write_all = half_then_killed
from graphpipe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_plan_killed_while_writing_leaves_no_partial_file(tmp_path):
    """``graphpipe plan --out`` SIGKILLed in the middle of writing: the old plan file is intact and the folder
    holds nothing else (no temporary file under any name); the next plan writes normally."""
    out = tmp_path / "plan.json"
    out.write_text("previous plan\n")
    proc = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, "plan", "twobranch:small", "-n", "2", "-b", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert out.read_text() == "previous plan\n"
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
    proc = subprocess.run(GRAPHPIPE + ["plan", "twobranch:small", "-n", "2", "-b", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["format"] == "graphpipe.plan/1"
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_the_command_exits_at_once_with_its_whole_output_and_exit_code(tmp_path):
    """``graphpipe plan`` ends with os._exit (no interpreter teardown, cli.console_main): its piped stdout, which
    Python buffers (8 KiB) and os._exit would drop unflushed, arrives whole and parses, the plan file is
    complete, and a refusal still exits 2 with its one line."""
    out = tmp_path / "plan.json"
    argv = ["plan", "mmt:small", "--devices", "64", "--batch-size", "256", "--json", "--out", str(out)]
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell runs it
    proc = subprocess.run(GRAPHPIPE + argv, capture_output=True, text=True, timeout=300, env=buffered)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert json.loads(out.read_text())["strategy"] == shown["strategy"] == "gpp"
    bad = subprocess.run(GRAPHPIPE + ["plan", "mmt:small", "--devices", "0", "--batch-size", "8"],
                         capture_output=True, text=True, timeout=300, env=buffered)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("graphpipe: error: ")
