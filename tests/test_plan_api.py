"""The planning API (``graphpipe.plan``, ``Plan.simulate``, ``Plan.save``, ``graphpipe.load_plan``) against its
oracle, the CLI: for every schedule of the registry and every strategy, the plan file ``graphpipe.plan(...)``
saves is byte for byte the one ``graphpipe plan --out`` writes (timing fields aside) and ``Plan.simulate()``
predicts exactly what ``graphpipe simulate --json`` prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import branches_graph, chain_graph
from graphpipe.cli import main
from graphpipe.errors import GraphpipeError, InputError
from graphpipe.graph import graph_to_dict, write_json_atomic
from graphpipe.sched.generators import SCHEDULES
from graphpipe.search.planner import TIMING_KEYS

import graphpipe


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for name, graph in (("chain", chain_graph(16)), ("branches", branches_graph(3, 3))):
        paths[name] = str(folder / f"{name}.json")
        write_json_atomic(paths[name], graph_to_dict(graph))
    return paths


def _untimed(text: str) -> str:
    """The plan file with its wall-clock fields zeroed (:data:`TIMING_KEYS`: two identical runs differ there only)."""
    doc = json.loads(text)
    doc["search"] = {k: (0.0 if k in TIMING_KEYS else v) for k, v in doc["search"].items()}
    return json.dumps(doc)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# (model, strategy, schedule, extra API keywords, the same as CLI flags)
CASES = [("chain", "gpp", name, {}, []) for name in SCHEDULES] + [
    ("chain", "pipedream", None, {}, []),
    ("chain", "piper", "1f1b-async", {"vertical_sync": True}, ["--vertical-sync"]),
    ("chain", "gpipe", None, {}, []),
    ("chain", "gpp", "2bw", {"update_every": 2, "stash": False}, ["--update-every", "2", "--no-stash"]),
    ("chain", "gpp", "zbv", {"micro_batch_size": 2}, ["--micro-batch-size", "2"]),
    ("chain", "gpp", "interleaved", {"virtual_stages": 2}, ["--virtual-stages", "2"]),
    ("branches", "gpp", None, {}, []),
    ("branches", "gpp", "graph-zb", {"recompute": "all"}, ["--recompute", "all"]),
    ("branches", "pipedream", "2bw", {}, []),
    ("branches", "gpp", None, {"host_cores": 2}, ["--host-cores", "2"]),
]


@pytest.mark.parametrize("model,strategy,schedule,keywords,flags", CASES,
                         ids=[f"{m}-{st}-{sc}-{len(f)}" for m, st, sc, _, f in CASES])
def test_the_api_plans_and_predicts_what_the_cli_does(capsys, tmp_path, models, model, strategy, schedule,
                                                      keywords, flags):
    cli_path, api_path = str(tmp_path / "cli.json"), str(tmp_path / "api.json")
    argv = ["plan", models[model], "-n", "4", "-b", "16", "--strategy", strategy, "--out", cli_path, "--json",
            *(["--schedule", schedule] if schedule else []), *flags]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    notes: list[str] = []
    plan = graphpipe.plan(models[model], devices=4, batch_size=16, strategy=strategy, schedule=schedule,
                          notes=notes.append, **keywords)
    plan.save(api_path)
    cli_text, api_text = open(cli_path).read(), open(api_path).read()
    assert _untimed(api_text) == _untimed(cli_text)
    assert _untimed(out) == _untimed(cli_text)  # --json prints the file's document
    assert [f"graphpipe: note: {n}" for n in notes] == [line for line in err.splitlines() if "note:" in line
                                                        and "devices; more do not help" not in line]
    assert plan.notes == tuple(notes)
    assert plan.schedule.name == (schedule or plan.schedule.name)
    # the prediction: the plan's own figures, and graphpipe simulate's
    code, out, err = _cli(capsys, "simulate", cli_path, "--json", *(["--host-cores", "2"] if "host_cores" in keywords else []))
    assert code == 0, err
    simulated = json.loads(out)
    prediction = plan.simulate(host_cores=keywords.get("host_cores"))
    figures = {k: v for k, v in simulated.items() if k not in ("model", "strategy", "num_stages", "search")}
    assert json.dumps(dict(prediction.figures)) == json.dumps(figures)
    assert prediction.iteration_time_s == simulated["iteration_time_s"]
    assert prediction.throughput == simulated["throughput"]
    # the plan's own figure: the same sum, possibly in another order (an asynchronous plan's steady state)
    assert plan.predicted.iteration_time_s == pytest.approx(prediction.iteration_time_s, rel=1e-12)
    assert plan.predicted.throughput == pytest.approx(prediction.throughput, rel=1e-12)
    assert list(prediction.peak_memory_bytes) == simulated["peak_memory_bytes"]
    loaded = graphpipe.load_plan(api_path)
    assert isinstance(loaded, graphpipe.Plan) and loaded.stage_graph == plan.stage_graph
    assert loaded.simulate(host_cores=keywords.get("host_cores")).figures == prediction.figures


def test_a_factory_tuple_plans_like_its_spec(tmp_path):
    """A factory's tuple is captured as its ``file.py:factory`` spec is: the same stages and prediction."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "net.py"
    path.write_text("import torch\n"
                    "def make():\n"
                    "    net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])\n"
                    "    return net, (torch.randn(8, 32),), lambda out: out.sum()\n")
    spec = f"{path}:make"
    by_spec = graphpipe.plan(spec, devices=2, batch_size=8, schedule="1f1b")
    from graphpipe.frontend.capture import load_factory

    made = load_factory(spec)
    torch.manual_seed(0)
    by_tuple = graphpipe.plan((made.module, made.example_inputs, made.loss_fn), devices=2, batch_size=8,
                              schedule="1f1b")
    assert [s.op_ids for s in by_tuple.stage_graph.stages] == [s.op_ids for s in by_spec.stage_graph.stages]
    assert by_tuple.simulate().iteration_time_s == pytest.approx(by_spec.simulate().iteration_time_s)
    assert by_tuple.model == "Sequential"


@pytest.mark.parametrize("keywords,fragment", [
    ({"devices": 0}, "--devices must be >= 1"),
    ({"schedule": "nope"}, "unknown schedule 'nope'"),
    ({"strategy": "nope"}, "nope"),
    ({"vertical_sync": True}, "--vertical-sync is for the asynchronous schedules"),
    ({"schedule": "2bw", "update_every": 0}, "--update-every"),
    ({"not_an_option": 1}, "unknown planning option 'not_an_option'"),
    ({"host_cores": 0}, "--host-cores must be at least 1"),
])
def test_bad_arguments_raise_one_line(models, keywords, fragment):
    arguments = {"devices": 4, "batch_size": 16, **keywords}
    with pytest.raises(GraphpipeError) as info:
        graphpipe.plan(models["chain"], **arguments)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_extra_keywords_reach_the_planners_options(models):
    """Any :class:`SearchOptions` field passes through (how new planner options reach the planner)."""
    from graphpipe.search.api import plan_inputs

    inputs = plan_inputs(models["chain"], devices=4, max_downsets=123, power_of_two=True)
    assert inputs.options.max_downsets == 123 and inputs.options.power_of_two
    with pytest.raises(InputError):
        graphpipe.plan(models["chain"], devices=4, batch_size=16, model_parallel=2)


def test_importing_graphpipe_is_cheap_and_plan_names_both():
    """``import graphpipe`` loads neither torch nor the planner; ``graphpipe.plan`` is callable whichever way the
    module ``graphpipe.plan`` was imported first, and still holds the plan file's types."""
    code = ("import sys, graphpipe\n"
            "assert 'torch' not in sys.modules and 'graphpipe.search' not in sys.modules, 'eager'\n"
            "from graphpipe.plan import Plan, read_plan\n"
            "import graphpipe.plan as module\n"
            "assert callable(graphpipe.plan) and module is graphpipe.plan and graphpipe.plan.Plan is Plan\n"
            "assert issubclass(graphpipe.Plan, Plan) and callable(graphpipe.load_plan)\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


README = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "README.md")


def test_the_readme_is_a_front_door():
    """Under 15k characters; install, one's own model planned, simulated and run, and both Python APIs (planning
    and training) in its first 80 lines."""
    text = open(README, encoding="utf-8").read()
    assert len(text) < 15_000, len(text)
    head = "\n".join(text.splitlines()[:80])
    for needle in ("## Install", "pip install", "graphpipe plan examples/two_tower.py:factory",
                   "graphpipe simulate two_tower.json", "graphpipe run two_tower.json", "graphpipe.plan(",
                   "plan.simulate()", "plan.save(", "graphpipe.Pipeline(", "pipe.step("):
        assert needle in head, needle


@pytest.mark.slow
def test_the_readmes_planning_block_runs_as_written(tmp_path):
    """The README's Python planning block, run in a copy of the examples, saves the plan ``graphpipe plan`` writes."""
    import re
    import shutil

    text = open(README, encoding="utf-8").read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "graphpipe.plan(" in b)
    root = __import__("os").path.dirname(README)
    shutil.copytree(__import__("os").path.join(root, "examples"), tmp_path / "examples")
    subprocess.run([sys.executable, "-c", block], cwd=tmp_path, check=True, capture_output=True, timeout=600)
    command = re.search(r"^graphpipe plan examples/two_tower\.py:factory (.*) --out two_tower\.json$", text, re.M)
    subprocess.run([sys.executable, "-m", "graphpipe", "plan", "examples/two_tower.py:factory",
                    *command.group(1).split(), "--out", "cli.json"], cwd=tmp_path, check=True, capture_output=True,
                   timeout=600)
    assert _untimed((tmp_path / "two_tower.json").read_text()) == _untimed((tmp_path / "cli.json").read_text())
