"""Compiled stages on what held-out models have: dropout, attention dropout, BatchNorm, frozen layers, and ops that
cannot compile.

Oracles: the single-process eager reference of ``--check`` (loss, every gradient, every buffer), dynamo's own
counters (no graph break: nothing ran eagerly behind the user's back; one compilation per stage however many
micro-batches and steps), ``scaled_dot_product_attention`` itself for the written-out attention, and the error
text naming the stage and the real cause.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from graphpipe.cluster import preset
from graphpipe.plan import Plan, write_plan
from graphpipe.runtime.compiled import CompileError, CompiledForward
from graphpipe.runtime.options import RunOptions
from graphpipe.sched import make_schedule

from test_runtime_units import make_sg, one_rank_group  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_models.py")


def _plan(factory: str, k: int, devices, num_devices: int, mbs: int = 2, schedule: str = "gpipe") -> Plan:
    """``k`` contiguous stages of the factory's ops on ``devices`` (a device per stage)."""
    from graphpipe.models import load_model

    spec = f"{MODELS}:{factory}"
    graph = load_model(spec).graph
    names = [op.name for op in graph.ops]
    cuts = [round(i * len(names) / k) for i in range(k + 1)]
    groups = [tuple(graph.op_id(n) for n in names[cuts[i]:cuts[i + 1]]) for i in range(k)]
    sg = make_sg(graph, groups, devices, [mbs] * k, 8, num_devices, shared=len(set(devices)) < k)
    cluster = preset("v100", num_devices)
    return Plan(model=spec, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


def test_dropout_attention_batchnorm_and_frozen_layers_compile_whole_and_train_like_eager(one_rank_group):
    """Three compiled stages on one rank, 4 micro-batches, 3 steps: --check passes for the loss, every gradient
    and the BatchNorm buffers (so compiled dropout and attention dropout drew the eager masks), no graph break
    (nothing fell back to eager) and one compilation per stage (a micro-batch or a step is new data, not a new
    graph)."""
    from torch._dynamo.utils import counters

    from graphpipe.runtime.worker import run_job

    torch._dynamo.reset()
    counters.clear()
    plan = _plan("noisy", 3, [(0,)] * 3, 1)
    result = run_job(0, 1, plan, RunOptions(steps=3, check=True, compile=True), torch.device("cpu"), "gloo")
    check = result.check
    assert check.passed, check
    assert check.num_params_checked == check.num_params > 0 and check.num_buffers_checked == check.num_buffers > 0
    assert len(set(result.losses)) == 3
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["aot_autograd"]["total"] == 3, dict(counters["aot_autograd"])


def test_an_op_drawing_from_the_global_generator_is_refused_naming_stage_and_op(one_rank_group):
    from graphpipe.runtime.worker import run_job

    plan = _plan("global_noise", 2, [(0,)] * 2, 1)
    with pytest.raises(CompileError, match=r"stage \d cannot be compiled.*randn_like.*global random generator"):
        run_job(0, 1, plan, RunOptions(steps=1, compile=True), torch.device("cpu"), "gloo")


def test_batch_sized_random_factories_compile_and_draw_what_eager_draws(one_rank_group):
    """Drop-path's ``rand((B, 1))`` and a ``randn((B, 4))`` in two compiled stages: --check against the eager
    reference passes (the draws come from the seeds the eager stages seed the global generator with), with no
    graph break and one compilation per stage; and the operator draws what the seeded global generator does."""
    from torch._dynamo.utils import counters

    from graphpipe.runtime.rng import draw_sized
    from graphpipe.runtime.worker import run_job

    for normal, factory in ((False, torch.rand), (True, torch.randn)):
        with torch.random.fork_rng():
            torch.manual_seed(12345)
            expected = factory((3, 5))
        assert torch.equal(draw_sized(12345, normal, (3, 5), torch.float32, torch.device("cpu")), expected)
    torch._dynamo.reset()
    counters.clear()
    plan = _plan("drop_path", 2, [(0,)] * 2, 1)
    result = run_job(0, 1, plan, RunOptions(steps=2, check=True, compile=True), torch.device("cpu"), "gloo")
    assert result.check.passed and result.check.num_params_checked == result.check.num_params > 0, result.check
    assert not result.check.unseeded_ops
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["aot_autograd"]["total"] == 2, dict(counters["aot_autograd"])


def test_a_graph_break_and_the_recompile_limit_are_errors_not_silent_eager_runs():
    def branchy(x):
        return x * 2 if float(x.sum()) > 0 else x  # a Python branch on a value: dynamo must break the graph

    with pytest.raises(CompileError, match="stage 3 cannot be compiled"):
        CompiledForward(branchy, stage_id=3, backend="eager")(torch.ones(2))
    compiled = CompiledForward(lambda x: x * 2, stage_id=5, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 2.0))
        with pytest.raises(CompileError, match="stage 5 .*recompiled more than.*recompile_limit=1"):
            compiled(torch.ones(3))


@pytest.mark.parametrize("case", ["causal-gqa", "float-mask", "bool-mask"])
def test_written_out_attention_is_the_kernel(case):
    """The attention a compiled stage writes out (keep-mask all ones) equals scaled_dot_product_attention."""
    from graphpipe.runtime.rng import _written_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=g)
    kv_heads = 2 if case == "causal-gqa" else 4
    k, v = torch.randn(2, kv_heads, 5, 3, generator=g), torch.randn(2, kv_heads, 5, 3, generator=g)
    args = dict(query=q, key=k, value=v, dropout_p=0.5)
    if case == "causal-gqa":
        args.update(is_causal=True, enable_gqa=True)
    elif case == "float-mask":
        args.update(attn_mask=torch.randn(2, 1, 5, 5, generator=g), scale=0.7)
    else:
        args.update(attn_mask=torch.rand(5, 5, generator=g) > 0.3)
        args["attn_mask"][:, 0] = True  # every row attends somewhere
    expected = F.scaled_dot_product_attention(**{**args, "dropout_p": 0.0})
    got = _written_attention(args, lambda shape, like: torch.ones(shape))
    torch.testing.assert_close(got * 0.5, expected)  # all kept: only the 1 / (1 - p) scale remains


def test_written_out_attention_dropout_depends_on_rows_not_on_the_cut():
    """In a compiled run's reference, attention dropout drawn over the whole batch cut at 2 rows equals what the
    pipeline's shards draw (the property --check relies on)."""
    from graphpipe.runtime.rng import ReferenceContext, ShardContext, _seeded_attention, explicit_attention

    attend = _seeded_attention(F.scaled_dot_product_attention)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 2, 3, 2, generator=g) for _ in range(3))
    with explicit_attention():
        whole = attend(q, k, v, dropout_p=0.5, rng_ctx=ReferenceContext(0, 1, 4, {"att": {"dropout": 2}}),
                       rng_op="att")
        shards = [attend(q[lo:lo + 2], k[lo:lo + 2], v[lo:lo + 2], dropout_p=0.5,
                         rng_ctx=ShardContext(0, 1, lo, 2, lo, 2), rng_op="att") for lo in (0, 2)]
    torch.testing.assert_close(whole, torch.cat(shards), rtol=0, atol=0)
    assert not torch.allclose(whole, F.scaled_dot_product_attention(q, k, v))  # it did drop


def test_the_cli_refusal_of_a_stage_takes_every_rank_down_with_one_line(tmp_path, capsys):
    from graphpipe.cli import main

    path = str(tmp_path / "noise.json")
    write_plan(path, _plan("global_noise", 2, [(0,), (1,)], 2))
    assert main(["run", path, "--compile", "--steps", "2", "--timeout", "60"]) == 2
    err = capsys.readouterr().err.strip()
    assert "randn_like" in err and "stage" in err and "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("sync", [False, True])
def test_compiled_batchnorm_files_its_statistics_as_the_eager_stage_does(sync, one_rank_group):
    """A compiled ShardedBatchNorm (per shard, or synchronised over a group) normalises as eagerly and files its
    statistics under the same (op, first row) key: the shard's row, or the micro-batch's under sync."""
    import torch.distributed as dist

    from graphpipe.runtime.batchnorm import ShardedBatchNorm
    from graphpipe.runtime.rng import ShardContext
    from graphpipe.runtime.stage_modules import BoundForward

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = ShardedBatchNorm(torch.nn.BatchNorm1d(3))

        def forward(self, x, rng_ctx=None):
            return self.bn(x, rng_ctx, "bn")

    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, ShardedBatchNorm) or super().is_leaf_module(m, name)

    root = Stage()
    gm = torch.fx.GraphModule(root, Leaves().trace(root))
    gm.bn.group = dist.group.WORLD if sync else None
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    ctx = ShardContext(0, 0, 6, 4, 4, 8)  # rows 6..9 of the micro-batch starting at row 4
    eager = gm(x, ctx)
    expected = dict(gm.bn.pending)
    gm.bn.pending.clear()
    got = CompiledForward(BoundForward(gm), stage_id=0, backend="eager")(x, ctx)
    torch.testing.assert_close(got, eager)
    assert list(gm.bn.pending) == list(expected) == [("bn", 4 if sync else 6)]
    torch.testing.assert_close(gm.bn.pending[("bn", 4 if sync else 6)], expected[("bn", 4 if sync else 6)])
