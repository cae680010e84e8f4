"""``--check`` on ill-conditioned networks, and blocks whose own ops surround their children.

Oracles: plain PyTorch gradient accumulation micro-batch by micro-batch (the
shard-by-shard reference must equal it bit for bit), reachability in the fx
graph (no op piece is left and re-entered), brute force over random graphs,
and a pipelined run with one rank's gradients halved (it must fail).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.fx as fx

from test_model_classes import BATCH, ILL, MODELS, chain_plan

REENTRANT = MODELS + ":reentrant"

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ blocks that leave their op and come back
def _convex(nodes: set, graph_nodes) -> bool:
    """No path from a node of ``nodes`` leaves the set and comes back to it."""
    for start in nodes:
        stack = [u for u in start.users if u not in nodes]
        seen = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in nodes:
                return False
            stack.extend(v.users)
    return True


def test_a_block_running_its_own_ops_around_its_children_is_cut_into_ops_the_stages_can_order():
    from graphpipe.frontend.capture import captured_from_factory

    cap = captured_from_factory(os.path.join(os.path.dirname(MODELS), "model_classes.py") + ":reentrant")
    names = [op.name for op in cap.graph.ops]
    # the squeeze-and-excite before the projection, the residual after it; children keep their names
    assert {"blocks.0", "blocks.0[1]", "blocks.1", "blocks.1[1]", "blocks.0.project.0", "stem", "head"} <= set(names)
    assert names.index("blocks.0") < names.index("blocks.0.project.0") < names.index("blocks.0[1]")
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    for op, members in cap.op_nodes.items():
        assert _convex({by_name[m] for m in members}, cap.gm.graph.nodes), op
    assert cap.paths["blocks.0[1]"] == cap.paths["blocks.0"] == "blocks.0"


def _random_graph(rng: random.Random, size: int, ops: int):
    g = fx.Graph()
    nodes = [g.placeholder("x")]
    for i in range(size):
        srcs = rng.sample(nodes, k=min(len(nodes), rng.randint(1, 2)))
        nodes.append(g.call_function(torch.add, (srcs[0], srcs[-1])))
    g.output(nodes[-1])
    compute = nodes[1:]
    return compute, {n: f"op{rng.randrange(ops)}" for n in compute}


def test_pieces_of_a_cut_op_are_never_left_and_reentered_on_random_graphs():
    from graphpipe.frontend.reentrant import cyclic_ops, split_reentrant_ops

    rng = random.Random(0)
    split_some = 0
    for _ in range(300):
        nodes, owner = _random_graph(rng, rng.randint(2, 14), rng.randint(1, 4))
        original = dict(owner)
        path_of = {op: op for op in set(owner.values())}
        was_cyclic = bool(cyclic_ops(nodes, owner))
        added = split_reentrant_ops(nodes, owner, path_of)
        if not was_cyclic:
            assert owner == original and not added  # a clean contraction keeps its ops
            continue
        split_some += bool(added)
        for piece in set(owner.values()):
            members = {n for n in nodes if owner[n] == piece}
            op = original[next(iter(members))]
            assert all(original[n] == op for n in members)  # pieces only cut an op
            whole = {n for n in nodes if original[n] == op}
            for start in members:  # brute force: leaving the op from a piece never reaches the same piece
                stack, seen = [u for u in start.users if u not in whole], set()
                while stack:
                    v = stack.pop()
                    if v in seen or v.op == "output":
                        continue
                    seen.add(v)
                    assert owner.get(v) != piece
                    stack.extend(v.users)
    assert split_some > 20


# ------------------------------------------------------------------ the shard-by-shard reference
@pytest.mark.parametrize("spec", [ILL, REENTRANT])
def test_the_reference_of_a_plan_with_one_shard_size_is_plain_gradient_accumulation(spec):
    from graphpipe.frontend.capture import load_factory
    from graphpipe.runtime.reference import reference_run, uniform_rows
    from graphpipe.runtime.runnable import data_seed, load_runnable

    rows = 2
    ref = load_runnable(spec, 0, "cpu")
    layout = {n.name: {"dropout": rows, "batchnorm": rows} for n in ref.gm.graph.nodes}
    assert uniform_rows(layout, BATCH) == rows and uniform_rows({}, BATCH) is None
    assert uniform_rows({"a": {"dropout": 2, "batchnorm": 4}}, BATCH) is None
    shard = reference_run(spec, 0, BATCH, layout, 2, 0.01)
    # the same cuts, run as the whole mini-batch cut per op (an entry of another size turns shard-by-shard off)
    whole = reference_run(spec, 0, BATCH, {**layout, "(none)": {"dropout": BATCH, "batchnorm": BATCH}}, 2, 0.01)
    factory = load_factory(spec)
    model, loss_fn = factory.module.train(), factory.loss_fn
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        (x,) = ref.make_inputs(BATCH, data_seed(0, step))
        total = 0.0
        for lo in range(0, BATCH, rows):
            term = loss_fn(model(x[lo:lo + rows])) * (rows / BATCH)
            term.backward()
            total += float(term.detach())
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert set(grads) == set(shard.grads[step])
        for name, g in grads.items():
            assert torch.equal(g, shard.grads[step][name]), (step, name)
        for name, b in whole.buffers[step].items():  # BatchNorm's running statistics: one update per mini-batch
            torch.testing.assert_close(shard.buffers[step][name], b, rtol=1e-4, atol=1e-5)
        assert shard.losses[step] == pytest.approx(total, rel=1e-6)
        optimizer.step()


# ------------------------------------------------------------------ multi-rank
@pytest.mark.slow
def test_check_is_exact_on_ill_conditioned_plans_and_still_fails_a_wrong_gradient():
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.runtime.options import FaultInjection

    ill = chain_plan(ILL, (1, 2), [(0,), (1,)], [2, 2])
    reentrant = chain_plan(REENTRANT, (5, 9), [(0,), (1,)], [2, 2], "graph-1f1b")  # cut inside blocks.0
    fixed = dict(steps=2, warmup_steps=1, check=True, timeout_s=120, check_tolerance="fixed")
    patches = chain_plan(MODELS + ":patches", (2, 2), [(0,), (1,)], [2, 4], "graph-1f1b")  # unfolded rows inside
    # (seq, batch, dim) across the cut: rows stitched (2 -> 4) and sliced (4 -> 2) along the batch, not dim 0
    seq_first = [chain_plan(MODELS + ":seq_first", (2, 3), [(0,), (1,)], mbs, "graph-1f1b") for mbs in ([2, 4], [4, 2])]
    jobs = [(ill, RunOptions(**fixed)), (reentrant, RunOptions(**fixed)), (patches, RunOptions(**fixed)),
            *[(plan, RunOptions(**fixed)) for plan in seq_first],
            (ill, RunOptions(**fixed, fault=FaultInjection(1, "grad"))),
            (reentrant, RunOptions(**{**fixed, "check_tolerance": "fp64"}, fault=FaultInjection(0, "grad")))]
    ok_ill, ok_reentrant, ok_patches, ok_seq, ok_seq2, bad_ill, bad_reentrant = (r.check for r in run_plans(jobs, 2))
    for check in (ok_ill, ok_reentrant, ok_patches, ok_seq, ok_seq2):
        assert check.passed and check.num_params_checked == check.num_params > 0, check
        assert check.fp64_spread is None  # the fixed tolerance runs no float64 reference
    for check in (bad_ill, bad_reentrant):
        assert not check.passed and check.num_mismatches > 0, check
    assert bad_reentrant.fp64_spread is not None


def test_the_whole_batch_reference_runs_each_row_kernel_on_its_stages_rows():
    """A convolution over 3x3 maps sums in another order at 16 rows than at 4 (how much depends on the CPU's
    kernels); run on the pipeline's rows it gives the pipeline's numbers bit for bit, the rest stays whole."""
    from torch.export import export

    from graphpipe.runtime.numerics import _by_rows, rows_as_the_pipeline

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(768, 192, 1)
            self.fc = torch.nn.Linear(192 * 9, 3)

        def forward(self, x, tokens):
            return self.fc(torch.relu(self.conv(x)).flatten(1)), torch.nn.functional.linear(tokens, self.fc.weight[:, :4])

    torch.manual_seed(0)
    net = Net()
    x, tokens = torch.randn(16, 768, 3, 3), torch.randn(5, 4)  # tokens: dim 0 is not the batch
    gm = export(net, (x, tokens)).module()
    pieces = [net(x[lo:lo + 4], tokens)[0] for lo in range(0, 16, 4)]
    kernels = [n for n in gm.graph.nodes if n.op == "call_function" and ("conv" in str(n.target)
                                                                        or "linear" in str(n.target))]
    layout = {n.name: {"dropout": 4, "batchnorm": 4} for n in kernels}
    rows_as_the_pipeline(gm, layout, 16)
    assert sum(n.target is _by_rows for n in gm.graph.nodes) == len(kernels) == 3
    out, projected = gm(x, tokens)
    assert torch.equal(out, torch.cat(pieces))
    assert torch.equal(projected, torch.nn.functional.linear(tokens, net.fc.weight[:, :4]))


def test_a_stack_of_reentrant_blocks_captured_once_equals_the_whole_capture():
    """Planning captures a stack of identical blocks once and unrolls it (graphpipe.frontend.capture_repeats): the pieces
    ``blocks.k`` and ``blocks.k[1]`` of every block come out as the whole capture makes them."""
    from model_classes import SEBlock

    from graphpipe.frontend.capture import capture
    from graphpipe.frontend.capture_repeats import unrolled_capture

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.blocks = torch.nn.Sequential(*[SEBlock(4) for _ in range(9)])
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    torch.manual_seed(0)
    model, x = Deep(), torch.randn(BATCH, 3, 4, 4)
    unrolled = unrolled_capture(model, (x,), name="deep", loss_fn=lambda out: out.pow(2).mean())
    whole = capture(model, (x,), name="deep", loss_fn=lambda out: out.pow(2).mean()).graph
    assert unrolled is not None and unrolled == whole
    assert {f"blocks.{k}[1]" for k in range(9)} <= {op.name for op in whole.ops}


def test_a_row_kernel_runs_whole_where_cutting_its_rows_would_change_it():
    from graphpipe.runtime.numerics import ROW_KERNELS, _by_rows

    aten = torch.ops.aten
    torch.manual_seed(0)
    w, v = torch.randn(3, 16), torch.randn(16)  # a 1-D input of the batch's length: linear contracts over it
    assert torch.equal(_by_rows(aten.linear.default, ROW_KERNELS[aten.linear.default], 4, 16, v, w),
                       aten.linear.default(v, w))
    x, m, bias = torch.randn(16, 5), torch.randn(5, 2), torch.randn(16, 2)  # a full-size bias: no piece fits it
    assert torch.equal(_by_rows(aten.addmm.default, ROW_KERNELS[aten.addmm.default], 4, 16, bias, x, m),
                       aten.addmm.default(bias, x, m))
    signal = torch.randn(16, 40)  # conv1d's unbatched form (channels, length): dim 0 is channels
    kernel = torch.randn(2, 16, 3)
    assert torch.equal(_by_rows(aten.conv1d.default, ROW_KERNELS[aten.conv1d.default], 4, 16, signal, kernel),
                       aten.conv1d.default(signal, kernel))
