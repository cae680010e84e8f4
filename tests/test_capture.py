"""Capture through torch.export: op contraction, parameter accounting, numerics of gm and of
``split_module`` partitions, factory loading.

Oracles: the module itself (``assert_close`` of outputs), the module's
parameter bytes, closed-form tensor sizes, and the defining properties of a
contraction (every fx node in exactly one op, each op connected, op graph a DAG).
"""

from __future__ import annotations

import random
import textwrap

import pytest
from conftest import ZOO_SMALL
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpipe.frontend import zoo
from graphpipe.frontend.capture import capture, load_factory, split_by_ops
from graphpipe.frontend.layer import Layer
from graphpipe.frontend.capture_repeats import graph_from_factory
from graphpipe.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def run_gm(cap, *inputs):
    """The captured graph's output in the module's own structure."""
    return cap.io.output(cap.gm(*inputs))


def _check_contraction(cap) -> None:
    """Every compute node (not a placeholder, output or parameter read) in exactly one op; each op's nodes connected."""
    fx_nodes = {n.name: n for n in cap.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}
    owned = [name for nodes in cap.op_nodes.values() for name in nodes]
    assert sorted(owned) == sorted(fx_nodes)
    assert set(cap.op_nodes) == {op.name for op in cap.graph.ops}
    for nodes in cap.op_nodes.values():
        members = set(nodes)
        reached, frontier = {nodes[0]}, [nodes[0]]
        while frontier:
            n = fx_nodes[frontier.pop()]
            for m in list(n.all_input_nodes) + list(n.users):
                if m.name in members and m.name not in reached:
                    reached.add(m.name)
                    frontier.append(m.name)
        assert reached == members


def _params(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module", params=ZOO_SMALL)
def small(request):
    built = zoo.build(request.param)
    return built, capture(built.module, built.example_inputs, name=built.name)


def test_small_models_capture_exactly(small):
    built, cap = small
    assert cap.graph.param_bytes == _params(built.module)
    _check_contraction(cap)
    torch.testing.assert_close(run_gm(cap, *built.example_inputs), built.module(*built.example_inputs))
    # backward through gm gives the module's gradients
    loss = built.loss_fn(run_gm(cap, *built.example_inputs))
    grads = torch.autograd.grad(loss, list(built.module.parameters()))
    ref = torch.autograd.grad(built.loss_fn(built.module(*built.example_inputs)), list(built.module.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_convex_two_way_splits_match_module(small):
    """Any topological prefix is a convex cut; split_module on it reproduces the module."""
    built, cap = small
    rng = random.Random(0)
    x = built.make_inputs(3, 11)
    expected = built.module(*x)
    n = cap.graph.num_ops
    for k in sorted({1, n - 1, rng.randint(1, n - 1)}):
        stage_of_op = {op.name: int(i >= k) for i, op in enumerate(cap.graph.ops)}
        split = split_by_ops(cap, stage_of_op)
        torch.testing.assert_close(cap.io.output(split(*x)), expected)
        assert len([m for m in split.children() if isinstance(m, torch.fx.GraphModule)]) == 2
    # one partition per op (what profiling uses)
    split = split_by_ops(cap, {op.name: i for i, op in enumerate(cap.graph.ops)})
    torch.testing.assert_close(cap.io.output(split(*x)), expected)


def test_edge_and_output_bytes_closed_form():
    built = zoo.build("mmt:small,seq=8,hidden=16,heads=2")
    g = capture(built.module, built.example_inputs, name="m").graph
    per_sample = 8 * 16 * 4  # one fp32 (seq, hidden) tensor
    a, b = g.op_id("branch0.layer0"), g.op_id("branch0.layer1")
    assert g.edge_bytes(a, b) == per_sample
    assert g.edge_bytes(b, g.op_id("concat")) == per_sample
    assert g.edge_bytes(g.op_id("concat"), g.op_id("head")) == 2 * per_sample
    assert g.ops[a].out_bytes == per_sample and g.ops[g.op_id("concat")].out_bytes == 2 * per_sample
    assert g.ops[g.op_id("head")].out_bytes == 10 * 4  # logits
    # saved activations include at least the op's own output
    assert all(op.act_bytes >= op.out_bytes for op in g.ops if op.kind == "transformer")


class Residual(nn.Module):
    """A user model with glue: casts, residual adds, a free parameter, functional ops."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.w = nn.Parameter(torch.randn(8, 3))

    def forward(self, x):
        x = x.float() * 2
        h = F.relu(self.a(x))
        y = torch.cat([self.b(h), self.c(h)], dim=-1)
        y = y[..., :8] + y[..., 8:] + x
        return self.norm(y) @ self.w


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.left, self.right = nn.Linear(8, 4), nn.Linear(8, 4)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.enc(x)
        return self.out(torch.cat([torch.tanh(self.left(h)), self.right(h)], dim=-1))


def test_glue_contraction_rules_on_user_models():
    torch.manual_seed(0)
    m, x = Residual(), torch.randn(5, 8)
    cap = capture(m, (x,), name="res")
    _check_contraction(cap)
    assert cap.graph.param_bytes == _params(m)
    torch.testing.assert_close(run_gm(cap, x), m(x))
    assert "relu" in cap.op_nodes["a"]  # forward rule: activation joins its layer
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    with_w = [op for op, nodes in cap.op_nodes.items()
              if any(a.op == "get_attr" and a.target == "w" for x_ in nodes for a in by_name[x_].all_input_nodes)]
    assert len(with_w) == 1 and cap.graph.ops[cap.graph.op_id(with_w[0])].param_bytes >= 8 * 3 * 4
    split = split_by_ops(cap, {op.name: i for i, op in enumerate(cap.graph.ops)})
    torch.testing.assert_close(cap.io.output(split(x)), m(x))

    m, x = Branchy().eval(), torch.randn(3, 5, 8)
    cap = capture(m, (x,), name="branchy")
    names = [op.name for op in cap.graph.ops]
    assert names == ["enc", "left", "right", "out"]  # enc is one op; cat joins its consumer
    assert "cat" in cap.op_nodes["out"] and "tanh" in cap.op_nodes["left"]
    g = cap.graph
    assert g.succs(g.op_id("enc")) == (g.op_id("left"), g.op_id("right"))
    assert cap.graph.ops[0].kind == "transformerencoderlayer"
    torch.testing.assert_close(run_gm(cap, x), m(x))


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "factory_mod.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_load_factory_and_graph_from_factory(tmp_path):
    path = _write(tmp_path, """
        import torch
        def make():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
            return m, (torch.randn(3, 4),), lambda out: out.pow(2).mean()
        def not_a_triple():
            return 1, 2
        def not_a_module():
            return 1, (torch.randn(2),), print
        def bad_inputs():
            return torch.nn.Linear(2, 2), ("x",), print
        helper_value = 3
    """)
    made = load_factory(f"{path}:make")
    module, inputs = made.module, made.example_inputs
    assert isinstance(module, nn.Module) and inputs[0].shape == (3, 4) and made.example_target is None
    graph = graph_from_factory(f"{path}:make")
    assert [op.name for op in graph.ops] == ["0", "2"] and graph.param_bytes == _params(module)
    cases = [
        (f"{tmp_path}/missing.py:make", "not found"),
        (f"{path}:nope", "no function 'nope'"),
        (f"{path}:not_a_triple", "(module, example_inputs, loss_fn[, example_target[, dynamic_shapes]])"),
        (f"{path}:not_a_module", "nn.Module"),
        (f"{path}:bad_inputs", "tuple of tensors"),
        (f"{path}", "file.py:function_name"),
    ]
    for spec, words in cases:
        with pytest.raises(InputError) as err:
            load_factory(spec)
        assert words in str(err.value), (spec, str(err.value))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(InputError, match="boom"):
        load_factory(f"{broken}:make")


class RandomProgram(nn.Module):
    """Random straight-line mix of Linear layers and glue (add, mul, tanh, cat+slice,
    free parameters) over earlier values: a stress case for the contraction rules."""

    def __init__(self, seed: int, steps: int = 14):
        super().__init__()
        rng = random.Random(seed)
        self.program: list[tuple] = []
        self.layers = nn.ModuleList()
        self.free = nn.ParameterList()
        num_values = 1
        for _ in range(steps):
            kind = rng.choice(["layer", "layer", "add", "tanh", "cat", "param"])
            a, b = rng.randrange(num_values), rng.randrange(num_values)
            if kind == "layer":
                self.layers.append(nn.Linear(6, 6))
                self.program.append(("layer", len(self.layers) - 1, a))
            elif kind == "param":
                self.free.append(nn.Parameter(torch.randn(6)))
                self.program.append(("param", len(self.free) - 1, a))
            else:
                self.program.append((kind, a, b))
            num_values += 1
        self.outputs = sorted({num_values - 1, rng.randrange(num_values)})

    def forward(self, x):
        values = [x]
        for kind, i, j in self.program:
            if kind == "layer":
                values.append(self.layers[i](values[j]))
            elif kind == "param":
                values.append(values[j] * self.free[i])
            elif kind == "add":
                values.append(values[i] + values[j])
            elif kind == "tanh":
                values.append(torch.tanh(values[i]))
            else:
                values.append(torch.cat([values[i], values[j]], dim=-1)[..., 3:9])
        return sum(values[k] for k in self.outputs)


@pytest.mark.parametrize("seed", range(12))
def test_contraction_properties_on_random_programs(seed):
    torch.manual_seed(seed)
    m, x = RandomProgram(seed), torch.randn(4, 6)
    cap = capture(m, (x,), name=f"rand{seed}")  # OpGraph.build would raise on a cyclic contraction
    _check_contraction(cap)
    expected = m(x)
    if expected.requires_grad:  # export drops code the output does not need: parameters there get no gradient
        expected.sum().backward()
    assert cap.graph.param_bytes == sum(p.numel() * p.element_size() for p in m.parameters() if p.grad is not None)
    torch.testing.assert_close(run_gm(cap, x), expected)
    torch.testing.assert_close(cap.io.output(split_by_ops(cap, {op.name: i for i, op in enumerate(cap.graph.ops)})(x)),
                               expected)
    k = max(1, cap.graph.num_ops // 2)
    torch.testing.assert_close(cap.io.output(split_by_ops(cap, {op.name: int(i >= k)
                                                               for i, op in enumerate(cap.graph.ops)})(x)), expected)


def test_saved_on_both_sides_of_a_cut_is_on_the_edge():
    """``h = relu(a(x))`` is saved by the ReLU (charged to ``a``) and again as the input of ``b`` and of ``c``:
    one tensor on one device, so ``b``'s and ``c``'s act_bytes leave it out, and each edge carries it as
    ``saved`` for a stage that holds the consumer without ``a`` (graphpipe.costs.received_saved_bytes)."""
    g = capture(Residual(), (torch.randn(3, 8),), name="r").graph
    a, b, c = g.op_id("a"), g.op_id("b"), g.op_id("c")
    h_bytes = 8 * 4
    assert g.edge_bytes(a, b) == g.edge_bytes(a, c) == h_bytes
    assert {(e.src, e.dst): e.saved for e in g.saved_edges} == {(a, b): h_bytes, (a, c): h_bytes}
    # Linear -> Linear: nothing saves the first output but the second op, which is charged for it
    g = capture(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), (torch.randn(3, 4),), name="ll").graph
    assert g.saved_edges == () and g.ops[1].act_bytes == 8 * 4


def test_embedding_bag_act_bytes_are_what_a_cpu_step_saves():
    """The meta kernel of embedding_bag saves an offset2bag of one int64 per index; the CPU kernel a run uses
    saves other, smaller tensors. Capture charges what the CPU step saves (the runtime's meter on the same
    forward), the input indices (resident data) excluded."""
    from graphpipe.runtime.measure import SavedBytesMeter
    from graphpipe.frontend.zoo_models import EmbeddingBagTable

    batch, bag = 4, 5
    table = EmbeddingBagTable(50, 8)
    indices = torch.randint(0, 50, (batch, bag))
    g = capture(table, (indices,), name="emb").graph
    meter = SavedBytesMeter(table.parameters())
    meter.reset(resident=(indices,))
    with meter.hooks():
        out = table(indices)
    assert meter.peak > 0 and g.ops[0].act_bytes * batch == meter.peak
    del out


class _FixesBatch(nn.Module):
    """Reshapes by the example's batch size: the exported graph would only run at that batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).reshape(4, 8).sum(-1)


def test_a_model_fixing_the_batch_is_still_refused():
    from graphpipe.errors import UserCodeError

    with pytest.raises(UserCodeError, match="torch.export cannot capture _FixesBatch"):
        capture(_FixesBatch(), (torch.randn(4, 8),), loss_fn=lambda out: out.sum())


class _RoundSTE(torch.autograd.Function):
    """Straight-through rounding (quantization-aware training): its backward is not its forward's derivative."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Cube(torch.autograd.Function):
    """A hand-written backward that is its forward's derivative (as Bloom's GeLU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class _CustomBackward(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.function.apply(torch.tanh(self.a(self.function.apply(x)))))  # first call: on the data


@pytest.mark.parametrize("function", [_RoundSTE, _Cube])
def test_a_custom_backward_export_would_drop_is_refused_and_a_derivative_is_kept(function):
    """Export keeps a custom autograd.Function's forward ops and drops its backward. A backward that differs from
    the forward's derivative (a straight-through estimator) is refused naming the Function and its line; one that is
    the derivative captures, and the captured graph's gradients are the module's (the oracle)."""
    from graphpipe.errors import UserCodeError

    torch.manual_seed(0)
    model, x = _CustomBackward(function), torch.randn(4, 4)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    if function is _RoundSTE:
        with pytest.raises(UserCodeError, match=r"test_capture\.py:\d+: .*autograd\.Function _RoundSTE has a "
                                                r"backward that is not its forward's derivative"):
            capture(model, (x,), loss_fn=loss_fn)
        return
    cap = capture(model, (x,), loss_fn=loss_fn)
    expected = dict(zip([n for n, _ in model.named_parameters()],
                        torch.autograd.grad(loss_fn(model(x)), list(model.parameters()))))
    captured = dict(cap.gm.named_parameters())
    got = torch.autograd.grad(loss_fn(run_gm(cap, x)), [captured[name] for name in expected])
    for (name, want), grad in zip(expected.items(), got):
        torch.testing.assert_close(grad, want, msg=name)


class _InPlaceDouble(torch.autograd.Function):
    """Doubles its input in place: the probe's leaf inputs cannot be modified in place, so it stays unconfirmed."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _AfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(_InPlaceDouble.apply(self.a(x)))


def test_a_custom_backward_the_probe_cannot_run_is_captured_with_a_warning(caplog):
    """A Function whose forward the probe cannot run (in place on its inputs) is not known wrong: it captures, a
    warning names it, and the captured gradients are the module's (here autograd's through the forward is right)."""
    torch.manual_seed(0)
    model, x = _AfterLinear(), torch.randn(4, 4)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    with caplog.at_level("WARNING", logger="graphpipe.frontend.capture"):
        cap = capture(model, (x,), loss_fn=loss_fn)
    assert "could not compare the custom autograd.Function _InPlaceDouble's backward" in caplog.text
    expected = torch.autograd.grad(loss_fn(model(x)), list(model.parameters()))
    captured = dict(cap.gm.named_parameters())
    got = torch.autograd.grad(loss_fn(run_gm(cap, x)), [captured[n] for n, _ in model.named_parameters()])
    for want, grad in zip(expected, got):
        torch.testing.assert_close(grad, want)


def test_llama4_experts_capture_with_a_dynamic_batch():
    """Llama-4's mixture of experts: a named batch dimension fails export's solver; the capture still keeps the
    batch a symbol, so the graph runs at another micro-batch size."""
    pytest.importorskip("transformers")
    from graphpipe.evals.llm_configs import build

    model, inputs, loss_fn, labels = build("llama4_scout", layers=2, tiny=True, seq=16)
    captured = capture(model, inputs, loss_fn=loss_fn, example_target=labels)
    assert captured.graph.num_ops > 0
    placeholder = next(n for n in captured.gm.graph.nodes if n.op == "placeholder")
    assert isinstance(placeholder.meta["val"].shape[0], torch.SymInt)


class _CubeAndCopy(torch.autograd.Function):
    """Two outputs: the cube (differentiated) and a detached copy, which the Function's outputs mark as needing a
    gradient but its forward run as plain ops does not: the probe compares over the cube only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3, x.detach() + 1

    @staticmethod
    def backward(ctx, grad, _unused):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class _CubeAndCopyWrong(_CubeAndCopy):
    @staticmethod
    def backward(ctx, grad, _unused):
        return grad


@pytest.mark.parametrize("function,same", [(_CubeAndCopy, True), (_CubeAndCopyWrong, False)])
def test_the_backward_probe_compares_only_the_outputs_both_differentiate(function, same):
    """The probe runs one autograd graph at a time (the Function's, then its forward's as plain ops); where the plain
    forward differentiates fewer outputs, both gradients are taken over the common ones: a right derivative passes,
    a straight-through backward does not."""
    from graphpipe.frontend.capture_refusals import _same_gradient

    x = torch.randn(3, 5).requires_grad_(True)
    assert _same_gradient(function, (x,), {}, torch.autograd.Function.apply.__func__) is same


class _ConvBNLayer(Layer):
    """A zoo-style layer (one op) with a BatchNorm inside it."""

    kind = "convbn"

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.proj, self.norm, self.head = _ConvBNLayer(), nn.Linear(256, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.proj(self.block(x).flatten(1)))))


def test_ops_holding_a_batchnorm_are_marked_inside_a_block_too_and_the_mark_round_trips():
    """The planner keeps stages with BatchNorm whole copies (the runtime merges its statistics over those only):
    the capture marks every op holding one, a BatchNorm of its own or one inside a block it keeps whole, the
    graph file keeps the mark, and a mark that is not a boolean is refused naming the field."""
    from graphpipe.errors import FormatError
    from graphpipe.graph import graph_from_dict, graph_to_dict

    captured = capture(_BNNet(), (torch.randn(4, 3, 8, 8),))
    graph = captured.graph
    ops = {op.name: op.batchnorm for op in graph.ops}
    holder = next(op for op, names in captured.op_nodes.items() if "norm" in names)  # after a Linear: with it
    assert ops == {"block": True, "proj": False, "head": False, **{holder: True}} and holder != "head"
    doc = graph_to_dict(graph)
    assert graph_from_dict(doc) == graph
    assert [("batchnorm" in op) for op in doc["ops"]] == [op.batchnorm for op in graph.ops]
    doc["ops"][0]["batchnorm"] = "yes"
    with pytest.raises(FormatError, match=r"^graph\.ops\[0\]\.batchnorm must be true or false, got 'yes'$"):
        graph_from_dict(doc)


class _DropNet(nn.Module):
    """A block with a dropout module, one with a functional dropout, one whose dropout draws nothing (p 0)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop, self.off = nn.Dropout(0.1), nn.Dropout(0.0)

    def forward(self, x):
        x = self.drop(torch.relu(self.a(x)))
        x = F.dropout(torch.relu(self.b(x)), 0.2, self.training)
        return self.off(self.c(x))


def test_ops_drawing_dropout_are_marked_and_the_mark_round_trips():
    """A sequence-parallel stage keeps a dropout's masks whole, so the cost model needs to know which ops draw
    one: the capture marks an op whose nodes include a dropout module or function with p > 0 (not one with p
    0), and the graph file keeps the mark (written only when true)."""
    from graphpipe.errors import FormatError
    from graphpipe.graph import graph_from_dict, graph_to_dict

    captured = capture(_DropNet().train(), (torch.randn(4, 8),))
    graph = captured.graph
    drawn = {op.name for op in graph.ops if op.dropout}
    owner = {name: op for op, names in captured.op_nodes.items() for name in names}
    assert drawn == {owner[n] for n in owner if "drop" in n and "off" not in n} == {"a", "b"}
    assert owner["off"] == "c"  # its p-0 dropout draws nothing
    doc = graph_to_dict(graph)
    assert graph_from_dict(doc) == graph
    assert [("dropout" in op) for op in doc["ops"]] == [op.dropout for op in graph.ops]
    doc["ops"][0]["dropout"] = 1
    with pytest.raises(FormatError, match=r"^graph\.ops\[0\]\.dropout must be true or false, got 1$"):
        graph_from_dict(doc)


class _ScaleMeanGrad(torch.autograd.Function):
    """``x * w`` with ``w`` broadcast over the rows, whose backward averages ``w``'s gradient over the rows
    instead of summing it: wrong, and only visible with more than one row."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).mean(0)


class _Scaled(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function, self.a, self.w, self.b = function, nn.Linear(4, 4), nn.Parameter(torch.ones(4)), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(self.function.apply(h, self.w) if self.function is _ScaleMeanGrad else self.function.apply(h))


@pytest.mark.parametrize("float64_elements", [None, 0])
def test_the_probe_sees_a_reduction_over_rows_and_wide_inputs_run_in_float32(monkeypatch, float64_elements):
    """The probe runs a custom Function on random inputs with the (symbolic) batch at 2 rows, so a backward that
    averages over the rows where the derivative sums is refused (at 1 row the two agree); inputs wider than
    PROBE_FLOAT64_ELEMENTS run in float32 (a paper-size layer's probe in float64 took 1.3 GB), which still refuses
    it and still passes a right derivative."""
    from graphpipe.errors import UserCodeError
    from graphpipe.frontend import capture_refusals

    if float64_elements is not None:
        monkeypatch.setattr(capture_refusals, "PROBE_FLOAT64_ELEMENTS", float64_elements)
    x = torch.randn(4, 4)
    with pytest.raises(UserCodeError, match=r"autograd\.Function _ScaleMeanGrad has a backward that is not"):
        capture(_Scaled(_ScaleMeanGrad), (x,))
    assert capture(_Scaled(_Cube), (x,)).graph.num_ops > 0
