"""What the capture does to a module's inputs and constants so one traced program serves every run
(:mod:`graphpipe.frontend.exporting`, steps 6-8 of its docstring).

* :func:`fold_constant_inputs`: non-tensor inputs (``output_hidden_states=True``, an int, a string, ``None``)
  become part of the program instead of graph inputs;
* :func:`keywords_bound`: keyword inputs that reach ``forward`` only through ``**kwargs`` (transformers 5)
  are bound as named parameters while exporting;
* :func:`bf16_safe_constants`: ``torch.finfo(float32)`` extremes a module took from a tensor's dtype are
  replaced by bf16's, so the fp32-traced program runs under bf16 autocast too.

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
import inspect
import logging
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["same_constant", "fold_constant_inputs", "keywords_bound", "bf16_safe_constants"]

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
