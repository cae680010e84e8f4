"""Values no stage boundary may cut (``graphpipe/frontend/folded.py``): the ops they join are merged at capture.

Oracles: the runtime's own test of a boundary value (``boundary_meta`` runs
the graph at two batch sizes and refuses a value whose dim 0 does not follow
the batch), applied to every value that crosses between ops of the capture
without merging; every chain of stages over the merged capture set up as a
rank does; a forward whose merge closes a cycle.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from test_model_classes import MODELS, chain_plan, rank_setup

PATCHES = MODELS + ":patches"

pytestmark = pytest.mark.usefixtures("one_thread")


def _crossing(runnable) -> list:
    """fx nodes read by an op other than the one producing them."""
    owner = {n: op for op, nodes in runnable.op_nodes.items() for n in nodes}
    return [node for node in runnable.gm.graph.nodes if node.name in owner
            and any(owner.get(u.name, owner[node.name]) != owner[node.name] for u in node.users)]


def test_capture_lets_cross_exactly_the_values_the_runtime_can_split(monkeypatch):
    import graphpipe.frontend.capture as capture
    from graphpipe.errors import PlanError
    from graphpipe.frontend.folded import splittable
    from graphpipe.runtime.runnable import build_runnable
    from graphpipe.runtime.stage_modules import boundary_meta

    with monkeypatch.context() as m:
        m.setattr(capture, "merge_folded_ops", lambda *a, **k: {})
        unmerged = build_runnable(PATCHES)
    batch = capture._batch_symbol(unmerged.gm)
    refused, allowed = set(), set()
    for node in _crossing(unmerged):
        try:
            boundary_meta(unmerged.gm, [node.name], unmerged.make_inputs)
            allowed.add(node.name)
        except PlanError as e:
            assert "no dim of it is the batch" in str(e)
            refused.add(node.name)
        assert splittable(node.meta["val"], batch) == (node.name in allowed), node.name
    assert refused and allowed  # the patches between mix.0 and mix.1; the image into and out of them
    seq_first = build_runnable(MODELS + ":seq_first")
    crossing = _crossing(seq_first)
    assert any(node.meta["val"].shape[1] != node.meta["val"].shape[0] for node in crossing)  # (seq, batch, dim)
    assert all(splittable(node.meta["val"], capture._batch_symbol(seq_first.gm)) for node in crossing)
    boundary_meta(seq_first.gm, [n.name for n in crossing], seq_first.make_inputs)  # nothing refused
    merged = build_runnable(PATCHES)
    assert list(merged.op_nodes) == ["stem", "mix", "out", "head"]  # mix.0 and mix.1, named after their module
    ours, theirs = set(merged.op_nodes["mix"]), set(unmerged.op_nodes["mix.0"]) | set(unmerged.op_nodes["mix.1"])
    assert ours <= theirs and all(n.startswith("sym_size") for n in theirs - ours)  # one copy of the input glue
    boundary_meta(merged.gm, [n.name for n in _crossing(merged)], merged.make_inputs)  # nothing refused


@pytest.mark.parametrize("groups", [(1, 3), (2, 2), (3, 1), (1, 1, 1, 1)])
def test_every_chain_of_stages_over_the_merged_ops_sets_up(groups):
    plan = chain_plan(PATCHES, groups, [(i,) for i in range(len(groups))], [2, 4, 2, 4][:len(groups)])
    _, meta = rank_setup(plan)
    assert meta and all(m.batched for m in meta.values())


class _Folds(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        u = self.fc(x)
        return u.reshape(-1, 4), u  # (2 * batch, 4) and (batch, 8)


class _Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, u):
        return self.fc(u)


class _Joins(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, t, g):
        return self.fc(t).reshape(g.shape) + g


class _Cycle(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Folds(), _Mid(), _Joins()])

    def forward(self, x):
        t, u = self.blocks[0](x)
        return self.blocks[2](t, self.blocks[1](u))


def test_merging_two_ops_also_merges_the_op_on_a_path_between_them():
    """blocks.0 hands blocks.2 a folded value and blocks.1 a batch-major one that blocks.2 reads too: merging
    blocks.0 and blocks.2 alone would leave blocks.1 both after and before the merged op."""
    from graphpipe.frontend.capture import capture

    cap = capture(_Cycle(), (torch.randn(3, 8),), name="cycle", loss_fn=lambda out: out.pow(2).mean())
    assert [op.name for op in cap.graph.ops] == ["blocks"]  # named after the module its members share
    assert cap.paths == {"blocks": "blocks"}


def test_a_sequence_first_value_crosses_batch_major_and_comes_back_as_the_stage_computed_it():
    """``nn.TransformerEncoder`` by default hands its layers ``(seq, batch, dim)``: each layer stays an op, and the
    runtime carries the value batch-major on the wire."""
    plan = chain_plan(MODELS + ":seq_first", (2, 1, 2), [(0,), (1,), (2,)], [2, 4, 2])
    assert [op.name for op in plan.stage_graph.graph.ops] == ["tok", "enc.layers.0", "enc.layers.1",
                                                               "enc.layers.2", "head"]
    _, meta = rank_setup(plan)
    assert meta and {(m.batch_dim, m.sample_shape) for m in meta.values()} == {(1, (5, 8))}
    m = next(iter(meta.values()))
    x = torch.randn(5, 3, 8)
    assert m.to_wire(x).shape == m.shape(3) == (3, 5, 8)
    assert torch.equal(m.to_wire(x)[1], x[:, 1]) and torch.equal(m.from_wire(m.to_wire(x)), x)
    assert m.from_wire(m.to_wire(x)).is_contiguous()


def test_a_pipeline_over_ranks_trains_and_evaluates_a_sequence_first_model_as_one_process_does(tmp_path):
    """``Pipeline.step`` and ``Pipeline.forward`` on three torchrun ranks, values crossing sequence-first between
    them: the losses, the evaluation output and every final weight equal plain training of the same model."""
    import os

    from test_api import torchrun

    from graphpipe.frontend.capture import load_factory
    from graphpipe.plan import write_plan

    plan_path = str(tmp_path / "plan.json")
    write_plan(plan_path, chain_plan(MODELS + ":seq_first", (2, 1, 2), [(0,), (1,), (2,)], [2, 4, 2], "graph-1f1b"))
    out = str(tmp_path / "out.pt")
    torchrun(plan_path, out, 3, script=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "factory_pipeline_script.py"))
    got = torch.load(out)

    made = load_factory(MODELS + ":seq_first")
    model, inputs = made.module, made.example_inputs
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = made.loss_fn(model(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got["eval"], model.eval()(*inputs))
    assert set(got["weights"]) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["weights"][name], p.detach(), msg=lambda m, n=name: f"{n}: {m}")
