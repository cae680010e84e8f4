"""``--check``'s reference: the single-process run a pipelined run is compared with (docs/semantics.md).

The reference is one process running
the whole mini-batch of every step through the captured model, with the
*same training semantics* as the pipeline, for as many steps as the run
(SGD with the run's learning rate in between):

* dropout masks from the same per-(seed, step, op, shard) generators
  (:mod:`graphpipe.runtime.rng`): the reference cuts each dropout's input at
  the pipeline's shard boundaries of that op's stage (:func:`reference_layout`);
* BatchNorm per micro-batch or synchronised across a stage's replicas, as
  ``--batchnorm`` says (:mod:`graphpipe.runtime.batchnorm`): the reference
  normalises the same groups of rows and defers running statistics the same way;
* tied parameters: one parameter in the reference, copies in the pipeline
  whose gradients are summed; every copy is compared with the reference.

After every step each rank compares (:func:`compare_gradients`,
:func:`compare_buffers`), with ``|a - b| <= atol + rtol*|b|`` (fp32
defaults of ``torch.testing.assert_close``, widened by the reference's own
fp32-vs-fp64 spread, :mod:`graphpipe.runtime.numerics`), the step's loss,
the gradient of every parameter it hosts and every buffer (running
statistics) after the step's commit. A second comparison, with *full-batch*
training (BatchNorm over the whole mini-batch, one dropout draw per op), is
reported in ``check.full_batch`` and never asserted: with micro-batches
smaller than the mini-batch the two are different training algorithms.
The verdict over all ranks is assembled on rank 0 (:func:`graphpipe.runtime.results.finish_job`).

:func:`reference_step` is the plain PyTorch reference of the
``torch.distributed.pipelining`` baseline (one step, whole mini-batch).

Example
-------
>>> ref = Reference(losses=(0.5,), grads=({"w": torch.ones(2)},), buffers=({},))
>>> ref.num_params, ref.spread_at(0)
(1, (None, None))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from graphpipe.errors import PlanError
from graphpipe.plan import Plan
from graphpipe.runtime.numerics import allowed, float64_graph, rows_as_the_pipeline, spread
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.runnable import Runnable, autocast, data_seed, load_runnable

__all__ = ["Reference", "reference_layout", "reference_run", "reference_step", "uniform_rows", "compare_gradients",
           "compare_buffers"]

log = logging.getLogger(__name__)


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
                  meta_params: bool = False, with_spread: bool = False, float64: bool = False,
                  shapes: Callable[[int], Sequence] | None = None) -> Reference:
    """``steps`` SGD steps of a fresh copy of the model on one process with the pipeline's semantics.

    ``layout`` (:func:`reference_layout`) says at which rows every dropout
    and BatchNorm call is cut; an empty layout is full-batch training. Step
    ``k`` reads ``make_inputs(batch_size, data_seed(seed, k))`` like the
    pipeline. ``meta_params``: the weights are those every rank materializes
    (:func:`~graphpipe.runtime.materialize.materialize_stages`, all stages here).
    ``float64``: the whole run in float64; ``with_spread`` (fp32): that run
    too, and the reference's own fp32-vs-fp64 spread per step
    (:mod:`graphpipe.runtime.numerics`). ``shapes(k)``: step ``k``'s input shapes when
    they are not the plan's (``--vary-shapes``): the inputs are cut to them
    (:func:`~graphpipe.frontend.shapes.resized`) as on the ranks, and a step of
    fewer rows cuts its dropout where the pipeline's proportionally smaller
    shards do.
    """
    from graphpipe.frontend.shapes import resized
    from graphpipe.runtime.batchnorm import sharded_batchnorms
    from graphpipe.runtime.rng import ReferenceContext, ShardContext, _rows

    ref = load_runnable(spec, seed, device, granularity=granularity, meta_params=meta_params, precision=precision)
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
        if shapes is not None:
            inputs = resized(inputs, shapes(step))
        step_rows = next((int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim()), batch_size)
        if float64:
            inputs = tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
        with autocast(precision, device):  # one region per step, as the run: the weight copies are cast anew
            if rows is None or step_rows != batch_size:  # a partial batch: shards of proportionally fewer rows
                ctx = ReferenceContext(seed, step, step_rows, layout, planned=batch_size)
                loss = ref.loss_fn(gm(*inputs, ctx))
                loss.backward()
                unbatched.update(ctx.unbatched)
            else:  # gradient accumulation over the pipeline's own shards, in order
                loss = 0.0
                for lo in range(0, batch_size, rows):
                    ctx = ShardContext(seed, step, lo, rows, lo, rows)
                    part = tuple(_rows(x, batch_size, slice(lo, lo + rows)) for x in inputs)
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
                              meta_params=meta_params, shapes=shapes)
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
    reference cut per op (:class:`~graphpipe.runtime.rng.ReferenceContext`),
    its row kernels run on their stages' rows
    (:func:`~graphpipe.runtime.numerics.rows_as_the_pipeline`).
    """
    sizes = {n for kinds in layout.values() for n in kinds.values()}
    if len(sizes) != 1:
        return None
    (rows,) = sizes
    return rows if 0 < rows < batch_size and batch_size % rows == 0 else None


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
                   granularity: str | None = None, meta_params: bool = False) -> Reference:
    """Single-process loss and gradients of a fresh copy of the model on the whole mini-batch (PyTorch's
    semantics), as a one-step :class:`Reference` (no buffers).

    The torch.distributed.pipelining baseline's reference; ours is
    :func:`reference_run`. The eager module runs on the data the graph runs
    on, its keyword inputs by name and the target to the loss
    (:meth:`~graphpipe.frontend.exporting.IOSpec.unflatten_inputs`). ``meta_params``:
    the weights every rank materializes (:func:`reference_run`'s).
    """
    ref = load_runnable(spec, seed, device, granularity=granularity, meta_params=meta_params)
    _materialize_whole(ref, ref.module, device, seed)
    args, kwargs, target = ref.io.unflatten_inputs(ref.make_inputs(batch_size, step_seed))
    loss = ref.loss_fn(ref.io.graph_output(ref.module(*args, **kwargs), target))
    loss.backward()
    grads = {n: p.grad for n, p in ref.module.named_parameters() if p.grad is not None}
    return Reference(losses=(float(loss.detach()),), grads=(grads,), buffers=(), meta_params=meta_params)


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
        grad = p.grad
        if hasattr(grad, "device_mesh"):  # an FSDP / TP stage's shard (a DTensor): against its piece of the reference
            from graphpipe.runtime.dtensors import local_pair

            grad, ref = local_pair(grad, ref)
        diff = (grad - ref).abs()
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        mismatches += int((diff > allowed(ref, options.atol, options.rtol, (spreads or {}).get(name, 0.0))).sum())
        count += int(counted)
    return max_abs, mismatches, count
