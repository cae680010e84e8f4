"""``graphpipe inspect`` through ``graphpipe.cli.main``: counts equal the files'
own, SP status matches the profiles' README, bad input is one line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from conftest import PROFILE_NAMES, branches_graph, non_sp_graph
from graphpipe.cli import main
from graphpipe.graph import graph_to_dict, write_json_atomic

README_SP = {"alexnet": True, "vgg16": True, "resnet18": True, "resnet50": True, "inception_v3": True,
             "nasnetamobile": False, "gnmt": False}


def run_json(capsys, *argv):
    assert main(["inspect", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def assert_one_line_error(capsys, argv, fragment):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphpipe: error: "), captured.err
    assert "Traceback" not in captured.err and fragment in lines[0]


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_profiles_counts_and_series_parallel(profiles_dir, capsys, name):
    path = os.path.join(profiles_dir, name, "graph.txt")
    with open(path, encoding="utf-8") as fh:
        lines = [ln for ln in fh.read().splitlines() if ln.strip()]
    doc = run_json(capsys, path)
    assert doc["num_ops"] == sum(not ln.startswith("\t") for ln in lines)
    assert doc["num_edges"] == sum(ln.startswith("\t") for ln in lines)
    assert doc["series_parallel"] is README_SP[name]
    assert len(doc["ops"]) == doc["num_ops"]
    assert doc["fwd_s_per_sample"] == pytest.approx(sum(o["fwd_s"] for o in doc["ops"]))
    assert doc["param_bytes"] == pytest.approx(sum(o["param_bytes"] for o in doc["ops"]))
    assert bool(doc["merged"]) is not README_SP[name]


def test_graph_json_table_and_json_agree(tmp_path, capsys):
    graph = branches_graph(3, 2)
    path = str(tmp_path / "g.json")
    write_json_atomic(path, graph_to_dict(graph))
    doc = run_json(capsys, path)
    assert doc["num_branches"] == 3 and doc["series_parallel"] is True
    assert doc["num_ops"] == graph.num_ops and doc["num_edges"] == graph.num_edges
    # t(1) = alpha + beta of every op, summed
    assert doc["fwd_s_per_sample"] == pytest.approx(sum(op.fwd.alpha + op.fwd.beta for op in graph.ops))
    assert doc["bwd_s_per_sample"] == pytest.approx(sum(op.bwd.alpha + op.bwd.beta for op in graph.ops))
    assert [o["name"] for o in doc["ops"]] == [op.name for op in graph.ops]
    assert main(["inspect", path]) == 0
    table = capsys.readouterr().out
    for op in graph.ops:
        assert op.name in table
    assert "series-parallel    yes" in table and "parallel branches  3" in table


def test_non_sp_graph_json_reports_contraction(tmp_path, capsys):
    path = str(tmp_path / "n.json")
    write_json_atomic(path, graph_to_dict(non_sp_graph()))
    doc = run_json(capsys, path)
    assert doc["series_parallel"] is False and doc["merged"]
    assert doc["num_ops_after_contraction"] < doc["num_ops"]
    assert main(["inspect", path]) == 0
    assert "series-parallel    no" in capsys.readouterr().out


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    assert_one_line_error(capsys, ["inspect", str(tmp_path / "missing.json")], "no such file")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert_one_line_error(capsys, ["inspect", str(bad_json)], "not valid JSON")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "other/9", "ops": [], "edges": []}))
    assert_one_line_error(capsys, ["inspect", str(wrong)], "unsupported format")
    cyc = tmp_path / "graph.txt"
    line = "{} -- Linear -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=4.0, parameter_size=0.0"
    cyc.write_text("\n".join([line.format("a"), line.format("b"), "\ta -- b", "\tb -- a"]) + "\n")
    assert_one_line_error(capsys, ["inspect", str(cyc)], "cycle")
    bad_txt = tmp_path / "bad" / "graph.txt"
    bad_txt.parent.mkdir()
    bad_txt.write_text("node1 -- Linear -- forward_compute_time=x\n")
    assert_one_line_error(capsys, ["inspect", str(bad_txt.parent)], f"{bad_txt}:1:")


ZOO_READY = importlib.util.find_spec("graphpipe.frontend.zoo") is not None and importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(not ZOO_READY, reason="graphpipe.frontend.zoo (or torch) not available")
def test_unknown_zoo_model_lists_known_ones(capsys):
    assert_one_line_error(capsys, ["inspect", "no-such-model"], "mmt")


@pytest.mark.skipif(not ZOO_READY, reason="graphpipe.frontend.zoo (or torch) not available")
@pytest.mark.parametrize("spec,branches", [("mmt", 4), ("candle-uno", 7)])
def test_zoo_models_branch_counts(capsys, spec, branches):
    """Paper configs (Appendix A.2): MMT has 4 modality branches, CANDLE-Uno 7 feature branches."""
    doc = run_json(capsys, spec)
    assert doc["series_parallel"] is True
    assert doc["num_branches"] == branches


def test_the_analytical_per_op_figure_is_explained(capsys):
    """Under the analytical preset every small op reads about alpha (the device's fixed cost per call): the note
    says what the figure is made of, with the device's alpha."""
    assert main(["inspect", "twobranch:small"]) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("note: fwd s/sample is the analytical t(1)")]
    assert len(note) == 1 and "alpha = 2e-05 s, V100-16GB's fixed cost of one layer call" in note[0]
    assert "so they read alike" in note[0] and "graphpipe profile" in note[0]
