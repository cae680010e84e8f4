"""The model a job runs: built from a plan's ``model`` spec, captured, with its loss and synthetic data.

Every rank of ``graphpipe run`` (:mod:`graphpipe.runtime.worker`, the
``torch.distributed.pipelining`` baseline :mod:`graphpipe.runtime.baseline`,
the asynchronous stream :mod:`graphpipe.runtime.async_run`) and
``--check``'s single-process reference (:mod:`graphpipe.runtime.reference`)
build the same model from the same seed here, so they agree on its weights,
its op names and its data:

* :func:`load_runnable` (once per process, then deep copies) and
  :func:`build_runnable`, the model named by a zoo spec or ``file.py:factory``
  as a :class:`Runnable`: module, capture, loss, ``make_inputs``;
* :func:`data_seed`, the seed of step ``k``'s synthetic mini-batch;
* :func:`autocast`, the precision a step runs at;
* :func:`plan_granularity`, the capture granularity the plan was made at.

Example
-------
>>> data_seed(0, 2), data_seed(3, 2)
(2, 3002)
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch.utils._pytree import tree_leaves

import torch

from graphpipe.errors import PlanError, UserCodeError
from graphpipe.plan import Plan

__all__ = ["Runnable", "load_runnable", "build_runnable", "data_seed", "autocast", "plan_granularity"]

log = logging.getLogger(__name__)


def autocast(precision: str, device: torch.device | str):
    """``torch.autocast`` to bfloat16 for ``bf16``, a no-op context for ``fp32`` (a disabled ``torch.autocast``
    still costs its set-up on every step)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def data_seed(seed: int, step: int) -> int:
    return seed * 1000 + step


@dataclass(frozen=True, slots=True, eq=False)
class Runnable:
    """A model ready to split: the module, its capture, loss and data generator."""

    spec: str
    module: torch.nn.Module
    gm: torch.fx.GraphModule
    op_nodes: dict[str, tuple[str, ...]]
    op_names: tuple[str, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    """The loss of what ``gm`` returns (the model's outputs the loss reads, then the target)."""
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    """``make_inputs(batch_size, seed)``: ``gm``'s positional arguments (inputs, then the target's leaves)."""
    io: Any = None
    """The :class:`~graphpipe.frontend.exporting.IOSpec` of ``gm`` (None without capture)."""
    meta_params: bool = False
    """The module's parameters and buffers are on the meta device (:func:`~graphpipe.runtime.materialize.params_on_meta`):
    each rank materializes its own stages; ``make_inputs`` still makes real data."""
    initial: dict = field(default_factory=dict)
    """With ``meta_params``: the buffers' values as built, by name (:func:`~graphpipe.runtime.materialize.buffers_to_meta`)."""
    shipment: bytes | None = None
    """The capture as :func:`~graphpipe.runtime.shipping.pack` bytes, for the ranks a launcher starts (captures that
    a rank would make: on the CPU, parameters on meta; None otherwise, or where it cannot travel)."""

    def shape_inputs(self, batch_size: int, seed: int = 0) -> tuple:
        """``make_inputs``, on the meta device when the parameters are: for runs that only read shapes."""
        from graphpipe.runtime.materialize import meta_copy

        made = self.make_inputs(batch_size, seed)
        return meta_copy(made) if self.meta_params else made

    def output(self, graph_out: Any) -> Any:
        """The model's output structure from what ``gm`` (or the sink stage) returns."""
        return self.io.output(graph_out) if self.io is not None else graph_out


_PRISTINE: dict[tuple, Runnable] = {}
"""Captured runnables by (spec, seed, device, granularity, factory file stamp), as first built, never trained."""
_PRISTINE_MAX = 8

_SHIPPED: dict[tuple, bytes] = {}
"""Captures the launcher shipped to this rank (:func:`adopt_shipments`), by :func:`load_runnable`'s key."""


def _key(spec: str, seed: int, device: str, granularity: str | None, meta_params: bool,
         precision: str = "fp32") -> tuple:
    """:func:`load_runnable`'s cache key (an edited factory file is another key; each precision its own trace)."""
    return (spec, seed, device, granularity, _factory_stamp(spec), meta_params, precision)


def rank_key(spec: str, seed: int, granularity: str | None, precision: str = "fp32") -> tuple:
    """:func:`load_runnable`'s key for what a rank loads: on the CPU, parameters on meta (runtime/worker.py)."""
    return _key(spec, seed, "cpu", granularity, True, precision)


def shipments(wanted: Sequence[tuple[str, int, str | None, str]]) -> dict[tuple, bytes]:
    """The captures this process holds of the rank loads ``wanted`` (spec, seed, granularity, precision), packed for the
    ranks it is about to start: they rebuild them instead of capturing (:mod:`graphpipe.runtime.shipping`).
    Only what is already captured travels; the rest the ranks capture themselves."""
    out = {}
    for spec, seed, granularity, precision in wanted:
        key = rank_key(spec, seed, granularity, precision)
        pristine = _PRISTINE.get(key)
        if pristine is not None and pristine.shipment is not None:
            out[key] = pristine.shipment
    return out


def adopt_shipments(shipped: dict[tuple, bytes]) -> None:
    """In a rank: the launcher's captures, used by :func:`load_runnable` in place of capturing anew."""
    _SHIPPED.update(shipped)


def load_runnable(spec: str, seed: int = 0, device: str = "cpu", capture: bool = True,
                  granularity: str | None = None, meta_params: bool = False, precision: str = "fp32") -> Runnable:
    """:func:`build_runnable`, exported once per process: a rank running many jobs of one model (tests, evals,
    ``--check``'s reference) gets a deep copy of the first capture (weights as built from ``seed``), not a
    second export."""
    if not capture:
        return build_runnable(spec, seed, device, capture, granularity, meta_params)
    key = _key(spec, seed, device, granularity, meta_params, precision)
    if key not in _PRISTINE:
        if len(_PRISTINE) >= _PRISTINE_MAX:
            _PRISTINE.pop(next(iter(_PRISTINE)))
        _PRISTINE[key] = build_runnable(spec, seed, device, capture, granularity, meta_params, _SHIPPED.pop(key, None),
                                        precision)
    pristine = _PRISTINE[key]
    import copy

    module, gm = copy.deepcopy((pristine.module, pristine.gm))  # one memo: the copies share their tensors
    return Runnable(spec, module, gm, pristine.op_nodes, pristine.op_names, pristine.loss_fn, pristine.make_inputs,
                    pristine.io, pristine.meta_params, pristine.initial, pristine.shipment)


def _factory_stamp(spec: str) -> tuple:
    """A factory file's modification time and size (an edited file is captured anew)."""
    if ".py:" not in spec:
        return ()
    path = spec.rpartition(":")[0]
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_size)


def build_runnable(spec: str, seed: int = 0, device: str = "cpu", capture: bool = True,
                   granularity: str | None = None, meta_params: bool = False,
                   shipped: bytes | None = None, precision: str = "fp32") -> Runnable:
    """Build (and capture) the model named by a plan's ``model``: a zoo spec or ``file.py:factory``.

    The runnable graph takes the model's inputs flattened (keyword inputs in
    the factory's order), then the target's leaves when the loss takes one;
    ``loss_fn`` takes what the graph returns. Factory models get synthetic
    inputs shaped like their example inputs (floats ~ N(0, 1); integers and
    booleans the example's rows, resampled together) and targets made of the
    example target's own rows, resampled (:func:`_synthetic_inputs`), so a
    loss sees labels from its domain and token ids keep their structure.
    ``capture=False`` skips the export (the single-process reference needs
    only the module). ``meta_params``: the module is built with its
    parameters on the meta device (:func:`~graphpipe.runtime.materialize.params_on_meta`;
    a factory that builds on the meta device itself is accepted too) and
    captured on meta inputs; nothing of its weights is allocated until a
    rank materializes its stages. ``shipped``: the launcher's capture of this
    model (:mod:`~graphpipe.runtime.shipping`), rebuilt around the module
    built here instead of exporting it again (captured anyway where it does
    not fit). ``precision``: the run's, which the module's code is traced at
    (:func:`~graphpipe.frontend.export_inputs.traced_at`).
    """
    from graphpipe.frontend import capture as cap
    from graphpipe.runtime.materialize import buffers_to_meta, kept_values, meta_copy, on_meta, params_on_meta

    target, make_inputs = None, None
    building = params_on_meta() if meta_params else contextlib.nullcontext({})
    if ".py:" in spec:
        with torch.random.fork_rng(devices=[]), building as kept:
            torch.manual_seed(seed)
            made = cap.load_factory(spec)
        module, example, loss_fn, target = made.module, made.example_inputs, made.loss_fn, made.example_target
        if not meta_params and on_meta(module):
            raise PlanError(f"{spec} builds its model on the meta device: only a run that materializes each rank's "
                            "stages can use it (graphpipe run does; this path needs real weights)")
        if not meta_params:
            module = module.to(device)
    elif spec.endswith((".json", ".txt")) or os.path.sep in spec:
        raise PlanError(f"plan model {spec!r} is a graph file, which has no module to run; the runtime needs a zoo "
                        "spec (mmt:small) or path/to/file.py:factory — plan that instead")
    else:
        from graphpipe.frontend import zoo
        with building as kept:
            built = zoo.build(spec, device=device, seed=seed)
        module, example, loss_fn, make_inputs = built.module, built.example_inputs, built.loss_fn, built.make_inputs
    # no target is no leaf (torch's pytree counts None as one: the reference would call the module with it)
    target_leaves = tree_leaves(target) if target is not None else []
    initial = {**buffers_to_meta(module), **kept_values(module, kept)} if meta_params else {}
    if not capture:
        flat = tuple(tree_leaves(example)) + tuple(target_leaves)
        return Runnable(spec, module, None, {}, (), loss_fn,  # type: ignore[arg-type]
                        make_inputs or _synthetic_inputs(flat, device, len(target_leaves)), None, meta_params,
                        initial)
    shapes = meta_copy if meta_params else (lambda x: x)  # meta weights are captured on meta inputs
    if shipped is not None:
        from graphpipe.runtime.shipping import ShipMismatch, unpack

        try:
            gm, op_nodes, io = unpack(shipped, module)
        except ShipMismatch as exc:
            log.info("%s: capturing on this rank: %s", spec, exc)
        else:
            return _assemble(spec, module, gm, op_nodes, io, example, target, loss_fn, make_inputs, device,
                             meta_params, initial, shipped)
    try:
        exported, op_nodes, _ = cap.trace_ops(module, shapes(example), loss_fn, shapes(target),
                                              cap.Granularity.parse(granularity), precision=precision)
    except UserCodeError as exc:
        if not meta_params:
            raise
        # code that makes tensors of its own on the CPU (a generator of its own) cannot run on meta inputs:
        # every rank builds the whole model with real weights, as the eager path does
        log.warning("%s: cannot be captured on the meta device (%s); every rank builds "
                                            "the whole model", spec, exc)
        try:
            return build_runnable(spec, seed, device, capture, granularity, meta_params=False, precision=precision)
        except PlanError:  # the factory builds on meta itself: the capture's own error is the one to show
            raise exc from None
    shipment = None
    if device == "cpu" and meta_params:  # what ranks load: a launcher holding it ships it to them
        from graphpipe.runtime.shipping import pack

        try:
            shipment = pack(module, exported.gm, op_nodes, exported.io)
        except Exception as exc:  # noqa: BLE001 - an object that cannot travel: the ranks capture themselves
            log.info("%s: the capture cannot be shipped to ranks (%s: %s)", spec, type(exc).__name__, exc)
    from graphpipe.runtime.materialize import meta_nonzero

    with meta_nonzero():  # parameters on meta: the shape runs below meet a mask's nonzero there
        return _assemble(spec, module, exported.gm, op_nodes, exported.io, example, target, loss_fn, make_inputs,
                         device, meta_params, initial, shipment)


def _assemble(spec: str, module: torch.nn.Module, gm: torch.fx.GraphModule, op_nodes: dict, io: Any, example: Any,
              target: Any, loss_fn: Callable, make_inputs: Callable | None, device: str, meta_params: bool,
              initial: dict, shipment: bytes | None) -> Runnable:
    """The :class:`Runnable` of a capture (made here or shipped): its synthetic data, its graph instrumented."""
    from graphpipe.frontend import capture as cap
    from graphpipe.runtime.materialize import meta_copy
    from graphpipe.runtime.stage_modules import instrument

    shapes = meta_copy if meta_params else (lambda x: x)
    args, kwargs = cap.normalize_inputs(example)
    flat = io.flat_inputs(args, kwargs, target)
    num_targets = len(tree_leaves(target)) if target is not None else 0
    make_inputs = make_inputs or _synthetic_inputs(flat, device, num_targets)
    # the meta device (preflight) only cuts the model: no run to find random calls
    gm = instrument(gm, shapes(make_inputs(2, 0)) if device != "meta" else None)
    return Runnable(spec, module, gm, op_nodes, tuple(op_nodes), io.wrap_loss(loss_fn), make_inputs, io,
                    meta_params, initial, shipment)


def plan_granularity(plan: Plan) -> str | None:
    """The ``--granularity`` the plan's model was captured at (None: the default)."""
    return plan.search.get("granularity") if plan.search else None


def _synthetic_inputs(example: Sequence[torch.Tensor], device: str, num_targets: int = 0):
    """``make_inputs(batch_size, seed)``: fresh tensors shaped like ``example`` (flat), drawn from ``seed``.

    The last ``num_targets`` leaves are the loss's target: their rows are the
    example target's own, drawn with replacement, so a BCE label stays in
    [0, 1], a class index stays a valid class and a regression target keeps
    its scale (random normals there made a recommender's BCE loss negative).
    Floating inputs are drawn afresh (N(0, 1)). Integer and boolean inputs
    are the example's rows, drawn with replacement, the same rows for all of
    them: token ids keep a vision-language model's image placeholders where
    the model puts its image features (one per feature, in every row), and
    inputs that go together (ids, attention masks, token types) stay
    consistent (uniform draws scattered placeholders at random). One whose
    example is on the meta device has no values to resample and is zeros.
    """
    first_target = len(example) - num_targets

    def resamplable(x) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 0 and x.device.type != "meta"

    rows_of = [x.shape[0] for i, x in enumerate(example) if i < first_target and resamplable(x)
               and not x.dtype.is_floating_point]

    def make_inputs(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        shared = torch.randint(0, min(rows_of), (batch_size,), generator=gen) if rows_of else None
        out = []
        for i, x in enumerate(example):
            if not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            shape = (batch_size, *x.shape[1:])
            if i >= first_target and resamplable(x):
                rows = torch.randint(0, x.shape[0], (batch_size,), generator=gen)
                out.append(x.detach().cpu()[rows].to(device))
            elif x.dtype.is_floating_point:
                out.append(torch.randn(shape, generator=gen, dtype=x.dtype).to(device))
            elif resamplable(x):  # integers and booleans: the example's rows, the same for every such input
                out.append(x.detach().cpu()[shared].to(device))
            else:
                out.append(torch.zeros(shape, dtype=x.dtype, device=device))
        return tuple(out)

    return make_inputs
