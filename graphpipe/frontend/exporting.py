"""Turn a user's ``nn.Module`` into one flat, runnable fx graph with ``torch.export``.

This is the front half of capture (:mod:`graphpipe.frontend.capture` groups the graph
into layers and costs it). Real model code (Hugging Face transformers, timm)
branches on shapes and takes keyword inputs, which ``torch.fx`` symbolic
tracing cannot follow; ``torch.export.export(..., strict=False)`` runs the
Python code with fake tensors instead, so any branch on a *shape* is taken
and recorded. The batch dimension (dim 0 of every input) is kept symbolic
(``Dim("batch")``), so the graph runs at every micro-batch size.

What :func:`export_model` does to the exported program, and why:

1. **Unlift.** ``ExportedProgram.module()`` gives a ``GraphModule`` whose
   parameters and buffers are the module's own tensors (``get_attr`` nodes),
   so tied weights stay one tensor and the runtime trains the user's weights.
2. **Flat calling convention.** The graph takes the flattened inputs (then
   the flattened target, when the factory gives one) as positional
   arguments and returns a flat tuple of outputs; :class:`IOSpec` rebuilds
   the user's structures (keyword inputs, ``ModelOutput`` dataclasses,
   dicts, tuples) at the edges. Outputs the loss never reads are dropped,
   so the loss runs on one stage.
3. **Modules the runtime gives semantics to come back as modules.** A
   BatchNorm is exported as an opaque call (its running-statistics update
   with ``momentum=None`` is data-dependent and cannot be exported) and
   restored as a ``call_module`` of the original BatchNorm; an ``aten``
   dropout inside an ``nn.Dropout*`` module becomes a ``call_module`` of that
   module. :mod:`graphpipe.runtime.rng` and :mod:`graphpipe.runtime.batchnorm`
   then replay masks and choose BatchNorm semantics exactly as before.
4. **Shape glue is local.** Export computes the batch size once
   (``sym_size``) and masks once, from the inputs, and lets every layer
   read them. Those nodes (no parameters, computed from inputs and buffers
   only) are *replicable*: :func:`replicate_input_glue` gives every reader
   its own copy, so no integer or mask ever has to cross a stage boundary.
5. Export's run-time guard (``_guards_fn``) and metadata assertions are
   removed: a stage legitimately runs at another batch size than the example.
6. **Constant inputs are part of the program.** A ``bool``, ``int``,
   string or ``None`` input (``output_hidden_states=True``) was specialized
   by export; its placeholder is replaced by the value, so stages are only
   ever handed tensors, and :class:`IOSpec` refuses other values in one line.
7. **Keyword inputs through ``**kwargs``** (transformers 5's
   ``output_hidden_states``, ``num_items_in_batch``) are bound as named
   parameters of ``forward`` while exporting, since export cannot give a
   var-keyword argument a dynamic batch (:mod:`graphpipe.frontend.export_inputs`).
8. **Traced at the run's precision.** A bf16 run's program is traced under
   bf16 ``torch.autocast`` (a meta-device model on fake CPU tensors), so code
   that reads a tensor's dtype (``torch.finfo(h.dtype).max``, a branch on
   ``h.dtype``) is recorded as the eager module runs it at bf16
   (:func:`graphpipe.frontend.export_inputs.traced_at`); each precision has
   its own capture. A program traced at fp32 has ``torch.finfo(float32)``
   extremes replaced by bf16's
   (:func:`graphpipe.frontend.export_inputs.bf16_safe_constants`), so it stays
   safe where it is replayed under autocast.

Example
-------
>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> ex = export_model(m, (torch.randn(3, 4),))
>>> [n.op for n in ex.gm.graph.nodes if n.op in ("placeholder", "output")]
['placeholder', 'output']
>>> ex.gm(torch.randn(5, 4))[0].shape
torch.Size([5, 2])
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from graphpipe.frontend.capture_refusals import BatchFixedAt, BatchFixedError, CustomBackwards, refuse_vmap
from graphpipe.errors import InputError, UserCodeError
from graphpipe.frontend.export_inputs import (bf16_safe_constants, fold_constant_inputs, keywords_bound, same_constant,
                                             traced_at)

__all__ = ["BATCHNORMS", "IOSpec", "Exported", "export_model", "module_path", "module_stack", "replicable_nodes",
           "replicate_input_glue", "normalize_inputs", "deliver_target", "join_outputs"]

log = logging.getLogger(__name__)

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""The BatchNorm classes export turns into one opaque call each and the runtime runs as modules."""
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_ASSERTIONS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
               "_assert_async")


# ----------------------------------------------------------------- marker op
@torch.library.custom_op("graphpipe::module_call", mutates_args=())
def _module_call(x: torch.Tensor, key: int) -> torch.Tensor:
    """Stands in, while exporting, for a module the runtime must call itself (a BatchNorm)."""
    return x.clone()


@_module_call.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


class _BatchNormCalls(torch.overrides.TorchFunctionMode):
    """While exporting, ``F.batch_norm`` on a known module's running statistics becomes an opaque call."""

    def __init__(self, owners: Sequence[tuple[nn.Module, int]]):
        super().__init__()
        self.owners = owners

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.batch_norm and len(args) > 1:
            # export swaps a module's tensors for fake ones while tracing: look them up now, not before
            key = next((k for owner, k in self.owners if owner._buffers.get("running_mean") is args[1]), None)
            if key is not None:
                return torch.ops.graphpipe.module_call(args[0], key)
        return func(*args, **kwargs)


def _twin(bn: nn.Module) -> nn.Module:
    """A torch BatchNorm of ``bn``'s dimension holding ``bn``'s own tensors (for subclasses such as timm's
    BatchNormAct2d, whose forward adds an activation after the normalisation)."""
    cls = next(c for c in type(bn).__mro__ if c in BATCHNORMS)
    twin = cls.__new__(cls)
    nn.Module.__init__(twin)
    for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
        setattr(twin, attr, getattr(bn, attr))
    for name in ("weight", "bias"):
        twin._parameters[name] = bn._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        twin._buffers[name] = bn._buffers.get(name)
    twin.train(bn.training)
    return twin


@contextlib.contextmanager
def _opaque_batchnorms(module: nn.Module):
    """While exporting, every BatchNorm of ``module`` is one opaque call keyed by its index in the list yielded.

    A torch BatchNorm's whole forward is replaced; a subclass keeps its forward
    and only its ``F.batch_norm`` call is (the list then holds a twin torch
    BatchNorm over the same tensors, :func:`_twin`).
    """
    exact = [m for m in module.modules() if type(m) in BATCHNORMS]
    subclassed = [m for m in module.modules() if isinstance(m, BATCHNORMS) and type(m) not in BATCHNORMS
                  and getattr(m, "running_mean", None) is not None]
    found: list[tuple[nn.Module, nn.Module]] = [(m, m) for m in exact] + [(m, _twin(m)) for m in subclassed]
    owners = [(owner, i) for i, (owner, _) in enumerate(found) if i >= len(exact)]
    try:
        for key, (bn, _) in enumerate(found[:len(exact)]):
            bn.forward = (lambda x, key=key: torch.ops.graphpipe.module_call(x, key))  # type: ignore[method-assign]
        with _BatchNormCalls(owners) if owners else contextlib.nullcontext():
            yield found
    finally:
        for bn in exact:
            bn.__dict__.pop("forward", None)


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch's fake-tensor and export loggers print tracebacks of a failing op; our one-line error says it."""
    names = ("torch._subclasses.fake_tensor", "torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes",
             "torch._dynamo")
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


PRECISION_KEY = "graphpipe_precision"
"""``gm.meta`` key: the precision the captured program was traced at (:func:`~graphpipe.frontend.export_inputs.traced_at`)."""

DATA_VALUE = "_graphpipe_value"
"""Attribute of a meta tensor made from Python data during export: its values, on the CPU (:class:`_KeepDataValues`)."""


def _data_leaf(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_data_leaf(v) for v in value)
    return isinstance(value, (bool, int, float)) and not isinstance(value, torch.SymInt)


@contextlib.contextmanager
def _outside_tracing():
    """A real tensor made inside export's tracing (its fake and proxy modes set aside): it holds values."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _valueless(t: torch.Tensor) -> bool:
    """A tensor with no values: on the meta device, or a fake one (a meta-device model traced at bf16 runs on
    fake CPU tensors: :func:`~graphpipe.frontend.export_inputs.traced_at`)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


class _KeepDataValues(TorchFunctionMode):
    """Export of a meta-device model: a tensor made from Python data keeps its values beside it.

    On the meta device ``torch.tensor([3.0, 4.0], device=x.device)`` and a list index (``qkv[..., [-2], :]``,
    which torch turns into such a tensor: Falcon's attention) hold no data, and export lifts them into the graph
    as constants that only their shape survives; a run then had nothing to fill them with (an index of garbage).
    Each such tensor gets its values, made on the CPU, as :data:`DATA_VALUE`; a list index is made into the
    tensor torch would make, so it gets them too. Materializing a stage fills the constant from them.
    """

    _MAKERS = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2
                and isinstance(args[0], torch.Tensor) and _valueless(args[0])):
            args = (args[0], self._index(args[1], args[0].device), *args[2:])
        out = func(*args, **kwargs)
        if func in self._MAKERS and isinstance(out, torch.Tensor) and _valueless(out):
            data = args[1] if func is torch.Tensor.new_tensor else args[0] if args else kwargs.get("data")
            if _data_leaf(data):
                with _outside_tracing():
                    value = torch.tensor(data, dtype=out.dtype)
                setattr(out, DATA_VALUE, value)
        return out

    def _index(self, index: Any, device: torch.device) -> Any:
        """``index`` with each list of Python numbers made into its tensor (with its values kept)."""
        if isinstance(index, list) and index and _data_leaf(index):
            with _outside_tracing():
                value = torch.tensor(index)
            made = torch.tensor(index, device=device)
            setattr(made, DATA_VALUE, value)
            return made
        if isinstance(index, tuple):
            return tuple(self._index(i, device) for i in index)
        return index


@contextlib.contextmanager
def _no_partial_graph_dump():
    """torch.export prints a failing export's partial graph to stderr (one line per parameter, tens of
    kilobytes for an LLM) before raising; our one-line error says what failed. What else export writes to
    stderr (warnings) is passed on once it returns or raises."""
    import io
    import sys

    buffer, real, graph = io.StringIO(), sys.stderr, None
    sys.stderr = buffer
    try:
        yield
    except BaseException as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        raise
    finally:
        sys.stderr = real
        text = buffer.getvalue()
        if graph is not None:
            text = text.replace(str(graph), "").strip("\n")
            text = text + "\n" if text else ""
        real.write(text)


@contextlib.contextmanager
def _no_stack_traces():
    """Export without a Python stack trace per graph node: nothing here reads ``node.meta["stack_trace"]``
    (errors name the user's line from the exception), and capturing and symbolizing one per node is a
    share of export's time that grows with the model. A no-op on a torch without the switch."""
    config = getattr(fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


def deliver_target(target: Any) -> Any:
    """Identity: carries the loss target from the data to the stage computing the loss (a graph node of that op)."""
    return target


def join_outputs(*values: Any) -> tuple[Any, ...]:
    """Identity on several values: the outputs the loss reads, gathered by one graph node.

    A loss reading outputs of two branches (a dual encoder's image and text
    embeddings) would otherwise have two sink ops, which a plan may put on two
    stages; the loss runs on one. Capture makes this node an op of its own (or
    part of the one op producing all the values), so every plan computes the
    loss's inputs in one stage.
    """
    return values


# ------------------------------------------------------------- I/O contract
def normalize_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a factory's example inputs: a tensor, a tuple/list (positional), or a dict (keyword)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"example inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, "
                     f"got {type(example_inputs).__name__}")


@dataclass(frozen=True, slots=True)
class IOSpec:
    """How the flat graph's inputs and outputs map to the user's structures.

    ``in_spec`` flattens ``(args, kwargs)``; ``out_spec`` rebuilds the
    module's output from its leaves, with ``None`` for leaves the loss does
    not read (``kept``: positions of the leaves the graph returns);
    ``target_spec`` rebuilds the target (None: the loss takes the output only).
    """

    in_spec: pytree.TreeSpec
    input_names: tuple[str, ...]
    out_spec: pytree.TreeSpec
    kept: tuple[int, ...]
    target_spec: pytree.TreeSpec | None = None
    num_target_leaves: int = 0
    constants: tuple[tuple[int, str, Any], ...] = ()
    """``(leaf position in in_spec, input name, value)`` of every non-tensor input leaf (a ``bool`` flag, an int,
    a string, ``None``): export specialized the program to these values, so they are part of the graph, not
    graph inputs; :meth:`flat_inputs` checks a caller passes the same ones."""

    @property
    def num_inputs(self) -> int:
        """How many of the graph's positional arguments are model inputs (the target's leaves follow them)."""
        return self.in_spec.num_leaves - len(self.constants)

    def flat_inputs(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                    target: Any = None) -> tuple[Any, ...]:
        """The graph's positional arguments for these inputs (and target): the tensor leaves, constants dropped."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_spec:
            raise InputError(f"inputs do not have the structure the model was captured with ({self.in_spec}); got {spec}")
        if self.constants:
            for pos, name, value in self.constants:
                if not same_constant(leaves[pos], value):
                    raise InputError(f"input {name!r} is {leaves[pos]!r}, but the model was captured with {value!r}, "
                                     "which is part of the captured program: capture with the value you run with "
                                     "(the factory's example inputs)")
            dropped = {pos for pos, _, _ in self.constants}
            leaves = [x for i, x in enumerate(leaves) if i not in dropped]
        if self.target_spec is not None:
            t_leaves, t_spec = pytree.tree_flatten(target)
            if t_spec != self.target_spec:
                raise InputError("the loss takes a target: pass one shaped like the factory's example target")
            leaves += t_leaves
        return tuple(leaves)

    def output(self, flat: Sequence[Any]) -> Any:
        """The module's output structure from the graph's returned leaves (the target excluded)."""
        full: list[Any] = [None] * self.out_spec.num_leaves
        for pos, value in zip(self.kept, flat):
            full[pos] = value
        return pytree.tree_unflatten(full, self.out_spec)

    def split(self, graph_out: Sequence[Any]) -> tuple[Any, Any]:
        """``(output, target)`` from what the graph returns."""
        flat = tuple(graph_out)
        n = len(self.kept)
        target = pytree.tree_unflatten(list(flat[n:]), self.target_spec) if self.target_spec is not None else None
        return self.output(flat[:n]), target

    def unflatten_inputs(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """``(args, kwargs, target)`` from the graph's positional arguments: the inverse of :meth:`flat_inputs`,
        to call the eager module on the data the graph runs on."""
        n = len(flat) - self.num_target_leaves
        leaves = list(flat[:n])
        for pos, _, value in self.constants:  # in increasing position order: each lands where it was
            leaves.insert(pos, value)
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        target = pytree.tree_unflatten(list(flat[n:]), self.target_spec) if self.target_spec is not None else None
        return tuple(args), dict(kwargs), target

    def graph_output(self, output: Any, target: Any = None) -> tuple[Any, ...]:
        """What the graph returns for the eager module's ``output`` (and the target): the leaves the loss reads,
        then the target's, so the wrapped loss (:meth:`wrap_loss`) applies to an eager run too."""
        leaves = pytree.tree_flatten(output)[0]
        if len(leaves) != self.out_spec.num_leaves:
            raise InputError(f"the module's output has {len(leaves)} leaves, the captured one {self.out_spec.num_leaves}")
        return (*(leaves[i] for i in self.kept), *(pytree.tree_leaves(target) if self.target_spec is not None else ()))

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        """``loss_fn(output)`` or ``loss_fn(output, target)`` as a function of the graph's return value."""
        takes_target = self.target_spec is not None

        def loss(graph_out: Any) -> torch.Tensor:
            out, target = self.split(graph_out)
            return loss_fn(out, target) if takes_target else loss_fn(out)

        return loss


@dataclass(frozen=True, slots=True, eq=False)
class Exported:
    """A flat runnable graph of the module (module docstring) and its I/O contract."""

    gm: fx.GraphModule
    io: IOSpec
    seconds: float = 0.0
    ranges: dict = field(default_factory=dict)
    """Symbol of a dim that varies (the batch, a sequence length) -> ``(least, most)`` sizes export proved the
    program runs at (``most`` None: unbounded); :mod:`graphpipe.frontend.shapes` checks every step against them."""


# ------------------------------------------------------------------ helpers
def module_stack(node: fx.Node) -> list[tuple[str, str, type | str]]:
    """``(key, path, type)`` of every module a node was called inside, outermost first (root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, (path, typ) in stack.items():
        if not path or key.startswith("_empty_nn_module_stack"):
            continue
        out.append((key, path, typ))
    return out


def module_path(key_or_path: str) -> str:
    """A module path without export's call suffix (``layer@1`` -> ``layer``)."""
    return key_or_path.split("@")[0]


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """``root.<path> = module``, creating empty parents as needed."""
    parent = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    parent.add_module(parts[-1], module) if parts[-1] not in parent._modules else setattr(parent, parts[-1], module)


DYNAMIC_ATTR = "_graphpipe_dynamic_shapes"
"""A module's attribute holding the ``dynamic_shapes`` its factory declared (:func:`declare_dynamic`)."""


def declare_dynamic(module: nn.Module, dynamic: Any, spec: str) -> None:
    """Keep a factory's ``dynamic_shapes`` (``{argument: {dim: Dim}}``) on its module for the capture."""
    if not isinstance(dynamic, dict) or not all(isinstance(k, str) for k in dynamic):
        raise InputError(f"{spec}: dynamic_shapes must be a dict keyed by forward's argument names "
                         f"({{'pixel_values': {{2: Dim.AUTO}}}}), got {type(dynamic).__name__}")
    names = set(inspect.signature(module.forward).parameters)
    unknown = sorted(set(dynamic) - names)
    if unknown:
        raise InputError(f"{spec}: dynamic_shapes names {', '.join(map(repr, unknown))}, which "
                         f"{type(module).__name__}.forward does not take")
    object.__setattr__(module, DYNAMIC_ATTR, dict(dynamic))


def _dynamic_shapes(module: nn.Module, args: tuple, kwargs: dict, batch: Any = None,
                    lengths: bool = True) -> dict[str, Any]:
    """Dim 0 of every tensor input is the batch (one symbol for all; or ``batch``, :data:`torch.export.Dim.AUTO`);
    with ``lengths``, every other dim of an integer input is ``Dim.AUTO`` and a factory's declared dims
    (:func:`declare_dynamic`) are added to their argument's; without, only the batch varies."""
    batch = torch.export.Dim("batch") if batch is None else batch
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(f"example inputs do not match {type(module).__name__}.forward: {exc}") from None

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() < 1:
            return None
        if not lengths or value.dtype.is_floating_point or value.dtype.is_complex:
            return {0: batch}
        # token ids, masks, labels: every other dim (a sequence length) is whatever the model allows; a dim the
        # model pins is specialized, one it does not stays a symbol
        return {0: batch, **{d: torch.export.Dim.AUTO for d in range(1, value.dim())}}

    out = {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}
    for name, dims in (getattr(module, DYNAMIC_ATTR, None) or {}).items() if lengths else ():
        if name in out and isinstance(out[name], dict) and isinstance(dims, dict):
            out[name] = {**out[name], **{int(k): v for k, v in dims.items() if int(k) != 0}}
    return out


def _check_batch_inputs(args: tuple, kwargs: dict) -> int:
    """The example batch size; every tensor input must have it as dim 0."""
    named = [(f"input {i}", x) for i, x in enumerate(pytree.tree_leaves(list(args)))] + \
            [(f"input {k!r}", x) for k, v in kwargs.items() for x in pytree.tree_leaves(v)]
    tensors = [(n, x) for n, x in named if isinstance(x, torch.Tensor)]
    if not tensors:
        raise InputError("example inputs need at least one tensor whose dim 0 is the batch")
    batch = None
    for name, x in tensors:
        if x.dim() == 0:
            raise InputError(f"{name} is a scalar tensor: every tensor input needs the batch as dim 0")
        if batch is None:
            batch = int(x.shape[0])
        elif int(x.shape[0]) != batch:
            raise InputError(f"{name} has dim 0 of size {int(x.shape[0])}, but the first input's batch is {batch}: "
                             "dim 0 of every input must be the batch")
    if batch < 2:
        raise InputError(f"example batch size must be at least 2 (got {batch}): export specializes a batch of 1")
    return batch


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line
    return type(exc).__name__


def _export_reason(exc: BaseException) -> str:
    """Why export stopped, in one line: a guard on a data-dependent value is a Python branch (or a shape)
    that depends on a tensor's values, shown with the source line torch names."""
    import re

    if isinstance(exc, BatchFixedError):
        return str(exc)
    reason = f"{type(exc).__name__}: {_first_line(exc)}"
    if "data-dependent" not in reason:
        return reason
    m = re.search(r'File "([^"]+)", line \d+, in \w+\n\s*(\S[^\n]*)', str(exc))
    code = f"`{m.group(2).strip()}` " if m and "/torch/" not in m.group(1) else ""
    return (f"{code}depends on a tensor's values, which export cannot trace (a Python branch, loop or "
            f"shape on data; {reason})")


def _export_location(exc: BaseException) -> str:
    """``file:line: `` of the user's frame export stopped in (from its message or traceback)."""
    import re

    if isinstance(exc, BatchFixedError):
        return f"{exc.where[0]}:{exc.where[1]}: "
    m = re.search(r'File "([^"]+)", line (\d+), in (\w+)', str(exc))
    if m and "/torch/" not in m.group(1):
        return f"{m.group(1)}:{m.group(2)}: "
    from graphpipe.errors import library_location, user_location

    # a model whose code is installed (transformers, timm) and no user frame: the deepest frame of that code
    return user_location(exc) or library_location(exc, (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,))


# ------------------------------------------------------------------- export
def _export_dynamic_batch(module: nn.Module, args: tuple, kwargs: dict, dynamic: dict[str, Any], lengths: bool = True):
    """``torch.export`` with a dynamic batch; where its solver cannot prove a guard that holds, the batch found.

    Some guards hold for every batch but are beyond the symbolic solver (Llama-4's
    mixture of experts reshapes its tokens into ``Min(hidden, tokens)``-strided views):
    a named ``Dim`` then fails with "Constraints violated". ``Dim.AUTO`` records such
    guards instead; the export is kept only if the batch stayed a symbol (a model that
    does fix the batch still gets the first error).
    """
    try:
        return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        if "Constraints violated" not in str(exc):
            raise
        auto = _dynamic_shapes(module, args, kwargs, torch.export.Dim.AUTO, lengths)
        batch = _check_batch_inputs(args, kwargs)
        fixed = BatchFixedAt(batch)
        try:
            with fixed.watching():
                ep = torch.export.export(module, args, kwargs, dynamic_shapes=auto, strict=False)
        except Exception:
            raise exc from None
        inputs = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"
                  and n.name in ep.graph_signature.user_inputs]
        if any(isinstance(v, torch.Tensor) and v.dim() >= 1 and not _symbolic(v.shape[0], ep) for v in inputs):
            if fixed.where is not None:
                raise BatchFixedError(fixed.where, batch) from exc
            raise exc from None
        return ep


def _symbolic(size: Any, ep) -> bool:
    """Whether an exported input's dim is still a symbol with a range of values (not specialized to one)."""
    if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
        return False
    bounds = ep.range_constraints.get(size.node.expr)
    return bounds is None or bounds.lower != bounds.upper


def export_model(module: nn.Module, example_inputs: Any, loss_fn: Callable[..., Any] | None = None,
                 example_target: Any = None, lengths: bool = True, precision: str = "fp32") -> Exported:
    """Export ``module`` on its example inputs into a flat runnable graph (module docstring).

    ``loss_fn`` (with ``example_target`` when it takes one) lets outputs the
    loss never reads be dropped. The module may live on the meta device.
    ``lengths``: keep an integer input's other dims (a sequence length) symbolic, as a run whose batches change
    shape needs; planning reads costs at the example's shape only, and exporting with the batch alone symbolic
    takes a half to a third of the time on Hugging Face models (the symbolic lengths' guards through attention).
    ``precision``: the run's (``fp32`` or ``bf16``); the module's code is traced at it (step 8).
    """
    args, kwargs = normalize_inputs(example_inputs)
    _check_batch_inputs(args, kwargs)
    with keywords_bound(module, kwargs):
        return _export_bound(module, args, kwargs, loss_fn, example_target, lengths, precision)


def _export_bound(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[..., Any] | None,
                  example_target: Any, lengths: bool = True, precision: str = "fp32") -> Exported:
    """:func:`export_model` once ``**kwargs`` inputs are bound (:func:`~graphpipe.frontend.export_inputs.keywords_bound`)."""
    import time

    dynamic = _dynamic_shapes(module, args, kwargs, lengths=lengths)
    t0 = time.perf_counter()
    training = module.training
    meta = any(t.device.type == "meta" for t in itertools.chain(module.parameters(), module.buffers()))
    module.train()
    # a Hugging Face model: training keeps no KV cache (an encoder-decoder's stacks hold configs of their own)
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", None)}
    custom = CustomBackwards()
    try:
        for config in configs.values():
            config.use_cache = False
        with (_opaque_batchnorms(module) as batchnorms, _quiet_torch_logs(), _no_stack_traces(),
              _no_partial_graph_dump(), _KeepDataValues() if meta else contextlib.nullcontext(),
              custom.watching(), traced_at(module, args, kwargs, precision) as tracing):
            ep = _export_dynamic_batch(module, tracing.args, tracing.kwargs, dynamic, lengths)
    except Exception as exc:  # export raises many types; the first line and the user's location say why
        raise UserCodeError(f"{_export_location(exc)}torch.export cannot capture {type(module).__name__}: "
                            f"{_export_reason(exc)}") from exc
    finally:
        module.train(training)
        for config in configs.values():
            config.use_cache = True
    if (refusal := custom.refusal(module)) is not None:
        raise refusal
    seconds = time.perf_counter() - t0
    gm = ep.module()
    tracing.settle(gm, DATA_VALUE)
    refuse_vmap(gm, module, lambda node: module_path(module_stack(node)[-1][1]) if module_stack(node) else None)
    in_spec = ep.call_spec.in_spec
    out_spec = ep.call_spec.out_spec
    _restore_modules(gm, module, batchnorms)
    _drop_counter_updates(gm, [owner for owner, bn in batchnorms if bn is not owner])
    _drop_guards(gm)
    _histc_on_floats(gm)
    _use_module_names(gm, module)
    constants = fold_constant_inputs(gm, args, kwargs)
    if precision == "fp32":  # a bf16 trace recorded bf16's extremes itself, and fp32's only where the code asked
        bf16_safe_constants(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_names = tuple(n.name for n in placeholders)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out_leaves = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    kept = _outputs_read_by_loss(gm, in_spec, out_spec, out_leaves, args, kwargs, loss_fn, example_target)
    target_spec, num_target = None, 0
    new_out: list[Any] = _joined([out_leaves[i] for i in kept], gm, output)
    if example_target is not None:
        t_leaves, target_spec = pytree.tree_flatten(example_target)
        num_target = len(t_leaves)
        anchor = next((v for v in new_out if isinstance(v, fx.Node) and v.op != "placeholder"), None)
        with gm.graph.inserting_before(output):
            for i in range(num_target):
                ph = _placeholder_after(gm, f"target_{i}" if num_target > 1 else "target")
                _target_shape(ph, t_leaves[i], placeholders)
                node = gm.graph.call_function(deliver_target, (ph,))
                if anchor is not None:  # the target joins the op producing the output
                    node.meta["nn_module_stack"] = dict(anchor.meta.get("nn_module_stack") or {})
                    node.meta["graphpipe_with"] = anchor.name
                new_out.append(node)
    output.args = (tuple(new_out),)
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional inputs, a flat tuple out
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    # a plain GraphModule over the same tensors (export's module refuses train()/eval())
    gm = fx.GraphModule(gm, gm.graph, class_name=type(module).__name__)
    io = IOSpec(in_spec, input_names, out_spec, tuple(kept), target_spec, num_target, constants)
    from graphpipe.frontend.shapes import RANGES_KEY

    ranges = _ranges(ep)
    gm.meta[RANGES_KEY] = ranges  # travels with the graph (a shipped capture too): the runtime checks steps by it
    gm.meta[PRECISION_KEY] = precision  # a bf16 trace runs under autocast only (materialize.as_traced)
    return Exported(gm, io, seconds, ranges)


def _ranges(ep) -> dict[str, tuple[int, int | None]]:
    """``symbol -> (least, most)`` of every symbolic input dim of ``ep`` (``most`` None: no bound)."""

    def whole(v) -> int | None:
        import sympy

        return int(v) if isinstance(v, (int, sympy.Integer)) else None

    out = {}
    for sym, r in ep.range_constraints.items():
        lo, hi = whole(r.lower), whole(r.upper)
        lo = lo or 0
        out[str(sym)] = (lo, hi if hi is not None and hi < 2 ** 62 else None)
    return out


def _target_shape(node: fx.Node, example: Any, inputs: Sequence[fx.Node]) -> None:
    """The target's dims as the inputs' symbols, recorded on its placeholder (export never saw the target).

    Dim 0 is the batch; another dim whose example size is that of exactly one varying input dim (labels of a
    sequence's length) is taken to be that dim; every other dim is fixed. The runtime cuts a synthetic target
    to each step's sizes by it (``graphpipe run --vary-shapes``)."""
    from graphpipe.frontend.shapes import SHAPE_KEY

    if not isinstance(example, torch.Tensor) or example.dim() == 0:
        return
    sizes: dict[int, set] = {}
    batch = None
    for ph in inputs:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for k, d in enumerate(val.shape):
            if isinstance(d, torch.SymInt) and not d.node.expr.is_number and d.node.hint is not None:
                if k == 0 and batch is None:
                    batch = d.node.expr
                elif k > 0:
                    sizes.setdefault(int(d.node.hint), set()).add(d.node.expr)
    if batch is None:
        return
    dims = [batch] + [next(iter(sizes[n])) if len(sizes.get(n, ())) == 1 else n
                      for n in (int(x) for x in example.shape[1:])]
    node.meta[SHAPE_KEY] = ("tensor", tuple(dims))


def _joined(values: list[Any], gm: fx.GraphModule, output: fx.Node) -> list[Any]:
    """``values`` (the outputs the loss reads), each computed node read through one :func:`join_outputs` node
    when there are several (see there)."""
    heads = list(dict.fromkeys(v for v in values if isinstance(v, fx.Node) and v.op != "placeholder"))
    if len(heads) < 2:
        return values
    with gm.graph.inserting_before(output):
        joined = gm.graph.call_function(join_outputs, tuple(heads))
        items = {h: gm.graph.call_function(operator.getitem, (joined, i)) for i, h in enumerate(heads)}
    for h, item in items.items():
        item.meta["val"] = h.meta.get("val")
    joined.meta["val"] = tuple(h.meta.get("val") for h in heads)
    return [items.get(v, v) if isinstance(v, fx.Node) else v for v in values]


def _placeholder_after(gm: fx.GraphModule, name: str) -> fx.Node:
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        return gm.graph.placeholder(name)


def _restore_modules(gm: fx.GraphModule, module: nn.Module,
                     batchnorms: Sequence[tuple[nn.Module, nn.Module]]) -> dict[str, nn.Module]:
    """BatchNorm markers and module dropouts back to ``call_module`` nodes of the user's modules (in place)."""
    paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
    restored: dict[str, nn.Module] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.graphpipe.module_call.default:
            owner, bn = batchnorms[node.args[1]]
            path = paths[id(owner)]
            if bn is not owner and any(True for c in owner.children() for _ in c.parameters()):
                path = f"{path}.batchnorm" if path else "batchnorm"  # the owner's children keep their paths
        elif node.target in (torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default):
            stack = module_stack(node)
            if not stack or stack[-1][2] not in _DROPOUTS and not _is_dropout_type(stack[-1][2]):
                continue
            path = module_path(stack[-1][1])
            try:
                sub = module.get_submodule(path)
            except AttributeError:
                continue
            if type(sub) not in _DROPOUTS:
                continue
            bn = sub
        else:
            continue
        target = path or "_graphpipe_root"
        if path not in restored:
            _set_submodule(gm, target, bn)
            restored[path] = bn
        with gm.graph.inserting_before(node):  # named like the module, as fx would name its call
            call = gm.graph.create_node("call_module", target, (node.args[0],), name=target.replace(".", "_"))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    return restored


def _use_module_names(gm: fx.GraphModule, module: nn.Module) -> None:
    """Read every parameter under the module's own first name for it (export may pick another name of a tied one)."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attr(gm, str(node.target))
        name = canonical.get(id(value))
        if name is None or name == node.target:
            continue
        owner_path, _, leaf = name.rpartition(".")
        holder: nn.Module = gm
        for part in owner_path.split(".") if owner_path else ():
            if part not in holder._modules:
                holder.add_module(part, nn.Module())
            holder = holder._modules[part]
        holder._parameters[leaf] = value
        node.target = name


def _drop_counter_updates(gm: fx.GraphModule, owners: Sequence[nn.Module]) -> None:
    """A BatchNorm subclass counts its batches itself (``num_batches_tracked.add_(1)``) before normalising; the
    restored torch BatchNorm counts them too, once per step as its mode says, so the subclass's update goes."""
    counters = {id(o._buffers.get("num_batches_tracked")) for o in owners if o._buffers.get("num_batches_tracked") is not None}
    if not counters:
        return
    for node in list(gm.graph.nodes):
        packet = getattr(node.target, "overloadpacket", None)  # aten.add_ of aten.add_.Tensor: in place
        if (node.op == "call_function" and packet is not None and packet.__name__.endswith("_")
                and node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
                and id(_attr(gm, str(node.args[0].target))) in counters and not node.users):
            gm.graph.erase_node(node)


def _is_dropout_type(typ: Any) -> bool:
    return isinstance(typ, str) and typ.rsplit(".", 1)[-1] in {t.__name__ for t in _DROPOUTS}


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input guard and metadata assertions (module docstring, point 5), in the bodies of
    higher-order ops too (a ``torch.no_grad()`` region is a graph of its own: M2M100's positions)."""
    for sub in list(gm.modules()):
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in list(sub.graph.nodes):
            if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
                sub.graph.erase_node(node)
            elif node.op == "call_function" and not node.users and any(
                    s in str(getattr(node.target, "__name__", node.target)) for s in _ASSERTIONS):
                sub.graph.erase_node(node)
        if hasattr(sub, "_guards_fn"):
            delattr(sub, "_guards_fn")
        if sub is not gm:  # a body's code is its own; the caller recompiles the main graph
            sub.recompile()


def _histc_on_floats(gm: fx.GraphModule) -> None:
    """``histc`` of an integer tensor counts it as floats and gives back the integer dtype.

    transformers' grouped experts count tokens per expert with ``histc``, on floats where the device is
    the CPU (which has no integer kernel) and on integers elsewhere, so a model captured on the meta device
    records the integer call, which then fails on a CPU rank. The counts are small integers, exact in float32.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.histc.default \
                or not isinstance(node.args[0], fx.Node):
            continue
        val = node.args[0].meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point:
            continue
        changed = True
        with gm.graph.inserting_before(node):
            floats = gm.graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],), {"dtype": torch.float32})
        node.args = (floats, *node.args[1:])
        with gm.graph.inserting_after(node):
            back = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        for new in (floats, back):  # module path and the rest of the histc's metadata
            new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        floats.meta["val"] = val.to(torch.float32)
        out = node.meta.get("val")
        if isinstance(out, torch.Tensor):
            back.meta["val"] = out
            node.meta["val"] = out.to(torch.float32)
    if changed:
        gm.recompile()


def _outputs_read_by_loss(gm: fx.GraphModule, in_spec, out_spec, out_leaves: list, args: tuple, kwargs: dict,
                          loss_fn, example_target) -> list[int]:
    """Positions of the output leaves the loss reads (all of them when that cannot be told)."""
    everything = list(range(len(out_leaves)))
    tensor_pos = [i for i, v in enumerate(out_leaves) if isinstance(v, fx.Node)
                  and isinstance(v.meta.get("val"), torch.Tensor) and v.meta["val"].dtype.is_floating_point]
    if loss_fn is None or len(out_leaves) <= 1 or not tensor_pos:
        return everything
    # the example's device (a meta-device model traced at bf16 ran on fake CPU tensors: its values say cpu)
    on_meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta"
                  for t in pytree.tree_leaves((args, kwargs, example_target)))
    stand_ins: list[Any] = []
    for v in out_leaves:
        val = v.meta.get("val") if isinstance(v, fx.Node) else v
        if isinstance(val, torch.Tensor):
            shape = [int(s) if not isinstance(s, torch.SymInt) else int(s.node.hint or 2) for s in val.shape]
            t = torch.zeros(shape, dtype=val.dtype, device="meta" if on_meta or val.device.type == "meta" else "cpu")
            if t.dtype.is_floating_point:
                t.requires_grad_(True)
            stand_ins.append(t)
        else:
            stand_ins.append(val)
    try:
        out = pytree.tree_unflatten(stand_ins, out_spec)
        with torch.enable_grad():
            loss = loss_fn(out, example_target) if example_target is not None else loss_fn(out)
            grads = torch.autograd.grad(loss, [stand_ins[i] for i in tensor_pos], allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - keep every output; the real run reports a failing loss itself
        log.debug("cannot tell which outputs the loss reads (%s); keeping all", exc)
        return everything
    used = {i for i, g in zip(tensor_pos, grads) if g is not None}
    kept = [i for i in everything if i in used or i not in tensor_pos and not isinstance(out_leaves[i], fx.Node)]
    return kept or everything


# ----------------------------------------------------- replicable input glue
def replicable_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from model inputs, buffers and constants only, without parameters or randomness.

    Masks, position ids, rotary tables and ``sym_size`` batch sizes: cheap,
    and read by many layers. Every op reading one gets its own copy
    (:func:`replicate_input_glue`), as it gets the inputs.
    """
    params = {id(p) for p in gm.parameters()}
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is deliver_target:
            continue
        if _is_random(node):
            continue
        ok = True
        for a in node.all_input_nodes:
            if a.op == "placeholder" or a in out:
                continue
            if a.op == "get_attr":
                value = _attr(gm, str(a.target))
                if isinstance(value, torch.Tensor) and id(value) not in params:
                    continue
                if isinstance(value, fx.GraphModule):  # a higher-order op's body
                    continue
            ok = False
            break
        if ok and node.all_input_nodes:
            out.add(node)
        elif ok and isinstance(node.meta.get("val"), torch.Tensor):  # a constant factory (arange, ones) nobody varies
            out.add(node)
    # only glue that other nodes read is copied: a value the model returns is computed once, by an op
    for node in reversed(list(gm.graph.nodes)):
        if node in out and (not node.users or any(u.op == "output" for u in node.users)):
            out.discard(node)
    return out


def _is_random(node: fx.Node) -> bool:
    name = str(getattr(node.target, "__name__", node.target))
    return any(s in name for s in ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential"))


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def replicate_input_glue(gm: fx.GraphModule, owner: Mapping[fx.Node, str], replicable: set[fx.Node]) -> dict[fx.Node, str]:
    """Give every op its own copy of the replicable nodes it reads (in place); returns the copies' owners.

    ``owner`` maps every non-replicable compute node to its op. The original
    replicable nodes lose their readers and are erased.
    """
    new_owner: dict[fx.Node, str] = {}
    copies: dict[tuple[fx.Node, str], fx.Node] = {}
    position = {node: i for i, node in enumerate(gm.graph.nodes)}

    def copy_for(node: fx.Node, op: str, before: fx.Node) -> fx.Node:
        key = (node, op)
        if key in copies:
            return copies[key]
        args_env = {a: copy_for(a, op, before) if a in replicable else a for a in node.all_input_nodes}
        for a in node.all_input_nodes:  # a subgraph's get_attr sits just before its call (no_grad, autocast)
            if a.op == "get_attr" and position[a] > position[before]:
                before.prepend(a)
                position[a] = position[before] - 0.5
        with gm.graph.inserting_before(before):
            clone = gm.graph.node_copy(node, lambda a: args_env[a])
        copies[key] = clone
        new_owner[clone] = op
        return clone

    first: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in owner and owner[node] not in first:
            first[owner[node]] = node
    for node in list(gm.graph.nodes):
        op = owner.get(node)
        if op is None or node in replicable:
            continue
        if any(a in replicable for a in node.all_input_nodes):
            node.args = fx.node.map_arg(node.args, lambda a: copy_for(a, op, first[op]) if a in replicable else a)
            node.kwargs = fx.node.map_arg(node.kwargs, lambda a: copy_for(a, op, first[op]) if a in replicable else a)
    for node in reversed(list(gm.graph.nodes)):
        if node in replicable and not node.users:
            gm.graph.erase_node(node)
    _local_sizes(gm, new_owner, owner)
    gm.graph.lint()
    gm.recompile()
    return new_owner


_SIZE_OPS = {torch.ops.aten.sym_size.int: "size", torch.ops.aten.sym_numel.default: "numel"}


def _size_expr(kind: str, value: Any, args: tuple) -> str | None:
    if not isinstance(value, torch.Tensor):
        return None
    if kind == "size":
        dim = args[1] if len(args) > 1 else 0
        return str(value.shape[dim]) if -value.dim() <= dim < value.dim() else None
    return str(value.numel())


def _local_sizes(gm: fx.GraphModule, copies: Mapping[fx.Node, str], owner: Mapping[fx.Node, str]) -> None:
    """A copied ``sym_size``/``sym_numel`` of a model input reads, where it can, a tensor its op reads anyway
    (same symbolic size), so a stage never takes a model input only to learn the batch size.

    Each rewired copy moves just before its first reader, after the tensor it now reads.
    """
    reads: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        op = owner.get(node)
        if op is None:
            continue
        for a in node.all_input_nodes:
            if a.op != "get_attr" and owner.get(a) != op and a not in copies and a not in reads.setdefault(op, []):
                reads[op].append(a)
    moved = []
    for node, op in copies.items():
        kind = _SIZE_OPS.get(node.target)
        source = node.args[0] if node.args else None
        if kind is None or not isinstance(source, fx.Node) or source.op != "placeholder" or source in reads.get(op, ()):
            continue
        want = _size_expr(kind, source.meta.get("val"), node.args)
        for cand in reads.get(op, ()):
            if want is not None and _size_expr(kind, cand.meta.get("val"), node.args) == want:
                node.args = (cand, *node.args[1:])
                moved.append(node)
                break
    if not moved:
        return
    pos = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(moved, key=pos.__getitem__, reverse=True):
        first = min(node.users, key=pos.__getitem__)
        first.prepend(node)
        pos[node] = pos[first] - 1e-6
    # copies feeding a moved one must precede it again
    for node in reversed(list(gm.graph.nodes)):
        if node in copies and node.users:
            first = min(node.users, key=lambda u: pos.get(u, 0.0))
            if pos[node] > pos[first]:
                first.prepend(node)
                pos[node] = pos[first] - 1e-6

