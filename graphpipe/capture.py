"""Capture an ``nn.Module`` as a layer-granularity :class:`OpGraph` with torch.fx.

DESIGN §3 ("Granularity"): we trace with torch.fx but plan on *layers*.

1. **Trace.** :class:`LayerTracer` keeps *layer modules* as fx leaves: every
   zoo :class:`~graphpipe.zoo_models.Layer`, and for user models the usual
   heavy torch layers (:data:`LAYER_TYPES`: Linear, Conv, Embedding,
   EmbeddingBag, MultiheadAttention, TransformerEncoderLayer, RNNs, ...).
   Other torch.nn modules (norms, activations, dropout) stay leaves too, as
   fx does by default, but they are *glue*, not layers.
2. **Contract.** Each call of a layer module is an *anchor* and starts an op.
   Every other fx node (glue: ``cat``, ``add``, ``getattr``, ``view``,
   activations, ``get_attr`` of free parameters) joins a neighbouring op by
   these rules, repeated until every node is owned:

   - *forward*: a glue node whose inputs (ignoring placeholders and
     ``get_attr``) all belong to one op X joins X (an activation or view
     after a layer, e.g. Linear + ReLU becomes one op);
   - *backward*: a glue node whose users all belong to one op Y joins Y
     (a ``cat``/``add`` of branch outputs feeding a layer, a parameter read);
   - otherwise the first (in fx order) unowned glue node starts a glue op of
     its own, named after the fx node (e.g. ``add_3``), and the rules run again.

   Each op is therefore a connected piece of the fx graph whose inputs enter
   at its anchor or at nodes upstream of it and whose outputs leave from the
   anchor or nodes downstream of it, so the op graph stays acyclic, and any
   grouping of ops into stages whose stage graph is a DAG (every
   :class:`~graphpipe.stages.StageGraph`) is a valid ``split_module`` partition. For zoo models
   every fx node is an anchor (branches, concat, interaction and heads are
   layers), so their op graphs are exactly their series-parallel layer DAGs.
   Placeholders belong to no op; the runtime feeds them to the stages using them.
3. **Cost.** The fx graph is run once (meta tensors cost nothing) under
   ``torch.utils.flop_counter.FlopCounterMode`` and a byte meter. Per op and
   per sample (sizes divided by the example batch size, the first input's
   dim 0): ``fwd = overhead + flops / (peak * mfu) * b`` (DESIGN §4 affine
   model), ``bwd`` = twice the forward FLOPs and twice the overhead (the
   standard 2x backward estimate: gradients w.r.t. inputs and weights);
   ``act_bytes`` = bytes of the tensors autograd saves for backward while
   the op runs (``saved_tensors_hooks``, each storage once, parameters
   excluded: what a run measures, issue 15; with ``loss_fn``, what the
   loss keeps is charged to the op producing the output); ``out_bytes`` = bytes
   of its fx values used outside it; edge bytes = bytes of the values
   flowing from one op to another, and an edge's ``saved`` = bytes of
   those values its consumer saves although another op was charged for
   the same storage (a ReLU output the next Linear saves as its input:
   one tensor on one device, two across a cut; see
   :func:`graphpipe.costs.received_saved_bytes`). ``F.embedding_bag``'s
   saves are the CPU kernel's, not the meta kernel's (it saves an int64
   per index that the CPU kernel does not). ``param_bytes`` = the op's parameters
   (each parameter counted once, at its first use), so the graph total equals
   the module's. A parameter several ops read (tied weights) is also listed
   in ``OpGraph.shared`` (:class:`~graphpipe.graph.SharedParams`: the ops and
   its bytes), so a planner can charge the copy and the gradient all-reduce
   a split costs.

Example
-------
>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> cap = capture(m, (torch.randn(3, 4),), name="mlp")
>>> [op.name for op in cap.graph.ops], cap.op_nodes["0"]
(['0', '2'], ('_0', '_1'))
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from graphpipe.cluster import DeviceSpec, preset
from graphpipe.errors import GraphCycleError, GraphpipeError, InputError, UserCodeError, user_code_error, user_location
from graphpipe.graph import Affine, Op, OpGraph, SharedParams
from graphpipe.zoo_models import Layer

__all__ = [
    "LAYER_TYPES",
    "LayerTracer",
    "Captured",
    "capture",
    "trace",
    "group_nodes",
    "split_by_ops",
    "load_factory",
    "graph_from_factory",
]

log = logging.getLogger(__name__)

LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding, nn.EmbeddingBag,
    nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
    nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer,
    nn.RNN, nn.LSTM, nn.GRU,
)
"""torch layers that anchor an op in user models (zoo Layers always do)."""

_NEUTRAL = ("placeholder", "get_attr")


class LayerTracer(fx.Tracer):
    """fx tracer that keeps layers (and torch.nn built-ins) as leaf calls."""

    def __init__(self, layer_types: Sequence[type[nn.Module]] = ()):
        super().__init__()
        self.layer_types = tuple(LAYER_TYPES) + tuple(layer_types)

    def is_layer(self, module: nn.Module) -> bool:
        return isinstance(module, Layer) or isinstance(module, self.layer_types)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.is_layer(m) or super().is_leaf_module(m, module_qualified_name)


@dataclass(frozen=True, slots=True)
class Captured:
    """A captured module: the op graph, the fx GraphModule and op -> fx node names.

    Every fx node except placeholders and the output belongs to exactly one
    op; ``op_nodes[op_name]`` lists them in fx order.
    """

    graph: OpGraph
    gm: fx.GraphModule
    op_nodes: dict[str, tuple[str, ...]]

    def op_of_node(self) -> dict[str, str]:
        """fx node name -> op name (the inverse of ``op_nodes``)."""
        return {node: op for op, nodes in self.op_nodes.items() for node in nodes}


# --------------------------------------------------------------------- trace
def trace(module: nn.Module, num_inputs: int, layer_types: Sequence[type[nn.Module]] = ()) -> tuple[fx.GraphModule, set[str]]:
    """Symbolically trace ``module``; returns the GraphModule and its anchor node names.

    Forwards taking ``*inputs`` (the zoo's branch models) are traced with one
    placeholder per example input.
    """
    from torch.fx._symbolic_trace import PH

    tracer = LayerTracer(layer_types)
    tracer.record_stack_traces = True  # a node that fails later names the user's source line
    code = inspect.unwrap(type(module).forward).__code__
    varargs = bool(code.co_flags & inspect.CO_VARARGS) and code.co_argcount == 1  # forward(self, *inputs)
    try:
        graph = tracer.trace(module, concrete_args=tuple(PH for _ in range(num_inputs)) if varargs else None)
    except Exception as exc:  # fx raises many types for untraceable code
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserCodeError(f"{user_location(exc)}torch.fx cannot trace {type(module).__name__}: "
                            f"{type(exc).__name__}: {first}; make data-dependent control flow a layer "
                            "(a zoo Layer subclass) so it stays a leaf") from exc
    gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
    anchors = {n.name for n in gm.graph.nodes
               if n.op == "call_module" and tracer.is_layer(gm.get_submodule(n.target))}
    return gm, anchors


def group_nodes(gm: fx.GraphModule, anchors: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Contract fx nodes into ops (rules in the module docstring).

    Returns ``(op_of_node, anchor_of_op)``: fx node name -> op name, and op
    name -> the fx node that started it, ops in creation order.
    """
    anchors = set(anchors)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    owner: dict[fx.Node, str] = {}
    started: dict[str, str] = {}
    calls: dict[str, int] = {}

    def start(node: fx.Node) -> None:
        if node.name in anchors:
            base = str(node.target)
            calls[base] = calls.get(base, 0) + 1
            name = base if calls[base] == 1 else f"{base}_{calls[base] - 1}"
        else:
            name = node.name
        while name in started:
            name += "_"
        started[name] = node.name
        owner[node] = name

    for node in nodes:
        if node.name in anchors:
            start(node)
    pending = [n for n in nodes if n not in owner]
    while pending:
        changed = True
        while changed:
            changed = False
            for node in pending:  # forward rule, fx (topological) order
                if node in owner:
                    continue
                ins = [m for m in node.all_input_nodes if m.op not in _NEUTRAL]
                if ins and all(m in owner for m in ins) and len({owner[m] for m in ins}) == 1:
                    owner[node] = owner[ins[0]]
                    changed = True
            for node in reversed(pending):  # backward rule
                if node in owner:
                    continue
                users = list(node.users)
                if users and all(u in owner for u in users) and len({owner[u] for u in users}) == 1:
                    owner[node] = owner[users[0]]
                    changed = True
            pending = [n for n in pending if n not in owner]
        if pending:
            start(pending[0])
            pending = pending[1:]
    # report ops in fx order of their first node, which is deterministic
    return {n.name: owner[n] for n in nodes}, started


# ------------------------------------------------------------------ measuring
def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


@dataclass(frozen=True, slots=True)
class _NodeCost:
    flops: float
    act_bytes: float
    """Bytes of the storages this node saved first (charged to it)."""
    out_bytes: float
    saved: frozenset = frozenset()
    """Storages this node saves for backward, charged to it or not."""
    outputs: tuple = ()
    """``(storage, bytes)`` of each tensor of the node's value."""


class _SavedMeter:
    """Bytes of the tensors autograd saves for backward (``saved_tensors_hooks``), each storage once,
    parameters excluded: what a training step keeps per sample between a micro-batch's F and its B
    (the runtime measures the same quantity, :class:`graphpipe.runtime.measure.SavedBytesMeter`).

    ``saves`` collects every storage saved while it is set (already counted or not), so that
    :class:`_Measure` can tell which of a node's saves are tensors an earlier node was charged for."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._seen = {p.untyped_storage()._cdata for p in params}
        self._resident = set(self._seen)
        self.total = 0
        self.saves: set[int] | None = None
        self.keep: list[Any] = []
        """Stand-in tensors held to the end of the run (a freed storage's key may be reused)."""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._seen:
            self._seen.add(key)
            self.total += storage.nbytes()
        if self.saves is not None and key not in self._resident:
            self.saves.add(key)
        return t

    def is_resident(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._resident

    def resident(self, t: torch.Tensor) -> None:
        """Never count ``t`` (a stand-in for resident data)."""
        key = t.untyped_storage()._cdata
        self._seen.add(key)
        self._resident.add(key)


class _FlashAttentionSaves(torch.overrides.TorchFunctionMode):
    """On meta tensors ``F.scaled_dot_product_attention`` takes the math path, which saves the
    seq x seq attention probabilities; CPU and GPU runs take a fused kernel that saves q, k, v, the
    output and the log-sum-exp. Run the fused CPU kernel's meta form instead, so the saved bytes are
    the ones a run keeps, and the math path under no_grad for its FLOPs (the fused op has no formula)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.nn.functional.scaled_dot_product_attention and len(args) == 3
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"
                and set(kwargs) <= {"is_causal", "scale"}):
            with torch.no_grad():
                func(*args, **kwargs)  # counted by FlopCounterMode
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args, 0.0, bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


class _EmbeddingBagSaves(torch.overrides.TorchFunctionMode):
    """``F.embedding_bag``'s meta kernel saves other tensors than the CPU kernel a run uses (in sum mode
    an ``offset2bag`` of one int64 per index, where CPU saves one per bag): dlrm's tables were charged twice
    what a run keeps. Run the meta op with its saves uncounted, and count the saves of the CPU kernel on a
    one-row table with the same indices shape and options instead (what it saves does not depend on the
    table's rows). A saved view of resident indices (the input data) stays uncounted, as in a run."""

    def __init__(self, meter: "_SavedMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is not torch.nn.functional.embedding_bag or len(args) < 2 or not isinstance(args[0], torch.Tensor)
                or args[0].device.type != "meta"):
            return func(*args, **kwargs)
        indices, weight, *rest = args
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # the meta kernel's saves: not counted
            out = func(*args, **kwargs)
        cpu_indices = torch.zeros(indices.shape, dtype=indices.dtype)
        if self.meter.is_resident(indices):
            self.meter.resident(cpu_indices)
        on_cpu = lambda v: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v  # noqa: E731
        table = torch.zeros(1, weight.shape[1], dtype=weight.dtype, requires_grad=weight.requires_grad)
        stand_in = func(cpu_indices, table, *(on_cpu(v) for v in rest), **{k: on_cpu(v) for k, v in kwargs.items()})
        self.meter.keep.append((cpu_indices, stand_in))  # with the saves its graph holds
        return out


class _Measure(fx.Interpreter):
    """Runs the GraphModule once, recording FLOPs, saved bytes and output bytes per node."""

    def __init__(self, gm: fx.GraphModule, flops: FlopCounterMode, meter: _SavedMeter):
        super().__init__(gm)
        self.flops, self.meter = flops, meter
        self.costs: dict[str, _NodeCost] = {}

    def run_node(self, n: fx.Node) -> Any:
        f0, b0 = self.flops.get_total_flops(), self.meter.total
        self.meter.saves = set()
        out = super().run_node(n)
        outputs = tuple((t.untyped_storage()._cdata, t.numel() * t.element_size())
                        for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.costs[n.name] = _NodeCost(float(self.flops.get_total_flops() - f0), float(self.meter.total - b0),
                                       float(_nbytes(out)), frozenset(self.meter.saves), outputs)
        self.meter.saves = None
        return out


def _measure(gm: fx.GraphModule, example_inputs: Sequence[Any], loss_fn=None) -> dict[str, _NodeCost]:
    # parameters, buffers and the input data are resident anyway: not activations (the runtime agrees)
    resident = list(gm.parameters()) + list(gm.buffers()) + [x for x in tree_leaves(list(example_inputs))
                                                             if isinstance(x, torch.Tensor)]
    flops, meter = FlopCounterMode(display=False), _SavedMeter(resident)
    interp = _Measure(gm, flops, meter)
    with torch.enable_grad(), flops, torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t), \
            _FlashAttentionSaves(), _EmbeddingBagSaves(meter):
        out = interp.run(*example_inputs)
        if loss_fn is not None:  # what the loss keeps for backward belongs to the op producing the output
            before = meter.total
            loss_fn(out)
            node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            if isinstance(node, fx.Node) and node.name in interp.costs:
                c = interp.costs[node.name]
                interp.costs[node.name] = _NodeCost(c.flops, c.act_bytes + meter.total - before, c.out_bytes,
                                                    c.saved, c.outputs)
    return interp.costs


def _batch_size(example_inputs: Sequence[Any]) -> int:
    for x in tree_leaves(list(example_inputs)):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] >= 1:
            return int(x.shape[0])
    raise InputError("example inputs need at least one tensor with a batch dimension (dim 0) to size per-sample costs")


# -------------------------------------------------------------------- capture
def capture(module: nn.Module, example_inputs: Sequence[Any], name: str | None = None,
            device: DeviceSpec | None = None, layer_types: Sequence[type[nn.Module]] = (),
            user_file: str | None = None, loss_fn=None) -> Captured:
    """Trace ``module`` and build its layer-granularity OpGraph with analytical costs.

    ``example_inputs`` may live on the meta device (and the module too): only
    shapes matter. ``device`` sets the cost model (default: the v100 preset's
    device). See the module docstring for the rules. A failure of the
    module's own code while tracing or running it is a one-line
    :class:`~graphpipe.errors.UserCodeError` naming the line in ``user_file``
    (or the deepest frame outside torch and graphpipe).
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"capture needs an nn.Module, got {type(module).__name__}")
    example_inputs = tuple(example_inputs)
    device = device if device is not None else preset("v100").device
    try:
        gm, anchors = trace(module, len(example_inputs), layer_types)
    except GraphpipeError:
        raise
    except Exception as exc:
        raise user_code_error(exc, "tracing the module's forward (torch.fx)", user_file) from exc
    op_of_node, started = group_nodes(gm, anchors)
    batch = _batch_size(example_inputs)
    try:
        costs = _measure(gm, example_inputs, loss_fn)
    except GraphpipeError:
        raise
    except Exception as exc:
        raise user_code_error(exc, "running the module's forward on its example inputs", user_file) from exc
    fx_nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]

    members: dict[str, list[fx.Node]] = {op: [] for op in started}
    for n in fx_nodes:
        members[op_of_node[n.name]].append(n)
    position = {n: i for i, n in enumerate(fx_nodes)}
    order = sorted(started, key=lambda op: position[members[op][0]])

    seen_params: set[int] = set()
    param_ops: dict[int, list[str]] = {}  # parameter -> ops reading it (tied weights: more than one)
    param_size: dict[int, int] = {}
    edge_bytes: dict[tuple[str, str], float] = {}
    incoming: dict[tuple[str, str], dict[int, int]] = {}  # op edge -> storages (and bytes) of the values on it
    ops: list[Op] = []
    rate = device.peak_flops * device.mfu
    for op_name in order:
        nodes = members[op_name]
        flops = sum(costs[n.name].flops for n in nodes) / batch
        act = sum(costs[n.name].act_bytes for n in nodes) / batch
        out = 0.0
        params = 0
        for n in nodes:
            for p in _node_params(gm, n):
                users = param_ops.setdefault(id(p), [])
                if op_name not in users:
                    users.append(op_name)
                param_size[id(p)] = p.numel() * p.element_size()
                if id(p) not in seen_params:
                    seen_params.add(id(p))
                    params += p.numel() * p.element_size()
            if any(u.op == "output" or op_of_node.get(u.name) != op_name for u in n.users):
                out += costs[n.name].out_bytes / batch
            for src in {m for m in n.all_input_nodes if m.op != "placeholder"}:
                src_op = op_of_node[src.name]
                if src_op != op_name:
                    edge_bytes[(src_op, op_name)] = edge_bytes.get((src_op, op_name), 0.0) + costs[src.name].out_bytes / batch
                    incoming.setdefault((src_op, op_name), {}).update(costs[src.name].outputs)
        kind = _kind(gm, started[op_name], nodes, anchors)
        ops.append(Op(op_name, kind,
                      fwd=Affine(device.op_overhead_s, flops / rate),
                      bwd=Affine(2 * device.op_overhead_s, 2 * flops / rate),
                      param_bytes=params, act_bytes=act, out_bytes=out))
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    if sum(op.param_bytes for op in ops) != total:
        log.warning("%s: %d parameter bytes are never used by forward; the op graph omits them",
                    name or type(module).__name__, total - sum(op.param_bytes for op in ops))
    try:
        saved = _edge_saved_bytes(incoming, members, op_of_node, costs, batch)
        graph = OpGraph.build(name or type(module).__name__, ops,
                              [(s, d, b, saved.get((s, d), 0.0)) for (s, d), b in edge_bytes.items()],
                              _shared_params(param_ops, param_size))
    except GraphCycleError as exc:
        raise InputError(f"contracting fx nodes into layers made a cycle ({exc}); pass layer_types= so the "
                         "layers on that cycle become anchors") from None
    op_nodes = {op: tuple(n.name for n in members[op]) for op in order}
    return Captured(graph, gm, op_nodes)


def _edge_saved_bytes(incoming: Mapping[tuple[str, str], Mapping[int, int]], members: Mapping[str, list[fx.Node]],
                      op_of_node: Mapping[str, str], costs: Mapping[str, _NodeCost], batch: int) -> dict[tuple[str, str], float]:
    """:attr:`graphpipe.graph.Edge.saved` per op edge: bytes per sample of the edge's values that the consumer
    saves while another op was charged for them (each storage's first saver holds its bytes, ``_SavedMeter``).

    Matching is by storage, which is sound here: every saved storage stays alive until the run ends (the
    autograd graph holds it), and an edge's values are alive while their consumer runs.
    """
    charged: dict[int, str] = {}
    for node_name, c in costs.items():  # run order: the first node saving a storage was charged for it
        for key in c.saved:
            charged.setdefault(key, op_of_node.get(node_name, ""))
    out = {}
    for (src_op, dst_op), values in incoming.items():
        saves = set().union(*(costs[n.name].saved for n in members[dst_op]))
        nbytes = sum(size for key, size in values.items() if key in saves and charged.get(key) != dst_op)
        if nbytes:
            out[(src_op, dst_op)] = nbytes / batch
    return out


def _shared_params(param_ops: Mapping[int, list[str]], param_size: Mapping[int, int]) -> tuple[SharedParams, ...]:
    """One :class:`SharedParams` per set of ops sharing parameters (bytes summed), in order of first use."""
    groups: dict[tuple[str, ...], int] = {}
    for pid, users in param_ops.items():
        if len(users) > 1:
            groups[tuple(users)] = groups.get(tuple(users), 0) + param_size[pid]
    return tuple(SharedParams(users, float(nbytes)) for users, nbytes in groups.items())


def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    if node.op == "call_module":
        return list(gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return [value] if isinstance(value, nn.Parameter) else []
    return []


def _kind(gm: fx.GraphModule, start_node: str, nodes: list[fx.Node], anchors: set[str]) -> str:
    if start_node not in anchors:
        return "glue"
    node = next(n for n in nodes if n.name == start_node)
    module = gm.get_submodule(node.target)
    return module.kind if isinstance(module, Layer) else type(module).__name__.lower()


# ---------------------------------------------------------------------- split
def split_by_ops(captured: Captured, part_of_op: Mapping[str, int]) -> fx.GraphModule:
    """``split_module`` of ``captured.gm`` with op ``o`` in partition ``part_of_op[o]``.

    The parts must be convex in the op graph (every stage partition of a
    StageGraph is). Submodules are named ``submod_{part}``.
    """
    missing = [op for op in captured.op_nodes if op not in part_of_op]
    if missing:
        raise InputError(f"split_by_ops: ops without a partition: {', '.join(missing[:5])}")
    op_of_node = captured.op_of_node()
    return split_module(captured.gm, captured.gm, lambda node: part_of_op[op_of_node[node.name]])


# ------------------------------------------------------------------- factories
def load_factory(spec: str) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    """Import ``path/to/file.py`` and call ``factory()`` from ``"path/to/file.py:factory"``.

    The factory must return ``(module, example_inputs, loss_fn)`` with
    ``example_inputs`` a tuple (or list) of tensors.
    """
    path, sep, func_name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not func_name:
        raise InputError(f"factory spec {spec!r} must look like path/to/file.py:function_name")
    if not os.path.isfile(path):
        raise InputError(f"factory file not found: {path}")
    mod_name = "graphpipe_factory_" + os.path.splitext(os.path.basename(path))[0]
    loader_spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(path))
    if loader_spec is None or loader_spec.loader is None:
        raise InputError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise user_code_error(exc, f"importing {path}", path) from exc
    factory = getattr(module, func_name, None)
    if not callable(factory):
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == mod_name)
        raise InputError(f"{path} has no function {func_name!r}; functions defined there: {', '.join(known) or 'none'}")
    try:
        result = factory()
    except Exception as exc:
        raise user_code_error(exc, f"calling {func_name}()", path) from exc
    if not (isinstance(result, tuple) and len(result) == 3):
        raise InputError(f"{spec}: factory must return (module, example_inputs, loss_fn), got "
                         f"{type(result).__name__}{' of length ' + str(len(result)) if isinstance(result, tuple) else ''}")
    net, inputs, loss_fn = result
    if not isinstance(net, nn.Module):
        raise InputError(f"{spec}: first item returned must be an nn.Module, got {type(net).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not (isinstance(inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in inputs) and inputs):
        raise InputError(f"{spec}: example_inputs must be a non-empty tuple of tensors")
    if not callable(loss_fn):
        raise InputError(f"{spec}: loss_fn must be callable, got {type(loss_fn).__name__}")
    return net, tuple(inputs), loss_fn


def graph_from_factory(spec: str, device: DeviceSpec | None = None) -> OpGraph:
    """Capture the module of a ``file.py:factory`` spec (see :func:`load_factory`)."""
    net, inputs, _ = load_factory(spec)
    name = os.path.splitext(os.path.basename(spec.rpartition(":")[0]))[0]
    return capture(net, inputs, name=name, device=device, user_file=spec.rpartition(":")[0]).graph
