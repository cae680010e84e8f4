"""The launcher's capture shipped to its ranks (graphpipe/runtime/shipping.py): what a rank rebuilds from the
bytes equals what it would capture itself (the oracle: a capture on the rank), reads the rank's own tensors, and
anything that does not fit is captured instead."""

from __future__ import annotations

import os

import pytest

from graphpipe.frontend import capture as cap
from graphpipe.runtime import runnable as runnable_mod
from graphpipe.runtime.runnable import adopt_shipments, build_runnable, load_runnable, rank_key
from graphpipe.runtime.shipping import ShipMismatch, pack, unpack

HERE = os.path.dirname(os.path.abspath(__file__))

SPECS = [
    "twobranch:small",                                   # the zoo: dropout modules
    os.path.join(HERE, "real_models.py") + ":tied_lm",   # one embedding read by two ops
    os.path.join(HERE, "model_classes.py") + ":pos_table",  # a buffer sliced by the sequence
    os.path.join(HERE, "model_classes.py") + ":custom_op",  # a custom operator of the user's
    os.path.join(HERE, "hf_models.py") + ":m2m100",      # a no_grad region: a higher-order op with a body graph
    os.path.join(HERE, "..", "evals", "cnn_models.py") + ":efficientnet_small",  # BatchNorm modules
]


def _codes(gm) -> dict[str, str]:
    """The generated code of ``gm`` and of every graph module inside it (higher-order ops' bodies)."""
    import torch.fx as fx

    return {name: m.code for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)}


def _no_capture(*args, **kwargs):
    raise AssertionError("the rank exported the model although the launcher shipped its capture")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.rpartition("/")[2])
def test_a_shipped_capture_rebuilds_what_the_rank_would_capture_around_its_own_tensors(spec, monkeypatch):
    if "hf_models" in spec:
        pytest.importorskip("transformers")
    captured = build_runnable(spec, 0, "cpu", True, None, meta_params=True)
    assert captured.shipment is not None
    monkeypatch.setattr(cap, "trace_ops", _no_capture)
    shipped = build_runnable(spec, 0, "cpu", True, None, meta_params=True, shipped=captured.shipment)
    assert _codes(shipped.gm) == _codes(captured.gm)  # after the runtime's instrumentation, on both
    assert shipped.op_nodes == captured.op_nodes and shipped.io == captured.io
    names = lambda gm: [(n, tuple(t.shape), t.dtype) for n, t in gm.named_parameters(remove_duplicate=False)]
    assert names(shipped.gm) == names(captured.gm)
    assert [n for n, _ in shipped.gm.named_buffers()] == [n for n, _ in captured.gm.named_buffers()]
    # the rebuilt graph reads the module this process built, as its own capture does (materialization fills them)
    own = {id(p) for p in shipped.module.parameters()}
    assert own and all(id(p) in own for p in shipped.gm.parameters())
    own_buffers = {id(b) for b in shipped.module.buffers()}
    captured_own = {id(b) for b in captured.module.buffers()}
    assert ([id(b) in own_buffers for b in shipped.gm.buffers()]
            == [id(b) in captured_own for b in captured.gm.buffers()])


def test_a_capture_that_does_not_fit_the_model_built_here_is_captured_again(caplog):
    """A shipment of another model (a factory file edited between the launcher's capture and the rank's start
    would be the same) is refused by the check of what it rebuilt; the rank then captures, as without one."""
    other = build_runnable("transformer:small", 0, "cpu", True, None, meta_params=True)
    with pytest.raises(ShipMismatch):
        unpack(other.shipment, build_runnable("twobranch:small", 0, "cpu", False, None, meta_params=True).module)
    with caplog.at_level("INFO", logger="graphpipe.runtime.runnable"):
        got = build_runnable("twobranch:small", 0, "cpu", True, None, meta_params=True, shipped=other.shipment)
    want = build_runnable("twobranch:small", 0, "cpu", True, None, meta_params=True)
    assert _codes(got.gm) == _codes(want.gm) and got.op_nodes == want.op_nodes
    assert "capturing on this rank" in caplog.text
    with pytest.raises(ShipMismatch, match="cannot read"):
        unpack(b"not a capture", want.module)


def test_the_launcher_ships_what_its_preflight_captured_and_a_rank_loads_it_without_exporting(monkeypatch):
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.plan import plan_to_dict
    from graphpipe.runtime import preflight
    from graphpipe.runtime.launch import _shipments
    from graphpipe.runtime.options import RunOptions
    from graphpipe.search.planner import make_plan

    spec = "candle-uno:small"
    plan = make_plan(spec, zoo.load_graph(spec), preset("v100", 2), 8, "gpp")
    options = RunOptions(steps=1, seed=3)
    preflight(plan, options)
    shipped = _shipments([(plan_to_dict(plan), options)])
    key = rank_key(spec, 3, None, options.precision)
    assert list(shipped) == [key]
    # as a rank: the shipment adopted, then the worker's load (runtime/worker.py) builds from it
    monkeypatch.setattr(runnable_mod, "_PRISTINE", {})
    monkeypatch.setattr(runnable_mod, "_SHIPPED", {})
    monkeypatch.setattr(cap, "trace_ops", _no_capture)
    adopt_shipments(shipped)
    loaded = load_runnable(spec, 3, "cpu", meta_params=True)
    assert loaded.op_names == tuple(op.name for op in plan.graph.ops)
    assert runnable_mod._SHIPPED == {}  # used once: a later load of the key is the cached copy


def test_pack_refuses_an_object_that_cannot_travel():
    """A graph attribute that pickles nowhere: pack raises, and the launcher then ships nothing (the ranks
    capture as before) rather than sending something a rank could not rebuild."""
    import threading

    import torch
    import torch.fx as fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.get_attr("lock"))
    root = torch.nn.Module()
    gm = fx.GraphModule({"lock": threading.Lock()}, graph)
    del x
    with pytest.raises(TypeError):
        pack(root, gm, {}, None)
