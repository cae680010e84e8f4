"""What every job shares, whichever executor runs it: options, the model, data, the reference, the figures.

Both the graphpipe executor (:mod:`graphpipe.runtime.worker`) and the
``torch.distributed.pipelining`` baseline (:mod:`graphpipe.runtime.baseline`)
import these, so the two runtimes are measured and checked the same way:

* :class:`RunOptions`, the settings of one job (``graphpipe run``'s flags; defined in
  :mod:`graphpipe.runtime.options`, which imports no torch);
* :func:`load_runnable`, the model named by a plan's ``model`` with its
  capture, loss and synthetic data (:func:`data_seed` seeds step ``k``);
* :func:`reference_run` (and the plain :func:`reference_step`) and
  :func:`compare_gradients`, the single-process run ``--check`` compares with;
* :func:`finish_job`, which gathers every rank's figures on rank 0.

What ``--check`` compares (docs/semantics.md). The reference is one process running
the whole mini-batch of every step through the captured model, with the
*same training semantics* as the pipeline, for as many steps as the run
(SGD with the run's learning rate in between):

* dropout masks from the same per-(seed, step, op, shard) generators
  (:mod:`graphpipe.runtime.rng`): the reference cuts each dropout's input at
  the pipeline's shard boundaries of that op's stage;
* BatchNorm per micro-batch or synchronised across a stage's replicas, as
  ``--batchnorm`` says (:mod:`graphpipe.runtime.batchnorm`): the reference
  normalises the same groups of rows and defers running statistics the same way;
* tied parameters: one parameter in the reference, copies in the pipeline
  whose gradients are summed; every copy is compared with the reference.

After every step each rank compares, with ``|a - b| <= atol + rtol*|b|``
(fp32 defaults of ``torch.testing.assert_close``), the step's loss, the
gradient of every parameter it hosts and every buffer (running statistics)
after the step's commit. A second comparison, with *full-batch* training
(BatchNorm over the whole mini-batch, one dropout draw per op), is reported
in ``check.full_batch`` and never asserted: with micro-batches smaller than
the mini-batch the two are different training algorithms.

Example
-------
>>> options = RunOptions(steps=3, check=True)
>>> options.warmup_steps, data_seed(options.seed, 2)
(1, 2)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from torch.utils._pytree import tree_leaves

import torch
import torch.distributed as dist

from graphpipe.errors import PlanError, UserCodeError
from graphpipe.plan import Plan
from graphpipe.runtime.numerics import SPREAD_FACTOR, allowed, float64_graph, rows_as_the_pipeline, spread
from graphpipe.runtime.options import CHECK_ATOL, CHECK_RTOL, FaultInjection, RunOptions, fault_from_env

__all__ = ["RunOptions", "FaultInjection", "fault_from_env", "Runnable", "load_runnable", "data_seed",
           "build_runnable", "plan_granularity", "Reference", "reference_run", "reference_layout", "reference_step", "compare_gradients", "compare_buffers",
           "finish_job", "CHECK_RTOL", "CHECK_ATOL"]

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
    """The :class:`~graphpipe.exporting.IOSpec` of ``gm`` (None without capture)."""
    meta_params: bool = False
    """The module's parameters and buffers are on the meta device (:func:`~graphpipe.runtime.materialize.params_on_meta`):
    each rank materializes its own stages; ``make_inputs`` still makes real data."""
    initial: dict = field(default_factory=dict)
    """With ``meta_params``: the buffers' values as built, by name (:func:`~graphpipe.runtime.materialize.buffers_to_meta`)."""

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


def load_runnable(spec: str, seed: int = 0, device: str = "cpu", capture: bool = True,
                  granularity: str | None = None, meta_params: bool = False) -> Runnable:
    """:func:`build_runnable`, exported once per process: a rank running many jobs of one model (tests, evals,
    ``--check``'s reference) gets a deep copy of the first capture (weights as built from ``seed``), not a
    second export."""
    if not capture:
        return build_runnable(spec, seed, device, capture, granularity, meta_params)
    key = (spec, seed, device, granularity, _factory_stamp(spec), meta_params)
    if key not in _PRISTINE:
        if len(_PRISTINE) >= _PRISTINE_MAX:
            _PRISTINE.pop(next(iter(_PRISTINE)))
        _PRISTINE[key] = build_runnable(spec, seed, device, capture, granularity, meta_params)
    pristine = _PRISTINE[key]
    import copy

    module, gm = copy.deepcopy((pristine.module, pristine.gm))  # one memo: the copies share their tensors
    return Runnable(spec, module, gm, pristine.op_nodes, pristine.op_names, pristine.loss_fn, pristine.make_inputs,
                    pristine.io, pristine.meta_params, pristine.initial)


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
                   granularity: str | None = None, meta_params: bool = False) -> Runnable:
    """Build (and capture) the model named by a plan's ``model``: a zoo spec or ``file.py:factory``.

    The runnable graph takes the model's inputs flattened (keyword inputs in
    the factory's order), then the target's leaves when the loss takes one;
    ``loss_fn`` takes what the graph returns. Factory models get synthetic
    inputs shaped like their example inputs (floats ~ N(0, 1), integers
    uniform in ``[min, max]`` of the example, booleans as in the example's
    range) and targets made of the example target's own rows, resampled
    (:func:`_synthetic_inputs`), so a loss sees labels from its domain.
    ``capture=False`` skips the export (the single-process reference needs
    only the module). ``meta_params``: the module is built with its
    parameters on the meta device (:func:`~graphpipe.runtime.materialize.params_on_meta`;
    a factory that builds on the meta device itself is accepted too) and
    captured on meta inputs; nothing of its weights is allocated until a
    rank materializes its stages.
    """
    from graphpipe import capture as cap
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
        from graphpipe import zoo

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
    from graphpipe.runtime.stage_modules import instrument

    shapes = meta_copy if meta_params else (lambda x: x)  # meta weights are captured on meta inputs
    try:
        exported, op_nodes, _ = cap.trace_ops(module, shapes(example), loss_fn, shapes(target),
                                              cap.Granularity.parse(granularity))
    except UserCodeError as exc:
        if not meta_params:
            raise
        # code that makes tensors of its own on the CPU (a generator of its own) cannot run on meta inputs:
        # every rank builds the whole model with real weights, as the eager path does
        logging.getLogger(__name__).warning("%s: cannot be captured on the meta device (%s); every rank builds "
                                            "the whole model", spec, exc)
        try:
            return build_runnable(spec, seed, device, capture, granularity, meta_params=False)
        except PlanError:  # the factory builds on meta itself: the capture's own error is the one to show
            raise exc from None
    args, kwargs = cap.normalize_inputs(example)
    flat = exported.io.flat_inputs(args, kwargs, target)
    make_inputs = make_inputs or _synthetic_inputs(flat, device, len(target_leaves))
    gm = exported.gm
    # the meta device (preflight) only cuts the model: no run to find random calls
    gm = instrument(gm, shapes(make_inputs(2, 0)) if device != "meta" else None)
    return Runnable(spec, module, gm, op_nodes, tuple(op_nodes), exported.io.wrap_loss(loss_fn), make_inputs, exported.io,
                    meta_params, initial)


def plan_granularity(plan: Plan) -> str | None:
    """The ``--granularity`` the plan's model was captured at (None: the default)."""
    return plan.search.get("granularity") if plan.search else None


def _synthetic_inputs(example: Sequence[torch.Tensor], device: str, num_targets: int = 0):
    """``make_inputs(batch_size, seed)``: fresh tensors shaped like ``example`` (flat), drawn from ``seed``.

    The last ``num_targets`` leaves are the loss's target: their rows are the
    example target's own, drawn with replacement, so a BCE label stays in
    [0, 1], a class index stays a valid class and a regression target keeps
    its scale (random normals there made a recommender's BCE loss negative).
    Inputs are drawn afresh (floats ~ N(0, 1), integers and booleans within
    the example's range). A target on the meta device, or one with no batch
    dimension, cannot be resampled and is drawn like an input.
    """
    lows = [int(x.min().item()) if isinstance(x, torch.Tensor) and x.numel() and not x.dtype.is_floating_point
            and x.device.type != "meta" else 0 for x in example]
    highs = [int(x.max().item()) if isinstance(x, torch.Tensor) and x.numel() and not x.dtype.is_floating_point
             and x.device.type != "meta" else 0 for x in example]
    first_target = len(example) - num_targets

    def resamplable(i: int, x) -> bool:
        return (i >= first_target and isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 0
                and x.device.type != "meta")

    def make_inputs(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i, (x, lo, hi) in enumerate(zip(example, lows, highs)):
            if not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            shape = (batch_size, *x.shape[1:])
            if resamplable(i, x):
                rows = torch.randint(0, x.shape[0], (batch_size,), generator=gen)
                out.append(x.detach().cpu()[rows].to(device))
            elif x.dtype.is_floating_point:
                out.append(torch.randn(shape, generator=gen, dtype=x.dtype).to(device))
            elif x.dtype == torch.bool:
                out.append(torch.randint(lo, hi + 1, shape, generator=gen).bool().to(device))
            else:  # integers: uniform in the example's [0 or min, max]; a constant input stays constant
                low = lo if lo == hi else min(lo, 0)
                out.append(torch.randint(low, hi + 1, shape, generator=gen, dtype=x.dtype).to(device))
        return tuple(out)

    return make_inputs


@dataclass(frozen=True, slots=True, eq=False)
class Reference:
    """What the single-process run produced, per step: loss, gradients (by model name), buffers after the step."""

    losses: tuple[float, ...]
    grads: tuple[dict[str, torch.Tensor], ...]
    buffers: tuple[dict[str, torch.Tensor], ...]
    unbatched: tuple[str, ...] = ()
    """Stochastic or BatchNorm ops whose input had no batch dimension (their draws cannot match the pipeline's)."""
    meta_params: bool = False
    """Weights materialized per tensor name (:mod:`graphpipe.runtime.materialize`), as the run's ranks do."""
    grad_spread: tuple[dict[str, float], ...] = ()
    """Per step, per parameter: the largest ``|fp32 - fp64|`` of the reference's gradient (empty: not measured);
    widens the comparison's tolerance (:mod:`graphpipe.runtime.numerics`)."""
    buffer_spread: tuple[dict[str, float], ...] = ()
    loss_spread: tuple[float, ...] = ()

    @property
    def num_params(self) -> int:
        return len(self.grads[0]) if self.grads else 0

    def spread_at(self, step: int) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """``(gradient spreads, buffer spreads)`` of step ``step`` (None where not measured)."""
        if not self.grad_spread:
            return None, None
        return self.grad_spread[step], self.buffer_spread[step]


def reference_layout(plan: Plan, node_stages: dict[str, int], batchnorm: str) -> dict[str, dict[str, int]]:
    """Rows per call of every context-taking op and row kernel in the pipeline: ``{op: {"dropout": n, "batchnorm": n}}``.

    A stage replica holds ``micro_batch_size / replicas`` rows; synchronised
    BatchNorm normalises the whole micro-batch.
    """
    layout = {}
    for node, stage_id in node_stages.items():
        stage = plan.stage_graph.stages[stage_id]
        shard = int(stage.samples_per_replica)  # round-robin replicas hold whole micro-batches
        layout[node] = {"dropout": shard, "batchnorm": stage.micro_batch_size if batchnorm == "sync" else shard}
    return layout


def reference_run(spec: str, seed: int, batch_size: int, layout: dict[str, dict[str, int]], steps: int, lr: float,
                  device: str = "cpu", granularity: str | None = None, precision: str = "fp32",
                  meta_params: bool = False, with_spread: bool = False, float64: bool = False) -> Reference:
    """``steps`` SGD steps of a fresh copy of the model on one process with the pipeline's semantics.

    ``layout`` (:func:`reference_layout`) says at which rows every dropout
    and BatchNorm call is cut; an empty layout is full-batch training. Step
    ``k`` reads ``make_inputs(batch_size, data_seed(seed, k))`` like the
    pipeline. ``meta_params``: the weights are those every rank materializes
    (:func:`~graphpipe.runtime.materialize.materialize_stages`, all stages here).
    ``float64``: the whole run in float64; ``with_spread`` (fp32): that run
    too, and the reference's own fp32-vs-fp64 spread per step
    (:mod:`graphpipe.runtime.numerics`).
    """
    from graphpipe.runtime.batchnorm import sharded_batchnorms
    from graphpipe.runtime.rng import ReferenceContext, ShardContext

    ref = load_runnable(spec, seed, device, granularity=granularity, meta_params=meta_params)
    _materialize_whole(ref, ref.gm, device, seed)
    gm = float64_graph(ref.gm) if float64 else ref.gm
    rows = uniform_rows(layout, batch_size)
    if rows is None and layout:
        rows_as_the_pipeline(gm, layout, batch_size)
    gm.train()
    params = dict(gm.named_parameters())
    optimizer = torch.optim.SGD(list(params.values()), lr=lr)
    losses, grads, buffers, unbatched = [], [], [], set()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        inputs = ref.make_inputs(batch_size, data_seed(seed, step))
        if float64:
            inputs = tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
        with autocast(precision, device):  # one region per step, as the run: the weight copies are cast anew
            if rows is None:
                ctx = ReferenceContext(seed, step, batch_size, layout)
                loss = ref.loss_fn(gm(*inputs, ctx))
                loss.backward()
                unbatched.update(ctx.unbatched)
            else:  # gradient accumulation over the pipeline's own shards, in order
                loss = 0.0
                for lo in range(0, batch_size, rows):
                    ctx = ShardContext(seed, step, lo, rows, lo, rows)
                    part = tuple(x[lo:lo + rows] if _batched(x, batch_size) else x for x in inputs)
                    term = ref.loss_fn(gm(*part, ctx)) * (rows / batch_size)
                    term.backward()
                    loss = loss + term.detach()
                    unbatched.update(ctx.unbatched)
        for bn in sharded_batchnorms(gm):
            bn.commit()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
        buffers.append({n: b.detach().clone() for n, b in gm.named_buffers()})
        optimizer.step()
    ref32 = Reference(tuple(losses), tuple(grads), tuple(buffers), tuple(sorted(unbatched)), meta_params)
    if not with_spread or precision != "fp32":
        return ref32
    try:
        ref64 = reference_run(spec, seed, batch_size, layout, steps, lr, device, granularity, float64=True,
                              meta_params=meta_params)
    except Exception as exc:  # noqa: BLE001 - a model that cannot run in float64 is checked at the fixed tolerance
        log.warning("%s: the float64 reference failed (%s: %s); --check uses the fixed fp32 tolerance",
                    spec, type(exc).__name__, exc)
        return ref32
    return replace(ref32, grad_spread=tuple(spread(a, b) for a, b in zip(ref32.grads, ref64.grads)),
                   buffer_spread=tuple(spread(a, b) for a, b in zip(ref32.buffers, ref64.buffers)),
                   loss_spread=tuple(abs(a - b) for a, b in zip(ref32.losses, ref64.losses)))


def uniform_rows(layout: dict[str, dict[str, int]], batch_size: int) -> int | None:
    """The rows every call of every op holds in the pipeline when that is one number below the batch, else None.

    Then the reference runs shard by shard and accumulates gradients, as
    the pipeline does: every op sees the rows, and the kernels the shapes,
    of its pipelined call, so fp32 rounding (and a ReLU or max-pool decision
    it tips) matches the run's. Plans with several shard sizes (gpp's
    per-stage micro-batches, synchronised BatchNorm) keep the whole-batch
    reference cut per op (:class:`~graphpipe.runtime.rng.ReferenceContext`).
    """
    sizes = {n for kinds in layout.values() for n in kinds.values()}
    if len(sizes) != 1:
        return None
    (rows,) = sizes
    return rows if 0 < rows < batch_size and batch_size % rows == 0 else None


def _batched(x: Any, batch_size: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch_size


def _materialize_whole(ref: Runnable, module: torch.nn.Module, device: str, seed: int) -> None:
    """Every tensor of ``module`` (``ref``'s graph or module) materialized as the run's ranks materialize their
    stages' (nothing to do for a runnable built with real weights)."""
    if not ref.meta_params:
        return
    from types import SimpleNamespace

    from graphpipe.runtime.materialize import materialize_stages

    whole = SimpleNamespace(module=module, param_names={}, segments=(), assemble=None)
    materialize_stages(ref.module, {0: whole}, torch.device(device), seed, ref.initial)


def reference_step(spec: str, seed: int, batch_size: int, step_seed: int, device: str,
                   granularity: str | None = None, meta_params: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients of a fresh copy of the model on the whole mini-batch (PyTorch's semantics).

    The torch.distributed.pipelining baseline's reference; ours is
    :func:`reference_run`. The eager module runs on the data the graph runs
    on, its keyword inputs by name and the target to the loss
    (:meth:`~graphpipe.exporting.IOSpec.unflatten_inputs`). ``meta_params``:
    the weights every rank materializes (:func:`reference_run`'s).
    """
    ref = load_runnable(spec, seed, device, granularity=granularity, meta_params=meta_params)
    _materialize_whole(ref, ref.module, device, seed)
    args, kwargs, target = ref.io.unflatten_inputs(ref.make_inputs(batch_size, step_seed))
    loss = ref.loss_fn(ref.io.graph_output(ref.module(*args, **kwargs), target))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.module.named_parameters() if p.grad is not None}


def compare_buffers(named_buffers, ref_buffers: dict[str, torch.Tensor], options: RunOptions,
                    spreads: dict[str, float] | None = None) -> tuple[float, int, int]:
    """``(max |a - b|, elements outside tolerance, buffers counted)``; ``named_buffers`` yields ``(name, buffer, counted)``.

    ``spreads``: the reference's fp32-vs-fp64 spread per buffer, which widens its tolerance
    (:func:`~graphpipe.runtime.numerics.allowed`)."""
    max_abs, mismatches, count = 0.0, 0, 0
    for name, b, counted in named_buffers:
        if name not in ref_buffers:
            raise PlanError(f"--check: buffer {name!r} is not a buffer of the single-process model")
        ref = ref_buffers[name].to(b.device)
        diff = (b.double() - ref.double()).abs()
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        mismatches += int((diff > allowed(ref.double(), options.atol, options.rtol, (spreads or {}).get(name, 0.0))).sum())
        count += int(counted)
    return max_abs, mismatches, count


def compare_gradients(named_params, ref_grads: dict[str, torch.Tensor], options: RunOptions,
                      spreads: dict[str, float] | None = None) -> tuple[float, int, int]:
    """``(max |a - b|, elements outside atol + rtol*|b|, parameters counted)`` against the reference.

    ``named_params`` yields ``(name, parameter, counted)``; ``name`` is the
    parameter's name in the whole model. Frozen parameters (``requires_grad=False``)
    are not compared or counted: they must have no gradient. ``spreads``: the
    reference's fp32-vs-fp64 spread per parameter, which widens its tolerance.
    """
    max_abs, mismatches, count = 0.0, 0, 0
    for name, p, counted in named_params:
        if not p.requires_grad:  # frozen: it must stay without a gradient, and the reference has none either
            if p.grad is not None and bool(p.grad.ne(0).any()):
                raise PlanError(f"--check: frozen parameter {name!r} got a gradient in the pipelined run")
            continue
        if name not in ref_grads:
            raise PlanError(f"--check: parameter {name!r} has no gradient in the single-process run")
        if p.grad is None:
            raise PlanError(f"--check: parameter {name!r} got no gradient in the pipelined run")
        ref = ref_grads[name].to(p.grad.device)
        diff = (p.grad - ref).abs()
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        mismatches += int((diff > allowed(ref, options.atol, options.rtol, (spreads or {}).get(name, 0.0))).sum())
        count += int(counted)
    return max_abs, mismatches, count


def finish_job(rank: int, world_size: int, plan: Plan, options: RunOptions, step_times: Sequence[float],
               step_losses: Sequence[float], check_stats: tuple[float, int, int], reference, records: Sequence,
               backend: str, extra: dict | None = None, starts: Sequence[float] | None = None,
               control=None) -> dict[str, Any] | None:
    """Combine every rank's figures on rank 0 (collective: every rank calls it).

    Records are relative to each rank's own start after the barrier. On one
    host ``time.perf_counter`` is one monotonic clock shared by all
    processes, so rank 0 shifts every rank's records to the earliest start:
    the measured timeline is then causally exact (a consumer's F never
    starts before its producer's F ended). Across hosts each rank's barrier
    exit stays its zero.
    """
    sg = plan.stage_graph
    times = torch.tensor(list(step_times), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=control)
    losses = torch.tensor(list(step_losses), dtype=torch.float64)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=control)
    max_abs = torch.tensor([check_stats[0]], dtype=torch.float64)
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=control)
    counts = torch.tensor([check_stats[1], check_stats[2], check_stats[3] if len(check_stats) > 3 else 0],
                          dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=control)
    measured_idx = list(range(options.warmup_steps, options.steps))
    step_list = [float(times[i]) for i in measured_idx]
    med = statistics.median(step_list)
    shown = min(measured_idx, key=lambda i: (abs(float(times[i]) - med), i))
    gathered = [None] * world_size if rank == 0 else None
    mine = (socket.gethostname(), starts[shown] if starts else 0.0, list(records[shown]) if records else [],
            sorted(os.sched_getaffinity(0)))
    dist.gather_object(mine, gathered, dst=0, group=control)
    if rank != 0:
        return None
    if len({host for host, _, _, _ in gathered}) == 1:
        origin = min(t0 for _, t0, _, _ in gathered)
        gathered = [(host, t0, [_shift(r, t0 - origin) for r in recs], cpus) for host, t0, recs, cpus in gathered]
    out: dict[str, Any] = {
        "measured": {"iteration_time_s": med, "throughput": sg.batch_size / med,
                     "step_times_s": step_list, "warmup_steps": options.warmup_steps, "timeline_step": shown},
        "losses": [float(x) for x in losses],
        "records": [r for _, _, recs, _ in gathered for r in recs],
        "backend": backend,
        "rank_cpus": [cpus for _, _, _, cpus in gathered],
    }
    out.update(extra or {})
    if options.check and isinstance(reference, Reference):
        out["check"] = _check_summary(plan, options, [float(x) for x in losses], reference, float(max_abs[0]), counts)
    elif options.check:
        if reference is None:
            reference = reference_step(plan.model, options.seed, sg.batch_size, data_seed(options.seed, 0), "cpu",
                                       plan_granularity(plan), meta_params=True)  # the baseline's weights
        ref_loss = reference[0]
        loss_diff = abs(float(losses[0]) - ref_loss)
        total_params = len(reference[1])  # every parameter the forward uses must have been compared once
        passed = (counts[0] == 0 and loss_diff <= options.atol + options.rtol * abs(ref_loss)
                  and int(counts[1]) == total_params)
        out["check"] = {"passed": bool(passed), "max_abs_diff": max(float(max_abs[0]), loss_diff),
                        "loss": float(losses[0]), "reference_loss": ref_loss, "loss_abs_diff": loss_diff,
                        "num_params_checked": int(counts[1]), "num_params": total_params,
                        "num_mismatches": int(counts[0]), "rtol": options.rtol, "atol": options.atol}
    return out


def _check_summary(plan: Plan, options: RunOptions, losses: list[float], reference: Reference, max_abs: float,
                   counts: torch.Tensor) -> dict[str, Any]:
    """Rank 0's verdict over every step: losses, gradients and buffers; plus the full-batch comparison (reported)."""
    steps = len(reference.losses)
    loss_diffs = [abs(losses[k] - reference.losses[k]) for k in range(steps)]
    loss_spread = reference.loss_spread or (0.0,) * steps
    losses_ok = all(d <= float(allowed(torch.tensor(r), options.atol, options.rtol, w))
                    for d, r, w in zip(loss_diffs, reference.losses, loss_spread))
    num_buffers = len(reference.buffers[0]) if reference.buffers else 0
    passed = (counts[0] == 0 and losses_ok and int(counts[1]) == reference.num_params
              and int(counts[2]) == num_buffers)
    check = {"passed": bool(passed), "max_abs_diff": max([max_abs, *loss_diffs]),
             "loss": losses[0], "reference_loss": reference.losses[0], "loss_abs_diff": loss_diffs[0],
             "steps_checked": steps, "losses_checked": losses[:steps], "reference_losses": list(reference.losses),
             "num_params_checked": int(counts[1]), "num_params": reference.num_params,
             "num_buffers_checked": int(counts[2]), "num_buffers": num_buffers,
             "num_mismatches": int(counts[0]), "rtol": options.rtol, "atol": options.atol,
             "batchnorm": options.batchnorm_for(plan)}
    if reference.unbatched:
        check["inexact_ops"] = list(reference.unbatched)
    if reference.grad_spread:  # the tolerance each value got on top of atol + rtol |b|
        check["fp64_spread"] = {"factor": SPREAD_FACTOR, "loss": max(loss_spread),
                                "max_grad": max((w for step in reference.grad_spread for w in step.values()),
                                                default=0.0)}
    full = reference_run(plan.model, options.seed, plan.stage_graph.batch_size, {}, 1, options.lr,
                         granularity=plan_granularity(plan), meta_params=reference.meta_params)
    check["full_batch"] = {
        "loss": full.losses[0], "loss_abs_diff": abs(full.losses[0] - reference.losses[0]),
        "max_grad_abs_diff": max((float((g - reference.grads[0][n]).abs().max()) for n, g in full.grads[0].items()
                                  if n in reference.grads[0] and g.numel()), default=0.0),
        "note": "full-batch training (BatchNorm over the whole mini-batch, one dropout draw per op): reported, not asserted"}
    return check


def _shift(record: dict, offset: float) -> dict:
    return {**record, "ready": record["ready"] + offset, "start": record["start"] + offset, "end": record["end"] + offset}
