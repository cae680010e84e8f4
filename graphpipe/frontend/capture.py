"""Capture an ``nn.Module`` as a layer-granularity :class:`OpGraph` (docs/design.md, "Capture").

1. **Export.** :func:`graphpipe.frontend.exporting.export_model` runs the module through
   ``torch.export`` (non-strict, batch dimension dynamic): any model whose
   Python code export can follow, Hugging Face transformers and timm
   included, keyword inputs and ``ModelOutput`` outputs included. The result
   is one flat runnable fx graph of ``aten`` ops whose nodes remember the
   module calls they ran inside (``nn_module_stack``).
2. **Layers from the module hierarchy.** Every node's *unit* is a module of
   its stack (:func:`unit_of`): by default the outermost zoo
   :class:`~graphpipe.frontend.zoo_models.Layer`, else the deepest child of a
   ``ModuleList``/``Sequential``/``ModuleDict`` holding parameters (the
   repeated blocks: ``encoder.layers.3``), else the outermost heavy torch
   layer (:data:`LAYER_TYPES`: Linear, Conv, Embedding, ...). A user picks
   another granularity with module-path patterns or a depth
   (:class:`Granularity`). Each call of a unit starts an op named after the
   module path (a second call of the same module: ``path_1``).
3. **Contract.** Every other node (glue: residual adds, activations,
   reshapes, concatenations, pooling) joins a neighbouring op by these rules,
   repeated until every node is owned:

   - *forward*: a glue node whose inputs (ignoring placeholders, ``get_attr``
     and replicable input glue) all belong to one op X joins X (an
     activation after a layer);
   - *backward*: a glue node whose users all belong to one op Y joins Y
     (a ``cat``/``add`` of branch outputs feeding a layer);
   - otherwise the first (in graph order) unowned glue node starts a glue op
     of its own, named after the node (e.g. ``add_3``), and the rules run again.

   Nodes computed from the inputs and buffers alone (masks, position ids,
   batch sizes) are copied into every op reading them
   (:func:`graphpipe.frontend.exporting.replicate_input_glue`); parameters
   (``get_attr``) are read where used. Each op is therefore a connected piece
   of the graph whose inputs enter at or upstream of its unit and whose
   outputs leave at or downstream of it, so the op graph stays acyclic, and
   any grouping of ops into stages whose stage graph is a DAG is a valid
   split. Zoo models come out exactly as their series-parallel layer DAGs.
   A unit whose own nodes run both before and after another op (a block
   written with ``nn.Sequential`` children and its own squeeze-and-excite
   and residual between and after them) would close a cycle; such an op is
   cut into one op per level, ``name`` and ``name[1]``
   (:mod:`graphpipe.frontend.reentrant`). Two ops joined by a value no stage
   boundary can split into micro-batches (``(batch * patches, ...)``) are
   merged, with any op between them (:mod:`graphpipe.frontend.folded`).
4. **Cost.** The graph is run once (meta tensors cost nothing) under
   ``torch.utils.flop_counter.FlopCounterMode`` and a byte meter. Per op and
   per sample (sizes divided by the example batch size): ``fwd = overhead +
   flops / (peak * mfu) * b`` (the affine model of docs/design.md), ``bwd`` =
   twice the forward FLOPs and twice the overhead (gradients w.r.t. inputs
   and weights); ``act_bytes`` = bytes of the tensors autograd saves for
   backward while the op runs (``saved_tensors_hooks``, each storage once,
   parameters excluded: what a run measures; with ``loss_fn``, what the loss
   keeps is charged to the op producing the output); ``out_bytes`` = bytes of
   its values used outside it; edge bytes = bytes of the values flowing from
   one op to another, and an edge's ``saved`` = bytes of those values its
   consumer saves although another op was charged for the same storage (one
   tensor on one device, two across a cut; see
   :func:`graphpipe.costs.received_saved_bytes`). Attention and
   ``embedding_bag`` are charged the saves of the CPU kernels a run uses,
   not those of their meta kernels. At ``precision="bf16"`` the graph runs
   under ``torch.autocast`` on fake CPU tensors, so saves are the bf16
   tensors (and autocast's bf16 weight copies) a bf16 run keeps.
   ``param_bytes`` = the op's parameters (each counted once, at its first
   use), so the graph total equals the module's. A parameter several ops read
   (tied weights) is also listed in ``OpGraph.shared``.

Example
-------
>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> cap = capture(m, (torch.randn(3, 4),), name="mlp")
>>> [op.name for op in cap.graph.ops], [op.kind for op in cap.graph.ops]
(['0', '2'], ['linear', 'linear'])
"""

from __future__ import annotations

import fnmatch
import importlib.util
import functools
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from graphpipe.frontend.capture_refusals import meta_value_error
from graphpipe.cluster import DeviceSpec, preset
from graphpipe.errors import GraphCycleError, GraphpipeError, InputError, UserCodeError, user_code_error
from graphpipe.frontend.export_inputs import fake_cpu_copy, restore_state, swap_state
from graphpipe.frontend.exporting import (BATCHNORMS, Exported, IOSpec, deliver_target, export_model, module_path,
                                 module_stack, normalize_inputs, replicable_nodes, replicate_input_glue)
from graphpipe.frontend.flops import UnknownCosts, flop_counter
from graphpipe.frontend.folded import merge_folded_ops
from graphpipe.graph import Affine, Op, OpGraph, SharedParams
from graphpipe.frontend.reentrant import split_reentrant_ops
from graphpipe.frontend.layer import Layer

__all__ = [
    "op_param_bytes",
    "dropout_p",
    "LAYER_TYPES",
    "PRECISIONS",
    "Granularity",
    "Captured",
    "Factory",
    "capture",
    "trace_ops",
    "unit_of",
    "group_nodes",
    "split_by_ops",
    "load_factory",
    "factory_result",
    "captured_from_factory",
    "is_weight_copy",
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
"""torch layers that are an op of their own when no repeated block holds them (zoo Layers always are)."""

PRECISIONS = ("fp32", "bf16")
"""Precisions activation bytes are measured at (``--precision``)."""

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True, slots=True)
class Granularity:
    """Which modules are ops: the default rule, module-path patterns, or a depth.

    ``patterns``: ``fnmatch`` patterns over module paths (``encoder.layers.*``);
    a node belongs to the outermost module of its stack matching one.
    ``depth``: a node belongs to the module of its stack with exactly that
    many path components (``1``: the root's children). Nodes in no such
    module are glue. :meth:`parse` reads the CLI's ``--granularity``.
    """

    patterns: tuple[str, ...] = ()
    depth: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Granularity":
        if text is None or not str(text).strip() or str(text).strip() == "auto":
            return cls()
        text = str(text).strip()
        if text.isdigit():
            if int(text) < 1:
                raise InputError(f"--granularity depth must be >= 1, got {text}")
            return cls(depth=int(text))
        return cls(patterns=tuple(p.strip() for p in text.split(",") if p.strip()))

    @property
    def is_default(self) -> bool:
        return not self.patterns and self.depth is None

    def describe(self) -> str:
        return "auto" if self.is_default else (str(self.depth) if self.depth is not None else ",".join(self.patterns))


@dataclass(frozen=True, slots=True)
class Captured:
    """A captured module: the op graph, the runnable fx graph, op -> node names, and its I/O contract.

    Every compute node belongs to exactly one op (``op_nodes[op_name]``, in
    graph order); placeholders and ``get_attr`` nodes belong to none (they
    are read where used). ``paths[op_name]`` is the module path of the op's
    unit ("" for glue ops).
    """

    graph: OpGraph
    gm: fx.GraphModule
    op_nodes: dict[str, tuple[str, ...]]
    io: IOSpec | None = None
    paths: dict[str, str] | None = None
    export_seconds: float = 0.0

    def op_of_node(self) -> dict[str, str]:
        """fx node name -> op name (the inverse of ``op_nodes``)."""
        return {node: op for op, nodes in self.op_nodes.items() for node in nodes}


# ------------------------------------------------------------------- layers
class _Modules:
    """Module path -> module of the user's model, cached (paths come from ``nn_module_stack``)."""

    def __init__(self, root: nn.Module):
        self.root = root
        self._cache: dict[str, nn.Module | None] = {}

    def get(self, path: str) -> nn.Module | None:
        if path not in self._cache:
            try:
                self._cache[path] = self.root.get_submodule(path)
            except AttributeError:
                self._cache[path] = None
        return self._cache[path]

    def is_block(self, path: str) -> bool:
        """A child of a container, holding parameters: one of the repeated blocks."""
        parent, _, _ = path.rpartition(".")
        holder = self.get(parent) if parent else self.root
        module = self.get(path)
        return (isinstance(holder, _CONTAINERS) and module is not None
                and next(module.parameters(recurse=True), None) is not None)


def unit_of(node: fx.Node, modules: _Modules, granularity: Granularity,
            layer_types: tuple[type[nn.Module], ...] = LAYER_TYPES) -> tuple[str, str] | None:
    """``(call key, module path)`` of the unit module ``node`` ran inside, or None for glue (module docstring)."""
    stack = module_stack(node)
    if not stack:
        return None
    if granularity.patterns:
        for key, path, _ in stack:
            if any(fnmatch.fnmatchcase(path, p) for p in granularity.patterns):
                return key, path
        return None
    if granularity.depth is not None:
        for key, path, _ in stack:
            if path.count(".") + 1 == granularity.depth:
                return key, path
        return None
    for key, path, _ in stack:  # a zoo Layer is one op, whatever it holds
        if isinstance(modules.get(path), Layer):
            return key, path
    for key, path, _ in reversed(stack):
        if modules.is_block(path):
            return key, path
    for key, path, _ in stack:
        if isinstance(modules.get(path), layer_types):
            return key, path
    return None


def _check_patterns(granularity: Granularity, gm: fx.GraphModule, module: nn.Module) -> None:
    """Every pattern must match a module the forward calls (exit 2 naming it otherwise)."""
    called = {path for n in gm.graph.nodes for _, path, _ in module_stack(n)}
    for pattern in granularity.patterns:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in called):
            top = sorted({p.split(".")[0] for p in called})
            raise InputError(f"--granularity pattern {pattern!r} matches no module the forward calls; "
                             f"top-level module paths: {', '.join(top) or 'none'}")


def group_nodes(gm: fx.GraphModule, units: Mapping[fx.Node, tuple[str, str]],
                neutral: set[fx.Node] = frozenset()) -> tuple[dict[fx.Node, str], dict[str, str]]:
    """Contract graph nodes into ops (rules in the module docstring).

    ``units`` gives the nodes that ran inside a unit module (their call key
    and path); ``neutral`` nodes (replicable input glue, the target) belong
    to no op here. Returns ``(owner, path_of_op)``: node -> op name for every
    other compute node, and op name -> module path ("" for glue ops).
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and n not in neutral]
    owner: dict[fx.Node, str] = {}
    path_of: dict[str, str] = {}
    op_of_key: dict[str, str] = {}
    calls: dict[str, int] = {}

    def new_op(base: str, path: str) -> str:
        calls[base] = calls.get(base, 0) + 1
        name = base if calls[base] == 1 else f"{base}_{calls[base] - 1}"
        while name in path_of:
            name += "_"
        path_of[name] = path
        return name

    for node in nodes:
        unit = units.get(node)
        if unit is None:
            continue
        key, path = unit
        if key not in op_of_key:
            op_of_key[key] = new_op(module_path(path), module_path(path))
        owner[node] = op_of_key[key]

    def outside(m: fx.Node) -> bool:
        return m.op in ("placeholder", "get_attr") or m in neutral

    # a node nobody reads is a side effect (an in-place buffer update): it joins the op running next
    effects = [n for n in nodes if n not in owner and not n.users]
    pending = [n for n in nodes if n not in owner and n.users]

    def source(m: fx.Node, depth: int = 0) -> bool:
        """Unowned glue computed from parameters and inputs only (``logit_scale.exp()``): it follows its reader."""
        return (m not in owner and depth < 16
                and all(outside(a) or source(a, depth + 1) for a in m.all_input_nodes))

    batch = _batch_symbol(gm)
    while pending:
        changed = True
        while changed:
            changed = False
            for node in pending:  # forward rule, graph (topological) order
                if node in owner or not _batch_major(node, batch):  # (a transpose of the batch joins its reader)
                    continue
                ins = [m for m in node.all_input_nodes if not outside(m) and not source(m)]
                if ins and all(m in owner for m in ins) and len({owner[m] for m in ins}) == 1:
                    owner[node] = owner[ins[0]]
                    changed = True
            for node in reversed(pending):  # backward rule
                if node in owner:
                    continue
                users = [u for u in node.users if u not in neutral]
                if users and all(u in owner for u in users) and len({owner[u] for u in users}) == 1:
                    owner[node] = owner[users[0]]
                    changed = True
            pending = [n for n in pending if n not in owner]
        if pending:  # stuck: a new glue op, preferably at a node reading other ops (sources then follow it)
            start = next((n for n in pending if not source(n) and _batch_major(n, batch)),
                         next((n for n in pending if not source(n)), pending[0]))
            owner[start] = new_op(start.name, "")
            pending = [n for n in pending if n is not start]
    position = {n: i for i, n in enumerate(nodes)}
    owned = [n for n in nodes if n in owner]
    for node in effects:
        later = [n for n in owned if position[n] > position[node]]
        earlier = [n for n in owned if position[n] < position[node]]
        if later or earlier:
            owner[node] = owner[later[0] if later else earlier[-1]]
        else:
            owner[node] = new_op(node.name, "")
    split_reentrant_ops(nodes, owner, path_of)  # a module leaving its op and coming back: one op per level
    merge_folded_ops(nodes, owner, path_of, batch)  # a value no boundary may cut (batch * patches rows) joins its ops
    return owner, path_of


def _batch_symbol(gm: fx.GraphModule) -> str | None:
    """The batch size's symbol: dim 0 of the first tensor input."""
    for n in gm.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() >= 1:
            return str(val.shape[0])
    return None


def _batch_major(node: fx.Node, batch: str | None) -> bool:
    """False for a tensor whose dim 0 is not the batch (it may not leave an op: stages exchange batch-major values)."""
    from graphpipe.frontend.folded import is_batch_dim

    val = node.meta.get("val")
    if batch is None or not isinstance(val, torch.Tensor):
        return True
    return val.dim() >= 1 and is_batch_dim(val.shape[0], batch)


def _layer_types(extra: Sequence[type[nn.Module]]) -> tuple[type[nn.Module], ...]:
    return tuple(LAYER_TYPES) + tuple(extra)


def trace_ops(module: nn.Module, example_inputs: Any, loss_fn: Callable[..., Any] | None = None,
              example_target: Any = None, granularity: Granularity | None = None,
              layer_types: Sequence[type[nn.Module]] = (), lengths: bool = True, precision: str = "fp32",
              ) -> tuple[Exported, dict[str, tuple[str, ...]], dict[str, str]]:
    """Export ``module`` and group its graph into ops, without measuring costs.

    Returns the export (its ``gm`` rewritten so every op owns its copies of
    input glue), ``op_nodes`` (op -> node names in graph order, ops in the
    order of their first node) and each op's module path. The runtime calls
    this on every rank: the same module and inputs give the same names.
    ``lengths``: :func:`~graphpipe.frontend.exporting.export_model`'s (False: only the batch symbolic);
    ``precision``: the run's, which the module's code is traced at (its step 8).
    """
    granularity = granularity or Granularity()
    exported = export_model(module, example_inputs, loss_fn, example_target, lengths, precision)
    gm = exported.gm
    if granularity.patterns:
        _check_patterns(granularity, gm, module)
    modules = _Modules(module)
    types = _layer_types(layer_types)
    replicable = replicable_nodes(gm)
    targets = {n for n in gm.graph.nodes if n.op == "call_function" and n.target is deliver_target}
    units = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_module", "call_method") and n not in replicable and n not in targets:
            unit = unit_of(n, modules, granularity, types)
            if unit is not None:
                units[n] = unit
    owner, path_of = group_nodes(gm, units, replicable | targets)
    by_name = {n.name: n for n in gm.graph.nodes}
    for t in targets:  # the target joins the op producing the output it is returned with
        anchor = by_name.get(t.meta.get("graphpipe_with", ""))
        if anchor is not None and anchor in owner:
            owner[t] = owner[anchor]
    owner.update(replicate_input_glue(gm, owner, replicable))
    op_nodes: dict[str, list[str]] = {}
    for node in gm.graph.nodes:  # graph order: ops in order of their first node
        if node in owner:
            op_nodes.setdefault(owner[node], []).append(node.name)
    return exported, {op: tuple(v) for op, v in op_nodes.items()}, {op: path_of.get(op, "") for op in op_nodes}


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
        if is_weight_copy(t):  # autocast's copy of a weight: model state (see is_weight_copy)
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._seen:
            self._seen.add(key)
            self.total += storage.nbytes()
            self.keep.append(t)  # a save whose graph is freed (a router's top-k) must not free the key for reuse
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


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_EMBEDDING_BAGS = (torch.ops.aten.embedding_bag.default, torch.ops.aten.embedding_bag.padding_idx)


def _on_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


class _Measure(fx.Interpreter):
    """Runs the graph once, recording FLOPs, saved bytes and output bytes per node.

    Two kernels save other tensors on the meta device than in a run, and are
    charged what a run keeps instead:

    * attention: meta takes the math path, which saves the seq x seq
      probabilities; CPU and GPU runs take a fused kernel saving q, k, v, the
      output and the log-sum-exp. The fused CPU kernel's meta form runs
      instead (:mod:`graphpipe.frontend.flops` counts its FLOPs);
    * ``embedding_bag``: the meta kernel saves an int64 ``offset2bag`` per
      index where CPU saves one per bag. The meta op runs with its saves
      uncounted, and the CPU kernel on a one-row table with indices of the
      same shape gives the saves (they do not depend on the table's rows).
    """

    def __init__(self, gm: fx.GraphModule, flops: FlopCounterMode, meter: "_SavedMeter", fake=None,
                 unknown: UnknownCosts | None = None):
        super().__init__(gm)
        self.unknown = unknown
        self.flops, self.meter = flops, meter
        self.costs: dict[str, _NodeCost] = {}
        self.fake = fake
        """On fake CPU tensors (bf16 of a meta module): meta tensor -> its fake CPU stand-in."""
        self._constants: dict[int, Any] = {}

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if self.fake is not None and _on_meta(value):  # a tensor constant the state swap did not reach
            value = self._constants.setdefault(id(value), self.fake(value))
        return value

    def _off_meta(self, args, kwargs):
        """An exported op that names ``device=meta`` (a dtype cast, an ``arange`` of positions, a rotary table)
        would make meta tensors among the fake CPU ones: it names the CPU instead."""
        def cpu(v):
            if isinstance(v, torch.device) and v.type == "meta" or isinstance(v, str) and v == "meta":
                return torch.device("cpu")
            return v
        return tree_map(cpu, args), tree_map(cpu, kwargs)

    def call_function(self, target, args, kwargs):
        if self.fake is not None:
            args, kwargs = self._off_meta(args, kwargs)
            try:
                return self._call(target, args, kwargs)
            except (RuntimeError, NotImplementedError):
                # a graph exported on the meta device took the branch for accelerators (Mixtral's expert counts:
                # an integer histc the CPU kernel lacks); its shapes come from the meta kernel, which is all a
                # fake run needs of it (such ops save nothing for backward)
                return self._on_meta_kernel(target, args, kwargs)
        return self._call(target, args, kwargs)

    def _on_meta_kernel(self, target, args, kwargs):
        def meta(v):
            return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

        with torch.no_grad():
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                out = target(*tree_map(meta, args), **tree_map(meta, kwargs))
        return tree_map(lambda v: self.fake(v) if _on_meta(v) else v, out)

    def _call(self, target, args, kwargs):
        if target is _SDPA and _on_meta(args[0]):
            return self._attention(args, kwargs)
        if target in _EMBEDDING_BAGS and (_on_meta(args[0]) or _is_fake(args[0])):
            return self._embedding_bag(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def _attention(self, args, kwargs):
        q, k, v, *rest = args
        names = ("attn_mask", "dropout_p", "is_causal")
        opts = {**dict(zip(names, rest)), **kwargs}
        if opts.get("dropout_p", 0.0) or opts.get("enable_gqa", False) or q.shape[-1] != v.shape[-1]:
            return _SDPA(*args, **kwargs)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(  # counted (graphpipe.frontend.flops)
            q, k, v, 0.0, bool(opts.get("is_causal", False)), attn_mask=opts.get("attn_mask"),
            scale=opts.get("scale"))[0]

    def _embedding_bag(self, target, args, kwargs):
        weight, indices, *rest = args
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # the meta kernel's saves: not counted
            out = target(*args, **kwargs)

        def on_cpu(value):
            if not isinstance(value, torch.Tensor):
                return value
            cpu = torch.zeros(tuple(int(d) for d in value.shape), dtype=value.dtype)
            if self.meter.is_resident(value):
                self.meter.resident(cpu)
            return cpu

        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # a real CPU kernel, also while measuring on fake tensors
            table = torch.zeros(1, weight.shape[1], dtype=weight.dtype, requires_grad=weight.requires_grad)
            cpu_args = [on_cpu(indices)] + [on_cpu(v) for v in rest]
            stand_in = target(table, *cpu_args, **{k: on_cpu(v) for k, v in kwargs.items()})
        self.meter.keep.append((cpu_args, stand_in))  # with the saves its graph holds
        return out

    def run_node(self, n: fx.Node) -> Any:
        f0, b0 = self.flops.get_total_flops(), self.meter.total
        self.meter.saves = set()
        out = super().run_node(n)
        outputs = tuple((t.untyped_storage()._cdata, t.numel() * t.element_size())
                        for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.costs[n.name] = _NodeCost(float(self.flops.get_total_flops() - f0), float(self.meter.total - b0),
                                       float(_nbytes(out)), frozenset(self.meter.saves), outputs)
        if self.unknown is not None and n.op == "call_function":
            self.unknown.note(n.target, self.costs[n.name].flops)
        self.meter.saves = None
        return out


def is_weight_copy(t: torch.Tensor) -> bool:
    """True for autocast's low-precision copy of a parameter (``ToCopyBackward0`` of an accumulated leaf).

    Autocast casts each weight once per autocast region and shares the copy
    across every micro-batch of the region (one per training step): it is
    model state, planned as 2 more bytes per parameter, not an activation.
    The runtime's meter applies the same rule.
    """
    base = t._base if t._base is not None else t  # a saved transpose of the copy is the copy
    fn = getattr(base, "grad_fn", None)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    acc = nxt[0][0] if nxt else None
    return type(acc).__name__ == "AccumulateGrad" and isinstance(getattr(acc, "variable", None), nn.Parameter)


def _measure(gm: fx.GraphModule, flat_inputs: Sequence[Any], loss_fn=None, precision: str = "fp32",
             name: str = "model") -> dict[str, _NodeCost]:
    """Costs of every node of ``gm`` run on ``flat_inputs`` (its positional arguments).

    At ``bf16`` the graph runs under CPU autocast; a module on the meta
    device runs on fake CPU tensors (nothing is allocated), since autocast
    does not act on meta tensors. Ops that look like compute but have no
    FLOP formula are named in one warning (:class:`graphpipe.frontend.flops.UnknownCosts`).
    """
    unknown = UnknownCosts()
    if precision == "bf16":
        costs = _measure_bf16(gm, flat_inputs, loss_fn, unknown)
    else:
        costs = _measure_run(gm, flat_inputs, loss_fn, unknown=unknown)
    unknown.warn(name)
    return costs


def _measure_run(gm: fx.GraphModule, flat_inputs: Sequence[Any], loss_fn=None,
                 autocast: bool = False, fake=None, unknown: UnknownCosts | None = None) -> dict[str, _NodeCost]:
    # parameters, buffers and the input data are resident anyway: not activations (the runtime agrees)
    resident = list(gm.parameters()) + list(gm.buffers()) + [x for x in tree_leaves(list(flat_inputs))
                                                             if isinstance(x, torch.Tensor)]
    flops, meter = flop_counter(), _SavedMeter(resident)
    interp = _Measure(gm, flops, meter, fake, unknown)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.enable_grad(), flops, torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t), cast:
        out = interp.run(*flat_inputs)
        if loss_fn is not None:  # what the loss keeps for backward belongs to the node producing the output
            before = meter.total
            loss_fn(out)
            output = next(n for n in gm.graph.nodes if n.op == "output")
            node = next((a for a in output.all_input_nodes if a.name in interp.costs), None)
            if node is not None:
                c = interp.costs[node.name]
                interp.costs[node.name] = _NodeCost(c.flops, c.act_bytes + meter.total - before, c.out_bytes,
                                                    c.saved, c.outputs)
    return interp.costs


def _measure_bf16(gm: fx.GraphModule, flat_inputs: Sequence[Any], loss_fn=None,
                  unknown: UnknownCosts | None = None) -> dict[str, _NodeCost]:
    """:func:`_measure_run` under bf16 autocast; meta tensors become fake CPU tensors first."""
    state = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    if not any(_on_meta(t) for _, t in state) and not any(_on_meta(x) for x in flat_inputs):
        return _measure_run(gm, flat_inputs, loss_fn, autocast=True, unknown=unknown)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = functools.partial(fake_cpu_copy, mode)
        swapped = swap_state(gm, fake)
        try:
            inputs = [fake(x) for x in flat_inputs]
            return _measure_run(gm, inputs, loss_fn, autocast=True, fake=fake, unknown=unknown)
        finally:
            restore_state(gm, swapped)


def _loss_call_error(exc: BaseException, loss_fn, example_target: Any, user_file: str | None):
    """The one line for a failure of the loss call (not of the module's forward), or None when the exception
    did not come through it: the traceback passes through :meth:`IOSpec.wrap_loss`'s call of ``loss_fn``."""
    import inspect

    from graphpipe.frontend import exporting
    tb, through = exc.__traceback__, False
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "loss" and os.path.abspath(code.co_filename) == os.path.abspath(exporting.__file__):
            through = True
            break
        tb = tb.tb_next
    if not through or loss_fn is None:
        return None
    call = "loss_fn(output)" if example_target is None else "loss_fn(output, target)"
    name = getattr(loss_fn, "__name__", "loss_fn")
    doing = f"calling the loss {call.replace('loss_fn', name, 1)}"
    code = getattr(loss_fn, "__code__", None)
    if tb.tb_next is None and code is not None:  # the call itself failed (its arguments): point at the loss's def
        text = str(exc).strip().splitlines()
        error = UserCodeError(f"{code.co_filename}:{code.co_firstlineno}: {doing} failed: {type(exc).__name__}: "
                              f"{text[0] if text else ''}")
    else:
        error = user_code_error(exc, doing, user_file)
    if example_target is not None:
        return error
    try:
        required = [p for p in inspect.signature(loss_fn).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        required = []
    if len(required) < 2:
        return error
    return UserCodeError(f"{error}; the loss takes a target ({required[1].name!r}) but the factory returned none: "
                         "return (module, example_inputs, loss_fn, example_target)")


# -------------------------------------------------------------------- capture
def capture(module: nn.Module, example_inputs: Any, name: str | None = None,
            device: DeviceSpec | None = None, layer_types: Sequence[type[nn.Module]] = (),
            user_file: str | None = None, loss_fn=None, example_target: Any = None,
            granularity: Granularity | None = None, precision: str = "fp32") -> Captured:
    """Export ``module`` and build its layer-granularity OpGraph with analytical costs.

    ``example_inputs``: a tensor, a tuple (positional) or a dict (keyword
    inputs); they may live on the meta device (and the module too): only
    shapes matter. ``loss_fn(output)`` or, with ``example_target``,
    ``loss_fn(output, target)``. ``device`` sets the cost model (default: the
    v100 preset's device). See the module docstring for the rules. A failure
    of the module's own code is a one-line
    :class:`~graphpipe.errors.UserCodeError` naming its source line.
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"capture needs an nn.Module, got {type(module).__name__}")
    if precision not in PRECISIONS:
        raise InputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    device = device if device is not None else preset("v100").device
    try:
        # costs are read at the example's shape: only the batch need stay symbolic (half the export time or less)
        exported, op_nodes, paths = trace_ops(module, example_inputs, loss_fn, example_target, granularity, layer_types,
                                              lengths=False, precision=precision)
    except GraphpipeError:
        raise
    except Exception as exc:
        raise (_loss_call_error(exc, loss_fn, example_target, user_file)
               or user_code_error(exc, "exporting the module's forward (torch.export)", user_file)) from exc
    gm, io = exported.gm, exported.io
    args, kwargs = normalize_inputs(example_inputs)
    flat = io.flat_inputs(args, kwargs, example_target)
    batch = _batch_size(flat)
    try:
        costs = _measure(gm, flat, io.wrap_loss(loss_fn) if loss_fn is not None else None, precision,
                         name or type(module).__name__)
    except GraphpipeError:
        raise
    except Exception as exc:
        refusal = meta_value_error(exc, gm) or _loss_call_error(exc, loss_fn, example_target, user_file)
        raise (refusal or user_code_error(exc, "running the module's forward on its example inputs",
                                          user_file)) from exc
    by_name = {n.name: n for n in gm.graph.nodes}
    members: dict[str, list[fx.Node]] = {op: [by_name[x] for x in names] for op, names in op_nodes.items()}
    op_of_node = {x: op for op, names in op_nodes.items() for x in names}
    order = list(op_nodes)

    seen_params: set[int] = set()
    param_ops: dict[int, list[str]] = {}  # parameter -> ops reading it (tied weights: more than one)
    param_size: dict[int, int] = {}
    edge_bytes: dict[tuple[str, str], float] = {}
    incoming: dict[tuple[str, str], dict[int, int]] = {}  # op edge -> storages (and bytes) of the values on it
    crossing: set[tuple[str, str]] = set()
    ops: list[Op] = []
    rate = device.peak_flops * device.mfu
    modules = _Modules(module)
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
            for src in n.all_input_nodes:
                src_op = op_of_node.get(src.name)
                if src_op is not None and src_op != op_name and (src.name, op_name) not in crossing:
                    crossing.add((src.name, op_name))  # a value read by several nodes of the op crosses once
                    edge_bytes[(src_op, op_name)] = edge_bytes.get((src_op, op_name), 0.0) + costs[src.name].out_bytes / batch
                    incoming.setdefault((src_op, op_name), {}).update(costs[src.name].outputs)
        ops.append(Op(op_name, _kind(modules, paths.get(op_name, ""), op_name),
                      fwd=Affine(device.op_overhead_s, flops / rate),
                      bwd=Affine(2 * device.op_overhead_s, 2 * flops / rate),
                      param_bytes=params, act_bytes=act, out_bytes=out,
                      batchnorm=any(_is_batchnorm(gm, n) for n in nodes),
                      dropout=any((dropout_p(gm, n) or 0.0) > 0 for n in nodes)))
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    if sum(op.param_bytes for op in ops) != total:
        log.warning("%s: %d parameter bytes are never used by forward; the op graph omits them",
                    name or type(module).__name__, total - sum(op.param_bytes for op in ops))
    try:
        saved = _edge_saved_bytes(incoming, members, op_of_node, costs, batch)
        graph = OpGraph.build(name or type(module).__name__, ops,
                              [(s, d, b, saved.get((s, d), 0.0)) for (s, d), b in edge_bytes.items()],
                              _shared_params(param_ops, param_size), _lengths(module, args, kwargs))
    except GraphCycleError as exc:
        raise InputError(f"contracting graph nodes into layers made a cycle ({exc}); choose another --granularity "
                         "so the layers on that cycle become ops of their own") from None
    return Captured(graph, gm, dict(op_nodes), io, paths, exported.seconds)


def _lengths(module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The example's size of every input dim that may vary per step, other than the batch (sorted, distinct): the
    dims a run's export keeps symbolic (:func:`~graphpipe.frontend.exporting._dynamic_shapes`), read from the
    example (the planning capture keeps only the batch symbolic)."""
    from graphpipe.frontend.exporting import _dynamic_shapes

    try:
        dynamic = _dynamic_shapes(module, args, kwargs)
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except Exception:  # noqa: BLE001 - inputs this cannot read cost as before, with no lengths
        return ()
    sizes = set()
    for name, value in bound.items():  # each input leaf beside its dims' spec (None where nothing varies)
        specs = tree_leaves(dynamic.get(name), is_leaf=lambda d: d is None or isinstance(d, dict))
        for x, dims in zip(tree_leaves(value, is_leaf=lambda v: v is None), specs):
            if isinstance(x, torch.Tensor) and isinstance(dims, dict):
                sizes.update(int(x.shape[int(d)]) for d in dims if 0 < int(d) < x.dim())
    return tuple(sorted(sizes))


def _batch_size(flat_inputs: Sequence[Any]) -> int:
    for x in tree_leaves(list(flat_inputs)):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] >= 1:
            return int(x.shape[0])
    raise InputError("example inputs need at least one tensor with a batch dimension (dim 0) to size per-sample costs")


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


def op_param_bytes(gm: fx.GraphModule, op_nodes: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Each op's parameter bytes as :func:`capture` counts them (a parameter at the first op reading it, in
    ``op_nodes``' order): what the runtime compares with a plan's ops to tell the model is the plan's."""
    by_name = {n.name: n for n in gm.graph.nodes}
    seen: set[int] = set()
    out: dict[str, int] = {}
    for op_name, names in op_nodes.items():
        total = 0
        for name in names:
            for p in _node_params(gm, by_name[name]):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        out[op_name] = total
    return out


def _is_batchnorm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` calls one of the user's BatchNorms (export's markers restored: the runtime runs each as
    a module, :mod:`graphpipe.runtime.batchnorm`)."""
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), BATCHNORMS)


def dropout_p(gm: fx.GraphModule, node: fx.Node) -> float | None:
    """The probability of the dropout ``node`` calls, None where it calls none: a dropout module (any
    ``nn.Dropout*``, or the runtime's seeded stand-in, ``SeededDropout``, known here by name: the front end does
    not import the runtime) or a dropout function (``F.dropout``, ``aten.dropout``, the runtime's
    ``seeded_dropout``: any function so named, its probability the second argument or ``p``; 0 where that is not
    a number). The capture marks the ops drawing one (``Op.dropout``); a sequence-parallel stage looks through
    them (:mod:`graphpipe.runtime.intra_stage`)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        dropout = isinstance(module, nn.modules.dropout._DropoutNd) or type(module).__name__ == "SeededDropout"
        return float(module.p) if dropout else None
    if node.op != "call_function" or "dropout" not in str(getattr(node.target, "__name__", node.target)):
        return None
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    """Parameters ``node`` reads: a module call's, and those of its ``get_attr`` inputs."""
    found: list[nn.Parameter] = []
    if node.op == "call_module":
        found += list(gm.get_submodule(node.target).parameters())
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            value: Any = gm
            for part in str(a.target).split("."):
                value = getattr(value, part)
            if isinstance(value, nn.Parameter):
                found.append(value)
    return found


def _kind(modules: _Modules, path: str, name: str = "") -> str:
    """A zoo Layer's ``kind``, else the unit module's class name in lower case; ``folded`` for ops merged across
    top-level modules (``convs+lin``, :func:`graphpipe.frontend.folded.merge_folded_ops`); ``glue`` for glue ops."""
    if not path:
        return "folded" if "+" in name else "glue"
    module = modules.get(path)
    if module is None:
        return "glue"
    return module.kind if isinstance(module, Layer) else type(module).__name__.lower()


# ---------------------------------------------------------------------- split
def split_by_ops(captured: Captured, part_of_op: Mapping[str, int]) -> fx.GraphModule:
    """``split_module`` of ``captured.gm`` with op ``o`` in partition ``part_of_op[o]``.

    The parts must be convex in the op graph (every stage partition of a
    StageGraph is). Submodules are named ``submod_{part}``; a ``get_attr``
    joins the partition of its first reader.
    """
    missing = [op for op in captured.op_nodes if op not in part_of_op]
    if missing:
        raise InputError(f"split_by_ops: ops without a partition: {', '.join(missing[:5])}")
    op_of_node = captured.op_of_node()

    def part(node: fx.Node) -> int:
        if node.name in op_of_node:
            return part_of_op[op_of_node[node.name]]
        readers = [part(u) for u in node.users if u.op != "output"]
        return min(readers) if readers else 0

    return split_module(captured.gm, captured.gm, part)


# ------------------------------------------------------------------- factories
@dataclass(frozen=True, slots=True, eq=False)
class Factory:
    """What a ``file.py:factory`` returns.

    ``(module, example_inputs, loss_fn)``, or with a fourth element
    ``example_target``: then the loss is ``loss_fn(output, target)`` and the
    target (a tensor or a tuple/dict of tensors, dim 0 the batch) is sent to
    the stage computing the loss. A fifth element, ``dynamic_shapes`` in
    ``torch.export``'s form (``{"pixel_values": {2: Dim.AUTO, 3: Dim.AUTO}}``,
    keyed by ``forward``'s argument names), declares more dims that vary per
    step than the default (every dim but the batch of an integer input);
    the target may then be None. ``example_inputs`` is a tensor, a tuple of
    positional inputs, or a dict of keyword inputs (``input_ids``,
    ``attention_mask``, ``pixel_values``).
    """

    module: nn.Module
    example_inputs: Any
    loss_fn: Callable[..., torch.Tensor]
    example_target: Any = None

    @property
    def args(self) -> tuple[Any, ...]:
        return normalize_inputs(self.example_inputs)[0]

    @property
    def kwargs(self) -> dict[str, Any]:
        return normalize_inputs(self.example_inputs)[1]


def load_factory(spec: str) -> Factory:
    """Import ``path/to/file.py`` and call ``factory()`` from ``"path/to/file.py:factory"`` (see :class:`Factory`)."""
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
    return factory_result(result, spec)


def factory_result(result: Any, spec: str) -> Factory:
    """``result``, what a factory returned, checked and read as a :class:`Factory`; ``spec`` names it in errors."""
    if not (isinstance(result, tuple) and len(result) in (3, 4, 5)):
        raise InputError(f"{spec}: factory must return (module, example_inputs, loss_fn[, example_target"
                         f"[, dynamic_shapes]]), got "
                         f"{type(result).__name__}{' of length ' + str(len(result)) if isinstance(result, tuple) else ''}")
    net, inputs, loss_fn = result[:3]
    target = result[3] if len(result) >= 4 else None
    if len(result) == 5:
        from graphpipe.frontend.exporting import declare_dynamic

        declare_dynamic(net, result[4], spec)
    if not isinstance(net, nn.Module):
        raise InputError(f"{spec}: first item returned must be an nn.Module, got {type(net).__name__}")
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    leaves = tree_leaves(inputs if isinstance(inputs, (tuple, dict)) else (inputs,))
    if not leaves or not isinstance(inputs, (torch.Tensor, tuple, dict)) or not any(isinstance(x, torch.Tensor) for x in leaves):
        raise InputError(f"{spec}: example_inputs must be a tensor, a non-empty tuple of tensors or a dict of "
                         "keyword inputs")
    if not callable(loss_fn):
        raise InputError(f"{spec}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if len(result) >= 4 and target is not None and not any(isinstance(x, torch.Tensor) for x in tree_leaves(target)):
        raise InputError(f"{spec}: the fourth item (example_target) must be a tensor or a tuple/dict of tensors")
    return Factory(net, inputs if not isinstance(inputs, torch.Tensor) else (inputs,), loss_fn, target)


def captured_from_factory(spec: str, device: DeviceSpec | None = None, granularity: Granularity | None = None,
                          precision: str = "fp32") -> Captured:
    """:func:`capture` of a ``file.py:factory`` spec, with its loss and target."""
    made = load_factory(spec)
    name = os.path.splitext(os.path.basename(spec.rpartition(":")[0]))[0]
    return capture(made.module, made.example_inputs, name=name, device=device, user_file=spec.rpartition(":")[0],
                   loss_fn=made.loss_fn, example_target=made.example_target, granularity=granularity,
                   precision=precision)
