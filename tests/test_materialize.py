"""Models built on the meta device: per-stage materialization, initialisation and the up-front memory check.

Oracles: a tensor's materialized values depend on the seed and its name only (equal whether a rank
hosts it alone or the whole model; equal to the same module initialised with the same per-name seeds);
tensors of stages a rank does not host keep no storage; tied copies start equal; the memory estimate is
the sum of its parts (weights and gradients of the hosted stages, the plan's activations, a base per
process) and a run that does not fit is refused before any rank starts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from graphpipe.errors import InputError
from graphpipe.runtime.materialize import (buffers_to_meta, materialize_stages, params_on_meta, retarget_devices,
                                           tensor_seed)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.left = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
        self.right = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # no reset_parameters: nothing can rebuild it
        self.fc = nn.Linear(3, 3)


def stage(*modules: nn.Module, names=None):
    """A stand-in for a StageProgram holding ``modules``."""
    holder = nn.ModuleList(modules)
    return SimpleNamespace(module=holder, param_names=names or {}, segments=(), assemble=None)


def meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def real(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"}


def test_values_depend_on_the_seed_and_the_name_only_and_other_stages_stay_on_meta():
    alone, whole = meta_net(), meta_net()
    materialize_stages(alone, {1: stage(alone.right)}, torch.device("cpu"), seed=3)
    materialize_stages(whole, {0: stage(whole.embed, whole.left), 1: stage(whole.right)}, torch.device("cpu"), seed=3)
    assert set(real(alone)) == {"right.weight", "right.bias"}  # nothing of the other stages got storage
    assert set(real(whole)) == {n for n, _ in [*Net().named_parameters(), *Net().named_buffers()]}
    for name, t in real(alone).items():
        torch.testing.assert_close(t, real(whole)[name], rtol=0, atol=0)
    # the oracle: the module's own initialiser run with the generator seeded from (seed, name) per tensor
    torch.manual_seed(tensor_seed(3, "right.weight"))
    w = torch.empty(6, 6)
    nn.init.kaiming_uniform_(w, a=5 ** 0.5)
    torch.testing.assert_close(real(alone)["right.weight"], w, rtol=0, atol=0)
    other = meta_net()
    materialize_stages(other, {1: stage(other.right)}, torch.device("cpu"), seed=4)
    assert not torch.equal(real(other)["right.weight"], real(alone)["right.weight"])
    bn = whole.left[1]
    assert torch.equal(bn.running_var, torch.ones(6)) and torch.equal(bn.weight, torch.ones(6))


class Tokens(nn.Module):
    """DINOv2's embeddings: raw parameters that the root's ``_init_weights`` fills together, one of them
    (``mask``) never read by a forward without a mask, so no stage holds it."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.empty(1, 4))
        self.pos = nn.Parameter(torch.empty(3, 4))
        self.mask = nn.Parameter(torch.empty(1, 4))


class WithTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = Tokens()
        self.fc = nn.Linear(4, 4)

    def _init_weights(self, module):
        if isinstance(module, Tokens):
            nn.init.trunc_normal_(module.cls, std=0.02)
            nn.init.trunc_normal_(module.pos, std=0.02)
            module.mask.zero_()


def test_materializing_an_unused_tensor_later_leaves_its_initialised_siblings_as_they_were():
    """The stage holding ``cls`` and ``pos`` is materialized, then the unused ``mask`` (for a whole checkpoint,
    :func:`materialize_unused`): its initialiser fills all three again, yet ``cls`` and ``pos`` keep the values
    the whole model materialized in one go gives them (seeded by their names), and ``mask`` is zero."""
    from graphpipe.runtime.materialize import materialize_unused

    with torch.device("meta"):
        staged, whole = WithTokens(), WithTokens()
    tokens = staged.tokens
    holder = nn.Module()
    holder.register_parameter("cls", tokens.cls)
    holder.register_parameter("pos", tokens.pos)
    programs = {0: SimpleNamespace(module=holder, param_names={}, segments=(), assemble=None)}
    materialize_stages(staged, programs, torch.device("cpu"), seed=5)
    first = {n: t.detach().clone() for n, t in real(staged).items()}
    assert set(first) == {"tokens.cls", "tokens.pos"}
    assert materialize_unused(staged, programs.values(), seed=5) == set()  # mask and fc: each has an initialiser
    materialize_stages(whole, {0: stage(whole.tokens, whole.fc)}, torch.device("cpu"), seed=5)
    for name in ("tokens.cls", "tokens.pos"):
        torch.testing.assert_close(real(staged)[name], first[name], rtol=0, atol=0)
        torch.testing.assert_close(real(staged)[name], real(whole)[name], rtol=0, atol=0)
    assert torch.equal(real(staged)["tokens.mask"], torch.zeros(1, 4))


def test_tied_copies_on_another_stage_start_equal_and_stay_distinct():
    model = meta_net()
    copy = nn.Linear(6, 10, bias=False, device="meta")
    copy.weight = nn.Parameter(model.embed.weight.detach().clone())  # what the split gives a second stage
    done = materialize_stages(model, {0: stage(model.embed), 2: stage(copy, names={"0.weight": "embed.weight"})},
                              torch.device("cpu"), seed=0)
    assert not done.uninitialised
    assert copy.weight is not model.embed.weight
    torch.testing.assert_close(copy.weight, model.embed.weight, rtol=0, atol=0)
    lone = nn.Linear(6, 10, bias=False, device="meta")  # a rank hosting only the copy gets the same values
    lone.weight = nn.Parameter(meta_net().embed.weight.detach().clone())
    other = meta_net()
    materialize_stages(other, {2: stage(lone, names={"0.weight": "embed.weight"})}, torch.device("cpu"), seed=0)
    torch.testing.assert_close(lone.weight, model.embed.weight, rtol=0, atol=0)


def test_a_tensor_without_initialiser_is_listed_and_buffers_keep_their_built_values():
    with torch.device("meta"):
        model = Raw()
    done = materialize_stages(model, {0: stage(model)}, torch.device("cpu"), seed=0)
    assert done.uninitialised == {"scale"}
    with params_on_meta():
        net = Net()
    net.left[1].running_mean.fill_(2.0)
    assert all(p.device.type == "meta" for p in net.parameters())
    initial = buffers_to_meta(net)
    assert all(b.device.type == "meta" for b in net.buffers())
    materialize_stages(net, {0: stage(net.left)}, torch.device("cpu"), seed=0, initial=initial)
    assert torch.equal(net.left[1].running_mean, torch.full((6,), 2.0))


def test_a_weight_normed_layer_is_initialised_through_its_parametrization():
    """``weight_norm`` (HuBERT's and Wav2Vec2's positional convolution): the layer's initialiser reaches the stored
    ``g`` and ``v``, as an eager build's does. Oracle: weight norm's own invariant (``g`` is the norm of ``v`` per
    output slice, so the computed weight is ``v``) and ``Conv1d.reset_parameters``'s bound ``1/sqrt(fan_in)``."""
    with torch.device("meta"):
        conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), dim=2)
    materialize_stages(conv, {0: stage(conv)}, torch.device("cpu"), seed=0)
    g, v = conv.parametrizations.weight.original0, conv.parametrizations.weight.original1
    assert g.device.type == v.device.type == "cpu" and torch.isfinite(v).all() and v.abs().max() > 0
    assert v.abs().max() <= 1 / (4 * 3) ** 0.5
    torch.testing.assert_close(g, torch.norm_except_dim(v, 2, 2))
    torch.testing.assert_close(conv.weight, v)


def test_device_literals_captured_on_meta_are_retargeted():
    class Pos(nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[1], device=x.device)

    gm = torch.fx.symbolic_trace(Pos())
    for node in gm.graph.nodes:  # as a capture on meta inputs records it
        if node.op == "call_function" and node.target is torch.arange:
            node.kwargs = {**node.kwargs, "device": torch.device("meta")}
    gm.recompile()
    assert retarget_devices(gm, torch.device("cpu"))
    torch.testing.assert_close(gm(torch.zeros(2, 3)), torch.arange(3.0).expand(2, 3))


def _plan(spec: str = "mmt:small", devices: int = 3):
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    return make_plan(zoo.canonical_spec(spec), zoo.load_graph(spec), preset("v100", devices), 8, "gpp",
                     SearchOptions(micro_batch_size=2))


def test_memory_estimate_is_the_sum_of_its_parts_and_a_run_that_cannot_fit_is_refused():
    from graphpipe.runtime.memory import RANK_MEMORY_BYTES
    from graphpipe.runtime.memory import check_host_memory, rank_memory

    plan = _plan()
    sg = plan.stage_graph
    ranks = rank_memory(plan)
    for r in ranks:
        weights = sum(sg.param_bytes(s) for s in sg.stages_on_device(r.rank))
        assert r.state_bytes == pytest.approx(2 * weights)
        assert r.activation_bytes == pytest.approx(plan.predicted.peak_activation_bytes[r.rank])
        assert r.base_bytes == RANK_MEMORY_BYTES
    assert sum(r.state_bytes for r in ranks) >= 2 * sg.graph.param_bytes  # replicas hold their stage whole
    need = sum(r.total_bytes for r in ranks)
    assert check_host_memory(plan, available=need) == ranks
    with pytest.raises(InputError) as err:
        check_host_memory(plan, world_size=4, available=need)  # an idle fourth rank costs a base too
    message = str(err.value)
    assert "\n" not in message and "4 ranks would need" in message and "what would fit" in message


def test_cli_run_that_cannot_fit_exits_2_before_starting_a_rank(tmp_path, capsys, monkeypatch):
    from graphpipe.cli import main
    from graphpipe.plan import write_plan
    from graphpipe.runtime import memory

    path = str(tmp_path / "plan.json")
    write_plan(path, _plan())
    monkeypatch.setattr(memory, "available_memory", lambda: 2.0**30)

    def no_launch(*_a, **_k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("graphpipe.runtime.launch", no_launch)
    assert main(["run", path, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "would need about" in err and "1.0 GiB available" in err and "Traceback" not in err


def test_constants_made_from_python_data_keep_their_values_when_captured_on_meta(tmp_path):
    """A list index (``y[:, [-2, 0]]``, Falcon's attention) and ``torch.tensor(data, device=y.device)`` become
    graph constants; captured on meta they hold no data, so each rank fills them from the values export saw
    (not empty storage): the materialized graph computes what the eager module does with the same weights."""
    from graphpipe.runtime.reference import _materialize_whole
    from graphpipe.runtime.rng import ReferenceContext
    from graphpipe.runtime.runnable import load_runnable

    path = tmp_path / "consts.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 6)\n"
        "    def forward(self, x):\n"
        "        y = self.l(x)\n"
        "        return y[:, [-2, 0]] * torch.tensor([3.0, 4.0], device=y.device)\n"
        "def make():\n"
        "    return M(), (torch.randn(8, 4),), lambda out: out.sum()\n")
    ref = load_runnable(f"{path}:make", 0, "cpu", meta_params=True)
    constants = [b for name, b in ref.gm.named_buffers() if "lifted" in name]
    assert len(constants) == 2 and all(b.device.type == "meta" for b in constants)
    _materialize_whole(ref, ref.gm, "cpu", 0)
    values = sorted(b.tolist() for name, b in ref.gm.named_buffers() if "lifted" in name)
    assert values == [[-2, 0], [3.0, 4.0]]
    x = torch.randn(8, 4)
    out = ref.gm(x, ReferenceContext(0, 0, 8, {}))
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, ref.module(x))
