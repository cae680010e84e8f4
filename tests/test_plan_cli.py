"""``graphpipe plan``: output, --json/--out, atomic writes, --compare, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import branches_graph, chain_graph
from graphpipe.cli import main
from graphpipe.graph import graph_to_dict, write_json_atomic
from graphpipe.plan import read_plan
from graphpipe.sched import validate_schedule


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "branches.json"
    write_json_atomic(str(path), graph_to_dict(branches_graph(3, 2)))
    return str(path)


def _run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors exit from inside the parser
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphpipe: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_table_output(capsys, model_file):
    code, out, _ = _run(capsys, "plan", model_file, "--devices", "4", "--batch-size", "32")
    assert code == 0
    assert "gpp plan" in out and "iteration time" in out and "throughput" in out and "peak memory" in out
    assert "search time" in out and "in-flight" in out


def test_json_out_and_determinism(capsys, model_file, tmp_path):
    out_path = str(tmp_path / "plan.json")
    code, out, _ = _run(capsys, "plan", model_file, "-n", "4", "-b", "32", "--json", "--out", out_path)
    assert code == 0
    doc = json.loads(out)
    assert doc["format"] == "graphpipe.plan/1" and doc["strategy"] == "gpp"
    plan = read_plan(out_path)
    validate_schedule(plan.stage_graph, plan.schedule)
    with open(out_path) as fh:
        assert json.load(fh)["stages"] == doc["stages"]
    code, out2, _ = _run(capsys, "plan", model_file, "-n", "4", "-b", "32", "--json")
    doc2 = json.loads(out2)
    for d in (doc, doc2):
        d["search"] = {k: v for k, v in d["search"].items() if not k.endswith("time_s")}
    assert doc == doc2


def test_failed_command_leaves_existing_file_untouched(capsys, model_file, tmp_path):
    out_path = tmp_path / "plan.json"
    out_path.write_text("precious\n")
    code, _, err = _run(capsys, "plan", model_file, "-n", "2", "-b", "32", "--memory-gb", "0.001",
                        "--out", str(out_path))
    _one_line_error(code, err, "no plan fits in 0.001 GB per device; the smallest needs")
    assert out_path.read_text() == "precious\n"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []


@pytest.mark.parametrize("argv,fragment", [
    (("--devices", "0", "--batch-size", "8"), "--devices must be >= 1"),
    (("--devices", "2", "--batch-size", "0"), "--batch-size must be a positive integer"),
    (("--devices", "2", "--batch-size", "-4"), "--batch-size must be a positive integer"),
    (("--devices", "2", "--batch-size", "abc"), "invalid int value"),
    (("--devices", "2", "--batch-size", "8", "--micro-batch-size", "3"), "does not divide the batch size 8"),
    (("--devices", "2", "--batch-size", "8", "--cluster", "tpu"), "unknown cluster"),
])
def test_bad_inputs_are_one_line_errors(capsys, model_file, argv, fragment):
    code, _, err = _run(capsys, "plan", model_file, *argv)
    _one_line_error(code, err, fragment)


def test_more_devices_than_usable(capsys, tmp_path):
    path = str(tmp_path / "chain.json")
    write_json_atomic(path, graph_to_dict(chain_graph(2)))
    # whole copies (tensor parallelism would use every device: --tp auto splits the chain's layers)
    code, out, err = _run(capsys, "plan", path, "-n", "8", "-b", "2", "--tp", "1", "--shard", "none", "--json")
    assert code == 0
    doc = json.loads(out)
    used = doc["search"]["devices_used"]
    assert used < 8 and doc["search"]["unused_devices"] == 8 - used
    assert f"uses {used} of 8 devices" in err


def test_compare_includes_piper_refusal(capsys, tmp_path):
    path = str(tmp_path / "wide.json")
    write_json_atomic(path, graph_to_dict(branches_graph(9, 4)))  # (4+1)^9 ~ 2M downsets > 200k
    code, out, _ = _run(capsys, "plan", path, "-n", "8", "-b", "32", "--compare", "--json")
    assert code == 0
    rows = json.loads(out)["results"]
    # each strategy's row (--tp/--shard auto), then its PP-only row (--tp 1 --shard none)
    assert [r["strategy"] for r in rows] == [f"{s}{v}" for s in ("gpp", "pipedream", "piper", "gpipe")
                                             for v in ("", " pp-only")]
    keys = {"strategy", "feasible", "throughput", "iteration_time_s", "search_time_s", "num_stages", "depth",
            "peak_memory_bytes", "error"}
    assert all(set(r) == keys for r in rows)
    by = {r["strategy"]: r for r in rows}
    assert by["piper"]["feasible"] is False and "downsets" in by["piper"]["error"]
    assert by["gpp"]["feasible"] and by["pipedream"]["feasible"]
    assert all(by[s]["throughput"] >= by[f"{s} pp-only"]["throughput"] * (1 - 1e-9)
               for s in ("gpp", "pipedream", "gpipe"))  # layouts include PP-only: never worse
    code, table, _ = _run(capsys, "plan", path, "-n", "8", "-b", "32", "--compare")
    assert code == 0 and "piper" in table and "downsets" in table and "vs gpp" in table


def test_zoo_model_plan(capsys):
    pytest.importorskip("torch")
    code, out, _ = _run(capsys, "plan", "twobranch:small", "-n", "4", "-b", "16", "--strategy", "pipedream")
    assert code == 0 and "pipedream plan" in out


def test_profile_costs_are_applied(capsys, model_file, tmp_path):
    profile = {"format": "graphpipe.profile/1", "model": "branches", "device": "cpu", "batch_sizes": [1, 2],
               "ops": {"b0_0": {"fwd_s": [0.5, 0.25], "bwd_s": [1.0, 0.5]}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    code, out, _ = _run(capsys, "plan", model_file, "-n", "2", "-b", "8", "--profile", str(path), "--json")
    assert code == 0
    ops = {op["name"]: op for op in json.loads(out)["graph"]["ops"]}
    assert ops["b0_0"]["fwd_s"] == [0.5, 0.25] and ops["b0_0"]["bwd_s"] == [1.0, 0.5]
    profile["ops"] = {"no_such_op": profile["ops"]["b0_0"]}
    path.write_text(json.dumps(profile))
    code, _, err = _run(capsys, "plan", model_file, "-n", "2", "-b", "8", "--profile", str(path))
    _one_line_error(code, err, "no_such_op")


def test_compare_streams_rows_and_stops_slow_baselines(capsys, model_file):
    import multiprocessing

    code, out, err = _run(capsys, "plan", model_file, "-n", "4", "-b", "16", "--compare",
                          "--baseline-time-limit", "1e-6")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("strategy") and [ln.split()[0] for ln in lines[1:]] == \
        [s for s in ("gpp", "pipedream", "piper", "gpipe") for _ in ("", " pp-only")]  # each with its PP-only row
    assert "stopped" not in lines[1] and "stopped" not in lines[2]  # gpp is never stopped
    assert all("stopped after 1e-06 s" in ln for ln in lines[3:])
    assert multiprocessing.active_children() == []  # the stopped searches left nothing behind


@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_baseline_time_limit_must_be_positive(capsys, model_file, value):
    code, _, err = _run(capsys, "plan", model_file, "-n", "4", "-b", "16", "--compare", "--baseline-time-limit", value)
    _one_line_error(code, err, "--baseline-time-limit")


def test_compare_writes_the_gpp_plan(capsys, model_file, tmp_path):
    out_path = str(tmp_path / "gpp.json")
    code, out, _ = _run(capsys, "plan", model_file, "-n", "4", "-b", "16", "--compare", "--out", out_path)
    assert code == 0 and f"wrote {out_path}" in out
    plan = read_plan(out_path)
    assert plan.strategy == "gpp"
    gpp_row = next(ln for ln in out.splitlines() if ln.startswith("gpp "))
    assert f"{plan.predicted['throughput']:.2f}" in gpp_row


def test_per_device_memory_line_writes_a_run_of_replicas_once():
    """At 1024 devices the table's memory line would list 1024 numbers: runs of 4+ equal ones are 'v xN'."""
    from graphpipe.cli.plan_cmd import _runs

    assert _runs(["1.00"] * 4 + ["2.00"] + ["3.00"] * 3 + ["1.00"] * 5) == "1.00 x4 2.00 3.00 3.00 3.00 1.00 x5"
    assert _runs([]) == "" and _runs(["5.00"]) == "5.00"
    values = [f"{v:.2f}" for v in (1, 1, 2, 2, 2, 2, 2, 7)]
    expanded = [w for part in _runs(values).replace(" x", "x").split()
                for w in ([part.split("x")[0]] * int(part.split("x")[1]) if "x" in part else [part])]
    assert expanded == values  # nothing lost or reordered
