"""Real-world models through torch.export: Hugging Face CLIP, Llama (tied embedding), BERT and a timm EfficientNet,
each built from a small config in code (random weights, nothing downloaded).

Oracles: the module's own parameter bytes and outputs; the series-parallel decomposition (CLIP's towers are two
branches); ``--check``'s single-process reference (loss, every gradient, every buffer) on 3-4 CPU ranks for gpp,
pipedream and gpipe plans with a target-taking loss.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("transformers")

from graphpipe.cluster import preset  # noqa: E402
from graphpipe.frontend.capture import captured_from_factory  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "hf_models.py")
BATCH = 8

pytestmark = pytest.mark.usefixtures("one_thread")


def _factory(name):
    if name == "efficientnet":
        pytest.importorskip("timm")
    return f"{SPEC}:{name}"


@pytest.mark.parametrize("name", ["clip", "llama", "bert", "efficientnet"])
def test_inspect_real_models_parameter_bytes_and_numerics(name):
    import hf_models

    spec = _factory(name)
    cap = captured_from_factory(spec)
    module, inputs, loss_fn, target = getattr(hf_models, name)()
    assert cap.graph.param_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
    assert cap.graph.num_ops >= 4 and sum(op.fwd.beta for op in cap.graph.ops) > 0
    # the captured graph computes the module's loss (run at another batch size than the example's)
    made = __import__("graphpipe.frontend.capture", fromlist=["load_factory"]).load_factory(spec)
    args, kwargs = made.args, made.kwargs
    double = lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) else t  # noqa: E731
    args, kwargs = tuple(double(a) for a in args), {k: double(v) for k, v in kwargs.items()}
    tgt = double(made.example_target)
    made.module.train()
    torch.manual_seed(0)
    out = cap.io.wrap_loss(made.loss_fn)(cap.gm(*cap.io.flat_inputs(args, kwargs, tgt)))
    if name == "llama":  # no dropout in its training path: equal losses
        ref = made.loss_fn(made.module(*args, **kwargs), tgt)
        torch.testing.assert_close(out, ref)
    assert torch.isfinite(out)


def test_clip_towers_are_parallel_branches_and_gpp_puts_them_on_different_devices():
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan
    from graphpipe.sp import num_branches

    spec = _factory("clip")
    graph = captured_from_factory(spec).graph
    assert num_branches(graph) >= 2
    plan = make_plan(spec, graph, preset("v100", 4), BATCH, "gpp", SearchOptions())
    sg = plan.stage_graph
    tower_devices = {}
    for tower in ("vision_model", "text_model"):
        stages = {sg.stage_of(graph.op_id(op.name)) for op in graph.ops if op.name.startswith(tower)}
        tower_devices[tower] = {d for s in stages for d in sg.stages[s].devices}
    assert not tower_devices["vision_model"] & tower_devices["text_model"], tower_devices


def _has_timm() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - a torchvision that does not load beside this torch counts as absent
        return False
    return True


def _plans():
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    plans = {}
    names = ("clip", "llama", "efficientnet") if _has_timm() else ("clip", "llama")
    for name in names:
        spec = _factory(name)
        graph = captured_from_factory(spec).graph
        for strategy, devices in (("gpp", 4), ("pipedream", 3), ("gpipe", 3)):
            plans[f"{name}/{strategy}"] = make_plan(spec, graph, preset("v100", devices), BATCH, strategy,
                                                    SearchOptions(micro_batch_size=2 if strategy != "gpp" else None))
    return plans


@pytest.mark.slow
def test_real_models_run_check_for_gpp_pipedream_and_gpipe():
    from graphpipe.runtime import RunOptions, run_plans

    plans = _plans()
    names = sorted(plans)
    results = run_plans([(plans[n], RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=180)) for n in names], 4)
    failures = {}
    for name, result in zip(names, results):
        check = result.check
        if not (check.passed and check.num_params_checked == check.num_params > 0
                and check.num_buffers_checked == check.num_buffers):
            failures[name] = check
    assert not failures, failures
    for model in {n.split("/")[0] for n in names}:  # every model really ran pipelined in some plan
        assert any(plans[n].stage_graph.num_stages > 1 for n in names if n.startswith(model + "/")), model


def test_a_no_grad_region_is_cut_and_trained_like_one_process():
    """M2M100's positions come from a ``torch.no_grad()`` region, a higher-order op whose body is a graph of its
    own: its input glue is copied after the body's ``get_attr``, its metadata assertions are dropped and its
    device literals retargeted as the main graph's are (each rank captures on meta), so --check passes."""
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.search.planner import make_plan

    spec = _factory("m2m100")
    plan = make_plan(spec, captured_from_factory(spec).graph, preset("v100", 3), BATCH, "gpp")
    assert plan.stage_graph.num_stages > 1
    result, = run_plans([(plan, RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=180))], 3)
    check = result.check
    assert check.passed and check.num_params_checked == check.num_params > 0


def test_mixtral_experts_train_like_one_process_on_cpu_ranks():
    """Each rank captures the model on meta, where transformers' grouped experts count tokens per expert with
    an integer ``histc`` that the CPU lacks: graphpipe counts them as floats (exact), and --check passes."""
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    spec = _factory("mixtral")
    plan = make_plan(spec, captured_from_factory(spec).graph, preset("v100", 2), BATCH, "gpipe",
                     SearchOptions(micro_batch_size=2))
    assert plan.stage_graph.num_stages == 2
    result, = run_plans([(plan, RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=180))], 2)
    check = result.check
    assert check.passed and check.num_params_checked == check.num_params > 0


def test_meta_device_llama_capture_allocates_nothing():
    """A factory may build on the meta device: capture then costs the model without weights."""
    import hf_models

    from graphpipe.frontend.capture import capture

    cfg = hf_models.llama_config(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=2816, tie=True)
    model, inputs, loss_fn, target = hf_models.llama_meta(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    t0 = time.perf_counter()
    cap = capture(model, inputs, name="llama-meta", loss_fn=loss_fn, example_target=target)
    assert time.perf_counter() - t0 >= 0  # timing is reported in evals, not asserted
    assert cap.graph.num_ops == 4 + 2  # embedding, 4 decoder layers, the (tied) head
    assert cap.graph.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert cap.graph.shared  # the head reads the embedding's weight
    assert all(p.device.type == "meta" for p in cap.gm.parameters())


def test_export_refusal_is_one_line_with_the_source_location(tmp_path, capfd):
    """The branch on a value is named with its source line, and torch's dump of the partial graph it
    prints to stderr before raising does not reach the user (an LLM's is tens of kilobytes)."""
    from graphpipe.errors import UserCodeError

    path = tmp_path / "dyn.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        if x.sum() > 0:\n"
        "            return self.l(x)\n"
        "        return x\n"
        "def make():\n"
        "    return M(), (torch.randn(3, 4),), lambda out: out.sum()\n")
    with pytest.raises(UserCodeError) as err:
        captured_from_factory(f"{path}:make")
    message = str(err.value)
    assert "\n" not in message and "dyn.py:6" in message and "torch.export cannot capture M" in message
    assert "`if x.sum() > 0:` depends on a tensor's values" in message
    assert "def forward" not in capfd.readouterr().err


def test_inputs_without_batch_dimension_are_named():
    from graphpipe.frontend.capture import capture
    from graphpipe.errors import InputError

    m = torch.nn.Linear(4, 4)
    with pytest.raises(InputError, match="input 1 has dim 0 of size 3"):
        capture(m, (torch.randn(2, 4), torch.randn(3, 4)))


def test_cli_refusals_are_one_line_exit_2(tmp_path):
    """A --granularity pattern matching no module names it and the top-level modules; an input whose dim 0 is not
    the batch is named."""
    import subprocess
    import sys

    def cli(*argv):
        proc = subprocess.run([sys.executable, "-m", "graphpipe", *argv], capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        return lines[0]

    line = cli("inspect", "mmt:small", "--granularity", "encoder.*")
    assert "pattern 'encoder.*' matches no module" in line and "branch0, branch1" in line
    path = tmp_path / "two.py"
    path.write_text("import torch\n"
                    "class Two(torch.nn.Module):\n"
                    "    def __init__(self):\n"
                    "        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
                    "    def forward(self, x, table):\n"
                    "        return self.l(x) + table.sum()\n"
                    "def make():\n"
                    "    return Two(), (torch.randn(3, 4), torch.randn(5, 4)), lambda out: out.sum()\n")
    assert "input 1 has dim 0 of size 5" in cli("inspect", f"{path}:make")
