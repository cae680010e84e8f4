"""What the capture does to a module's inputs and constants so one traced program serves every run
(:mod:`graphpipe.frontend.exporting`, steps 6-8 of its docstring).

* :func:`fold_constant_inputs`: non-tensor inputs (``output_hidden_states=True``, an int, a string, ``None``)
  become part of the program instead of graph inputs;
* :func:`keywords_bound`: keyword inputs that reach ``forward`` only through ``**kwargs`` (transformers 5)
  are bound as named parameters while exporting;
* :func:`traced_at`: the module's code runs at the run's precision while it is traced (under bf16
  ``torch.autocast`` for a bf16 run, on fake CPU tensors for a meta-device model), so code that reads a
  tensor's dtype (``torch.finfo(h.dtype)``, ``if h.dtype == ...``) is recorded as it runs at that precision;
* :func:`bf16_safe_constants`: in a program traced at fp32, ``torch.finfo(float32)`` extremes a module took
  from a tensor's dtype are replaced by bf16's, so that program is safe under bf16 autocast too;
* :func:`retarget_devices`: device literals recorded while tracing, moved to the device a program runs on.

Example
-------
>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x, **kwargs):
...         return x * 2 if kwargs.get("double") else x
>>> m = M()
>>> with keywords_bound(m, {"x": torch.ones(2), "double": True}):
...     list(inspect.signature(m.forward).parameters)
['x', 'double']
>>> "forward" in m.__dict__
False
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["same_constant", "fold_constant_inputs", "keywords_bound", "traced_at", "bf16_safe_constants",
           "retarget_devices", "fake_cpu_copy", "swap_state", "restore_state"]

log = logging.getLogger(__name__)


def same_constant(given: Any, captured: Any) -> bool:
    try:
        return type(given) is type(captured) and bool(given == captured)
    except Exception:  # noqa: BLE001 - a value without a plain equality: the same object only
        return given is captured


def fold_constant_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[tuple[int, str, Any], ...]:
    """Take the non-tensor input leaves out of the graph's inputs (:mod:`graphpipe.frontend.exporting`, step 6).

    Non-strict export specializes the program to the example's ``bool``/``int``/``str``/``None`` inputs (a
    branch on ``output_hidden_states`` is taken once), yet keeps a placeholder for each; a stage would then be
    handed a Python value as if it were a tensor. Each such placeholder is replaced by its value in any node
    reading it and removed. Returns ``(leaf position, input name, value)`` of each, for :class:`IOSpec`.
    """
    with_paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(with_paths):  # not one placeholder per leaf: leave the graph as export made it
        return ()
    constants = []
    for pos, ((path, value), node) in enumerate(zip(with_paths, placeholders)):
        if isinstance(value, torch.Tensor):
            continue
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a, node=node, value=value: value if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, node=node, value=value: value if a is node else a)
        gm.graph.erase_node(node)
        constants.append((pos, _leaf_name(path), value))
    return tuple(constants)


_FP32_EXTREMES = {torch.finfo(torch.float32).max: torch.finfo(torch.bfloat16).max,
                  torch.finfo(torch.float32).min: torch.finfo(torch.bfloat16).min}
"""fp32's largest finite values -> bf16's (:func:`bf16_safe_constants`)."""


def bf16_safe_constants(gm: fx.GraphModule) -> tuple[str, ...]:
    """Replace, in every node's scalar arguments, ``torch.finfo(torch.float32).max`` / ``.min`` by bf16's; returns
    the names of the nodes changed (:mod:`graphpipe.frontend.exporting`, step 8).

    Capture runs the module at fp32, so code written against the tensor's dtype
    (``torch.clamp(h, min=torch.finfo(h.dtype).min, max=torch.finfo(h.dtype).max)`` in DETR and T5, or
    ``masked_fill(mask, torch.finfo(dtype).min)``) records fp32's extremes, which a bf16 tensor cannot hold: a
    run under autocast fails with "value cannot be converted to type c10::BFloat16 without overflow" where
    the eager module, seeing bf16, used bf16's. bf16's extremes are what eager code computes at bf16, and at
    fp32 they differ from fp32's only for values beyond 3.39e38 (a clamp) or are equally -inf-like (a mask
    filled before a softmax), so the one program runs at both precisions.
    """
    changed = []

    def safe(value: Any) -> Any:
        if isinstance(value, float) and value in _FP32_EXTREMES:
            return _FP32_EXTREMES[value]
        return value

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = pytree.tree_map(safe, node.args)
        kwargs = pytree.tree_map(safe, node.kwargs)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed.append(node.name)
    if changed:
        log.info("torch.finfo(float32) extremes made bf16-safe at %d node(s): %s", len(changed), ", ".join(changed[:5]))
    return tuple(changed)


class Tracing:
    """What :func:`traced_at` yields: the inputs to export with, and :meth:`settle` for the exported graph."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        self.module, self.args, self.kwargs = module, args, kwargs
        self.faked = False

    def settle(self, gm: fx.GraphModule, data_attr: str) -> None:
        """After a trace on fake CPU tensors (a meta-device model at bf16): ``gm`` holds the module's own meta
        parameters and buffers again (by name; tied ones stay one tensor), a constant the trace made becomes a
        meta tensor of its shape (keeping the values recorded as ``data_attr``), and device literals say
        ``meta``, so the program is the one a meta-device capture makes and the run materializes as usual."""
        if not self.faked:
            return
        from torch._subclasses.fake_tensor import is_fake

        own = dict(itertools.chain(self.module.named_parameters(remove_duplicate=False),
                                   self.module.named_buffers(remove_duplicate=False)))
        made: dict[int, torch.Tensor] = {}
        for prefix, sub in gm.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                table = getattr(sub, kind)
                for name, t in list(table.items()):
                    if t is None or not is_fake(t):
                        continue
                    fqn = f"{prefix}.{name}" if prefix else name
                    if fqn in own:
                        table[name] = own[fqn]
                        continue
                    if id(t) not in made:
                        made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if getattr(t, data_attr, None) is not None:
                            setattr(made[id(t)], data_attr, getattr(t, data_attr))
                    table[name] = made[id(t)]
        retarget_devices(gm, torch.device("meta"))


@contextlib.contextmanager
def traced_at(module: nn.Module, args: tuple, kwargs: dict, precision: str):
    """Run the module's code at ``precision`` while export traces it (:mod:`graphpipe.frontend.exporting`, step 8).

    A bf16 run executes the program under ``torch.autocast``; code that reads a tensor's dtype
    (``torch.finfo(h.dtype).max`` in a clamp, a mask's ``finfo(dtype).min``, ``if h.dtype == torch.float16``)
    must see the dtypes autocast gives it, or the recorded program does what the eager module never does at
    bf16. Tracing under the same autocast records exactly that: autocast acts below the traced level, so the
    program holds no casts of its own and is replayed under autocast as the eager module runs. A model on the
    meta device (a run's capture: nothing is allocated) has no autocast, so it is traced on fake CPU tensors of
    the same shapes instead, and :meth:`Tracing.settle` puts its meta tensors back. Yields a :class:`Tracing`.
    """
    tracing = Tracing(module, args, kwargs)
    if precision == "fp32":
        yield tracing
        return
    if precision != "bf16":
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    state = list(itertools.chain(module.parameters(), module.buffers()))
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.device.type == "meta" for t in state + inputs):
        device = next((t.device.type for t in state + inputs), "cpu")
        with torch.autocast(device, dtype=torch.bfloat16):
            yield tracing
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = functools.partial(fake_cpu_copy, mode)
    with mode:
        swapped = swap_state(module, fake)
    try:
        with mode:
            tracing.args, tracing.kwargs = pytree.tree_map(fake, (args, kwargs))
        tracing.faked = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield tracing
    finally:
        restore_state(module, swapped)


def fake_cpu_copy(mode, t: Any) -> Any:
    """``t`` as a fake CPU tensor of the active fake ``mode``: a meta tensor becomes one of its shape and dtype
    (holding nothing), any other tensor its own fake; other values pass through. For what only CPU kernels
    decide (autocast's dtypes) on a model that lives on the meta device."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type == "meta":
        return mode.from_tensor(torch.empty(t.shape, dtype=t.dtype, device="meta")).to("cpu")
    return mode.from_tensor(t)


def swap_state(gm: nn.Module, convert) -> list[tuple[nn.Module, str, str, Any]]:
    """Replace every parameter and buffer of ``gm`` by ``convert(tensor)`` (parameters stay parameters)."""
    done: dict[int, Any] = {}
    swapped = []
    for module in gm.modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in done:
                    new = convert(t.detach())
                    done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if kind == "_parameters" else new
                swapped.append((module, kind, name, t))
                table[name] = done[id(t)]
    return swapped


def restore_state(gm: nn.Module, swapped) -> None:
    for module, kind, name, t in swapped:
        getattr(module, kind)[name] = t


def _leaf_name(path: tuple) -> str:
    """``flag`` for keyword input ``flag``, ``input 0`` for the first positional one, ``cfg['k']`` inside one."""
    where, first, *rest = path
    head = f"input {first.idx}" if where.idx == 0 else str(first.key)
    return head + "".join(str(k) for k in rest)



@contextlib.contextmanager
def keywords_bound(module: nn.Module, kwargs: Mapping[str, Any]):
    """While exporting: ``module.forward`` with every keyword input that would land in its ``**kwargs`` bound as
    a keyword parameter of its own (:mod:`graphpipe.frontend.exporting`, step 7).

    ``torch.export`` cannot take ``dynamic_shapes`` for a var-keyword argument (it fails with "Must provide a
    tree_name when there might be a mismatch"), and transformers 5 passes ``output_hidden_states``,
    ``num_items_in_batch`` and the like through ``**kwargs``. The instance's ``forward`` is replaced by a
    function with the same parameters plus those names (keyword-only) that calls the original; the module
    itself, its parameter names and module paths are untouched, and the attribute is removed afterwards.
    """
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        yield
        return
    params = list(sig.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        yield
        return
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    extra = [k for k in kwargs if k not in named]
    if not extra:
        yield
        return
    original = module.forward
    fixed = [p for p in params if p.kind is not p.VAR_KEYWORD]
    fixed += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in extra]

    def forward(*args: Any, **kw: Any) -> Any:
        return original(*args, **kw)

    forward.__signature__ = sig.replace(parameters=fixed)  # type: ignore[attr-defined]
    had = "forward" in module.__dict__
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = original
        else:
            del module.forward


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device) -> bool:
    """Rewrite device literals of ``gm``'s nodes captured on another device (``meta``, or ``cpu`` for a CUDA
    run) to ``device``, in place; returns whether anything changed.

    ``torch.arange(n, device=x.device)`` traced on meta inputs is recorded
    as ``arange(n, device=meta)``; run as is it would make meta tensors.
    """
    device = torch.device(device)
    stale = {"meta"} | ({"cpu"} if device.type != "cpu" else set())

    def fix(value):
        if isinstance(value, torch.device) and value.type in stale:
            return device
        if isinstance(value, str) and value in stale:
            return str(device)
        if isinstance(value, (tuple, list)):
            return type(value)(fix(v) for v in value)
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    changed = False
    for sub in gm.modules():  # a higher-order op's body (no_grad, autocast regions) is a graph of its own
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        changed_here = False
        for node in sub.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            kwargs = {k: fix(v) if k == "device" else v for k, v in node.kwargs.items()}
            args = tuple(fix(a) if isinstance(a, torch.device) else a for a in node.args)
            if kwargs != dict(node.kwargs) or args != tuple(node.args):
                node.kwargs, node.args = kwargs, args
                changed_here = True
        if changed_here:
            sub.recompile()
            changed = True
    return changed
