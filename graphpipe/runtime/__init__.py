"""Execute plans for real on torch.distributed (docs/design.md, "The runtime").

The only package that touches ``torch.distributed``. One process per device:
``graphpipe run PLAN.json`` spawns them (:func:`run_plan`), or run the same
code under torchrun::

    graphpipe run plan.json --steps 5 --check --json
    graphpipe run plan.json --trace run.trace.json --gantt run.png
    graphpipe run plan.json --baseline torch          # torch.distributed.pipelining, sequential plans only
    torchrun --nproc-per-node 4 -m graphpipe.runtime plan.json --steps 5 --json

Pieces:

* :mod:`~graphpipe.runtime.stage_modules` cuts the captured fx graph into one
  module per stage with explicit inputs and outputs per stage edge;
* :mod:`~graphpipe.runtime.routing` derives which rows of which tensor go to
  which rank, and the message order of every rank pair;
* :mod:`~graphpipe.runtime.comm` posts non-blocking sends and in-order receives;
* :mod:`~graphpipe.runtime.executor` dispatches a rank's typed actions
  (one :class:`~graphpipe.runtime.executor.ExecutorContext` each) to one
  :class:`~graphpipe.runtime.hosted.HostedStage` per stage the rank hosts,
  which computes them and sends and receives their messages;
* :mod:`~graphpipe.runtime.api` is the training API, :class:`graphpipe.Pipeline`;
* :mod:`~graphpipe.runtime.setup` sets a rank up (:func:`~graphpipe.runtime.setup.setup_rank`,
  shared by every path);
* :mod:`~graphpipe.runtime.runnable` builds and captures the model a job
  runs, with its loss and synthetic data;
* :mod:`~graphpipe.runtime.driver` is the one job driver (barriers,
  timing, warm-up, ``--check`` cadence, fault hooks, checkpoints, memory)
  over an engine: graphpipe's (:mod:`~graphpipe.runtime.worker`, through
  the API: synthetic data, SGD), PipeDream's stream
  (:mod:`~graphpipe.runtime.async_run`) or torch's
  (:mod:`~graphpipe.runtime.baseline`), each checked against
  :mod:`~graphpipe.runtime.reference`, the single-process run;
* :mod:`~graphpipe.runtime.results` holds a run's result as frozen records
  (:class:`RunResult`, :class:`RunSummary`) and their JSON form;
* :mod:`~graphpipe.runtime.launch` spawns and watches the ranks;
* :mod:`~graphpipe.runtime.materialize` gives a model built on the meta
  device real storage for one rank's stages only, initialised per tensor name;
* :mod:`~graphpipe.runtime.checkpoint` reads one rank's tensors from a
  checkpoint (graphpipe's, a plain state dict's, safetensors);
* :mod:`~graphpipe.runtime.memory` estimates each rank's host memory, and
  refuses a run that cannot fit before any rank starts;
* :mod:`~graphpipe.runtime.measure` turns measured records into a
  :class:`graphpipe.sched.Timeline`;
* :mod:`~graphpipe.runtime.baseline` runs sequential plans on
  ``torch.distributed.pipelining``.

Failures: any rank's exception ends every rank, and :func:`run_plan` raises
:class:`RuntimeFailure` (``graphpipe run`` exits 1) with ``rank R failed:
<exception>``. Plans that cannot run (op names not the model's, a graph-file
model, torch baseline of a non-sequential plan) raise
:class:`~graphpipe.errors.PlanError` before any process starts (exit 2).

Test hook: ``RunOptions.fault`` (:class:`FaultInjection`) makes rank ``R``
raise at its first F (or B, or before joining the process group), or go
silent at its first F (``hang``), so its peers fail after ``--timeout``
seconds. Used to test that failures never hang. Runs started from the
shell take it from the environment variables ``GRAPHPIPE_FAIL_RANK=R`` and
``GRAPHPIPE_FAIL_AT=F|B|setup|hang``, read once by :func:`run_plans` and
``python -m graphpipe.runtime``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from graphpipe.errors import InputError, PlanError
from graphpipe.plan import Plan, plan_to_dict
from graphpipe.runtime.options import FaultInjection, RunOptions, fault_from_env
from graphpipe.runtime.launch import RuntimeFailure, launch
from graphpipe.runtime.layouts import layout_refusal
from graphpipe.runtime.results import RunResult, RunSummary

log = logging.getLogger(__name__)

__all__ = ["RunOptions", "FaultInjection", "RuntimeFailure", "RunResult", "RunSummary", "preflight", "run_plan",
           "run_plans", "layout_refusal"]



def preflight(plan: Plan, options: RunOptions) -> None:
    """Every check that can fail before launching: schedule, model vs plan, torch expressibility, GPUs.

    Builds the model on the meta device (no weights) to compare its op names
    with the plan's and to cut it into stages.
    """
    from graphpipe.sched import validate_plan

    from graphpipe.runtime.stage_modules import check_op_names, split_model
    from graphpipe.runtime.runnable import load_runnable, plan_granularity

    validate_plan(plan)
    refusal = layout_refusal(plan, compile=options.compile)
    if refusal is None and options.baseline == "torch" and any(s.parallel for s in plan.stage_graph.stages):
        refusal = ("--baseline torch runs whole-copy stages on torch.distributed.pipelining; this plan has FSDP or "
                   "TP stages: run it without --baseline (graphpipe's executor runs them)")
    if refusal is not None:
        raise InputError(refusal)
    if options.checkpoint_dir:
        from graphpipe.runtime.step_checkpoints import check_steps_left, newest_complete

        found = newest_complete(options.checkpoint_dir)
        if found is not None:
            check_steps_left(options.checkpoint_dir, found[0], options.steps)
    from graphpipe.sched.async_pipe import plan_spec

    if options.compile:
        from graphpipe.runtime.compiled import compile_refusal

        refusal = compile_refusal(a for actions in plan.schedule.device_actions for a in actions)
        if refusal is not None:
            raise InputError(refusal)

    spec = plan_spec(plan)
    if options.checkpoint_dir and (spec is not None or options.baseline == "torch"):
        what = "--baseline torch" if options.baseline == "torch" else f"{spec.name} (no flush: no step boundary)"
        raise InputError(f"--checkpoint-dir checkpoints graphpipe's executor at step boundaries; {what} has none to "
                         "save at: drop --checkpoint-dir, or run a flushing schedule on graphpipe's executor")
    if spec is not None and options.vary_shapes is not None:
        raise InputError(f"--vary-shapes runs graphpipe's synchronous schedules; {spec.name} streams mini-batches "
                         "of the plan's shape: plan another --schedule or drop --vary-shapes")
    if spec is not None:
        from graphpipe.sched.async_pipe import version_table

        if options.baseline == "torch":
            raise InputError(f"--baseline torch runs flushing schedules only; {spec.name} streams without a flush")
        if options.compile:
            raise InputError(f"--compile runs synchronous schedules; {spec.name}'s weight versions swap a stage's "
                             "parameters per micro-batch: plan another --schedule or run without --compile")
        if options.precision != "fp32":
            raise InputError(f"{spec.name} runs at fp32 only (its replay check is exact); drop --precision")
        version_table(plan.stage_graph, spec, options.steps)  # 2bw's m must divide steps x micro-batches
    # Captured as each rank loads it (parameters on meta: nothing is allocated here either), so the launcher
    # ships this capture to the ranks instead of each exporting the model again (runtime/shipping.py).
    runnable = load_runnable(plan.model, options.seed, "cpu", granularity=plan_granularity(plan), meta_params=True,
                             precision=options.precision)
    check_op_names([op.name for op in plan.graph.ops], runnable.op_names, plan.model)
    split = split_model(runnable.gm, runnable.op_nodes, plan.stage_graph)
    from graphpipe.frontend.shapes import data_dims

    if sized := data_dims(runnable.gm, split.boundary_values):  # their shards must not be joined: say so here
        from graphpipe.runtime.routing import Routing
        from graphpipe.runtime.setup import _edge_values
        from graphpipe.runtime.stage_modules import check_data_sized_edges

        try:
            check_data_sized_edges(Routing(plan.stage_graph, plan.schedule, _edge_values(split), ()), sized)
        except PlanError as exc:
            raise InputError(str(exc)) from None
    if options.vary_shapes is not None:
        _check_draws(plan, options, runnable.gm)
    if options.precision == "bf16":
        import torch

        if options.baseline == "torch":
            raise InputError("--precision bf16 is not supported with --baseline torch; drop one of them")
        if options.backend == "nccl" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise InputError(f"--precision bf16: {torch.cuda.get_device_name()} has no bfloat16 support; "
                             "use --precision fp32")
    if options.baseline == "torch":
        from graphpipe.runtime.baseline import check_torch_expressible

        redo = [s.id for s in plan.stage_graph.stages if s.recompute]
        if redo:
            raise InputError(f"stages {redo} re-materialize (recompute), which the torch.distributed.pipelining "
                             "baseline does not run; drop --baseline torch or re-plan with --recompute none")

        check_torch_expressible(plan, split, runnable.io)
    if options.backend == "nccl":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < plan.cluster.num_devices:
            raise InputError(f"--backend nccl needs one GPU per rank: the plan has {plan.cluster.num_devices} devices, "
                             f"this machine {n} GPU(s); use --backend gloo")


def _check_draws(plan: Plan, options: RunOptions, gm) -> None:
    """Every step's ``--vary-shapes`` draw against what the model and the plan take, before any rank starts:
    the refusal a rank would raise at that step, here, once."""
    import torch.nn as nn

    from graphpipe.frontend.shapes import ShapeDraw, ShapeRules
    from graphpipe.runtime.routing import rows_refusal

    draw = ShapeDraw.parse(options.vary_shapes)
    rules = ShapeRules(gm)
    sg = plan.stage_graph
    if not rules.symbols and draw.rows is None:
        raise InputError(f"--vary-shapes: {plan.model} has no input dim that may vary (an integer input's dims "
                         "other than the batch do, or a float input's its factory declares)")
    if draw.rows is not None:
        batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())
        for rows in draw.rows:  # the extremes: every rows in between is refused for a reason one of them has
            refusal = rows_refusal(sg, rows, batchnorm)
            if refusal is not None:
                raise InputError(f"--vary-shapes: {refusal}")
    for step in range(options.steps):
        rules.at(draw.sizes(options.seed, step, rules.batch, rules.symbols, sg.batch_size))


def run_plans(plans: list[tuple[Plan, RunOptions]], world_size: int | None = None) -> list[RunResult]:
    """Run several plans one after the other in one set of processes (amortises start-up).

    ``world_size`` defaults to the largest plan's device count; smaller plans
    leave the extra ranks idle. Returns rank 0's :class:`RunResult` per plan. The
    processes start with the first plan's ``num_threads`` and
    ``cpus_per_rank``.
    """
    fault = fault_from_env()  # the test hook's way in; RunOptions.fault carries it from here on
    if fault is not None:
        plans = [(plan, options if options.fault is not None else replace(options, fault=fault)) for plan, options in plans]
    for plan, options in plans:
        preflight(plan, options)
    world = world_size or max(plan.cluster.num_devices for plan, _ in plans)
    plans, skipped = _fit_host_memory(plans, world)
    if plans and plans[0][1].cpus_per_rank:
        from graphpipe.runtime.worker import rank_cpus

        rank_cpus(world - 1, plans[0][1].cpus_per_rank)  # enough CPUs for the last rank, or refuse before spawning
    jobs = [(plan_to_dict(plan), options) for plan, options in plans]
    max_restarts = max(options.max_restarts for _, options in plans) if plans else 0
    restarts = 0
    while True:
        try:
            results = launch(jobs, world)
        except RuntimeFailure as exc:
            if restarts >= max_restarts:
                raise
            restarts += 1
            # every rank starts again and resumes from its checkpoint folder's newest complete step
            log.warning("%s -- restarting every rank (%d of --max-restarts %d)", exc, restarts, max_restarts)
            jobs = [(doc, replace(options, fault=None)) for doc, options in jobs]  # an injected fault fires once
            continue
        return [result if result is None else
                replace(result, restarts=restarts if result.resumed_from_step is not None else None,
                        check_skipped=reason)
                for result, reason in zip(results, skipped)]


def _fit_host_memory(plans: list[tuple[Plan, RunOptions]], world: int) -> tuple[list, list[str | None]]:
    """Refuse a plan whose ranks cannot fit in this host's memory (:func:`~graphpipe.runtime.memory.check_host_memory`,
    before any rank starts); drop ``--check`` where its single-process references (one per rank hosting a
    stage) would not fit beside the run, with the reason (logged, and in the result's ``check_skipped``)."""
    from graphpipe.runtime.memory import GIB, available_memory, check_host_memory, reference_bytes
    from graphpipe.sched.async_pipe import plan_spec

    out, skipped = [], []
    for plan, options in plans:
        ranks = check_host_memory(plan, world)
        reason = None
        available = available_memory()
        if options.check and options.baseline != "torch" and plan_spec(plan) is None and available is not None:
            hosting = len(set(plan.stage_graph.devices_used()) | {0})
            need = sum(r.total_bytes for r in ranks) + hosting * reference_bytes(plan)
            if need > available:
                reason = (f"--check skipped: its single-process reference of the whole model, on each of the "
                          f"{hosting} ranks hosting a stage, would take the run to about {need / GIB:.1f} GiB "
                          f"of host memory, and this host has {available / GIB:.1f} GiB available")
                log.warning("%s", reason)
                options = replace(options, check=False)
        out.append((plan, options))
        skipped.append(reason)
    return out, skipped


def run_plan(plan: Plan, options: RunOptions | None = None) -> RunSummary:
    """Run ``plan`` on one process per device; its :class:`RunSummary` (measured, predicted, check, timeline).

    Example (spawns processes)::

        summary = run_plan(read_plan("plan.json"), RunOptions(steps=5, check=True))
        summary.measured.throughput, summary.check.passed
    """
    from graphpipe.runtime.measure import measured_timeline, summarize

    options = options or RunOptions()
    raw = run_plans([(plan, options)])[0]
    shown = plan
    if raw.async_run is not None:  # the measured timeline of a stream is the whole run
        from graphpipe.sched.async_pipe import stream_graph, stream_schedule

        shown = replace(plan, stage_graph=stream_graph(plan.stage_graph, options.steps),
                        schedule=stream_schedule(plan.stage_graph, plan.schedule.name, options.steps))
    return replace(summarize(plan, raw), timeline=measured_timeline(shown, raw.records) if raw.records else None)
