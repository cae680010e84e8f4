"""Profiling: the NNLS fit, the op timer on a fake clock whose costs we set,
the profile file format, apply_profile, and the ``graphpipe profile`` verb.

Oracles: synthetic times generated from known (alpha, beta); a fake clock
advanced by ops by exactly alpha + beta * b, so measurement + fit must
return those numbers; a round trip through the file.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn as nn

from graphpipe.frontend.capture import capture
from graphpipe.cli import main
from graphpipe.errors import FormatError, InputError
from graphpipe.graph import Affine
from graphpipe.frontend.profile import (PROFILE_FORMAT, Profile, apply_profile, fit_affine, profile_captured,
                               profile_from_dict, profile_to_dict, read_profile, resize_batch, time_ops,
                               write_profile)
from graphpipe.frontend.layer import Layer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fit_affine_recovers_coefficients():
    rng = random.Random(3)
    for _ in range(20):
        alpha, beta = rng.uniform(0, 1e-2), rng.uniform(0, 1e-3)
        sizes = sorted(rng.sample(range(1, 64), 4))
        fit = fit_affine(sizes, [alpha + beta * b for b in sizes])
        assert fit.alpha == pytest.approx(alpha, abs=1e-12) and fit.beta == pytest.approx(beta, abs=1e-12)
        noisy = [(alpha + beta * b) * (1 + rng.uniform(-0.01, 0.01)) for b in sizes]
        fit = fit_affine(sizes, noisy)
        assert fit(32) == pytest.approx(alpha + beta * 32, rel=0.05)


def test_fit_affine_is_nonnegative_least_squares():
    # decreasing times: the unconstrained slope is negative; NNLS clamps beta to 0, alpha = mean
    fit = fit_affine([1, 2, 4, 8], [4.0, 3.0, 2.0, 1.0])
    assert fit.beta == 0.0 and fit.alpha == pytest.approx(2.5)
    with pytest.raises(InputError):
        fit_affine([1, 2], [1.0])
    with pytest.raises(InputError):
        fit_affine([1, 2], [1.0, float("nan")])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_COSTED: dict[int, "Costed"] = {}


@torch.library.custom_op("graphpipe_test::charge", mutates_args=())
def _charge(x: torch.Tensor, key: int) -> torch.Tensor:
    """Identity whose forward and backward advance a fake clock by an affine cost (an op export keeps)."""
    layer = _COSTED[key]
    layer.clock.now += layer.fwd(x.shape[0])
    return x.clone()


@_charge.register_fake
def _(x, key):
    return torch.empty_like(x)


def _charge_setup(ctx, inputs, output):
    ctx.key = inputs[1]


def _charge_backward(ctx, grad):
    layer = _COSTED[ctx.key]
    layer.clock.now += layer.bwd(grad.shape[0])
    return grad, None


_charge.register_autograd(_charge_backward, setup_context=_charge_setup)


class Costed(Layer):
    kind = "costed"

    def __init__(self, clock, fwd: Affine, bwd: Affine):
        super().__init__()
        self.clock, self.fwd, self.bwd = clock, fwd, bwd
        self.linear = nn.Linear(4, 4)
        self.key = len(_COSTED)
        _COSTED[self.key] = self

    def forward(self, x):
        # charged after the Linear: its output needs a gradient even when x is a model input
        return torch.ops.graphpipe_test.charge(self.linear(x), self.key)


class TwoCosted(nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.first = Costed(clock, Affine(3e-3, 1e-3), Affine(5e-3, 4e-3))
        self.second = Costed(clock, Affine(1e-4, 2e-3), Affine(0.0, 7e-3))

    def forward(self, x):
        return self.second(self.first(x))


def test_profile_measures_and_fits_controlled_costs():
    clock = FakeClock()
    model = TwoCosted(clock)
    x = torch.randn(2, 4)
    cap = capture(model, (x,), name="two")
    prof = profile_captured(cap, lambda b: resize_batch((x,), b), "two", "cpu", batch_sizes=(1, 2, 4, 8),
                            repeats=3, warmup=1, timer=clock)
    assert prof.batch_sizes == (1, 2, 4, 8) and set(prof.ops) == {"first", "second"}
    for name in ("first", "second"):
        layer = getattr(model, name)
        fwd, bwd = prof.ops[name]
        assert fwd.alpha == pytest.approx(layer.fwd.alpha, abs=1e-12) and fwd.beta == pytest.approx(layer.fwd.beta, abs=1e-12)
        assert bwd.alpha == pytest.approx(layer.bwd.alpha, abs=1e-12) and bwd.beta == pytest.approx(layer.bwd.beta, abs=1e-12)
    # the clock is charged by _Charge's backward, on I's path (an input gradient), so W is free -- except for the
    # first op, whose input is the model's: it has no I, and its whole backward is W
    assert prof.wgrad["first"].alpha == pytest.approx(5e-3, abs=1e-12)
    assert prof.wgrad["first"].beta == pytest.approx(4e-3, abs=1e-12)
    assert prof.wgrad["second"] == Affine(0.0, 0.0)



def test_backward_is_timed_as_one_call_and_w_is_its_measured_share(monkeypatch):
    """B is the one-call backward a GPipe / 1F1B stage runs; the I/W split only apportions it. A GPU adds
    autograd overhead to every split call (an H100 summed per-op I + W to 2.7x the model's backward): here
    each W call costs 1 ms more on the fake clock, which B must not see, and W's share must."""
    import graphpipe.frontend.split_backward as split_backward

    clock = FakeClock()
    model = TwoCosted(clock)
    x = torch.randn(2, 4)
    cap = capture(model, (x,), name="two")
    plain_w = split_backward.backward_weight

    def costly_w(pending):
        clock.now += 1e-3
        plain_w(pending)

    monkeypatch.setattr(split_backward, "backward_weight", costly_w)
    prof = profile_captured(cap, lambda b: resize_batch((x,), b), "two", "cpu", batch_sizes=(1, 2, 4, 8),
                            repeats=3, warmup=1, timer=clock)
    for name in ("first", "second"):
        bwd = getattr(model, name).bwd
        assert prof.ops[name][1].alpha == pytest.approx(bwd.alpha, abs=1e-12)
        assert prof.ops[name][1].beta == pytest.approx(bwd.beta, abs=1e-12)
    # first: no I (its input is the model's), so all of B is W; second: I = its charged backward, W = the 1 ms
    assert prof.wgrad["first"](4) == pytest.approx(model.first.bwd(4), abs=1e-12)
    second_b = model.second.bwd
    for b in (1, 2, 4, 8):
        share = 1e-3 / (second_b(b) + 1e-3)
        assert prof.wgrad["second"](b) == pytest.approx(second_b(b) * share, rel=0.05)

class Act(Layer):
    kind = "act"

    def forward(self, x):
        return torch.relu(x)


class Dense(Layer):
    kind = "linear"

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.linear(x)


def test_profile_times_the_weight_gradient_of_ops_with_parameters():
    """A 2-layer MLP on CPU at two sizes: W is measured for the two Linears only, inside their backward."""
    torch.manual_seed(0)
    model = nn.Sequential(Dense(32, 64), Act(), Dense(64, 8))
    x = torch.randn(4, 32)
    cap = capture(model, (x,), name="mlp")
    assert [op.kind for op in cap.graph.ops] == ["linear", "act", "linear"]
    timings = time_ops(cap, lambda b: resize_batch((x,), b), (2, 8), repeats=3, warmup=1)
    with_params = {op.name for op in cap.graph.ops if op.param_bytes > 0}
    assert {name for name, t in timings.items() if t.wgrad_s is not None} == with_params and len(with_params) == 2
    for name in with_params:  # W is a share of B (B * W / (I + W)), so it never exceeds B, even as medians
        assert all(0 < w <= b for w, b in zip(timings[name].wgrad_s, timings[name].bwd_s))
    prof = profile_captured(cap, lambda b: resize_batch((x,), b), "mlp", "cpu", batch_sizes=(2, 8), repeats=3, warmup=1)
    assert set(prof.wgrad) == with_params
    for name in with_params:  # fitted separately: a loose bound for timing noise, never absolute times
        for b in (2, 8):
            assert 0 < prof.wgrad[name](b) <= 2 * prof.ops[name][1](b)
    graph = apply_profile(cap.graph, prof)
    assert [op.wgrad for op in graph.ops] == [prof.wgrad.get(op.name) for op in cap.graph.ops]
    assert graph.ops[1].wgrad is None


def test_resize_batch_repeats_rows():
    x = torch.arange(6).reshape(3, 2)
    (y,) = resize_batch((x,), 5)
    assert y.shape == (5, 2) and torch.equal(y[3], x[0]) and torch.equal(y[:3], x)


def test_profile_file_round_trip_and_apply(tmp_path, chain):
    prof = Profile("chain", "cpu", (1, 2, 4), {"l1": (Affine(1e-3, 2e-4), Affine(2e-3, 4e-4)),
                                               "l3": (Affine(0.0, 1e-5), Affine(0.0, 2e-5))},
                   wgrad={"l1": Affine(5e-4, 1e-4)})
    path = str(tmp_path / "p.json")
    write_profile(path, prof)
    doc = json.loads(open(path).read())
    assert doc["format"] == PROFILE_FORMAT and doc["ops"]["l1"]["fwd_s"] == [1e-3, 2e-4]
    assert doc["ops"]["l1"]["wgrad_s"] == [5e-4, 1e-4] and "wgrad_s" not in doc["ops"]["l3"]
    back = read_profile(path)
    assert back == prof
    g = apply_profile(chain, back)
    assert g.ops[g.op_id("l1")].fwd == Affine(1e-3, 2e-4) and g.ops[g.op_id("l3")].bwd == Affine(0.0, 2e-5)
    assert g.ops[g.op_id("l1")].wgrad == Affine(5e-4, 1e-4) and g.ops[g.op_id("l3")].wgrad is None
    for name in ("l0", "l2"):  # ops the profile does not name keep their costs
        assert g.ops[g.op_id(name)] == chain.ops[chain.op_id(name)]
    assert [(e.src, e.dst, e.bytes) for e in g.edges] == [(e.src, e.dst, e.bytes) for e in chain.edges]
    with pytest.raises(InputError, match="zz"):
        apply_profile(chain, Profile("x", "cpu", (1, 2), {"zz": (Affine(0, 0), Affine(0, 0))}))


def test_read_profile_refuses_other_formats(tmp_path):
    bad = dict(profile_to_dict(Profile("m", "cpu", (1, 2), {})), format="graphpipe.profile/9")
    with pytest.raises(FormatError, match="graphpipe.profile/9"):
        profile_from_dict(bad)
    with pytest.raises(FormatError, match="fwd_s"):
        profile_from_dict({"format": PROFILE_FORMAT, "ops": {"a": {"fwd_s": [1.0], "bwd_s": [1.0, 2.0]}}})
    with pytest.raises(FormatError):
        profile_from_dict({"format": PROFILE_FORMAT, "ops": {"a": {"fwd_s": [-1.0, 0], "bwd_s": [1.0, 2.0]}}})
    old = {"format": PROFILE_FORMAT, "ops": {"a": {"fwd_s": [1.0, 0], "bwd_s": [1.0, 2.0]}}}
    assert profile_from_dict(old).wgrad == {}, "older profiles time only B"
    with pytest.raises(FormatError, match=r"ops\.a\.wgrad_s\[1\] must be a number, got true"):
        profile_from_dict({**old, "ops": {"a": {**old["ops"]["a"], "wgrad_s": [1.0, True]}}})
    path = tmp_path / "g.json"
    path.write_text('{"format": "graphpipe.graph/1"}')
    with pytest.raises(FormatError):
        read_profile(str(path))
    with pytest.raises(InputError, match="no such"):
        read_profile(str(tmp_path / "missing.json"))


def test_profile_cli_writes_a_valid_profile(tmp_path, capsys):
    from graphpipe.frontend import zoo
    out = str(tmp_path / "prof.json")
    spec = "transformer:small,layers=2"
    assert main(["profile", spec, "--device", "cpu", "--out", out, "--batch-sizes", "1,2,4",
                 "--repeats", "2", "--warmup", "1"]) == 0
    prof = read_profile(out)
    graph = zoo.load_graph(spec)
    assert prof.model == zoo.canonical_spec(spec) and prof.batch_sizes == (1, 2, 4)
    assert set(prof.ops) == {op.name for op in graph.ops}
    assert all(f.alpha + f.beta > 0 and b.alpha + b.beta > 0 for f, b in prof.ops.values())
    applied = apply_profile(graph, prof)
    assert all(applied.ops[i].fwd == prof.ops[op.name][0] for i, op in enumerate(graph.ops))
    assert set(prof.wgrad) == {op.name for op in graph.ops if op.param_bytes > 0}
    assert all(applied.ops[i].wgrad == prof.wgrad.get(op.name) for i, op in enumerate(graph.ops))
    # errors are one line and exit 2
    assert main(["profile", "nosuchmodel", "--out", out]) == 2
    assert main(["profile", spec, "--out", out, "--batch-sizes", "4"]) == 2
    assert main(["profile", "graph.json", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("graphpipe: error:") == 3 and "two distinct" in err


def test_models_cli_lists_the_zoo(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows["mmt"]["ops"] == 34 and rows["mmt"]["branches"] == 4
    assert rows["candle-uno"]["branches"] == 7 and rows["dlrm"]["branches"] == 14
    assert rows["transformer"]["ops"] == 34 and rows["twobranch"]["ops"] == 19
    assert all(r["parameters"] > 1e8 for r in rows.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda(tmp_path):
    out = str(tmp_path / "cuda.json")
    assert main(["profile", "mmt:small,layers=1", "--device", "cuda", "--out", out, "--batch-sizes", "1,4,16",
                 "--repeats", "3"]) == 0
    prof = read_profile(out)
    assert prof.device.startswith("cuda") and len(prof.ops) == 4
    assert all(f.alpha + f.beta > 0 and b.alpha + b.beta > 0 for f, b in prof.ops.values())
