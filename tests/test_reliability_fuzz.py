"""Issue 20: property-based fuzzing of every document graphpipe reads and of its command line.

The property: whatever the input, ``graphpipe`` either succeeds (exit 0) or
exits 2 with exactly one ``graphpipe: error: ...`` line on stderr (warnings
and notes may precede it); never exit 1 (our bug) and never a traceback.

Documents are valid ones (graph, plan, cluster, profile of a small chain)
with one node replaced by an arbitrary JSON value, or one key removed, so
every field's type check is reached; command lines are drawn from each
verb's flags with odd values. Runs go through :func:`graphpipe.cli.main` in
this process (the console script is ``sys.exit(main())``), so a few hundred
cases take seconds. Hypothesis is derandomized with a fixed example count,
so CI sees the same cases every time.
"""

from __future__ import annotations

import json
import math
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import branches_graph  # noqa: E402

SETTINGS = settings(max_examples=int(os.environ.get("GP_FUZZ_N", 40)), derandomize=os.environ.get("GP_FUZZ_N") is None, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4) | st.sampled_from(["0", "v100", "F"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


@st.composite
def mutated(draw, base):
    """``base`` with one node (reached by a random walk) replaced by any JSON value, or one key deleted."""
    doc = json.loads(json.dumps(base))
    node, depth = doc, 0
    while isinstance(node, (dict, list)) and node and depth < 6:
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
            if isinstance(node, dict) and draw(st.integers(0, 4)) == 0:
                del node[key]
            else:
                node[key] = draw(JSON)
            return doc
        node, depth = child, depth + 1
    return draw(JSON)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from graphpipe.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    _, err = capsys.readouterr()
    return code, err


def assert_success_or_one_line(code, err, argv) -> None:
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        errors = [line for line in lines if line.startswith("graphpipe: error: ")]
        others = [line for line in lines if not line.startswith(("graphpipe: error: ", "graphpipe: warning: ",
                                                                  "graphpipe: note: "))]
        assert len(errors) == 1 and not others and lines[-1] == errors[0], (argv, err)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Valid documents of a 2-branch graph: graph, plan on 2 devices, cluster, profile; and their folder."""
    from graphpipe.cluster import cluster_to_dict, preset
    from graphpipe.graph import graph_to_dict
    from graphpipe.plan import plan_to_dict
    from graphpipe.search.planner import make_plan

    folder = tmp_path_factory.mktemp("fuzz")
    graph = branches_graph(2, 2)
    cluster = preset("v100", 2)
    plan = make_plan("branches", graph, cluster, 8, "gpp")
    docs = {"graph": graph_to_dict(graph), "plan": plan_to_dict(plan), "cluster": cluster_to_dict(cluster),
            "profile": {"format": "graphpipe.profile/1", "model": "branches", "device": "cpu", "batch_sizes": [1, 2],
                        "ops": {op.name: {"fwd_s": [1e-4, 1e-5], "bwd_s": [2e-4, 2e-5]} for op in graph.ops[:3]}}}
    for name, doc in docs.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
    return docs, folder


def _write(folder, name: str, doc) -> str:
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, allow_nan=True)
    return path


@pytest.mark.parametrize("kind,argv", [("graph", ["inspect", "g.json", "--json"]),
                                       ("plan", ["simulate", "p.json", "--json"])], ids=["graph", "plan"])
def test_fuzz_graph_and_plan_documents(base, capsys, kind, argv):
    docs, folder = base

    @SETTINGS
    @given(mutated(docs[kind]))
    def check(doc):
        args = [argv[0], _write(folder, argv[1], doc), *argv[2:]]
        assert_success_or_one_line(*run_cli(capsys, *args), args)

    check()


def test_fuzz_cluster_and_profile_documents(base, capsys):
    docs, folder = base
    graph = str(folder / "graph.json")

    @SETTINGS
    @given(mutated(docs["cluster"]), mutated(docs["profile"]))
    def check(cluster, profile):
        argv = ["plan", graph, "-n", "2", "-b", "8", "--cluster", _write(folder, "c.json", cluster),
                "--profile", _write(folder, "prof.json", profile)]
        assert_success_or_one_line(*run_cli(capsys, *argv), argv)

    check()


ODD = st.sampled_from(["0", "-1", "1", "2", "3", "8", "nan", "inf", "-inf", "1e308", "99999999999999999999", "",
                       "x", "1.5", "0x10", " 4", "true"])


@st.composite
def command_lines(draw, folder):
    """A verb with a random subset of its flags, each with an odd or ordinary value."""
    plan, graph = str(folder / "plan.json"), str(folder / "graph.json")
    verb = draw(st.sampled_from(["plan", "simulate", "inspect"]))
    if verb == "plan":
        argv = ["plan", draw(st.sampled_from([graph, "twobranch:small", "mmt:small,layers=0", "nosuch", "x.py:f",
                                              str(folder), graph + "x"]))]
        flags = {"-n": ODD, "-b": ODD, "--micro-batch-size": ODD, "--memory-gb": ODD, "--host-cores": ODD,
                 "--time-limit": st.sampled_from(["0.5", "0", "nan", "inf", "-1"]),
                 "--strategy": st.sampled_from(["gpp", "gpipe", "piper", "bogus"]),
                 "--schedule": st.sampled_from(["1f1b", "gpipe", "graph-1f1b", "cpsat", "bogus"]),
                 "--cluster": st.sampled_from(["v100", "a100", "bogus", plan, str(folder)]),
                 "--out": st.sampled_from([str(folder / "o.json"), str(folder), "/proc/o.json", "o.txt"])}
        required = ("-n", "-b")
    elif verb == "simulate":
        argv = ["simulate", draw(st.sampled_from([plan, graph, str(folder), "missing.json"]))]
        flags = {"--schedule": st.sampled_from(["1f1b", "gpipe", "interleaved", "graph-1f1b", "bogus"]),
                 "--host-cores": ODD, "--time-limit": ODD,
                 "--gantt": st.sampled_from([str(folder / "g.png"), str(folder / "g.txt"), str(folder)]),
                 "--trace": st.sampled_from([str(folder / "t.json"), "/proc/t.json"]),
                 "--out": st.sampled_from([str(folder / "o.json"), str(folder / "t.json")])}
        required = ()
    else:
        argv = ["inspect", draw(st.sampled_from([graph, "twobranch:small", "mmt:branches=2000", "mmt:seq=" + "9" * 30,
                                                 "mmt:small,heads=3", ":", "mmt:small,,", plan]))]
        flags = {"--device": st.sampled_from(["v100", "h100", "bogus", plan]), "--pipedream-batch-size": ODD}
        required = ()
    for flag, values in flags.items():
        if flag in required or draw(st.integers(0, 3)) == 0:
            argv += [flag, draw(values)]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


def test_fuzz_command_lines(base, capsys):
    _, folder = base

    @SETTINGS
    @given(command_lines(folder))
    def check(argv):
        assert_success_or_one_line(*run_cli(capsys, *argv), argv)

    check()


def test_nan_in_a_document_is_not_a_number(base, capsys):
    """json.loads accepts NaN; every number field refuses it (one fixed case the fuzzer need not find)."""
    docs, folder = base
    doc = json.loads(json.dumps(docs["graph"]))
    doc["ops"][0]["param_bytes"] = math.nan
    code, err = run_cli(capsys, "inspect", _write(folder, "nan.json", doc))
    assert code == 2 and "param_bytes must be a finite number" in err, err
