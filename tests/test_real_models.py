"""Dropout, BatchNorm and tied weights under micro-batching, replication and planning (docs/semantics.md).

Oracle: ``--check``'s single-process reference with the same training
semantics (dropout streams per (seed, step, op, shard), BatchNorm per
micro-batch or synchronised across replicas, one parameter for tied copies):
loss, every gradient and every buffer equal after each of 3 SGD steps with
fp32 ``assert_close`` tolerances. The multi-rank plans all run in one
spawned 4-rank world (CI has 2 cores).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from graphpipe.cluster import preset
from graphpipe.plan import Plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

HERE = os.path.dirname(os.path.abspath(__file__))
BRANCHY = os.path.join(HERE, "real_models.py") + ":branchy"
TIED = os.path.join(HERE, "real_models.py") + ":tied_lm"
NOISY = os.path.join(HERE, "real_models.py") + ":noisy"
SHARED = os.path.join(HERE, "real_models.py") + ":shared_layer"
OWN_RNG = os.path.join(HERE, "real_models.py") + ":own_generator"
DROP_PATH = os.path.join(HERE, "real_models.py") + ":drop_path"
BATCH = 8
ALL_STRATEGIES = ("gpp", "pipedream", "gpipe", "piper")


def graph_of(spec: str):
    from graphpipe.models import load_model

    return load_model(spec).graph


def planned(spec: str, strategy: str, num_devices: int, micro_batch_size: int = 2) -> Plan:
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    return make_plan(spec, graph_of(spec), preset("v100", num_devices), BATCH, strategy,
                     SearchOptions(micro_batch_size=micro_batch_size))


def hand_built(spec, groups, devices, mbs, num_devices, schedule, batchnorm="per-micro-batch", recompute=False) -> Plan:
    graph = graph_of(spec)
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), tuple(devs), mb, recompute=recompute)
              for i, (ops, devs, mb) in enumerate(zip(groups, devices, mbs))]
    sg = StageGraph.build(graph, stages, BATCH, num_devices)
    cluster = preset("v100", num_devices)
    return Plan(model=spec, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster), batchnorm=batchnorm)


# ------------------------------------------------------------------ single process
def test_dropout_masks_depend_on_rows_not_on_how_the_batch_is_cut():
    from graphpipe.runtime.rng import ReferenceContext, ShardContext, seeded_dropout

    x = torch.ones(8, 5)
    ref = seeded_dropout(x, 0.5, True, ReferenceContext(3, 2, 8, {"d": {"dropout": 2}}), "d")
    for lo in range(0, 8, 2):  # each shard on its own, in any order, twice (a recomputed forward)
        ctx = ShardContext(3, 2, lo, 2, lo, 2)
        assert torch.equal(seeded_dropout(x[lo:lo + 2], 0.5, True, ctx, "d"), ref[lo:lo + 2])
        assert torch.equal(seeded_dropout(x[lo:lo + 2], 0.5, True, ctx, "d"), ref[lo:lo + 2])
    other_step = seeded_dropout(x, 0.5, True, ReferenceContext(3, 3, 8, {"d": {"dropout": 2}}), "d")
    other_op = seeded_dropout(x, 0.5, True, ReferenceContext(3, 2, 8, {"d": {"dropout": 2}}), "e")
    assert not torch.equal(ref, other_step) and not torch.equal(ref, other_op)
    kept = ref[ref != 0]
    assert torch.allclose(kept, torch.full_like(kept, 2.0))  # inverted dropout scaling


def test_recomputed_forward_replays_the_mask_under_checkpoint():
    from torch.utils.checkpoint import checkpoint

    from graphpipe.runtime.rng import ShardContext, seeded_dropout

    w = torch.randn(5, 5, requires_grad=True)
    x = torch.randn(4, 5)
    ctx = ShardContext(0, 1, 4, 4, 4, 4)
    f = lambda x, ctx: seeded_dropout(x @ w, 0.5, True, ctx, "d").sum()  # noqa: E731
    f(x, ctx).backward()
    plain = w.grad.clone()
    w.grad = None
    torch.manual_seed(123)  # the global generator plays no part
    checkpoint(f, x, ctx, use_reentrant=False, preserve_rng_state=False).backward()
    torch.testing.assert_close(w.grad, plain, rtol=0, atol=0)


def test_deferred_batchnorm_running_stats_equal_full_batch_ones():
    from graphpipe.runtime.batchnorm import ShardedBatchNorm
    from graphpipe.runtime.rng import ReferenceContext

    torch.manual_seed(0)
    x = torch.randn(8, 3, 4) * 3 + 1
    full = torch.nn.BatchNorm1d(3)
    full(x)
    for momentum in (0.1, None):
        bn = ShardedBatchNorm(torch.nn.BatchNorm1d(3, momentum=momentum))
        y = bn(x, ReferenceContext(0, 0, 8, {"bn": {"batchnorm": 2}}), "bn")
        torch.testing.assert_close(y[2:4], torch.nn.functional.batch_norm(x[2:4], None, None, training=True))
        bn.commit()
        expected = full if momentum is not None else None
        if expected is not None:
            torch.testing.assert_close(bn.running_mean, full.running_mean)
            torch.testing.assert_close(bn.running_var, full.running_var)
        else:  # cumulative average after one step: the mini-batch statistics themselves
            torch.testing.assert_close(bn.running_mean, x.mean((0, 2)))
            torch.testing.assert_close(bn.running_var, x.transpose(0, 1).reshape(3, -1).var(1))
        assert int(bn.num_batches_tracked) == 1


def test_split_keeps_tied_copies_apart_and_names_them():
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.stage_modules import split_model

    plan = hand_built(TIED, (["embed", "block0"], ["add", "block1", "add_1"], ["block2", "head"]),
                      [(0,), (1,), (2,)], [2, 2, 2], 3, "gpipe")
    runnable = load_runnable(plan.model)
    split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
    (tie,) = split.tied
    # the captured graph reads a tied parameter under the module's first name for it, in every stage
    assert tie.name == "embed.weight" and tie.copies == ((0, "embed.weight"), (2, "embed.weight"))
    first = split.programs[0].module.get_parameter("embed.weight")
    copy = split.programs[2].module.get_parameter("embed.weight")
    assert first is not copy and torch.equal(first, copy)
    assert split.programs[2].param_names["embed.weight"] == "embed.weight"


def test_a_layer_called_from_two_stages_gets_a_private_copy_in_the_second():
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.stage_modules import split_model

    plan = hand_built(SHARED, (["inp", "shared"], ["shared_1", "out"]), [(0,), (1,)], [2, 2], 2, "gpipe")
    runnable = load_runnable(plan.model)
    original = runnable.gm.get_submodule("shared")
    split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
    assert [(t.name, t.copies) for t in split.tied] == [("shared.weight", ((0, "shared.weight"), (1, "shared.weight"))),
                                                         ("shared.bias", ((0, "shared.bias"), (1, "shared.bias")))]
    first, second = (p.module.get_submodule("shared") for p in split.programs)
    # stage 0 trains the model's own tensor; stage 1 holds a copy of its own
    assert first.weight is original.weight and second.weight is not original.weight
    assert torch.equal(first.weight, second.weight)


def test_global_generator_draws_are_seeded_per_shard_and_replayed_by_the_reference():
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.rng import ReferenceContext, ShardContext

    runnable = load_runnable(NOISY)
    gm, x = runnable.gm, runnable.make_inputs(BATCH, 3)[0]
    assert "rng_ctx" in gm.code and "seeded_randn_like" in gm.code
    takes_ctx = [n.name for n in gm.graph.nodes if any(a.name == "rng_ctx" for a in n.all_input_nodes)]
    assert "randn_like" in takes_ctx and len(takes_ctx) >= 3  # the block's dropouts and the noise
    layout = {node: {"dropout": 2} for node in takes_ctx}
    (full,) = gm(x, ReferenceContext(0, 1, BATCH, layout))
    torch.manual_seed(7)  # the global generator's state plays no part
    for lo in (6, 0, 2, 4):
        torch.testing.assert_close(gm(x[lo:lo + 2], ShardContext(0, 1, lo, 2, lo, 2))[0], full[lo:lo + 2])
    (again,) = gm(x[0:2], ShardContext(0, 2, 0, 2, 0, 2))  # another step, another draw
    assert not torch.allclose(again, full[0:2])


def test_a_random_factory_sized_by_the_batch_draws_each_shards_rows_as_the_reference_does():
    """Drop-path's ``torch.rand((batch, 1, 1))`` has no batched tensor argument: its size's first entry is the
    batch, so each shard draws its own rows (seeded by the first row) and the reference, cut at the same
    rows, draws the same ones; before, it drew from the global generator unseeded (BEiT's --check failed)."""
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.rng import ReferenceContext, ShardContext

    runnable = load_runnable(DROP_PATH)
    gm, x = runnable.gm, runnable.make_inputs(BATCH, 3)[0]
    takes_ctx = [n.name for n in gm.graph.nodes if any(a.name == "rng_ctx" for a in n.all_input_nodes)]
    assert len(takes_ctx) == 2 and all("rand" in name for name in takes_ctx)
    layout = {node: {"dropout": 2} for node in takes_ctx}
    ref = ReferenceContext(0, 1, BATCH, layout)
    full = gm(x, ref)
    full = full[0] if isinstance(full, (tuple, list)) else full
    assert not ref.unbatched
    torch.manual_seed(7)  # the global generator's state plays no part
    for lo in (6, 0, 2, 4):
        shard = ShardContext(0, 1, lo, 2, lo, 2)
        out = gm(x[lo:lo + 2], shard)
        torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, full[lo:lo + 2])
        assert not shard.unbatched
    kept = (full != x).any(dim=(1, 2))  # a row dropped by both layers is the input itself
    assert 0 < int(kept.sum()) < BATCH


def test_unseeded_random_op_is_named():
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.rng import ShardContext, find_unseeded_random

    runnable = load_runnable(OWN_RNG)
    found = find_unseeded_random(runnable.gm, runnable.make_inputs(2, 0), ShardContext(0, 0, 0, 2, 0, 2))
    assert list(found) == ["randn"] and "generator of its own" in found["randn"]
    # seeded dropout; global-generator draws (randn_like, TransformerEncoderLayer's dropouts) seeded per shard;
    # attention kernels at dropout_p=0 draw nothing
    for spec in (BRANCHY, TIED, NOISY, "mmt:small", "twobranch:small"):
        seeded = load_runnable(spec)
        assert find_unseeded_random(seeded.gm, seeded.make_inputs(2, 0), ShardContext(0, 0, 0, 2, 0, 2)) == {}, spec


def test_bad_batchnorm_mode_is_one_line_exit_2(tmp_path, capsys):
    from graphpipe.cli import main
    from graphpipe.plan import write_plan

    write_plan(str(tmp_path / "p.json"), planned(BRANCHY, "gpipe", 2))
    assert main(["run", str(tmp_path / "p.json"), "--batchnorm", "full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batchnorm" in err[0] and "per-micro-batch" in err[0]


def test_batchnorm_mode_round_trips_through_the_plan_file(tmp_path):
    from graphpipe.errors import FormatError
    from graphpipe.plan import plan_from_dict, plan_to_dict

    plan = hand_built(BRANCHY, (["stem", "a1", "a2"], ["b1", "b2", "head"]), [(0,), (1,)], [2, 2], 2, "gpipe",
                      batchnorm="sync")
    doc = plan_to_dict(plan)
    assert doc["batchnorm"] == "sync" and plan_from_dict(doc).batchnorm == "sync"
    with pytest.raises(FormatError, match="batchnorm"):
        plan_from_dict({**doc, "batchnorm": "full"})


def test_every_strategy_plans_the_tied_model_into_something_the_runtime_runs():
    """Planner and runtime agree: a split tie is synchronised, never refused (all strategies, with replication)."""
    from graphpipe.runtime import RunOptions, preflight
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.stage_modules import split_model

    for strategy in ALL_STRATEGIES:
        for num_devices, mb in ((2, 2), (4, 2), (4, 1)):
            plan = planned(TIED, strategy, num_devices, mb)
            preflight(plan, RunOptions(check=True))
            runnable = load_runnable(plan.model)
            split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
            owners = {plan.stage_graph.stage_of(plan.graph.op_id(op)) for op in ("embed", "head")}
            assert (len(split.tied) == 1) == (len(owners) > 1), (strategy, num_devices)


def test_stage_module_under_checkpoint_replays_masks_and_records_batchnorm_once():
    """Re-materialization (torch.utils.checkpoint) runs the stage's forward again inside B: same masks, same stats."""
    from torch.utils.checkpoint import checkpoint

    from graphpipe.runtime.batchnorm import sharded_batchnorms
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.rng import ShardContext
    from graphpipe.runtime.stage_modules import split_model

    plan = hand_built(BRANCHY, (["stem", "a1", "a2", "b1", "b2", "head"],), [(0,)], [4], 1, "gpipe")
    runs = []
    for recompute in (False, True):
        runnable = load_runnable(BRANCHY)
        (prog,) = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph).programs
        x = runnable.make_inputs(BATCH, 0)[0][4:8]
        ctx = ShardContext(0, 2, 4, 4, 4, 4)
        torch.manual_seed(recompute)  # the global generator plays no part
        if recompute:
            _, out = checkpoint(prog.module, x, ctx, use_reentrant=False, preserve_rng_state=False)
        else:
            _, out = prog.module(x, ctx)
        runnable.loss_fn(out).backward()
        bns = sharded_batchnorms(prog.module)
        assert all(list(bn.pending) == [(key, 4)] for bn, key in zip(bns, ("stem_bn", "a_bn", "b_bn")))
        runs.append(({n: p.grad.clone() for n, p in prog.module.named_parameters()},
                     [bn.pending[k].clone() for bn in bns for k in bn.pending]))
    for name, grad in runs[0][0].items():
        torch.testing.assert_close(runs[1][0][name], grad, rtol=0, atol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_capture_finds_tied_parameters_and_the_plan_pays_for_splitting_them():
    from graphpipe.graph import graph_from_dict, graph_to_dict
    from graphpipe.sched import predicted_figures, simulate

    graph = graph_of(TIED)
    assert [(g.ops, g.bytes) for g in graph.shared] == [(("embed", "head"), 32 * 16 * 4.0)]
    assert graph_from_dict(graph_to_dict(graph)).shared == graph.shared
    assert graph_of(BRANCHY).shared == ()
    split = planned(TIED, "gpipe", 4)
    assert split.stage_graph.stage_of(split.graph.op_id("embed")) != split.stage_graph.stage_of(split.graph.op_id("head"))
    sim = predicted_figures(simulate(split.stage_graph, split.schedule, split.cluster))
    p = split.predicted
    head_devices = split.stage_graph.stages[split.stage_graph.stage_of(split.graph.op_id("head"))].devices
    assert p["shared_params_copy_bytes"] == len(head_devices) * split.cluster.state_bytes(2048.0)
    assert p["iteration_time_s"] == pytest.approx(sim["iteration_time_s"] + p["shared_params_allreduce_s"])
    assert p["shared_params_allreduce_s"] > 0
    for d in head_devices:
        assert p["peak_memory_bytes"][d] == pytest.approx(sim["peak_memory_bytes"][d] + split.cluster.state_bytes(2048.0))
    together = planned(TIED, "gpp", 1)  # one stage: nothing to charge
    assert "shared_params_allreduce_s" not in together.predicted


# ------------------------------------------------------------------ multi-rank
BRANCHES = (["stem"], ["a1", "a2"], ["b1", "b2", "head"])
TIED_STAGES = (["embed", "block0"], ["add", "block1", "add_1"], ["block2", "head"])


def real_model_plans() -> dict[str, Plan]:
    plans = {}
    for strategy, n in (("gpp", 4), ("pipedream", 3), ("gpipe", 3)):
        for spec, name in ((BRANCHY, "branchy"), (TIED, "tied")):
            plans[f"{name}/{strategy}"] = planned(spec, strategy, n)
    # PipeDream replicates both stages on 4 devices (1F1B-RR: whole micro-batches round-robin over replicas)
    plans["branchy/pipedream-4/per-micro-batch"] = planned(BRANCHY, "pipedream", 4)
    plans["branchy/pipedream-4/sync"] = replace(plans["branchy/pipedream-4/per-micro-batch"], batchnorm="sync")
    # a replicated stage (micro-batch 4 split over 2 replicas) between stages of micro-batch 2
    for mode in ("per-micro-batch", "sync"):
        plans[f"branchy/replicated/{mode}"] = hand_built(BRANCHY, BRANCHES, [(0,), (1, 2), (3,)], [2, 4, 2], 4,
                                                         "graph-1f1b", batchnorm=mode)
    # the embedding replicated, the tied head elsewhere: a data-parallel all-reduce then the tie's sum
    plans["tied/replicated"] = hand_built(TIED, TIED_STAGES, [(0, 1), (2,), (3,)], [4, 2, 2], 4, "graph-1f1b")
    # re-materialization: every stage's forward runs again inside its B (torch.utils.checkpoint)
    plans["branchy/replicated/sync/recompute"] = hand_built(BRANCHY, BRANCHES, [(0,), (1, 2), (3,)], [2, 4, 2], 4,
                                                            "graph-1f1b", batchnorm="sync", recompute=True)
    # global-generator noise and nn.TransformerEncoderLayer's inner dropouts, a replicated stage
    plans["noisy/replicated"] = hand_built(NOISY, (["inp", "block"], ["out"]), [(0, 1), (2,)],
                                           [4, 2], 3, "1f1b")
    plans["shared-layer/2-stages"] = hand_built(SHARED, (["inp", "shared"], ["shared_1", "out"]), [(0, 1), (2,)], [4, 2],
                                                3, "1f1b")
    plans["tied/replicated/recompute"] = hand_built(TIED, TIED_STAGES, [(0, 1), (2,), (3,)], [4, 2, 2], 4, "graph-1f1b",
                                                    recompute=True)
    return plans


@pytest.mark.slow
def test_real_models_match_single_process_for_three_steps_and_unseeded_ops_are_named():
    _run_real_model_plans()


def _run_real_model_plans():
    from graphpipe.runtime import RunOptions, run_plans

    plans = real_model_plans()
    names = sorted(plans)
    own = planned(OWN_RNG, "gpipe", 2)
    *results, own_result = run_plans([(plans[n], RunOptions(steps=3, warmup_steps=1, check=True, timeout_s=120))
                                      for n in names] + [(own, RunOptions(steps=1, check=True))], 4)
    # a custom op with a generator of its own: named, and --check cannot be exact for it
    assert list(own_result.check.unseeded_ops) == ["randn"]
    failures = {}
    for name, result in zip(names, results):
        check = result.check
        if not (check.passed and check.steps_checked == 3 and check.num_params_checked == check.num_params > 0
                and check.num_buffers_checked == check.num_buffers):
            failures[name] = check
        assert check.full_batch is not None and check.unseeded_ops is None, name
    assert not failures, failures
    by_name = dict(zip(names, results))
    assert by_name["branchy/gpp"].check.num_buffers == 9  # three BatchNorms: mean, var, count
    assert by_name["branchy/replicated/sync"].check.batchnorm == "sync"
    # micro-batched BatchNorm is not full-batch BatchNorm: reported, and not zero
    assert by_name["branchy/gpp"].check.full_batch.loss_abs_diff > 0
    for name in names:  # the plans really were micro-batched (and replicated where named)
        sg = plans[name].stage_graph
        assert all(s.micro_batch_size < BATCH for s in sg.stages), name
    assert any(s.num_replicas > 1 for s in plans["tied/replicated"].stage_graph.stages)
    assert any(s.num_replicas > 1 for s in plans["branchy/pipedream-4/sync"].stage_graph.stages)
    assert all(s.recompute for s in plans["branchy/gpipe"].stage_graph.stages)  # GPipe re-materializes by default
