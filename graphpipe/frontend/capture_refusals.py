"""Refusals of models whose exported graph cannot run at every micro-batch size or be cut into stages.

Each names where the model's code does it, in one line, instead of torch's
message (which names a symbol or no line at all):

* :class:`BatchFixedAt` watches export's shape log for the guard that fixes
  the batch to the example's size (a Python list of the batch's rows, as
  LLaVA makes of its image features) and keeps that source line;
* :func:`refuse_vmap` refuses a graph that runs ``torch.vmap``;
* :class:`CustomBackwards` watches ``torch.autograd.Function.apply`` while
  exporting: export records a custom Function's forward as plain ops and
  drops its ``backward``, so one whose backward is not its forward's
  derivative (a straight-through estimator) would silently train with other
  gradients (and ``--check``, whose reference runs the same captured graph,
  could not see it).
* :func:`meta_value_error` names the op that reads a tensor's value on the
  meta device, where there is none (JetMoE's tokens per expert).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import re
import traceback
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from graphpipe.errors import UserCodeError, library_frame

__all__ = ["BatchFixedAt", "BatchFixedError", "CustomBackwards", "MetaValueError", "meta_value_error", "refuse_vmap"]

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class BatchFixedAt(logging.Handler):
    """While exporting, where the model's code first fixed a batch symbol to the example's batch size.

    torch's shape environment logs each guard it adds; ``Eq(s3, 8)`` on a dim 0
    symbol is the batch becoming a constant (a Python list of the batch's rows,
    a loop over them). The handler keeps the source line of the first such guard
    (the deepest frame outside torch, graphpipe and the standard library), so the
    refusal can name it instead of torch's "Constraints violated".
    """

    _LOGGER = "torch.fx.experimental.symbolic_shapes"

    def __init__(self, batch: int):
        super().__init__(logging.INFO)
        self._guard = re.compile(rf"^Eq\((?:s\d+, {batch}|{batch}, s\d+)\)$")
        self.where: tuple[str, int, str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.where is not None or "[guard added]" not in str(record.msg) or len(record.args or ()) < 2:
            return
        if not self._guard.match(str(record.args[1])):
            return
        frame = library_frame(traceback.extract_stack(), (_TORCH,))
        if frame is not None:
            self.where = (frame.filename, frame.lineno or 0, (frame.line or "").strip())

    @contextlib.contextmanager
    def watching(self):
        """Be torch's shape logger's only handler, at INFO, for the duration (it prints nothing then)."""
        logger = logging.getLogger(self._LOGGER)
        saved = logger.level, logger.propagate, logger.handlers[:]
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.handlers[:] = [self]
        try:
            yield self
        finally:
            logger.handlers[:] = saved[2]
            logger.setLevel(saved[0])
            logger.propagate = saved[1]


class BatchFixedError(Exception):
    """Export fixed the batch at a known source line (``BatchFixedAt.where``); the message says so."""

    def __init__(self, where: tuple[str, int, str], batch: int):
        self.where = where
        code = f"`{where[2]}` " if where[2] else ""
        super().__init__(f"{code}fixes the batch to the example's {batch} (a Python list or loop as long as the "
                         "batch, or a shape read from data), so no graph runs at other micro-batch sizes")


def refuse_vmap(gm: fx.GraphModule, module: nn.Module, path_of: Callable[[fx.Node], str | None]) -> None:
    """Refuse a graph that runs ``torch.vmap``, naming the module that calls it (``path_of(node)``: the path of
    the innermost module a node of ``gm`` was traced in, or ``None``).

    Export records vmap as calls entering and leaving a batching level, with
    no data edge to the batched ops between them: nothing can cut such a
    region into stages or copy it into the ops reading it, and fx's dead-code
    pass drops the calls (the graph then fails when run). Gemma-3 builds its
    image-token attention mask this way when given ``token_type_ids``.
    """
    node = next((n for n in gm.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "__name__", "") == "_vmap_increment_nesting"), None)
    if node is None:
        return
    path = path_of(node)
    where, inside = "", f" in {type(module).__name__}.forward"
    if path is not None:
        try:
            typ = type(module.get_submodule(path))
            where = f"{inspect.getsourcefile(typ)}: "
        except (AttributeError, TypeError):
            typ = None
        inside = f" inside {path}" + (f" ({typ.__name__})" if typ is not None else "")
    raise UserCodeError(f"{where}torch.export cannot capture {type(module).__name__}: torch.vmap runs{inside}, "
                        "and its batching levels have no data edges, so the graph cannot be cut into stages")


class CustomBackwards:
    """While exporting, the custom ``torch.autograd.Function`` calls whose ``backward`` differs from their forward's
    derivative (module docstring), each with the source line that applied it.

    Each call of a Function defined outside torch is probed once per class, outside export's tracing, on random
    inputs of the call's shapes: the Function's own ``backward`` against autograd through its ``forward``. One
    whose probe cannot run is captured with a warning naming it: its gradient is unconfirmed, not known wrong.
    Bloom's GeLU (a hand-written derivative of its tanh approximation) keeps its gradient and passes.
    """

    def __init__(self) -> None:
        self.found: list[tuple[type, str]] = []
        self._probed: set[type] = set()

    def refusal(self, module: nn.Module) -> UserCodeError | None:
        """The one-line error for the first differing Function, or None."""
        if not self.found:
            return None
        cls, where = self.found[0]
        return UserCodeError(f"{where}torch.export cannot capture {type(module).__name__}: the custom "
                             f"autograd.Function {cls.__qualname__} has a backward that is not its forward's "
                             "derivative, and export keeps only the forward's ops (its gradient would be autograd's through them); "
                             "write that gradient with tensor ops instead (a straight-through estimator: "
                             "x + (f(x) - x).detach())")

    @contextlib.contextmanager
    def watching(self):
        function = torch.autograd.Function
        original = function.__dict__["apply"]
        watch = self

        def apply(cls, *args, **kwargs):
            if cls not in watch._probed and not cls.__module__.startswith(("torch.", "graphpipe.")):
                same = _same_gradient(cls, args, kwargs, original.__func__)
                if same is not None:  # a call with nothing to differentiate (on the data) leaves it unprobed
                    watch._probed.add(cls)
                if same is False or isinstance(same, Exception):
                    frame = library_frame(traceback.extract_stack()[:-1], (_TORCH,))
                    where = f"{frame.filename}:{frame.lineno}: " if frame is not None else ""
                    if same is False:
                        watch.found.append((cls, where))
                    else:  # unconfirmed, not known wrong: captured, and the user told what export keeps
                        logging.getLogger("graphpipe.frontend.capture").warning(
                            "%scould not compare the custom autograd.Function %s's backward with its forward's "
                            "derivative on random inputs (%s: %s); export keeps only its forward's ops, so the "
                            "pipeline's gradient through it is autograd's through them", where, cls.__qualname__,
                            type(same).__name__, str(same).splitlines()[0] if str(same) else "")
            return original.__func__(cls, *args, **kwargs)

        function.apply = classmethod(apply)
        try:
            yield self
        finally:
            function.apply = original


class _Ctx:
    """A stand-in for a Function's context when its forward runs as plain autograd ops."""

    needs_input_grad: tuple = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *args):
        pass

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass


PROBE_FLOAT64_ELEMENTS = 1 << 22
"""Elements of a custom Function's widest input (at 2 rows of the batch) up to which its gradient probe runs in
float64 (32 MB a tensor); past it, float32 (:func:`_same_gradient`)."""


def _same_gradient(cls: type, args: tuple, kwargs: dict, apply: Callable) -> bool | Exception | None:
    """Whether ``cls``'s backward (through ``apply``, torch's own ``Function.apply``) equals autograd through its
    forward on random inputs of ``args``' shapes (None: no input or output of this call needs a gradient; the
    exception where the forward does not run on such inputs, or autograd cannot go through it)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def shape_of(value):
        # a symbolic size (the batch) at 2 rows, where a reduction over rows (a sum taken for a mean) shows
        return [min(int(s.node.hint), 2) if isinstance(s, torch.SymInt) else int(s) for s in value.shape]

    def real(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.dtype.is_floating_point:
            return torch.randn(shape_of(value), generator=gen, dtype=dtype).requires_grad_(value.requires_grad)
        return torch.zeros(shape_of(value), dtype=value.dtype)

    try:
        # float64 unless an input is wide: a paper-size layer's probe holds several of its activations at once
        # (Bloom-176B's GeLU backward: 1.3 GB in float64), so past PROBE_FLOAT64_ELEMENTS it runs in float32, its
        # tolerance widened to float32's rounding
        widest = max((math.prod(shape_of(a)) for a in args if isinstance(a, torch.Tensor)), default=0)
        dtype, rtol, atol = ((torch.float64, 1e-4, 1e-6) if widest <= PROBE_FLOAT64_ELEMENTS
                             else (torch.float32, 1e-3, 1e-5))
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.enable_grad():
            gen = torch.Generator().manual_seed(0)
            xs = [real(a) for a in args]
            wrt = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            if not wrt:
                return None
            # one autograd graph alive at a time (the Function's, then its forward's as plain ops): a paper-size
            # layer's activations at these shapes are tens of MB each (Bloom-176B's GeLU: 59 MB in float32)
            def run(forward):
                out = forward()
                out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                return out, [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.requires_grad]

            def grads_of(out, idx):
                return torch.autograd.grad([out[i] for i in idx], wrt, [grads[i] for i in idx], allow_unused=True)

            ours, mine = run(lambda: apply(cls, *xs, **kwargs))
            if not mine:
                return None
            grads = {i: torch.randn(ours[i].shape, generator=gen, dtype=ours[i].dtype) for i in mine}
            g_ours = grads_of(ours, mine)
            del ours
            theirs, plain = run(lambda: cls.forward(_Ctx(), *xs, **kwargs))
            pairs = [i for i in mine if i in plain]
            if not pairs:
                return None
            g_theirs = grads_of(theirs, pairs)
            if pairs != mine:  # outputs only the Function differentiates: compare over the common ones
                del theirs
                g_ours = grads_of(run(lambda: apply(cls, *xs, **kwargs))[0], pairs)
        return all((a is None and b is None) or (a is not None and b is not None
                                                 and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
                   or (a is None and b is not None and not b.any()) or (b is None and a is not None and not a.any())
                   for a, b in zip(g_ours, g_theirs))
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on random inputs: its gradient is unconfirmed
        return exc


class MetaValueError(UserCodeError):
    """A model on the meta device reads a tensor's value: refused whatever the depth it is captured at."""


_VALUE_OPS = ("_local_scalar_dense", "item", "nonzero", "tolist")
"""Ops of an exported graph that read a tensor's values (a data-dependent shape or a Python number)."""


def meta_value_error(exc: BaseException, gm: fx.GraphModule) -> MetaValueError | None:
    """The one-line refusal when running ``gm`` on the meta device failed because an op reads a tensor's value.

    A model built on the meta device has shapes but no values, so an op
    whose output shape depends on data (``.item()`` or ``.tolist()`` of the
    tokens routed to each expert, as JetMoE's experts split their inputs) has
    nothing to run on. None when ``exc`` is another failure. The message
    names the op's source line when export kept it.
    """
    if "meta tensor" not in str(exc):
        return None
    node = next((n for n in gm.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "__name__", "").split(".")[0] in _VALUE_OPS), None)
    where = ""
    if node is not None:
        trace = (node.meta.get("stack_trace") or "").strip().splitlines()
        files = [line.strip() for line in trace if line.strip().startswith("File ")]
        if files:
            where = f"{files[-1].split(', in ')[0][5:]}: "
    op = str(node.target) if node is not None else "an op"
    return MetaValueError(f"{where}the forward reads a tensor's value ({op}: a shape that depends on the data, such "
                         "as tokens per expert), which a model on the meta device does not have; build the model "
                         "and its example inputs on the CPU (real tensors) to capture it")
