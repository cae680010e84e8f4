"""Batches whose shape changes from step to step, a last partial batch, evaluation at any shape.

Oracle: one process training the same model on the same batches (same rows, same lengths) with the same
optimizer: every step's loss, the final weights and an evaluation at a shape never seen must match. Single
process checks: the shape rules' refusals and the partial batch's routing against brute force.
"""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shapes_models as sm  # noqa: E402
import shapes_script  # noqa: E402
from test_api import _port  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(name: str):
    """Losses, final weights and evaluation of one process over the script's steps."""
    made = getattr(sm, name)()
    model, loss_fn = made[0], made[2]
    opt = torch.optim.SGD(model.parameters(), lr=shapes_script.LR)
    losses = []
    for inputs, target in shapes_script.steps(name):
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs) if isinstance(inputs, tuple) \
            else model(inputs)
        loss = loss_fn(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        x = shapes_script.evaluation_inputs(name)
        evaluation = model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, tuple) else model(x)
    return losses, dict(model.named_parameters()), evaluation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shapes") / "out.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), os.path.join(HERE, "shapes_script.py"), out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chain", "branchy", "hf_bert", "patches", "trimmed"])
def test_varying_lengths_and_a_partial_batch_train_like_one_process(trained, name):
    """Lengths change every step (two unrelated ones in the branchy model) and the last batch has 5 of 8 rows:
    each loss, the final weights and an evaluation at 3 rows of a new length equal one process's. ``trimmed``
    sends a value whose length each micro-batch's data decides (its size travels ahead of it)."""
    losses, weights, evaluation = _reference(name)
    got = trained[name]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert set(got["weights"]) == set(weights)
    for n, w in weights.items():
        torch.testing.assert_close(got["weights"][n], w.detach(), rtol=1e-5, atol=1e-6)
    ref = evaluation.logits if hasattr(evaluation, "logits") else evaluation
    out = got["eval"].logits if hasattr(got["eval"], "logits") else got["eval"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_length_the_model_pins_is_refused_in_one_line_on_every_rank(trained):
    refusal = trained["pinned"]["refusal"]
    assert refusal is not None and "dim 1 is 9" in refusal and "fixes it at 12" in refusal


# ------------------------------------------------------------ single process
def _sg(sizes, replicas, batch=12):
    from graphpipe.graph import Op, OpGraph
    from graphpipe.stages import Stage, StageGraph

    n = len(sizes)
    g = OpGraph.build("chain", [Op(f"o{i}", "x") for i in range(n)], [(f"o{i}", f"o{i + 1}", 4.0) for i in range(n - 1)])
    stages, dev = [], 0
    for i, (mb, r) in enumerate(zip(sizes, replicas)):
        stages.append(Stage(i, (i,), tuple(range(dev, dev + r)), mb))
        dev += r
    return StageGraph.build(g, stages, batch, dev)


@pytest.mark.parametrize("sizes,replicas", [((2, 4), (1, 1)), ((4, 2), (1, 2)), ((6, 4), (2, 1)), ((3, 12), (1, 1))])
def test_a_partial_batch_routes_every_row_once_from_its_producer_shard_to_its_consumer_shard(sizes, replicas):
    """Brute force over every partial size a plan takes: each consumer shard's rows are exactly the rows its
    pieces bring, pieces tile the batch, and a row travels from the producer shard that holds it."""
    from graphpipe.actions import Schedule
    from graphpipe.runtime.routing import Routing, least_rows
    from graphpipe.sched.generators import make_schedule
    from graphpipe.cluster import preset

    sg = _sg(sizes, replicas)
    schedule = make_schedule("gpipe", sg, preset("cpu", sg.num_devices))
    assert isinstance(schedule, Schedule)
    full = Routing(sg, schedule, {(0, 1): ("x",)}, ("x",))
    for rows in range(least_rows(sg), sg.batch_size + 1):
        r = full.at_rows(rows)

        def holder(stage_id):  # row -> (micro-batch, replica) by the same proportional map, brute force
            stage, out = sg.stages[stage_id], {}
            per = stage.micro_batch_size // stage.num_replicas
            for mb in range(sg.batch_size // stage.micro_batch_size):
                for q in range(stage.num_replicas):
                    lo = mb * stage.micro_batch_size + q * per
                    for row in range(r.row(lo), r.row(lo + per)):
                        out[row] = (mb, q)
            return out

        prod, cons = holder(0), holder(1)
        assert sorted(prod) == sorted(cons) == list(range(rows))  # every shard's rows tile the batch
        seen = []
        for (p, c, mb, q), pieces in r.by_consumer.items():
            for piece in pieces:
                for row in range(piece.lo, piece.hi):
                    seen.append(row)
                    assert cons[row] == (piece.consumer_mb, piece.consumer_replica)
                    assert prod[row] == (piece.producer_mb, piece.producer_replica)
                assert piece.consumer_rows.stop - piece.consumer_rows.start == piece.hi - piece.lo
        assert sorted(seen) == list(range(rows))
        assert min(len(set(v for v in cons.values() if v == k)) for k in set(cons.values())) == 1


def test_the_shape_rules_bind_lengths_and_refuse_what_the_model_cannot_take():
    from graphpipe.errors import InputError
    from graphpipe.frontend.exporting import export_model
    from graphpipe.frontend.shapes import ShapeRules

    model, ids, loss, target = sm.chain()
    ex = export_model(model, (ids,), loss, target)
    rules = ShapeRules(ex.gm)
    shape = rules.bind((sm.tokens(0, 5, 20), sm.tokens(0, 5, 20)))
    assert shape.rows == 5 and sorted(shape.bindings.values()) == [5, 20]
    assert rules.symbols and len(rules.symbols) == 1
    with pytest.raises(InputError, match="exceeds pos's position table of 32 rows"):
        rules.bind((sm.tokens(0, 5, 33), sm.tokens(0, 5, 33)))
    rules.bind((sm.tokens(0, 5, 20), sm.tokens(0, 5, 21)))  # a target is the loss's to check, never refused here

    class Two(torch.nn.Module):  # ids and a mask the model adds: one length, which export ties
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(sm.VOCAB, 4)

        def forward(self, ids, mask):
            return self.e(ids) + self.e(mask)

    two = ShapeRules(export_model(Two(), (sm.tokens(0, 4, 6), sm.tokens(1, 4, 6))).gm)
    with pytest.raises(InputError, match="input 'mask' dim 1 is 7, but the model needs it equal to a dim of 'ids'"):
        two.bind((sm.tokens(0, 4, 6), sm.tokens(1, 4, 7)))
    pinned = export_model(*sm.pinned()[:2])
    with pytest.raises(InputError, match="dim 1 is 9, but the captured model fixes it at 12"):
        ShapeRules(pinned.gm).bind((sm.tokens(0, 4, 9),))


def test_a_shipped_capture_keeps_the_shapes_the_steps_are_sized_by():
    from graphpipe.frontend.exporting import export_model
    from graphpipe.frontend.shapes import ShapeRules
    from graphpipe.runtime.shipping import pack, unpack

    model, ids, loss, target = sm.chain()
    ex = export_model(model, (ids,), loss, target)
    gm, _, _ = unpack(pack(model, ex.gm, {}, ex.io), model)
    here, there = ShapeRules(ex.gm), ShapeRules(gm)
    assert [tuple(map(str, d)) for d in here.inputs] == [tuple(map(str, d)) for d in there.inputs]
    assert here.ranges == there.ranges and [t[1:] for t in here.tables] == [t[1:] for t in there.tables]


def test_vary_shapes_draws_the_same_sizes_on_every_rank_and_refuses_bad_ranges():
    from graphpipe.errors import InputError
    from graphpipe.frontend.shapes import ShapeDraw, resized

    draw = ShapeDraw.parse("6:20,5:8")
    a = [draw.sizes(3, k, "b", ("s1", "s2"), 8) for k in range(20)]
    assert a == [draw.sizes(3, k, "b", ("s1", "s2"), 8) for k in range(20)]
    assert all(6 <= s["s1"] <= 20 and 5 <= s["b"] <= 8 for s in a) and len({s["s1"] for s in a}) > 1
    assert ShapeDraw.parse("4:9").sizes(0, 0, "b", ("s",), 8)["b"] == 8
    for bad in ("9:4", "x", "1:2,3", "0:3", "1:2,3:4,5:6"):
        with pytest.raises(InputError, match="--vary-shapes"):
            ShapeDraw.parse(bad)
    x = torch.arange(12).reshape(3, 4)
    (y,) = resized((x,), [(2, 9)])
    assert y.shape == (2, 9) and torch.equal(y[:, :4], x[:2]) and torch.equal(y[:, 4:8], x[:2])


@pytest.mark.slow
def test_graphpipe_run_vary_shapes_checks_every_step_and_refuses_a_length_past_the_position_table(tmp_path):
    """``graphpipe run --vary-shapes`` on 2 ranks: steps of drawn lengths and rows, each compared by --check with
    one process on the same batch; a range past the model's position table exits 2 with one line, no hang."""
    import json

    plan = str(tmp_path / "chain.json")
    spec = os.path.join(HERE, "shapes_models.py") + ":chain"
    gp = [sys.executable, "-m", "graphpipe"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run(gp + ["plan", spec, "--devices", "2", "--batch-size", "8", "--cluster", "cpu",
                                "--micro-batch-size", "2", "--strategy", "gpipe", "--out", plan],
                          capture_output=True, text=True, timeout=300, env=env)
    assert made.returncode == 0, made.stderr[-2000:]
    run = subprocess.run(gp + ["run", plan, "--steps", "4", "--check", "--vary-shapes", "6:20,5:8", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["check"]["passed"] and result["check"]["num_mismatches"] == 0
    assert result["check"]["steps_checked"] == 4
    assert len(result["losses"]) == 4 and len(set(result["losses"])) == 4
    past = subprocess.run(gp + ["run", plan, "--steps", "2", "--vary-shapes", "33:40"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert past.returncode == 2, past.stderr[-2000:]
    assert "exceeds pos's position table of 32 rows" in past.stderr and "Traceback" not in past.stderr


def test_max_shape_fits_memory_at_the_longest_length_and_the_guard_refuses_a_step_past_the_devices():
    """--max-shape scales the saved activations by the longest length over the example's; the guard scales the
    plan's predicted activations by a step's growth beyond that and refuses a step that would not fit."""
    from types import SimpleNamespace

    import graphpipe
    from graphpipe.errors import InputError
    from graphpipe.frontend.exporting import export_model
    from graphpipe.models import load_model
    from graphpipe.runtime.api import Pipeline
    from graphpipe.frontend.shapes import ShapeRules
    from graphpipe.search.api import at_max_shape

    spec = os.path.join(HERE, "shapes_models.py") + ":chain"
    graph = load_model(spec).graph
    assert graph.lengths == (12,)
    longer = at_max_shape(graph, 30)
    for a, b in zip(graph.ops, longer.ops):
        assert b.act_bytes == pytest.approx(a.act_bytes * 30 / 12) and b.fwd == a.fwd and b.param_bytes == a.param_bytes
    assert at_max_shape(graph, 8) is graph
    with pytest.raises(InputError, match="--max-shape must be a positive length"):
        at_max_shape(graph, 0)
    plan = graphpipe.plan(spec, devices=2, batch_size=8, cluster="cpu", micro_batch_size=2, strategy="gpipe",
                          max_shape=16)
    assert plan.search["max_shape"] == 16 and plan.search["example_length"] == 12
    model, ids, loss, target = sm.chain()
    rules = ShapeRules(export_model(model, (ids,), loss, target).gm)
    planned = rules.bind((ids, target)).bindings
    peaks, acts = plan.predicted.peak_memory_bytes, plan.predicted.peak_activation_bytes
    # devices that hold the plan's peak (at length 16) with 37.5% more activations: 20 fits, 28 does not
    limit = max(p - a + a * 22 / 16 for p, a in zip(peaks, acts)) * 1.01
    fake = SimpleNamespace(plan=SimpleNamespace(predicted=plan.predicted, search=plan.search,
                                                cluster=SimpleNamespace(memory_bytes=limit),
                                                stage_graph=plan.stage_graph),
                           _shapes=rules, _shapes_planned=planned)
    Pipeline._memory_guard(fake, rules.at({**planned, rules.symbols[0]: 16}))
    Pipeline._memory_guard(fake, rules.at({**planned, rules.symbols[0]: 20}))
    with pytest.raises(InputError, match=r"would need about .* GB on device \d .*re-plan with --max-shape"):
        Pipeline._memory_guard(fake, rules.at({**planned, rules.symbols[0]: 28}))
    Pipeline._memory_guard(fake, rules.at({**planned, rules.batch: 4, rules.symbols[0]: 28}))  # half the rows


def test_a_value_whose_size_depends_on_the_data_is_named_with_its_data_dims():
    """A boundary value with a symbol no input carries (export's unbacked ``u0``) cannot be sized from the
    step's inputs: its dims sized by the data are named (its messages carry a header), an input's symbol is not."""
    import torch.fx as fx

    from graphpipe.frontend.shapes import apply_shape_records, data_dims

    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.tanh, (a,))
    g.output((a, b))
    gm = fx.GraphModule(torch.nn.Module(), g)
    apply_shape_records(gm, {"x": ("tensor", ("s0", "s1")), "relu": ("tensor", ("s0", "2*s1")),
                             "tanh": ("tensor", ("s0", "u0", "s1+u1"))})
    assert data_dims(gm, ["relu", "tanh"]) == {"tanh": (1, 2)}


@pytest.mark.parametrize("mbs, replicas, joins", [((4, 4), 1, False), ((4, 2), 1, False), ((4, 4), 2, False),
                                                   ((2, 4), 1, True), ((4, 8), 1, True), ((8, 4), 2, False), ((2, 2), 2, False)])
def test_a_value_sized_by_the_data_is_refused_where_a_consumer_shard_joins_producer_shards(mbs, replicas, joins):
    """Oracle: the routing's pieces. Rows of two producer shards cannot stack when each shard kept its own
    number of positions, so such an edge is refused exactly when some consumer shard takes more than one piece."""
    from graphpipe.errors import PlanError
    from graphpipe.runtime.routing import Routing
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.setup import _edge_values
    from graphpipe.runtime.stage_modules import boundary_meta, check_data_sized_edges, split_model

    groups = shapes_script.plans()["trimmed"][0]
    devices = [(0,), tuple(range(1, 1 + replicas))]
    plan = shapes_script.hand_built("trimmed", groups, devices, list(mbs))
    runnable = load_runnable(plan.model)
    split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
    meta = boundary_meta(runnable.gm, split.boundary_values, runnable.make_inputs)
    assert [v for v, m in meta.items() if m.sized_by_data] == list(split.boundary_values)
    routing = Routing(plan.stage_graph, plan.schedule, _edge_values(split), list(meta))
    several = any(len(pieces) > 1 for pieces in routing.by_consumer.values())
    assert several == joins
    if joins:
        with pytest.raises(PlanError, match="size that depends on the data"):
            check_data_sized_edges(routing, list(meta))
    else:
        check_data_sized_edges(routing, list(meta))
    if (mbs, replicas) == ((2, 4), 1):  # graphpipe run says it before any rank starts (exit 2, one line)
        from graphpipe.errors import InputError
        from graphpipe.runtime import preflight
        from graphpipe.runtime.options import RunOptions

        with pytest.raises(InputError, match="joins rows of several shards of stage 0"):
            preflight(plan, RunOptions(steps=1))
