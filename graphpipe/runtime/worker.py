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

Measured iteration time: ranks meet at a barrier, each takes ``t0`` right
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
import signal
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from graphpipe.errors import PlanError
from graphpipe.plan import Plan, plan_from_dict
from graphpipe.progress import step_done
from graphpipe.runtime.executor import StepResult
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.reference import compare_buffers, compare_gradients, reference_run
from graphpipe.runtime.results import RunResult, finish_job
from graphpipe.runtime.runnable import data_seed, load_runnable, plan_granularity
from graphpipe.runtime.step_checkpoints import check_steps_left
from graphpipe.runtime.teardown import before_init, collect_groups

__all__ = ["rank_cpus", "pin_rank", "run_rank", "run_job", "peak_rss_bytes"]

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


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pick_backend(requested: str, world_size: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def run_job(rank: int, world_size: int, plan: Plan, options: RunOptions, device: torch.device,
            backend: str, control=None) -> RunResult | None:
    """Run one plan on this rank; rank 0 returns the job's :class:`~graphpipe.runtime.results.RunResult`, other
    ranks ``None``.

    ``control`` is the process group for barriers and figures (a CPU gloo
    group under NCCL; ``None``: the world group).
    """
    if options.baseline == "torch":
        from graphpipe.runtime.baseline import run_torch_job

        return run_torch_job(rank, world_size, plan, options, device, control)
    from graphpipe.sched.async_pipe import plan_spec

    spec = plan_spec(plan)
    if spec is not None:  # PipeDream's asynchronous schedules: one stream, weight versions (runtime/async_run.py)
        from graphpipe.runtime.async_run import run_async_job

        return run_async_job(rank, world_size, plan, spec, options, device, backend, control)
    sg = plan.stage_graph
    if sg.num_devices > world_size:
        raise PlanError(f"plan needs {sg.num_devices} ranks, the job has {world_size}")
    from graphpipe.runtime.api import Pipeline

    my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
    # Every rank builds the model with its parameters on the meta device, so all agree on the boundary values and
    # shapes; each materializes only its own stages' weights (runtime/materialize.py).
    runnable = load_runnable(plan.model, options.seed, "cpu", granularity=plan_granularity(plan), meta_params=True)
    unseeded = _warn_unseeded(runnable, plan.model) if rank == 0 else {}
    make_inputs = runnable.make_inputs
    # graphpipe run is a user of the training API: synthetic data, SGD, and its report.
    pipe = Pipeline.for_job(plan, runnable, rank=rank, world_size=world_size, device=device, backend=backend,
                             options=options)
    del runnable  # drop every other stage's parameters
    ctx = pipe.rank_setup
    programs, layout, tied_copies, buffer_stage = ctx.programs, ctx.layout, ctx.tied_copies, ctx.buffer_stage
    params = list(pipe.parameters())
    optimizer = torch.optim.SGD(params, lr=options.lr) if params else None
    reference = None
    if options.check and (my_stages or rank == 0):
        # the reference trains at the run's precision too, one autocast region per step as the run; a compiled
        # run's attention dropout is written out (runtime/compiled.py), and so is the reference's
        from graphpipe.runtime.rng import explicit_attention

        with explicit_attention(options.compile):
            reference = reference_run(plan.model, options.seed, sg.batch_size, layout, options.steps, options.lr,
                                      granularity=plan_granularity(plan), precision=options.precision, meta_params=True,
                                      with_spread=options.check_tolerance == "fp64")

    start = pipe.resume(options.checkpoint_dir, optimizer=optimizer) if options.checkpoint_dir else 0
    if options.checkpoint_dir:
        check_steps_left(options.checkpoint_dir, start, options.steps, PlanError)
    steps: list[StepResult] = []
    check_stats = [0.0, 0, 0, 0]
    for step in range(start, options.steps):
        inputs = make_inputs(sg.batch_size, data_seed(options.seed, step)) if pipe.reads_inputs else None
        steps.append(pipe.timed_step(inputs, group=control))
        if options.fault is not None and options.fault.hits(rank, "grad"):  # a wrong gradient --check must catch
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        if reference is not None and my_stages:
            # Replicas all compare; only a stage's first replica counts (and only the owner of a tied parameter).
            grads = compare_gradients(((programs[s].param_names.get(name, name), p,
                                        step == start and sg.stages[s].devices[0] == rank and (s, name) not in tied_copies)
                                       for s in sorted(programs) for name, p in programs[s].module.named_parameters()),
                                      reference.grads[step], options, reference.spread_at(step)[0])
            bufs = compare_buffers(((name, b, step == start and sg.stages[s].devices[0] == rank and buffer_stage[name] == s)
                                    for s in sorted(programs) for name, b in programs[s].module.named_buffers()),
                                   reference.buffers[step], options, reference.spread_at(step)[1])
            check_stats = [max(check_stats[0], grads[0], bufs[0]), check_stats[1] + grads[1] + bufs[1],
                           check_stats[2] + grads[2], check_stats[3] + bufs[2]]
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        if options.checkpoint_dir and (step + 1) % options.checkpoint_every == 0:
            pipe.save(options.checkpoint_dir, optimizer, step=step + 1)
        if options.fault is not None and options.fault.hits(rank, "kill") and step == start + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        step_done()
    measured = options
    if start:  # the run's steps (and the reference's losses it is checked against) begin at the resumed step
        measured = replace(options, steps=options.steps - start,
                           warmup_steps=min(options.warmup_steps, options.steps - start - 1))
        if reference is not None:
            reference = replace(reference, losses=reference.losses[start:], buffers=reference.buffers[start:])
    # Activation memory per device (rank = device): peak bytes saved for backward, and CUDA's allocator peak.
    timed = steps[options.warmup_steps:] or steps
    mem = torch.tensor([float(max(s.peak_saved_bytes for s in timed)),
                        float(max(s.cuda_peak_bytes or 0 for s in timed)), float(peak_rss_bytes())],
                       dtype=torch.float64)
    mems = [torch.zeros_like(mem) for _ in range(world_size)]
    dist.all_gather(mems, mem, group=control)
    out = finish_job(rank, world_size, plan, measured, [s.iteration_time_s for s in steps], [s.loss for s in steps],
                     tuple(check_stats), reference, records=[[asdict(r) for r in s.records] for s in steps],
                     backend=backend, starts=[s.t0 for s in steps], control=control)
    if out is None:
        return None
    memory = {"peak_rss_bytes": [float(m[2]) for m in mems]}
    if options.measure:
        memory["peak_activation_bytes"] = [float(m[0]) for m in mems]
    if any(s.cuda_peak_bytes is not None for s in timed):
        memory["cuda_max_memory_allocated_bytes"] = [float(m[1]) for m in mems]
    check = out.check
    if check is not None and unseeded:
        check = replace(check, unseeded_ops=unseeded)
    if check is not None and check.inexact_ops:
        log.warning("%s: op(s) %s take an input without a batch dimension: their dropout masks or BatchNorm "
                    "statistics cannot be cut per micro-batch, so --check cannot be exact for them",
                    plan.model, ", ".join(check.inexact_ops))
    return replace(out, measured=replace(out.measured, **memory), check=check, precision=options.precision,
                   resumed_from_step=start if options.checkpoint_dir else None)
    return out


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
