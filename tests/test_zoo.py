"""Model zoo: structure of the paper configs, options, determinism, errors.

Oracles: closed-form parameter counts and FLOPs of a transformer block, the
branch structure each spec asks for, and real forward/backward runs.
"""

from __future__ import annotations

import pytest
from conftest import ZOO_SMALL
import torch

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def _chain_lengths(graph) -> list[int]:
    """Ops on each source's path until the first op with several predecessors."""
    lengths = []
    for src in graph.sources():
        n, op = 1, src
        while len(graph.succs(op)) == 1 and len(graph.preds(graph.succs(op)[0])) == 1:
            op = graph.succs(op)[0]
            n += 1
        lengths.append(n)
    return lengths


@pytest.mark.parametrize("spec", ZOO_SMALL)
def test_small_model_trains_one_step(spec):
    built = zoo.build(spec)
    params = list(built.module.parameters())
    loss = built.loss_fn(built.module(*built.example_inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    # the loss is a per-sample mean: the mean of two half-batch losses equals the full-batch loss
    x = built.make_inputs(4, 1)
    full = built.loss_fn(built.module(*x))
    halves = [built.loss_fn(built.module(*(t[i:i + 2] for t in x))) for i in (0, 2)]
    torch.testing.assert_close(full, sum(halves) / 2)


@pytest.mark.parametrize("spec", ["mmt:small", "dlrm:small"])
def test_build_is_deterministic_and_leaves_global_rng_alone(spec):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = zoo.build(spec, seed=7), zoo.build(spec, seed=7), zoo.build(spec, seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.module.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    for x, y in zip(a.make_inputs(3, 5), b.make_inputs(3, 5)):
        assert torch.equal(x, y) and x.shape[0] == 3
    assert any(not torch.equal(x, y) for x, y in zip(a.make_inputs(3, 5), a.make_inputs(3, 6)))


def test_mmt_paper_structure_and_block_costs():
    graph = zoo.load_graph("mmt")
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("transformer") == 32
    assert {op.name for op in graph.ops if op.kind != "transformer"} == {"concat", "head"}
    assert len(graph.sources()) == 4 and _chain_lengths(graph) == [8] * 4
    concat = graph.op_id("concat")
    assert len(graph.preds(concat)) == 4 and graph.succs(concat) == (graph.op_id("head"),)
    # closed form for a pre-LN block with FFN 4h: 12h^2 + 13h parameters, fp32
    h, s, f = 1024, 256, 4096
    layer = graph.ops[graph.op_id("branch2.layer5")]
    assert layer.param_bytes == 4 * (12 * h * h + 13 * h)
    # forward FLOPs per sample: matmuls 2*s*(4h^2 + 2hf) plus attention 4*s^2*h
    flops = 2 * s * (4 * h * h + 2 * h * f) + 4 * s * s * h
    dev = preset("v100").device
    assert layer.fwd.beta == pytest.approx(flops / (dev.peak_flops * dev.mfu), rel=1e-6)
    assert layer.bwd.beta == pytest.approx(2 * layer.fwd.beta) and layer.fwd.alpha == dev.op_overhead_s
    assert layer.out_bytes == s * h * 4  # one fp32 (seq, hidden) activation per sample
    assert graph.param_bytes == 4 * sum(p.numel() for p in zoo.build("mmt", device="meta").module.parameters())


def test_candle_uno_and_dlrm_paper_branches():
    uno = zoo.load_graph("candle-uno")
    assert len(uno.sources()) == 7 and _chain_lengths(uno) == [4] * 7
    assert len(uno.preds(uno.op_id("concat"))) == 7
    dlrm = zoo.load_graph("dlrm")
    assert len(dlrm.preds(dlrm.op_id("interaction"))) == 14
    emb = [op for op in dlrm.ops if op.kind == "embedding"]
    assert len(emb) == 7 and all(op.param_bytes == 1_000_000 * 64 * 4 for op in emb)
    built = zoo.build("dlrm", device="meta")
    assert all(p.is_meta for p in built.module.parameters())  # 1M-row tables were never allocated
    assert built.example_inputs[7].dtype == torch.int64 and built.example_inputs[7].shape[1] == 100


def test_options_change_structure():
    assert len(zoo.load_graph("candle-uno:small,branches=3").sources()) == 3
    g = zoo.load_graph("mmt:small,branches=3,layers=4")
    assert len(g.sources()) == 3 and _chain_lengths(g) == [4] * 3
    assert zoo.load_graph("transformer:small,layers=5").num_ops == 5 + 2  # embed + layers + head
    tb = zoo.load_graph("twobranch:small,branches=3")
    assert len(tb.succs(tb.op_id("embed"))) == 3
    assert len(zoo.build("dlrm:small,branches=3").example_inputs) == 6


def test_canonical_spec_is_stable():
    assert zoo.canonical_spec("mmt") == zoo.canonical_spec("mmt:paper") == "mmt"
    assert zoo.canonical_spec(" MMT:layers=4,small,branches=3 ") == "mmt:small,branches=3,layers=4"
    for spec in ["dlrm:rows=10,small", "candle-uno:branches=16", "twobranch:small"]:
        c = zoo.canonical_spec(spec)
        assert zoo.canonical_spec(c) == c
        assert zoo.parse_spec(c).config == zoo.parse_spec(spec).config
    assert zoo.build("mmt:small,layers=2").name == "mmt:small"


@pytest.mark.parametrize("spec, words", [
    ("gpt9", ["unknown model 'gpt9'", "mmt", "candle-uno"]),
    ("mmt:depth=3", ["unknown option 'depth=3'", "layers=N", "branches=N"]),
    ("mmt:tiny", ["unknown option 'tiny'", "small"]),
    ("mmt:layers=two", ["layers", "integer", "'two'"]),
    ("mmt:branches=0", ["branches", ">= 1"]),
    ("mmt:small,hidden=30", ["hidden (30)", "heads (4)"]),
    ("", ["known models"]),
])
def test_bad_specs_raise_input_error(spec, words):
    with pytest.raises(InputError) as err:
        zoo.build(spec, device="meta")
    for word in words:
        assert word in str(err.value)


def test_bad_devices_raise_input_error():
    with pytest.raises(InputError, match="unknown torch device"):
        zoo.build("mmt:small", device="tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            zoo.build("mmt:small", device="cuda")


def test_option_names_and_models_listing():
    assert set(zoo.MODELS) == {"mmt", "dlrm", "candle-uno", "transformer", "twobranch"}
    assert "branches" in zoo.option_names("candle-uno") and "rows" in zoo.option_names("dlrm")
    with pytest.raises(InputError):
        zoo.option_names("nope")


@pytest.mark.parametrize("spec", list(zoo.MODELS) + ["dlrm:small,branches=3", "candle-uno:branches=16"])
def test_zoo_graphs_are_series_parallel(spec):
    sp = pytest.importorskip("graphpipe.sp", reason="graphpipe.sp (SP decomposition) not built yet")
    graph = zoo.load_graph(spec)
    assert sp.is_series_parallel(graph), sp.prime_regions(graph)


def test_one_placeholder_per_input_branch():
    from graphpipe.frontend.capture import capture

    built = zoo.build("mmt", device="meta")
    cap = capture(built.module, built.example_inputs, name="mmt")
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 4
    # each modality input feeds exactly its own branch's first layer
    op_of = cap.op_of_node()
    for i, ph in enumerate(placeholders):
        assert {op_of[u.name] for u in ph.users} == {f"branch{i}.layer0"}
