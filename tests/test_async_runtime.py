"""PipeDream's asynchronous pipelines for real: the replay oracle, weight stashing, and runs on 2 and 4 CPU ranks.

The replay oracle (:func:`graphpipe.runtime.async_run.replay_reference`) is
checked against plain training loops on one stage, where the version rules
reduce to textbook formulas; the distributed runs are then checked against
the oracle (every micro-batch's loss and the final weights, fp32
assert_close tolerances), and a run without stashing must fail that check.
"""

from __future__ import annotations

import pytest
import torch

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan
from graphpipe.runtime import RunOptions, run_plans
from graphpipe.runtime.async_run import replay_reference, stream_inputs
from graphpipe.runtime.runnable import load_runnable
from graphpipe.runtime.rng import ShardContext
from graphpipe.sched import make_schedule
from graphpipe.sched.async_pipe import async_spec_for, version_table, with_async
from graphpipe.search.planner import make_plan
from graphpipe.stages import Stage, StageGraph

MODEL = "transformer:small"


def _one_stage_plan(batch: int = 8, mb: int = 2) -> Plan:
    graph = zoo.load_graph(MODEL)
    sg = StageGraph.build(graph, [Stage(0, tuple(range(graph.num_ops)), (0,), mb)], batch, 1)
    cluster = preset("v100", 1)
    return Plan(model=MODEL, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("1f1b", sg, cluster))


def _plain_loop(steps: int, batch: int, mb: int, lr: float, delay_windows: int | None):
    """Independent loop on the whole module: per-micro-batch SGD (``delay_windows=None``), or 2BW with ``m = M``:
    window ``k`` runs on ``W(max(0, k - 1))`` and ``W(k+1) = W(k) - lr * (its summed gradients)``."""
    run = load_runnable(MODEL, 0, "cpu")
    gm = run.gm
    x = stream_inputs(run.make_inputs, batch, 0, steps)
    history = [{n: p.detach().clone() for n, p in gm.named_parameters()}]
    losses = []
    num_mbs = batch // mb
    for w in range(steps):
        total = {n: torch.zeros_like(t) for n, t in history[0].items()}
        for j in range(num_mbs):
            i = w * num_mbs + j
            at = history[-1] if delay_windows is None else history[max(0, w - delay_windows)]
            params = {n: t.clone().requires_grad_(True) for n, t in at.items()}
            ctx = ShardContext(0, 0, i * mb, mb, i * mb, mb)
            loss = run.loss_fn(torch.func.functional_call(gm, params, (*(t[i * mb:(i + 1) * mb] for t in x), ctx)))
            loss = loss * mb / batch
            loss.backward()
            losses.append(float(loss.detach()))
            if delay_windows is None:
                history.append({n: history[-1][n] - lr * params[n].grad for n in params})
            else:
                total = {n: total[n] + params[n].grad for n in params}
        if delay_windows is not None:
            history.append({n: history[-1][n] - lr * total[n] for n in total})
    return losses, history[-1]


@pytest.mark.parametrize("name", ["1f1b-async", "2bw"])
def test_replay_oracle_on_one_stage_is_the_textbook_update(name):
    plan = _one_stage_plan()
    spec = async_spec_for(name, plan.stage_graph)
    table = version_table(plan.stage_graph, spec, 2)
    ref = replay_reference(plan, table, 0, 0.5, 2)
    losses, weights = _plain_loop(2, 8, 2, 0.5, None if name == "1f1b-async" else 1)
    torch.testing.assert_close(torch.tensor(ref.mb_losses), torch.tensor(losses))
    for n, w in weights.items():
        torch.testing.assert_close(ref.weights[n], w)


def _pipedream(model: str, n: int, spec_name: str, **kw) -> Plan:
    plan = make_plan(model, zoo.load_graph(model), preset("v100", n), 16, "pipedream", schedule="1f1b")
    return with_async(plan, async_spec_for(spec_name, plan.stage_graph, **kw))


@pytest.mark.slow
def test_every_small_zoo_models_pipedream_plan_matches_the_replay_on_2_and_4_ranks():
    """Every zoo small model's PipeDream plan on 2 and 4 ranks (round-robin replicated stages among them), the
    three asynchronous variants in turn; then stashing off, which the same check must catch."""
    variants = [("1f1b-async", {}), ("1f1b-async", {"vertical_sync": True}), ("2bw", {})]
    jobs, labels = [], []
    for k, (model, n) in enumerate((m, n) for m in ("transformer", "mmt", "dlrm", "candle-uno", "twobranch")
                                   for n in (2, 4)):
        name, kw = variants[k % len(variants)]
        plan = _pipedream(f"{model}:small", n, name, **kw)
        jobs.append((plan, RunOptions(steps=3, check=True, timeout_s=120.0)))
        labels.append((model, n, name, kw, plan))
    no_stash = _pipedream(f"{MODEL}", 4, "1f1b-async", stash=False)
    jobs.append((no_stash, RunOptions(steps=3, check=True, lr=0.5, timeout_s=120.0)))
    results = run_plans(jobs, world_size=4)
    assert any(st.round_robin and st.num_replicas > 1 for *_, plan in labels for st in plan.stage_graph.stages)
    for (model, n, name, kw, plan), raw in zip(labels, results[:-1]):
        check = raw.check
        assert check.passed and check.num_params_checked == check.num_params > 0, (model, n, name, kw, check)
        # stashed weights are tensors: measured bytes equal the version schedule's count x the plan's weight bytes
        measured = raw.measured
        assert measured.stashed_weight_bytes == measured.stashed_weight_bytes_predicted, (model, n, name)
        if name == "2bw":
            assert max(max(v) for v in raw.async_run.stashed_versions) <= 1
    assert not results[-1].check.passed  # backward on the latest weights: not the replayed training
    assert results[-1].measured.stashed_weight_bytes == (0.0,) * 4
