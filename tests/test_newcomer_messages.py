"""The mistakes a new user makes first, each answered by one line that names the mistake and the fix (exit 2).

Each test makes the mistake as a user would (the command line, or ``graphpipe.Pipeline`` in a script) and checks
the one line: a ``.py`` model without ``:factory``; a loss that wants a target the factory did not return; the
wrong model given to ``Pipeline``; a hand-edited plan whose stage moved device, or whose stage names an unknown
op. Loading a checkpoint in a Pipeline raises no torch warning about a missing process group.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

import pytest
import torch

from graphpipe.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import api_models  # noqa: E402


def one_line(capsys, argv, *fragments) -> str:
    """``graphpipe ARGV`` exits 2 with exactly one error line (progress lines aside), no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("graphpipe: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_a_py_model_without_factory_lists_the_files_functions(capsys):
    path = os.path.join(ROOT, "examples", "two_tower.py")
    line = one_line(capsys, ["plan", path, "--devices", "2", "--batch-size", "8"],
                    f"{path} is a Python file: name the factory that builds the model, as {path}:FACTORY",
                    "functions in it: tower, loss_fn, clicks, factory, main")
    assert "node line" not in line
    one_line(capsys, ["inspect", path], "functions in it: ")
    one_line(capsys, ["plan", "no_such_model.py", "-n", "2", "-b", "8"], "no such file: no_such_model.py")


def test_a_loss_wanting_a_target_the_factory_did_not_return_blames_the_loss(tmp_path, capsys):
    model = tmp_path / "mine.py"
    model.write_text("import torch, torch.nn as nn\n"
                     "import torch.nn.functional as F\n"
                     "def loss_fn(out, target):\n"
                     "    return F.mse_loss(out, target)\n"
                     "def factory():\n"
                     "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), (torch.randn(8, 4),), "
                     "loss_fn\n")
    line = one_line(capsys, ["plan", f"{model}:factory", "-n", "2", "-b", "8"],
                    f"{model}:3: calling the loss loss_fn(output) failed: TypeError:",
                    "the loss takes a target ('target') but the factory returned none: "
                    "return (module, example_inputs, loss_fn, example_target)")
    assert "running the module's forward" not in line


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api_plan(tmp_path) -> str:
    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.plan import write_plan
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    source = load_model(os.path.join(HERE, "api_models.py") + ":branchy")
    plan = make_plan(source.model_id, source.graph, preset("v100", 1), api_models.BATCH, "gpipe",
                     SearchOptions(micro_batch_size=4))
    path = str(tmp_path / "one.json")
    write_plan(path, plan)
    return path


class _Narrow(torch.nn.Module):
    """Takes 5 features where the plan's model takes 6: torch.export fails inside its matmul."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.stem(x)


def test_the_wrong_model_for_a_plan_is_named_and_checkpoints_load_quietly(tmp_path, monkeypatch):
    """In one process (a world of one rank): a model that fails on the plan's inputs, one of other op names, one of
    the same names at another width; then the plan's own model saves and loads with no torch warning."""
    import torch.distributed as dist

    from graphpipe.errors import PlanError
    from graphpipe.runtime.api import Pipeline

    plan = _api_plan(tmp_path)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the caller's group: every Pipeline below joins it
    try:
        with pytest.raises(PlanError, match=r"the model given to Pipeline is not the plan's \(.*api_models.py:"
                                            r"branchy\): capturing it on the plan's example inputs failed \(.*"
                                            r"RuntimeError: a and b must have same "):
            Pipeline(plan, _Narrow(), api_models.loss_fn)
        with pytest.raises(PlanError, match=r"plan does not match model .*op\(s\) the model does not have"):
            Pipeline(plan, torch.nn.Sequential(torch.nn.Linear(6, 3)), api_models.loss_fn)
        with pytest.raises(PlanError, match=r"the model given to Pipeline is not the plan's \(.*\): op 'stem' has "
                                            r"224 parameter bytes, the plan's 448"):
            Pipeline(plan, api_models.TwoBranch(width=8), api_models.loss_fn)
        torch.manual_seed(0)
        pipe = Pipeline(plan, api_models.TwoBranch(), api_models.loss_fn)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        x, y = api_models.data(0)
        pipe.step(x, y)
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.save(str(tmp_path / "ckpt"), optimizer=opt)
            pipe.load(str(tmp_path / "ckpt"), optimizer=opt)
            pipe.save(str(tmp_path / "steps"), optimizer=opt, step=1)
            assert pipe.resume(str(tmp_path / "steps"), optimizer=opt) == 1
        assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)], \
            [str(w.message) for w in caught]
        pipe.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _zoo_plan(tmp_path) -> str:
    """twobranch:small planned on 4 devices, one stage each (written by the CLI, as a user's plan is)."""
    path = str(tmp_path / "tb.json")
    assert main(["plan", "twobranch:small", "-n", "4", "-b", "8", "--out", path]) == 0
    return path


def test_hand_edited_plans_are_refused_in_the_files_terms(tmp_path, capsys):
    path = _zoo_plan(tmp_path)
    capsys.readouterr()
    doc = json.loads(open(path).read())
    moved = json.loads(json.dumps(doc))  # the stages on devices 2 and 3 swap places; the schedule stays
    stage = next(s for s in moved["stages"] if s["devices"] == [2])
    other = next(s for s in moved["stages"] if s["devices"] == [3])
    stage["devices"], other["devices"] = [3], [2]
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    for command in ("simulate", "run"):
        one_line(capsys, [command, str(tmp_path / "moved.json")],
                 f"the plan's schedule no longer matches stages[{stage['id']}].devices ([3])",
                 f"graphpipe simulate PLAN.json --schedule {doc['schedule']['name']} --out PLAN.json")
    fixed = str(tmp_path / "fixed.json")
    assert main(["simulate", str(tmp_path / "moved.json"), "--schedule", doc["schedule"]["name"], "--out", fixed]) == 0
    assert main(["simulate", fixed]) == 0
    unknown = json.loads(json.dumps(doc))
    unknown["stages"][1]["ops"].append("no.such.op")
    (tmp_path / "unknown.json").write_text(json.dumps(unknown))
    capsys.readouterr()
    one_line(capsys, ["simulate", str(tmp_path / "unknown.json")],
             f"{tmp_path / 'unknown.json'}.stages[1].ops[{len(unknown['stages'][1]['ops']) - 1}]: op 'no.such.op' is "
             "not in the plan's graph")
