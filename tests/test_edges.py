"""The edges real models hit, each against an oracle.

Oracles: the eager module (outputs and gradients, ``torch.testing.assert_close``); ``--check``'s single-process
reference for multi-rank runs (loss, every gradient and buffer after each step), all plans in one launched
2-rank job; one-line errors (``InputError``) for refusals.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from graphpipe.errors import InputError

HERE = os.path.dirname(os.path.abspath(__file__))
EDGES = os.path.join(HERE, "edge_models.py")
sys.path.insert(0, HERE)
import edge_models  # noqa: E402

from test_runtime_units import one_rank_group  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _eager_and_captured(factory: str):
    from graphpipe.frontend.capture import load_factory, trace_ops
    from graphpipe.frontend.exporting import normalize_inputs

    made = load_factory(f"{EDGES}:{factory}")
    exported, op_nodes, _ = trace_ops(made.module, made.example_inputs, made.loss_fn)
    return made, exported, op_nodes, normalize_inputs(made.example_inputs)


# ------------------------------------------------------------ 1. non-tensor inputs
def test_non_tensor_inputs_are_part_of_the_captured_program():
    """A bool, an int, a string and None: the graph takes the tensor alone, computes what the eager module does
    with those values, and a caller passing another value is refused in one line."""
    made, exported, _, (args, kwargs) = _eager_and_captured("flagged")
    io = exported.io
    assert [n.name for n in exported.gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert [(name, value) for _, name, value in io.constants] == [
        ("output_hidden_states", True), ("scale", 2), ("mode", "shifted"), ("extra", None)]
    flat = io.flat_inputs(args, kwargs)
    assert len(flat) == io.num_inputs == 1 and isinstance(flat[0], torch.Tensor)
    assert io.unflatten_inputs(flat)[1] == kwargs  # the eager module is called with the constants again
    want = made.module(**kwargs)
    got = io.output(exported.gm(*flat))
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["hidden_states"][1], want["hidden_states"][1])
    with pytest.raises(InputError, match="input 'output_hidden_states' is False, but the model was captured "
                                         "with True") as info:
        io.flat_inputs(args, {**kwargs, "output_hidden_states": False})
    assert "\n" not in str(info.value)


def test_pipeline_steps_a_model_with_non_tensor_inputs_and_refuses_another_value(one_rank_group):
    """``Pipeline.step`` on the bool/int/str/None inputs (two stages on one rank): the loss and every gradient of
    the eager module's micro-batched loop; a step with ``output_hidden_states=False`` is one-line InputError."""
    from graphpipe.frontend.capture import load_factory
    from graphpipe.runtime.api import Pipeline

    made = load_factory(f"{EDGES}:flagged")
    plan = _one_rank_plan(f"{EDGES}:flagged", (["stem", "blocks.0"], ["blocks.1", "head", "join_outputs"]))
    eager = edge_models.flagged()[0]
    eager.load_state_dict(made.module.state_dict())
    pipe = Pipeline(plan, made.module, made.loss_fn)
    inputs = made.example_inputs
    _assert_steps_like_eager(pipe, pipe.step(inputs), eager, made.loss_fn,
                             lambda lo: eager(**{**inputs, "x": inputs["x"][lo:lo + 4]}))
    with pytest.raises(InputError, match="input 'output_hidden_states' is False") as info:
        pipe.step({**inputs, "output_hidden_states": False})
    assert "\n" not in str(info.value)
    pipe.close()


def _assert_steps_like_eager(pipe, loss, eager, loss_fn, forward_rows, precision: str = "fp32") -> None:
    """The Pipeline's step ``loss`` and every gradient equal the eager module's loop over the plan's micro-batches
    of 4 (``forward_rows(lo)``: the eager output of rows ``lo:lo+4``), each loss scaled by its share, at
    ``precision`` (bf16: under CPU autocast)."""
    ref = 0.0
    for lo in range(0, edge_models.BATCH, 4):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            term = loss_fn(forward_rows(lo)) * 0.5
        term.backward()
        ref += float(term.detach())
    torch.testing.assert_close(float(loss), ref)
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")


def _one_rank_plan(spec: str, groups):
    from graphpipe.cluster import preset
    from graphpipe.plan import Plan
    from graphpipe.sched import make_schedule
    from test_real_models import graph_of
    from test_runtime_units import make_sg

    graph = graph_of(spec)
    sg = make_sg(graph, [tuple(graph.op_id(op) for op in g) for g in groups], [(0,)] * len(groups),
                 [4] * len(groups), edge_models.BATCH, 1, shared=True)
    return Plan(model=spec, stage_graph=sg, cluster=preset("v100", 1), strategy="custom",
                schedule=make_schedule("gpipe", sg, preset("v100", 1)))


# ------------------------------------------------------------ 2. keyword inputs through **kwargs
def test_keyword_inputs_through_var_keywords_are_captured():
    """A tensor and a flag that reach ``forward(x, **kwargs)`` only through ``**kwargs``: torch.export alone fails
    on them ("Must provide a tree_name"); the capture binds them, takes the tensor as an input with a dynamic
    batch, folds the flag, computes the eager output at another batch size, and leaves ``forward`` as it was."""
    made, exported, _, (args, kwargs) = _eager_and_captured("var_keywords")
    assert "forward" not in made.module.__dict__
    assert exported.io.input_names == ("x", "scale")
    assert [name for _, name, _ in exported.io.constants] == ["output_hidden_states"]
    rows = {k: v[:3] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}  # another batch size
    got = exported.io.output(exported.gm(*exported.io.flat_inputs((), rows)))
    torch.testing.assert_close(got[0], made.module(**rows)[0])


# ------------------------------------------------------------ 3. dtype-dependent code at bf16
def test_dtype_dependent_constants_run_at_fp32_and_under_bf16_autocast():
    """DETR's ``clamp(h, ±(finfo(h.dtype).max - 1000))`` and a ``masked_fill(mask, finfo(dtype).min)``: captured at
    fp32, the graph holds bf16-safe extremes, so it runs under bf16 autocast (a bf16 tensor cannot take fp32's
    extremes) and equals the eager module at both precisions; ``inspect`` says how the program was captured."""
    from graphpipe.frontend.export_inputs import bf16_safe_constants

    made, exported, _, (args, _) = _eager_and_captured("dtype_dependent")
    gm = exported.gm
    assert bf16_safe_constants(gm) == ()  # done at capture already
    masked = [n for n in gm.graph.nodes if n.target is torch.ops.aten.masked_fill.Scalar]
    assert masked and all(n.args[2] == torch.finfo(torch.bfloat16).min for n in masked)
    torch.testing.assert_close(gm(*args)[0], made.module(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = gm(*args)[0], made.module(*args)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_a_bf16_program_is_traced_at_bf16_and_runs_what_the_eager_module_runs():
    """A branch on ``h.dtype`` (a clamp taken only at bf16): the bf16 trace records it, the fp32 trace does not;
    under autocast the bf16 program equals the eager module exactly and the fp32 one does not (so the oracle can
    fail); outside autocast the bf16 program cannot run (a bf16 mask beside fp32 queries), so the runtime runs it
    as traced. Traced on the meta device (a run's capture), the program is the same, holds the module's own meta
    parameters and no fake tensor."""
    from torch._subclasses.fake_tensor import is_fake

    from graphpipe.frontend.exporting import export_model
    from graphpipe.runtime.materialize import as_traced, meta_copy

    made = edge_models.dtype_branch()
    module, (x,) = made[0], made[1]
    fp32, bf16 = export_model(module, (x,)), export_model(module, (x,), precision="bf16")

    def clamps(ex):
        return [n.name for n in ex.gm.graph.nodes if n.target is torch.ops.aten.clamp.default]

    assert (clamps(fp32), clamps(bf16)) == ([], ["clamp", "clamp_1"])
    rows = x[:3]  # another batch size than traced
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, fp32_got = module(rows), bf16.gm(rows)[0], fp32.gm(rows)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(fp32_got, want)
    torch.testing.assert_close(fp32.gm(rows)[0], module(rows), rtol=0, atol=0)  # fp32 stays fp32's program
    with pytest.raises(RuntimeError, match="attn_mask dtype"):  # its bf16 mask beside fp32 queries
        bf16.gm(rows)
    with as_traced(bf16.gm, (rows,)) as convert:  # how the runtime runs a capture outside a step (rng's spy)
        torch.testing.assert_close(bf16.gm(convert(rows))[0], want, rtol=0, atol=0)
    on_meta = module.to("meta")
    meta = export_model(on_meta, (meta_copy(x),), precision="bf16")
    assert clamps(meta) == clamps(bf16)
    assert [(n.op, str(n.target)) for n in meta.gm.graph.nodes] == [(n.op, str(n.target)) for n in bf16.gm.graph.nodes]
    own = {id(p) for p in on_meta.parameters()}
    assert all(id(p) in own for p in meta.gm.parameters())
    assert not any(is_fake(t) for t in [*meta.gm.parameters(), *meta.gm.buffers()])
    with as_traced(meta.gm, (meta_copy(rows),)) as convert:  # on meta: fake CPU tensors under autocast
        assert meta.gm(convert(meta_copy(rows)))[0].dtype == torch.bfloat16


def test_pipeline_at_bf16_steps_the_branch_the_eager_module_takes_at_bf16(one_rank_group):
    """``Pipeline(precision="bf16")`` of the dtype-branching model (two stages on one rank): loss and every
    gradient equal the eager module's micro-batched loop under autocast, the bf16-only clamp included."""
    from graphpipe.frontend.capture import load_factory
    from graphpipe.runtime.api import Pipeline

    made = load_factory(f"{EDGES}:dtype_branch")
    plan = _one_rank_plan(f"{EDGES}:dtype_branch", (["stem", "layers.0"], ["layers.1", "query", "head"]))
    eager = edge_models.dtype_branch()[0]
    eager.load_state_dict(made.module.state_dict())
    pipe = Pipeline(plan, made.module, made.loss_fn, precision="bf16")
    (x,) = made.example_inputs
    _assert_steps_like_eager(pipe, pipe.step((x,)), eager, made.loss_fn, lambda lo: eager(x[lo:lo + 4]), "bf16")
    pipe.close()


def test_inspect_says_at_which_precision_the_program_was_captured(capsys):
    from graphpipe.cli import main

    assert main(["inspect", f"{EDGES}:dtype_dependent"]) == 0
    out = capsys.readouterr().out
    assert "traced at fp32" in out and "a bf16 run traces its own program" in out
    assert main(["inspect", f"{EDGES}:dtype_branch", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "traced at bf16 under torch.autocast" in out


# ------------------------------------------------------------ 4. in place on a received value
def test_a_stage_mutating_a_received_value_in_place_clones_it_and_the_gradient_is_exact():
    """Stage 1 of ``in_place`` does ``h += pos`` and ``h[:, :2].mul_(0.5)`` on the ``h`` stage 0 sends: the stage
    reads a clone, so autograd accepts the received leaf and its gradient (and every weight's) is the eager one."""
    from graphpipe.runtime.stage_modules import split_model
    from test_real_models import hand_built

    made, exported, op_nodes, (args, _) = _eager_and_captured("in_place")
    plan = hand_built(f"{EDGES}:in_place", (["stem"], ["blocks.0", "blocks.1", "head"]), [(0,), (1,)], [8, 8], 2,
                      "1f1b")
    split = split_model(exported.gm, op_nodes, plan.stage_graph)
    first, second = split.programs
    assert not any(n.name.endswith("_clone") for n in first.module.graph.nodes)  # it mutates nothing it receives
    clones = [n for n in second.module.graph.nodes if n.name.endswith("_clone")]
    assert [c.args[0].name for c in clones] == list(second.input_names)
    (x,) = args
    (sent, _) = first.module(x)
    received = sent[0].detach().requires_grad_(True)
    _, out = second.module(received)
    loss = made.loss_fn(exported.io.output(out))
    loss.backward()
    sent[0].backward(received.grad)
    eager = edge_models.in_place()[0]
    eager.load_state_dict(made.module.state_dict())
    ref = made.loss_fn(eager(x))
    ref.backward()
    torch.testing.assert_close(loss, ref)
    grads = {name: p.grad for name, p in made.module.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------ 8. a folded GNN's op name
def test_a_gnn_with_its_batch_folded_into_the_nodes_is_one_op_named_after_its_modules():
    """Every value between the convolutions and the head is ``(batch * nodes, dim)``: one op, named after the
    modules it spans (``convs+lin``, kind ``folded``), not after its first member with kind ``glue``; MobileViT's
    shape (blocks of ``mix`` on unfolded patches) is named after the module the blocks share."""
    from graphpipe.frontend.capture import captured_from_factory

    cap = captured_from_factory(f"{EDGES}:folded_gnn")
    assert [(op.name, op.kind) for op in cap.graph.ops] == [("convs+lin", "folded")]
    patches = captured_from_factory(os.path.join(HERE, "model_classes.py") + ":patches")
    assert [(op.name, op.kind) for op in patches.graph.ops] == [
        ("stem", "conv2d"), ("mix", "modulelist"), ("out", "conv2d"), ("head", "linear")]


# ------------------------------------------------------------ multi-rank runs, one launched job
def _edge_plans() -> dict:
    from test_real_models import hand_built

    return {
        "flagged": hand_built(f"{EDGES}:flagged", (["stem", "blocks.0"], ["blocks.1", "head", "join_outputs"]),
                              [(0,), (1,)], [2, 2], 2, "1f1b"),
        "gpt2_labels": hand_built(f"{EDGES}:gpt2_labels", (["transformer.wte", "transformer.wpe", "transformer.h.0"],
                                                           ["transformer.h.1", "lm_head", "join_outputs"]),
                                  [(0,), (1,)], [4, 4], 2, "1f1b"),
        "dtype_branch": hand_built(f"{EDGES}:dtype_branch", (["stem", "layers.0"], ["layers.1", "query", "head"]),
                                   [(0,), (1,)], [4, 4], 2, "1f1b"),
        "in_place": hand_built(f"{EDGES}:in_place", (["stem"], ["blocks.0", "blocks.1", "head"]), [(0,), (1,)],
                               [2, 2], 2, "1f1b"),
    }


@pytest.mark.slow
def test_edge_models_train_on_two_ranks_like_one_process():
    """``graphpipe run --check`` of each edge model over 2 ranks: constant inputs no longer reach a rank, a tiny
    GPT-2 called with ``labels=`` and ``output_hidden_states=True`` (through ``**kwargs``) trains, an in-place op
    on a received value trains, a model branching on its dtype trains at bf16; loss and every gradient equal one
    process for 2 steps."""
    from graphpipe.runtime import RunOptions, run_plans

    plans = _edge_plans()
    names = sorted(plans)
    precision = {"dtype_branch": "bf16"}  # traced at bf16 on every rank (meta weights on fake CPU tensors)
    results = run_plans([(plans[n], RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=120,
                                               precision=precision.get(n, "fp32"))) for n in names], 2)
    failures = {name: r.check for name, r in zip(names, results)
                if not (r.check.passed and r.check.num_params_checked == r.check.num_params > 0)}
    assert not failures, failures


# ------------------------------------------------------------ 5. checkpoints load into the plain module
def test_a_pipeline_checkpoint_loads_into_the_plain_module(one_rank_group, tmp_path):
    """``Pipeline.save`` after an SGD step holds every parameter and persistent buffer, the never-called
    ``post_layernorm`` and the never-read buffer included, and the tied head of a GPT-style toy under the
    embedding's name: ``load_into_module`` fills a fresh plain module with strict ``load_state_dict``, and it
    computes what the pipeline computes."""
    from graphpipe.frontend.capture import load_factory
    from graphpipe.runtime.api import Pipeline
    from graphpipe.runtime.checkpoint import checkpoint_layout, load_into_module
    from test_real_models import TIED, TIED_STAGES

    cases = {"unused": (f"{EDGES}:unused", (["stem", "blocks.0"], ["blocks.1", "head"])),
             "tied": (TIED, TIED_STAGES[:1] + (TIED_STAGES[1] + TIED_STAGES[2],))}
    for name, (spec, groups) in cases.items():
        plan = _one_rank_plan(spec, groups)
        made = load_factory(spec)
        pipe = Pipeline(plan, made.module, made.loss_fn)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.step(made.example_inputs)
        opt.step()
        pipe.save(tmp_path / name)
        plain = load_factory(spec).module
        with torch.no_grad():
            for t in plain.state_dict(keep_vars=True).values():
                t.zero_()  # nothing left from the factory's seed: every value comes from the checkpoint
        load_into_module(plain, tmp_path / name)
        for key, value in made.module.state_dict().items():  # the trained weights (the pipeline's own tensors)
            torch.testing.assert_close(plain.state_dict()[key], value, msg=lambda m, k=key: f"{name} {key}: {m}")
        trained = dict(pipe.named_parameters())
        assert any(not torch.equal(trained[k], load_factory(spec).module.state_dict()[k]) for k in trained)
        plain.eval(), made.module.eval()
        args = made.example_inputs
        torch.testing.assert_close(plain(*args), pipe.forward(args))
        pipe.close()
    saved = checkpoint_layout(tmp_path / "unused").shapes
    assert {"model/post_layernorm.weight", "model/post_layernorm.bias", "buffer/unused_stat"} <= set(saved)
    assert "buffer/cache" not in saved  # not persistent, and no stage holds it
    # built on meta: the unused LayerNorm and Linear are made from the seed as hosted tensors are (their own
    # reset_parameters), so the checkpoint still loads strictly into the plain module
    spec = f"{EDGES}:unused_on_meta"
    saved = {}
    for seed in (3, 3, 4):
        made = load_factory(spec)
        with torch.device("meta"):
            module = edge_models.UnusedOnMeta()
        pipe = Pipeline(_one_rank_plan(spec, (["stem"], ["head"])), module, made.loss_fn,
                        example_inputs=made.example_inputs, seed=seed)
        pipe.save(tmp_path / f"meta{len(saved)}")
        plain = edge_models.UnusedOnMeta()
        with torch.no_grad():
            for t in plain.state_dict(keep_vars=True).values():
                t.fill_(7.0)
        load_into_module(plain, tmp_path / f"meta{len(saved)}")  # strict: every key is in the checkpoint
        for name, value in pipe.named_parameters():
            torch.testing.assert_close(plain.state_dict()[name], value)
        pipe.close()
        saved[len(saved)] = plain.state_dict()
    assert torch.equal(saved[0]["post_layernorm.weight"], torch.ones(8))
    assert torch.equal(saved[0]["post_layernorm.bias"], torch.zeros(8))
    assert torch.equal(saved[0]["extra.weight"], saved[1]["extra.weight"])  # the seed and the name decide
    assert not torch.equal(saved[0]["extra.weight"], saved[2]["extra.weight"])
    assert saved[0]["extra.weight"].abs().max() <= 8 ** -0.5  # Linear's own init: U(-1/sqrt(in), 1/sqrt(in))


# ------------------------------------------------------------ 6. plan and simulate agree
def test_plan_and_simulate_print_one_prediction(tmp_path, capsys):
    """Across two of the zoo's small models and two tied-weight models (the GPT toy, a tiny Llama with tied
    embeddings), every strategy's plan: ``graphpipe simulate`` of the written plan prints the iteration time and
    peak memory the plan holds, the tied-weight all-reduce included where a tie is split (at least one is)."""
    import json

    from graphpipe.cli import main
    from graphpipe.plan import write_plan
    from test_real_models import TIED, planned

    every = (("gpp", 4), ("pipedream", 3), ("gpipe", 3), ("piper", 2))
    models = {"mmt:small": every[:2], "transformer:small": every[2:], TIED: every,
              os.path.join(HERE, "hf_models.py") + ":llama": every}
    split_ties = 0
    for spec, strategies in models.items():
        for strategy, devices in strategies:
            plan = planned(spec, strategy, devices)
            path = str(tmp_path / "plan.json")
            write_plan(path, plan)
            assert main(["simulate", path, "--json"]) == 0
            figures = json.loads(capsys.readouterr().out)
            where = f"{spec} {strategy}"
            assert figures["iteration_time_s"] == pytest.approx(plan.predicted.iteration_time_s, rel=1e-9), where
            assert figures["peak_memory_bytes"] == pytest.approx(list(plan.predicted.peak_memory_bytes), rel=1e-9), where
            charged = plan.predicted.shared_params_allreduce_s
            assert figures.get("shared_params_allreduce_s") == charged, where
            split_ties += bool(charged)
    assert split_ties > 0


# ------------------------------------------------------------ 7. memory estimates
def test_a_rank_is_charged_a_second_copy_of_its_largest_ops_gradients():
    """An embedding of 40 MB beside a 4 MB layer on rank 0, a 20 MB head on rank 1: each rank's estimate gains its
    largest op's parameter bytes (the gradient autograd makes before adding it into ``.grad``), and the
    launcher's host check counts it."""
    from graphpipe.cluster import preset
    from graphpipe.graph import Op, OpGraph
    from graphpipe.plan import Plan
    from graphpipe.runtime.memory import check_host_memory, rank_memory
    from graphpipe.sched import make_schedule
    from graphpipe.stages import Stage, StageGraph

    g = OpGraph.build("lm", [Op("embed", "embedding", param_bytes=40e6), Op("layer", "linear", param_bytes=4e6),
                             Op("head", "linear", param_bytes=20e6)], [("embed", "layer", 8.0), ("layer", "head", 8.0)])
    sg = StageGraph.build(g, [Stage(0, (0, 1), (0,), 2), Stage(1, (2,), (1,), 2)], 4, 2)
    plan = Plan(model="lm", stage_graph=sg, cluster=preset("v100", 2), strategy="custom",
                schedule=make_schedule("1f1b", sg, preset("v100", 2)))
    ranks = rank_memory(plan)
    assert [r.transient_bytes for r in ranks] == [40e6, 20e6]
    assert [r.state_bytes for r in ranks] == [88e6, 40e6]
    for r in ranks:
        assert r.total_bytes == r.state_bytes + r.activation_bytes + r.base_bytes + r.transient_bytes
    need = sum(r.total_bytes for r in ranks)
    assert check_host_memory(plan, available=need) == ranks
    with pytest.raises(InputError):
        check_host_memory(plan, available=need - 30e6)  # short of the transient gradients alone
