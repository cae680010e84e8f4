"""Compiled stages (``graphpipe run --compile``, ``Pipeline(..., compile=True)``).

Oracle: single-process eager training of the same model (``--check``: loss and every gradient within the
run's tolerances), and the compiler's own counters (every stage really went through AOTAutograd, so the
backward that ran was the compiled one). Refusals are checked for naming the real cause.
"""

from __future__ import annotations

import pytest
import torch

from graphpipe.actions import Action
from graphpipe.plan import write_plan
from graphpipe.runtime.compiled import CompileError, CompiledForward, compile_refusal
from graphpipe.runtime.options import RunOptions

from test_runtime_units import _plan, one_rank_group  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compiled_stages_train_like_one_eager_process(one_rank_group):
    """Three stages on one rank, each compiled (forward and backward): --check passes for every parameter over
    two steps (the optimizer stepped between them) and AOTAutograd compiled one graph per stage."""
    from torch._dynamo.utils import counters

    from graphpipe.runtime.worker import run_job

    torch._dynamo.reset()
    before = counters["aot_autograd"]["total"]
    groups = (["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"])
    plan = _plan("mmt:small", groups, [(0,)] * 3, [4, 4, 4], 8, 1, "gpipe", shared=True)
    result = run_job(0, 1, plan, RunOptions(steps=2, check=True, compile=True), torch.device("cpu"), "gloo")
    check = result.check
    assert check.passed, check
    assert check.num_params_checked == check.num_params > 0
    assert len(result.losses) == 2 and result.losses[1] != result.losses[0]
    assert counters["aot_autograd"]["total"] - before >= 3  # one joint forward/backward graph per stage


def test_a_stage_the_compiler_rejects_is_named():
    def rejecting(gm, example_inputs):  # a compiler that cannot handle the graph
        raise NotImplementedError("op aten.unsupported has no lowering")

    compiled = CompiledForward(lambda x: (x * 2).sin(), stage_id=7, backend=rejecting)
    with pytest.raises(CompileError, match="stage 7 cannot be compiled.*no lowering"):
        compiled(torch.ones(2))


def test_split_backward_and_asynchronous_schedules_are_refused_with_the_reason(tmp_path, capsys):
    from graphpipe.cli import main

    assert "split-backward" in compile_refusal([Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)])
    assert compile_refusal([Action(0, "F", 0), Action(0, "B", 0)]) is None
    chain = (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"])
    zb = _plan("transformer:small", chain, [(0,), (1,)], [2, 2], 8, 2, "zb-h1")
    path = str(tmp_path / "zb.json")
    write_plan(path, zb)
    assert main(["run", path, "--compile", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "split-backward" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(Exception, match="--baseline torch"):
        RunOptions(compile=True, baseline="torch")


def test_the_api_refuses_a_split_backward_plan():
    from graphpipe.errors import PlanError
    from graphpipe.runtime.api import Pipeline

    chain = (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"])
    zb = _plan("transformer:small", chain, [(0,), (1,)], [2, 2], 8, 2, "zb-h1")
    with pytest.raises(PlanError, match="compile=True cannot run a split-backward"):
        Pipeline(zb, compile=True)
