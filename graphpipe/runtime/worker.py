"""What one rank does: build the model, keep its stages, run steps, report (docs/design.md, "The runtime").

Every rank rebuilds the whole model from the plan's ``model`` spec and the
same seed (:func:`load_runnable`), captures it exactly as the planner did,
cuts it by stage (:mod:`graphpipe.runtime.stage_modules`) and keeps only the
programs of its own stages — the rest of the model is dropped with the
full module. Data is synthetic and deterministic: step ``k`` uses
``make_inputs(batch_size, seed * 1000 + k)`` and is generated only on ranks
whose stages read model inputs.

One *job* is one plan run for some steps; :func:`run_rank` runs a list of
jobs in one process group, so tests amortise process start-up over many
plans. A plan for fewer devices than the world leaves the extra ranks idle.
:func:`run_job` picks the job's engine and hands it to the one job driver
(:func:`~graphpipe.runtime.driver.drive_job`); :class:`PipelineEngine` is
graphpipe's own (a :class:`~graphpipe.Pipeline`).

Measured iteration time: ranks meet at a barrier (the driver's), each takes ``t0`` right
after it, runs its actions and gradient all-reduces, and the step time is
the max over ranks of ``end - t0`` (the optimizer step is excluded, as in
the simulator). The reported figure is the median over the steps after the
warm-up steps.

``--check`` (``RunOptions.check``): before the first step each rank runs
the same model on one process on the whole mini-batch for every step, with
the pipeline's dropout streams and BatchNorm mode
(:func:`~graphpipe.runtime.reference.reference_run`), and after every step
compares the loss, the gradient of every parameter it owns and every buffer
with ``|a - b| <= atol + rtol*|b|`` (fp32 defaults of
``torch.testing.assert_close``: rtol 1.3e-6, atol 1e-5). Rank 0 also looks
for ops drawing from the global RNG (:func:`~graphpipe.runtime.rng.find_unseeded_random`)
and warns, naming them: ``--check`` cannot be exact for those.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from graphpipe.errors import PlanError
from graphpipe.plan import Plan, plan_from_dict
from graphpipe.runtime.driver import (CheckTally, Engine, JobComm, JobRun, StepClock, StepReport, drive_job,
                                      peak_rss_bytes)
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.reference import Reference, compare_buffers, compare_gradients, reference_run
from graphpipe.runtime.results import RunResult, finish_job
from graphpipe.runtime.runnable import data_seed, load_runnable, plan_granularity
from graphpipe.runtime.teardown import before_init, collect_groups

__all__ = ["rank_cpus", "pin_rank", "run_rank", "run_job", "PipelineEngine", "peak_rss_bytes"]

log = logging.getLogger(__name__)

def rank_cpus(local_rank: int, per_rank: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The CPUs local rank ``local_rank`` is pinned to: its own ``per_rank`` of the allowed set.

    Rank ``r`` gets the ``r``-th run of ``per_rank`` consecutive CPUs of
    ``allowed`` (default: this process's affinity, sorted), so no two ranks
    of one host share a CPU. Pinning keeps the OS from moving a rank's
    compute thread between cores mid-iteration and from stacking two ranks on
    one core while another idles; with two CPUs per rank its gloo threads
    have a core of their own next to the compute thread. Raises
    :class:`~graphpipe.errors.InputError` when the set is too small.
    """
    from graphpipe.errors import InputError

    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    need = (local_rank + 1) * per_rank
    if need > len(cpus):
        raise InputError(f"--cpus-per-rank {per_rank}: rank {local_rank} needs CPUs up to the {need}th, "
                         f"but this process may use {len(cpus)} ({_cpu_list(cpus)})")
    return cpus[local_rank * per_rank:need]


def pin_rank(local_rank: int, per_rank: int) -> None:
    """Pin this process to local rank ``local_rank``'s CPUs (:func:`rank_cpus`); ``per_rank`` 0 leaves it free.

    Call it before threads start: gloo's and torch's threads inherit it.
    """
    if per_rank:
        os.sched_setaffinity(0, rank_cpus(local_rank, per_rank))


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus[:8])) + (",..." if len(cpus) > 8 else "")


def _pick_backend(requested: str, world_size: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def run_job(rank: int, world_size: int, plan: Plan, options: RunOptions, device: torch.device,
            backend: str, control=None) -> RunResult | None:
    """Run one plan on this rank; rank 0 returns the job's :class:`~graphpipe.runtime.results.RunResult`, other
    ranks ``None``.

    The engine is the plan's: torch's schedule (``--baseline torch``),
    PipeDream's stream (an asynchronous schedule) or graphpipe's executor;
    :func:`~graphpipe.runtime.driver.drive_job` runs it. ``control`` is the
    process group for barriers and figures (a CPU gloo group under NCCL;
    ``None``: the world group).
    """
    from graphpipe.sched.async_pipe import plan_spec

    if plan.stage_graph.num_devices > world_size:
        raise PlanError(f"plan needs {plan.stage_graph.num_devices} ranks, the job has {world_size}")
    engine: Engine
    if options.baseline == "torch":
        from graphpipe.runtime.baseline import TorchEngine

        engine = TorchEngine(rank, world_size, plan, options, device, control)
    elif (spec := plan_spec(plan)) is not None:  # PipeDream's asynchronous schedules: one stream, weight versions
        from graphpipe.runtime.async_run import StreamEngine

        engine = StreamEngine(rank, world_size, plan, spec, options, device, backend, control)
    else:
        engine = PipelineEngine(rank, world_size, plan, options, device, backend, control)
    return drive_job(engine, options, rank=rank, comm=JobComm(control, world_size))


class PipelineEngine:
    """graphpipe's synchronous runtime as a job engine (:class:`~graphpipe.runtime.driver.Engine`): a
    :class:`~graphpipe.Pipeline` built from the plan's model spec (synthetic data; the driver's SGD), checked
    after every step against :func:`~graphpipe.runtime.reference.reference_run`."""

    checks_each_step = True

    def __init__(self, rank: int, world_size: int, plan: Plan, options: RunOptions, device: torch.device,
                 backend: str, control=None) -> None:
        self.rank, self.world_size, self.plan, self.options = rank, world_size, plan, options
        self.device, self.backend, self.control = device, backend, control
        sg = plan.stage_graph
        self.my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
        self.pipe = None
        self.reference: Reference | None = None
        self.unseeded: dict[str, str] = {}

    def prepare(self) -> None:
        from graphpipe.runtime.api import JobModel, Pipeline

        plan, options = self.plan, self.options
        # Every rank builds the model with its parameters on the meta device, so all agree on the boundary values
        # and shapes; each materializes only its own stages' weights (runtime/materialize.py).
        runnable = load_runnable(plan.model, options.seed, "cpu", granularity=plan_granularity(plan), meta_params=True,
                                 precision=options.precision)
        self.unseeded = _warn_unseeded(runnable, plan.model) if self.rank == 0 else {}
        self.make_inputs = runnable.make_inputs
        # graphpipe run is a user of the training API, through its public constructor: the job's capture, timing
        # and fault hook ride in its job argument
        self.pipe = Pipeline(plan, precision=options.precision, seed=options.seed, timeout_s=options.timeout_s,
                             batchnorm=options.batchnorm_for(plan), compile=options.compile,
                             _job=JobModel(runnable, measure=options.measure, fault=options.fault))
        del runnable  # drop every other stage's parameters
        if options.check and (self.my_stages or self.rank == 0):
            # the reference trains at the run's precision too, one autocast region per step as the run; a compiled
            # run's attention dropout is written out (runtime/compiled.py), and so is the reference's
            from graphpipe.runtime.rng import explicit_attention

            with explicit_attention(options.compile):
                shapes = None
                if options.vary_shapes is not None:  # the reference trains on the same drawn batches
                    rules = self.pipe.shape_rules

                    def shapes(step: int):
                        return rules.input_shapes(self.sizes_at(step))
                self.reference = reference_run(plan.model, options.seed, plan.stage_graph.batch_size,
                                               self.pipe.check_layout, options.steps, options.lr,
                                               granularity=plan_granularity(plan), precision=options.precision,
                                               meta_params=True, with_spread=options.check_tolerance == "fp64",
                                               shapes=shapes)

    def num_steps(self) -> int:
        return self.options.steps

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.pipe.parameters())

    def resume(self, directory: str, optimizer) -> int:
        return self.pipe.resume(directory, optimizer=optimizer)

    def save(self, directory: str, optimizer, step: int) -> None:
        self.pipe.save(directory, optimizer, step=step)

    def step(self, step: int, clock: StepClock) -> StepReport:
        sg = self.plan.stage_graph
        inputs = (self.make_inputs(sg.batch_size, data_seed(self.options.seed, step))
                  if self.pipe.reads_inputs else None)
        sizes = self.sizes_at(step)
        if sizes is not None and inputs is not None:  # the plan's batch cut (or tiled) to the step's draw
            from graphpipe.frontend.shapes import resized

            inputs = resized(inputs, self.pipe.shape_rules.input_shapes(sizes))
        got = self.pipe.timed_step(inputs, start=clock.start, sizes=sizes)
        return StepReport(got.iteration_time_s, got.loss, got.t0, tuple(got.records),
                          got.peak_saved_bytes, got.cuda_peak_bytes)

    def sizes_at(self, step: int) -> dict[str, int] | None:
        """Step ``step``'s symbol sizes under ``--vary-shapes`` (None: the plan's), the same on every rank."""
        if self.options.vary_shapes is None:
            return None
        from graphpipe.frontend.shapes import ShapeDraw

        rules = self.pipe.shape_rules  # the draws were checked before launch (runtime.preflight)
        return ShapeDraw.parse(self.options.vary_shapes).sizes(self.options.seed, step, rules.batch, rules.symbols,
                                                              self.plan.stage_graph.batch_size)

    def check(self, step: int, first: bool) -> CheckTally | None:
        """Every gradient and buffer of this rank against the reference's step ``step``; replicas all compare,
        only the copy :meth:`Pipeline.counted_tensors` counts is counted, at the first step."""
        if self.reference is None or not self.my_stages:
            return None
        ref, options = self.reference, self.options
        params, buffers = self.pipe.counted_tensors()
        grad_spread, buffer_spread = ref.spread_at(step)
        grads = compare_gradients(((n, p, first and c) for n, p, c in params), ref.grads[step], options, grad_spread)
        bufs = compare_buffers(((n, b, first and c) for n, b, c in buffers), ref.buffers[step], options,
                               buffer_spread)
        return CheckTally.of_params(grads) + CheckTally.of_buffers(bufs)

    def finish(self, run: JobRun) -> RunResult | None:
        reference = self.reference
        if run.start and reference is not None:  # checked against the reference's steps from the resumed one
            reference = replace(reference, losses=reference.losses[run.start:], buffers=reference.buffers[run.start:])
        out = finish_job(self.rank, self.world_size, self.plan, run.options, run.reports, run.tally, reference,
                         backend=self.backend, control=self.control)
        if out is None:
            return None
        check = out.check
        if check is not None and self.unseeded:
            check = replace(check, unseeded_ops=self.unseeded)
        if check is not None and check.inexact_ops:
            log.warning("%s: op(s) %s take an input without a batch dimension: their dropout masks or BatchNorm "
                        "statistics cannot be cut per micro-batch, so --check cannot be exact for them",
                        self.plan.model, ", ".join(check.inexact_ops))
        return replace(out, measured=replace(out.measured, **run.memory.measured_fields(self.options.measure)),
                       check=check, precision=self.options.precision,
                       resumed_from_step=run.start if run.resumed else None)

    def close(self) -> None:
        """The job's end: the Pipeline releases the groups it made (the job's world group stays, run_rank's)."""
        self.pipe.close()


def _warn_unseeded(runnable, model: str) -> dict[str, str]:
    """Ops of the model that draw from the global RNG (a warning each): their draws cannot be replayed."""
    from graphpipe.runtime.batchnorm import sharded_batchnorms
    from graphpipe.runtime.rng import ShardContext, find_unseeded_random

    inputs = runnable.shape_inputs(2, 0)
    found = find_unseeded_random(runnable.gm, inputs, ShardContext(0, 0, 0, 2, 0, 2))
    for bn in sharded_batchnorms(runnable.gm):
        bn.pending.clear()
    for node, what in found.items():
        log.warning("%s: op %s (%s) draws from the global random generator, not a per-micro-batch stream: "
                    "--check cannot be exact for it (use nn.Dropout / F.dropout, or seed it from the shard)",
                    model, node, what)
    return found


def run_rank(rank: int, world_size: int, jobs: Sequence[tuple[dict, RunOptions]], init_method: str,
             on_job_done: Callable[[int, RunResult | None], None] | None = None) -> list[RunResult | None]:
    """Join the process group and run every job in order; returns rank 0's results (``None`` elsewhere)."""
    options0 = jobs[0][1]
    import torch.fx.experimental._config as fx_config

    # a rank runs its graphs for shapes on meta parameters in several places (set-up, meters, the reference):
    # a mask's nonzero must answer there (graphpipe.runtime.materialize.meta_nonzero), for the whole process
    fx_config.meta_nonzero_assume_all_nonzero = True
    pin_rank(int(os.environ.get("LOCAL_RANK", rank)), options0.cpus_per_rank)
    torch.set_num_threads(options0.num_threads)
    backend = _pick_backend(options0.backend, world_size)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if options0.fault is not None and options0.fault.hits(rank, "setup"):
        raise RuntimeError(f"injected failure at setup ({options0.fault.describe()})")
    before_init()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=options0.timeout_s),
                            device_id=device if backend == "nccl" else None)
    results = []
    # Barriers and figures travel on CPU tensors: under NCCL they get a gloo group of their own.
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    for index, (plan_doc, options) in enumerate(jobs):
        plan = plan_from_dict(plan_doc)
        result = run_job(rank, world_size, plan, options, device, backend, control)
        results.append(result)
        if on_job_done is not None:
            on_job_done(index, result)
    # Only a rank that finished leaves the group: a failing one exits with the group open, so its peers' "connection
    # closed" cannot reach the launcher before this rank's own error report (both callers exit after an error).
    # The groups must be gone, threads joined, before the interpreter exits (graphpipe.runtime.teardown).
    del control
    dist.destroy_process_group()
    collect_groups()
    return results
