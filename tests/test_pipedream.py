"""PipeDream graph.txt importer: every shared profile loads with the file's own
counts, unit conversions follow the README, malformed lines name path:line."""

from __future__ import annotations

import os
import re

import pytest

from conftest import PROFILE_NAMES
from graphpipe.errors import FormatError, GraphCycleError, InputError
from graphpipe.importers.pipedream_txt import parse_pipedream, read_pipedream

LINE = ("{node} -- {desc} -- forward_compute_time={fwd}, backward_compute_time={bwd}, "
        "activation_size={act}, parameter_size={params}")


def node_line(node, desc="Linear(4, 4)", fwd="1.0", bwd="2.0", act="256.0", params="80.0"):
    return LINE.format(node=node, desc=desc, fwd=fwd, bwd=bwd, act=act, params=params)


def file_counts(text: str) -> tuple[int, int]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return sum(not ln.startswith("\t") for ln in lines), sum(ln.startswith("\t") for ln in lines)


def expected_activation(field: str) -> float:
    """Oracle: activation_size as written, a number or the sum of a [a; b] list."""
    field = field.strip()
    if field.startswith("["):
        return sum(float(x) for x in field.strip("[]").split(";"))
    return float(field)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_every_profile_loads_with_file_counts_and_costs(profiles_dir, name):
    path = os.path.join(profiles_dir, name, "graph.txt")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    graph = read_pipedream(path)
    num_nodes, num_edges = file_counts(text)
    assert (graph.num_ops, graph.num_edges) == (num_nodes, num_edges)
    assert graph.name == name
    # per-op conversion, checked against each node line independently of the parser
    act_of = {}
    has_input = {ln.split(" -- ")[1].strip() for ln in text.splitlines() if ln.startswith("\t")}
    for line in text.splitlines():
        if not line.strip() or line.startswith("\t"):
            continue
        node, desc = line.split(" -- ")[:2]
        fields = dict(kv.split("=", 1) for kv in line.rsplit(" -- ", 1)[1].split(", "))
        op = graph.ops[graph.op_id(node)]
        act_of[node] = expected_activation(fields["activation_size"])
        assert op.fwd.alpha == 0 and op.bwd.alpha == 0
        # Input sources are data loading: zeroed, as the real optimizer does.
        free = desc.startswith("Input") and node not in has_input
        assert op.fwd.beta == pytest.approx(0.0 if free else float(fields["forward_compute_time"]) / 1000 / 128)
        assert op.bwd.beta == pytest.approx(0.0 if free else float(fields["backward_compute_time"]) / 1000 / 128)
        assert op.act_bytes == pytest.approx(act_of[node] / 128)
        assert op.out_bytes == op.act_bytes
        assert op.param_bytes == pytest.approx(0.0 if free else float(fields["parameter_size"]))
    for line in text.splitlines():
        if line.startswith("\t"):
            src, dst = (x.strip() for x in line.split(" -- "))
            assert graph.edge_bytes(graph.op_id(src), graph.op_id(dst)) == pytest.approx(act_of[src] / 128)


def test_known_counts_and_kinds(profiles_dir):
    counts = {"vgg16": (41, 41), "resnet50": (177, 193), "gnmt": (48, 58)}
    for name, expected in counts.items():
        g = read_pipedream(os.path.join(profiles_dir, name))  # a folder works too
        assert (g.num_ops, g.num_edges) == expected
    vgg = read_pipedream(os.path.join(profiles_dir, "vgg16", "graph.txt"))
    kinds = {op.kind for op in vgg.ops}
    assert {"Conv2d", "ReLU", "MaxPool2d", "Linear"} <= kinds
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in kinds)
    gnmt = read_pipedream(os.path.join(profiles_dir, "gnmt", "graph.txt"))
    assert len(gnmt.sources()) == 4 and len(gnmt.sinks()) == 9  # README


def test_vgg16_batch_size_arithmetic(profiles_dir):
    """README: a 128x112x112 fp32 activation over batch 128 is 128*112*112*4 bytes per sample."""
    g = read_pipedream(os.path.join(profiles_dir, "vgg16", "graph.txt"))
    assert any(op.act_bytes == 128 * 112 * 112 * 4 for op in g.ops)
    g64 = read_pipedream(os.path.join(profiles_dir, "vgg16", "graph.txt"), batch_size=64)
    assert g64.ops[0].fwd.beta == pytest.approx(2 * g.ops[0].fwd.beta)


def test_list_activation_and_kinds_parsed():
    text = "\n".join([node_line("node1", "Input0", "0.0", "0.0", "0.0", "0.0"),
                      node_line("node2", "LSTM(4, 4)", act="[100.0; 28.0]"),
                      "\tnode1 -- node2"]) + "\n"
    g = parse_pipedream(text, batch_size=4)
    assert [op.kind for op in g.ops] == ["Input", "LSTM"]
    assert g.ops[1].act_bytes == 32.0 and g.edges[0].bytes == 0.0
    assert g.ops[1].fwd.beta == pytest.approx(1.0 / 1000 / 4)


@pytest.mark.parametrize("lines,lineno,fragment", [
    ([node_line("node1", fwd="abc")], 1, "forward_compute_time='abc' is not a number"),
    ([node_line("node1", fwd="-1")], 1, "non-negative"),
    ([node_line("node1", fwd="nan")], 1, "finite"),
    ([node_line("node1", act="[1.0; 2.0")], 1, "closing"),
    ([node_line("node1"), "node2 -- Linear"], 2, "node line must be"),
    ([node_line("node1"), "node2 -- Linear -- forward_compute_time=1.0"], 2, "lacks backward_compute_time"),
    ([node_line("node1"), node_line("node1")], 2, "defined twice"),
    ([node_line("node1"), "\tnode1 -- node9"], 2, "unknown node 'node9'"),
    ([node_line("node1"), "\tnode1 node9"], 2, "edge line must be"),
    ([node_line("node1"), node_line("node2"), "\tnode1 -- node2", "\tnode1 -- node2"], 4, "duplicate edge"),
    ([node_line("node1"), "\tnode1 -- node1", node_line("node2")], 3, "after the edge lines"),
])
def test_malformed_line_names_path_and_line(tmp_path, lines, lineno, fragment):
    path = tmp_path / "graph.txt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError) as info:
        read_pipedream(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:{lineno}:"), message
    assert fragment in message


def test_cycle_missing_file_and_empty(tmp_path):
    path = tmp_path / "graph.txt"
    path.write_text("\n".join([node_line("a"), node_line("b"), "\ta -- b", "\tb -- a"]) + "\n")
    with pytest.raises(GraphCycleError, match="a -> b -> a|b -> a -> b"):
        read_pipedream(str(path))
    with pytest.raises(InputError, match="no such file"):
        read_pipedream(str(tmp_path / "missing.txt"))
    path.write_text("\n")
    with pytest.raises(FormatError, match="no node lines"):
        read_pipedream(str(path))
    with pytest.raises(InputError, match="batch_size"):
        parse_pipedream(node_line("a"), batch_size=0)


def test_input_sources_cost_nothing_and_are_reported(profiles_dir):
    """alexnet's Input node carries 635.9 ms of data loading (vs 85.3 ms for the model): zeroed, and listed
    by zeroed_inputs (what `graphpipe inspect` notes); the input tensor's bytes still flow to its consumer."""
    from graphpipe.importers.pipedream_txt import read_zeroed_inputs

    g = read_pipedream(os.path.join(profiles_dir, "alexnet"))
    inp = g.ops[g.op_id("node1")]
    assert inp.kind == "Input" and inp.fwd.beta == inp.bwd.beta == inp.param_bytes == 0
    assert inp.out_bytes == pytest.approx(154140672.0 / 128)
    assert g.edge_bytes(0, g.succs(0)[0]) == pytest.approx(154140672.0 / 128)
    assert g.fwd_time(range(g.num_ops), 128) + g.bwd_time(range(g.num_ops), 128) == pytest.approx(0.0853, abs=1e-3)
    assert read_zeroed_inputs(os.path.join(profiles_dir, "alexnet")) == [("node1", 635.902, 0.0)]
    assert read_zeroed_inputs(os.path.join(profiles_dir, "gnmt")) == []      # its Input0..2 are already 0


def test_input_with_predecessor_is_not_zeroed():
    """Only Input *sources* are data loading (the real optimizer zeroes gr.sources() named Input*)."""
    text = "\n".join([node_line("node1", desc="Input0", fwd="5.0", bwd="0.0"), node_line("node2", desc="Input1"),
                      "\tnode1 -- node2"])
    g = parse_pipedream(text)
    assert g.ops[0].fwd.beta == 0 and g.ops[1].fwd.beta == pytest.approx(1.0 / 1000 / 128)


def test_inspect_notes_zeroed_input(profiles_dir, capsys):
    from graphpipe.cli import main

    assert main(["inspect", os.path.join(profiles_dir, "alexnet")]) == 0
    out = capsys.readouterr().out
    assert "note: Input node node1's forward time 635.902 ms (data loading) was zeroed" in out
