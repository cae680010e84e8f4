"""Classes of third-party models graphpipe must plan, run with --check and train (tests/model_classes.py).

Oracles: ``--check``'s single-process reference (loss, every gradient and
buffer after every step at fp32 tolerances), the planner and runtime agreeing
on every strategy's plan, FLOP counts against a second implementation of
the same layer and against the formula, one-process PyTorch training for the
API.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from graphpipe.cluster import preset
from graphpipe.plan import Plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "model_classes.py")
POS = MODELS + ":pos_table"
FROZEN = MODELS + ":frozen"
ROW_SCALAR = MODELS + ":row_scalar"
ILL = MODELS + ":ill_conditioned"
CHAIN_TARGET = MODELS + ":chain_target"
CHAIN_KEYWORDS = MODELS + ":chain_keywords"
BATCH = 8

pytestmark = pytest.mark.usefixtures("one_thread")


def graph_of(spec: str):
    from graphpipe.models import load_model

    return load_model(spec).graph


def chain_plan(spec: str, groups, devices, mbs, schedule: str = "1f1b", recompute: bool = False) -> Plan:
    """Stages of consecutive ops (``groups``: op counts), on ``devices``, at micro-batch sizes ``mbs``."""
    graph = graph_of(spec)
    bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
    stages = [Stage(i, tuple(range(bounds[i], bounds[i + 1])), tuple(devs), mb, recompute=recompute)
              for i, (devs, mb) in enumerate(zip(devices, mbs))]
    num_devices = max(d for devs in devices for d in devs) + 1
    sg = StageGraph.build(graph, stages, BATCH, num_devices)
    cluster = preset("v100", num_devices)
    return Plan(model=spec, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


def rank_setup(plan: Plan):
    """What a rank builds before its first step, short of process groups: split, boundary values, routing."""
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.routing import Routing
    from graphpipe.runtime.stage_modules import boundary_meta, check_unbatched_edges, split_model

    runnable = load_runnable(plan.model)
    split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
    meta = boundary_meta(runnable.gm, split.boundary_values, runnable.make_inputs)
    edges = {(prog.stage_id, c): values for prog in split.programs for c, values in prog.send_values}
    routing = Routing(plan.stage_graph, plan.schedule, edges, [v for v, m in meta.items() if m.needs_grad])
    check_unbatched_edges(routing, meta)
    return split, meta


# ------------------------------------------------------------------ values without a batch dimension
def test_values_without_a_batch_dimension_are_told_apart_and_carried_whole():
    plan = chain_plan(POS, (1, 4, 2, 3), [(0,), (1,), (2,), (3,)], [2, 2, 2, 2])
    split, meta = rank_setup(plan)
    unbatched = {name: m for name, m in meta.items() if not m.batched}
    shapes = sorted(m.sample_shape for m in unbatched.values())
    assert shapes == [(1, 2, 5, 5), (1, 5, 8)], meta  # the position table and the relative bias
    assert all(m.constant for m in unbatched.values())  # computed from parameters alone
    assert all(m.shape(3) == m.sample_shape for m in unbatched.values())  # a message carries the whole value
    assert any(m.batched and m.shape(3) == (3, 5, 8) for m in meta.values())


def test_every_strategy_plans_the_position_table_into_something_the_runtime_runs():
    """Planner and runtime agree: no plan of any strategy is refused for a value without a batch dimension."""
    from graphpipe.runtime import RunOptions, preflight
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    cut = 0
    for strategy in ("gpp", "pipedream", "piper", "gpipe"):
        for num_devices, mb in ((2, 2), (4, 2), (4, 1)):
            plan = make_plan(POS, graph_of(POS), preset("v100", num_devices), BATCH, strategy,
                             SearchOptions(micro_batch_size=mb))
            preflight(plan, RunOptions(check=True))
            _, meta = rank_setup(plan)
            cut += any(not m.batched for m in meta.values())
    assert cut  # some plan did cut across the tables


def test_a_row_dependent_scalar_crosses_only_between_matching_shards():
    from graphpipe.errors import PlanError

    same = chain_plan(ROW_SCALAR, (2, 2), [(0,), (1,)], [2, 2])
    _, meta = rank_setup(same)
    (scalar,) = [m for m in meta.values() if not m.batched]
    assert scalar.sample_shape == () and not scalar.constant
    with pytest.raises(PlanError, match=r"depends on the rows.*2 rows and the consumer's 4"):
        rank_setup(chain_plan(ROW_SCALAR, (2, 2), [(0,), (1,)], [2, 4]))


# ------------------------------------------------------------------ frozen parameters
def test_frozen_parameters_get_no_gradient_buffer_and_are_not_compared():
    from graphpipe.errors import PlanError
    from graphpipe.runtime.reference import compare_gradients
    from graphpipe.runtime.options import RunOptions

    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(3))
    trained.grad = torch.full((3,), 2.0)
    stats = compare_gradients([("f", frozen, True), ("t", trained, True)], {"t": torch.full((3,), 2.0)}, RunOptions())
    assert stats == (0.0, 0, 1)  # the frozen one is neither compared nor counted
    frozen.grad = torch.ones(3)
    with pytest.raises(PlanError, match="frozen parameter 'f' got a gradient"):
        compare_gradients([("f", frozen, True)], {}, RunOptions())


# ------------------------------------------------------------------ multi-rank
def class_plans() -> dict[str, tuple[Plan, dict]]:
    ops = len(graph_of(POS).ops)
    assert ops == 10
    return {
        # the tables cross every cut, one micro-batch size
        "pos/4-stages": (chain_plan(POS, (1, 4, 2, 3), [(0,), (1,), (2,), (3,)], [2, 2, 2, 2]), {}),
        # a consumer of micro-batch 4 fed by producer micro-batches of 2, a replicated stage, re-materialization
        "pos/mixed-sizes": (chain_plan(POS, (3, 4, 3), [(0,), (1, 2), (3,)], [2, 4, 2], "graph-1f1b",
                                       recompute=True), {}),
        "pos/zero-bubble": (chain_plan(POS, (5, 5), [(0,), (1,)], [2, 2], "zb-h1"), {}),
        "frozen/replicated": (chain_plan(FROZEN, (5, 2, 3), [(0, 1), (2,), (3,)], [4, 2, 2], "graph-1f1b"), {}),
        "chain-target/torch": (chain_plan(CHAIN_TARGET, (2, 2), [(0,), (1,)], [2, 2], "1f1b"), {"baseline": "torch"}),
        "chain-keywords/torch": (chain_plan(CHAIN_KEYWORDS, (2, 2), [(0,), (1,)], [2, 2], "gpipe"),
                                 {"baseline": "torch"}),
    }


@pytest.mark.slow
def test_model_classes_match_single_process_for_two_steps():
    from graphpipe.runtime import RunOptions, run_plans

    plans = class_plans()
    names = sorted(plans)
    results = run_plans([(plans[n][0], RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=120,
                                                  **plans[n][1])) for n in names], 4)
    failures = {}
    for name, result in zip(names, results):
        check = result.check
        if not (check.passed and check.num_params_checked == check.num_params > 0):
            failures[name] = check
    assert not failures, failures
    by_name = dict(zip(names, results))
    trainable = sum(p.requires_grad for p in __import__("model_classes").frozen()[0].parameters())
    assert by_name["frozen/replicated"].check.num_params == trainable < 21  # frozen ones left out
    assert by_name["chain-target/torch"].baseline.startswith("torch.distributed.pipelining")


# ------------------------------------------------------------------ capture
def test_bf16_capture_of_meta_models_equals_the_fp32_graph():
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, HERE)
    import hf_models

    from graphpipe.frontend.capture import capture

    for made in (hf_models.llama(layers=2, hidden=32, meta=True), hf_models.gpt2_meta()):
        model, inputs, loss_fn, target = made
        fp32 = capture(model, inputs, loss_fn=loss_fn, example_target=target).graph
        bf16 = capture(model, inputs, loss_fn=loss_fn, example_target=target, precision="bf16").graph
        assert [op.name for op in bf16.ops] == [op.name for op in fp32.ops]
        # the same layers' FLOPs (attention on fake CPU tensors is counted on CPU's kernel, on meta on the math path)
        assert sum(op.fwd.beta for op in bf16.ops) == pytest.approx(sum(op.fwd.beta for op in fp32.ops), rel=0.1)
        assert 0 < sum(op.act_bytes for op in bf16.ops) < sum(op.act_bytes for op in fp32.ops)


def test_grouped_matmul_experts_cost_what_batched_experts_cost():
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, HERE)
    import hf_models

    from graphpipe.frontend.capture import capture

    costs = {}
    for impl in (None, "batched_mm"):
        model, inputs, loss_fn, target = hf_models.mixtral_meta(experts=impl)
        graph = capture(model, inputs, loss_fn=loss_fn, example_target=target).graph
        costs[impl] = [op.fwd for op in graph.ops]
    assert costs[None] == costs["batched_mm"]


def test_grouped_mm_formula_equals_the_matmuls_it_stands_for():
    from torch.utils.flop_counter import FlopCounterMode

    from graphpipe.frontend.flops import flop_counter

    a, b = torch.randn(12, 16), torch.randn(4, 16, 8)
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # an expert with no rows
    with flop_counter() as grouped:
        out = torch.ops.aten._grouped_mm(a, b, offs)
    with FlopCounterMode(display=False) as loop:
        start, parts = 0, []
        for g, end in enumerate(offs.tolist()):
            parts.append(a[start:end] @ b[g])
            start = end
    torch.testing.assert_close(out, torch.cat(parts))
    assert grouped.get_total_flops() == loop.get_total_flops() == 2 * 12 * 16 * 8


def test_ops_without_a_flop_formula_are_named_once(caplog):
    from graphpipe.frontend.capture import capture

    sys_path = __import__("sys").path
    sys_path.insert(0, HERE)
    import model_classes

    model, inputs, loss_fn = model_classes.custom_op()
    with caplog.at_level(logging.WARNING, logger="graphpipe.frontend.flops"):
        capture(model, inputs, name="custom", loss_fn=loss_fn)
        capture(model, inputs, name="custom", loss_fn=loss_fn)  # the same model again: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "graphpipe.frontend.flops"]
    assert len(warnings) == 1 and "graphpipe_tests::fused_scale" in warnings[0] and "aten" not in warnings[0]


def test_interpolation_is_cheap_and_a_matmul_counted_at_zero_is_not():
    from graphpipe.frontend.flops import UnknownCosts

    unknown = UnknownCosts()
    unknown.note(torch.ops.aten.upsample_bilinear2d.vec, 0)  # MobileViT's and segmentation heads' resizing
    unknown.note(torch.ops.aten.grid_sampler_2d.default, 0)
    unknown.note(torch.ops.aten.relu.default, 0)
    assert unknown.counts == {}
    unknown.note(torch.ops.aten.mm.default, 0)
    unknown.note(torch.ops.aten.linear.default, 0)
    assert sorted(unknown.counts) == ["aten::linear", "aten::mm"]


# ------------------------------------------------------------------ the training API
def _one_rank_world():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")


def _end_world():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)


def _write_plan(tmp_path, spec: str) -> str:
    """One stage on one rank at micro-batch 4 (a world of one process)."""
    from graphpipe.plan import write_plan

    plan = chain_plan(spec, (len(graph_of(spec).ops),), [(0,)], [4], "gpipe")
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    return path


def test_a_loss_with_a_target_trains_through_the_api_from_the_first_step(tmp_path):
    """The plan's factory loss takes no target; the user's does: step(x, y) equals plain PyTorch training, the
    optimizer built before the first step keeps stepping the same tensors, and example_target= alone is kept."""
    import torch.nn.functional as F

    import model_classes
    from graphpipe.errors import InputError
    from graphpipe.runtime.api import Pipeline

    plan = _write_plan(tmp_path, MODELS + ":untargeted")
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(BATCH, 6, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)) for _ in range(2)]
    loss_fn = lambda out, y: F.cross_entropy(out, y)  # noqa: E731

    expected = []
    model = model_classes.untargeted()[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    _one_rank_world()
    try:
        pipe = Pipeline(plan, model_classes.untargeted()[0], loss_fn, timeout_s=60)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        got = []
        for x, y in batches:
            got.append(pipe.step(x, y).item())
            opt.step()
            opt.zero_grad()
        assert got == pytest.approx(expected, rel=1e-5)
        weights = dict(pipe.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(weights[name], p)
        with pytest.raises(InputError, match="the loss takes a target"):
            pipe.step(batches[0][0])
        pipe.close()
        _end_world()
        _one_rank_world()
        x, y = batches[0]
        given = Pipeline(plan, model_classes.untargeted()[0], loss_fn, example_target=y, timeout_s=60)
        assert given._io.target_spec is not None  # captured with the target given alone
        assert given.step(x, y) == pytest.approx(loss_fn(model_classes.untargeted()[0](x), y).item(), rel=1e-5)
        given.close()
        _end_world()
        _one_rank_world()
        plain = Pipeline(plan, model_classes.untargeted()[0], lambda out: out.pow(2).mean(), timeout_s=60)
        with pytest.raises(InputError, match="the loss takes no target"):
            plain.step(x, y)
        plain.close()
    finally:
        _end_world()


def test_frozen_parameters_stay_frozen_through_the_api(tmp_path):
    """AdamW over pipe.parameters(): frozen tensors keep their values and get no optimizer state; the others
    train as in one process."""
    import model_classes
    from graphpipe.runtime.api import Pipeline

    plan = _write_plan(tmp_path, FROZEN)
    model, (ids,), loss_fn = model_classes.frozen()
    reference = model_classes.frozen()[0]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _one_rank_world()
    try:
        pipe = Pipeline(plan, model, loss_fn, timeout_s=60)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        for _ in range(2):
            pipe.step(ids)
            opt.step()
            opt.zero_grad()
            loss_fn(reference(ids)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        frozen = {n for n, p in reference.named_parameters() if not p.requires_grad}
        assert frozen == {"tok.weight", "pos.weight", "blocks.0.qkv.weight", "blocks.0.qkv.bias",
                          "blocks.0.out.weight", "blocks.0.out.bias"}
        after = dict(pipe.named_parameters())
        for name, p in reference.named_parameters():
            torch.testing.assert_close(after[name], p)
            if name in frozen:
                assert torch.equal(after[name], before[name]) and after[name].grad is None
                assert after[name] not in opt.state
            else:
                assert after[name] in opt.state
        pipe.close()
    finally:
        _end_world()


# ------------------------------------------------------------------ --check tolerance from the numerics
def test_check_tolerance_grows_with_the_references_own_rounding_but_still_catches_a_wrong_gradient():
    """Oracle: the reference run twice, fp32 and float64. A pipelined gradient as far from the reference as fp32
    rounding moves it passes; the same gradient fails the fixed fp32 tolerance; half a gradient (a lost
    micro-batch) fails even the widened one. A well-conditioned model's spread stays at rounding level."""
    from graphpipe.runtime.reference import compare_gradients, reference_run
    from graphpipe.runtime.options import RunOptions

    ill = reference_run(ILL, 0, BATCH, {}, 2, 0.01, with_spread=True)
    well = reference_run(POS, 0, BATCH, {}, 2, 0.01, with_spread=True)
    assert max(well.grad_spread[0].values()) < 1e-5 < 1e-3 < max(ill.grad_spread[0].values())
    assert len(ill.grad_spread) == 2 and set(ill.grad_spread[1]) == set(ill.grads[1])
    options = RunOptions()
    for step in range(2):
        grads, spreads = ill.grads[step], ill.spread_at(step)[0]

        def params(scale: float = 1.0, shift: float = 1.0):
            out = []
            for name, g in grads.items():
                p = torch.nn.Parameter(torch.zeros_like(g))
                sign = torch.ones_like(g).view(-1)
                sign[::2] = -1
                p.grad = g * scale + shift * spreads[name] * sign.view_as(g)  # one spread off, alternating
                out.append((name, p, True))
            return out

        assert compare_gradients(params(), grads, options)[1] > 0  # the fixed tolerance fails a correct run
        assert compare_gradients(params(), grads, options, spreads)[1] == 0
        assert compare_gradients(params(scale=0.5, shift=0.0), grads, options, spreads)[1] > 0


def test_float64_graph_widens_the_dtypes_the_export_spelled_out():
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.numerics import float64_graph

    runnable = load_runnable(POS)
    gm = float64_graph(runnable.gm)
    assert "torch.float32" not in gm.code and all(p.dtype == torch.float64 for p in gm.parameters())
    (out,) = gm(*runnable.make_inputs(2, 0))
    assert out.dtype == torch.float64


def test_a_factory_model_is_profiled_under_the_plans_op_names():
    """graphpipe profile on file.py:factory models (keyword inputs, a loss target): the profile applies to the
    graph the planner captures."""
    from graphpipe.frontend.profile import apply_profile, profile_model

    for spec in (CHAIN_TARGET, CHAIN_KEYWORDS):
        profile = profile_model(spec, batch_sizes=(1, 2), repeats=1, warmup=0)
        graph = graph_of(spec)
        assert set(profile.ops) == {op.name for op in graph.ops}
        costed = apply_profile(graph, profile, spec)
        assert all(op.fwd.beta >= 0 and op.fwd(2) > 0 for op in costed.ops)
