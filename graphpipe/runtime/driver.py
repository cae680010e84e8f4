"""One job driver for every way a plan runs: graphpipe's runtime, PipeDream's stream and torch's schedule.

A *job* is one plan run for some steps (docs/design.md, "The runtime").
Three engines run a plan's steps — graphpipe's synchronous executor
(:class:`graphpipe.runtime.worker.PipelineEngine`, through
:class:`graphpipe.Pipeline`), PipeDream's asynchronous stream
(:class:`graphpipe.runtime.async_run.StreamEngine`) and
``torch.distributed.pipelining`` (:class:`graphpipe.runtime.baseline.TorchEngine`)
— and :func:`drive_job` is the one loop around them, so the three are
measured and checked the same way. The driver owns what is the job's:

* **barriers and timing**: each step's shared start is a barrier on the
  job's control group followed by ``time.perf_counter()``
  (:class:`StepClock`); an engine calls :meth:`StepClock.start` once its
  untimed preparation (data, zeroed gradients) is done;
* **warm-up**: the figures of the first ``warmup_steps`` steps are left out
  of the memory peaks (and, in :func:`~graphpipe.runtime.results.finish_job`,
  of the median); a resumed run counts its warm-up from the resumed step;
* **the ``--check`` cadence**: after every step (or only the first, for an
  engine whose reference is one step, :attr:`Engine.checks_each_step`) the
  engine compares its gradients and buffers and the driver sums the
  :class:`CheckTally`;
* **the optimizer**: SGD at ``--lr`` over :meth:`Engine.parameters`, stepped
  and zeroed after the check (an engine that updates its own weights, as
  PipeDream's weight versions do, lists none);
* **fault hooks** (:class:`~graphpipe.runtime.options.FaultInjection`):
  ``grad`` halves the faulty rank's gradients after every step, ``kill``
  SIGKILLs it after its second step (and that step's checkpoint);
* **checkpoints**: resume from ``--checkpoint-dir``'s newest step, save
  every ``--checkpoint-every`` steps;
* **memory**: every rank's activation, CUDA and RSS peaks gathered once
  (:class:`JobMemory`).

An engine implements the small :class:`Engine` protocol: ``prepare`` (build
its stages and its reference), ``step`` (one step, returning a typed
:class:`StepReport`), ``check``, ``parameters``, ``finish`` (rank 0's
:class:`~graphpipe.runtime.results.RunResult`) and ``close`` (the job's
process groups released). Collectives go through a :class:`JobComm`, so the
cadence is testable without ``torch.distributed``.

Example
-------
>>> CheckTally(0.5, 1, 2) + CheckTally(0.25, 0, 3, 1)
CheckTally(max_abs_diff=0.5, num_mismatches=1, num_params=5, num_buffers=1)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from graphpipe.runtime.results import CheckTally, StepReport

if TYPE_CHECKING:
    import torch

    from graphpipe.runtime.options import RunOptions

__all__ = ["StepReport", "CheckTally", "JobMemory", "JobRun", "JobComm", "StepClock", "Engine", "drive_job",
           "peak_rss_bytes"]


@dataclass(frozen=True, slots=True)
class JobMemory:
    """Every rank's memory peaks over the measured steps, gathered by the driver (one entry per rank)."""

    peak_activation_bytes: tuple[float, ...]
    cuda_peak_bytes: tuple[float, ...]
    """0 on a CPU rank."""
    peak_rss_bytes: tuple[float, ...]
    on_cuda: bool
    """Whether this rank's steps ran on CUDA (the CUDA peaks mean something)."""

    def measured_fields(self, metered: bool) -> dict[str, tuple[float, ...]]:
        """The :class:`~graphpipe.runtime.results.Measured` fields these give: RSS always, the activation peak
        where the saved-tensor meter ran (``metered``), CUDA's allocator peak on CUDA."""
        out = {"peak_rss_bytes": self.peak_rss_bytes}
        if metered:
            out["peak_activation_bytes"] = self.peak_activation_bytes
        if self.on_cuda:
            out["cuda_max_memory_allocated_bytes"] = self.cuda_peak_bytes
        return out


@dataclass(frozen=True, slots=True, eq=False)
class JobRun:
    """What the driver hands an engine's :meth:`Engine.finish`: the steps it ran and what it gathered."""

    start: int
    """The first step run (0, or the step a checkpoint resumed from)."""
    options: "RunOptions"
    """The job's options with ``steps`` and ``warmup_steps`` counted from ``start`` (those the figures cover)."""
    reports: tuple[StepReport, ...]
    tally: CheckTally
    """This rank's ``--check`` comparison over every step checked."""
    memory: JobMemory
    resumed: bool = False
    """Whether the job ran with ``--checkpoint-dir`` (its result says from which step)."""


class JobComm:
    """The job's collectives on its control group (``None``: the world; a CPU gloo group under NCCL)."""

    def __init__(self, group=None, world_size: int | None = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.world_size = world_size if world_size is not None else dist.get_world_size(group)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def all_gather(self, values: Sequence[float]) -> list[tuple[float, ...]]:
        """Every rank's ``values`` (float64), in rank order."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor(list(values), dtype=torch.float64)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [tuple(float(x) for x in t) for t in out]


class StepClock:
    """A step's shared start: every rank meets at the job's barrier, then reads its clock.

    On one host ``time.perf_counter`` is one monotonic clock for all
    processes, so the records of every rank land on one timeline
    (:func:`~graphpipe.runtime.results.finish_job`).
    """

    def __init__(self, comm: JobComm) -> None:
        self._comm = comm

    def start(self) -> float:
        self._comm.barrier()
        return time.perf_counter()


class Engine(Protocol):
    """One way of running a plan's steps on a rank (module docstring)."""

    checks_each_step: bool
    """``--check`` compares after every step (True) or only after the first (a one-step reference)."""

    def prepare(self) -> None:
        """Build this rank's stages (and ``--check``'s reference); collective."""

    def num_steps(self) -> int:
        """How many times :meth:`step` runs (a stream of many mini-batches is one)."""

    def step(self, step: int, clock: StepClock) -> StepReport:
        """Run step ``step``; its timed part begins at ``clock.start()`` (collective)."""

    def check(self, step: int, first: bool) -> CheckTally | None:
        """Compare this rank's state after ``step`` with the reference (``first``: the first step run, whose
        comparison counts each tensor); None where this rank has nothing to compare."""

    def parameters(self) -> Sequence["torch.nn.Parameter"]:
        """The parameters the driver's optimizer steps (none when the engine updates its weights itself)."""

    def resume(self, directory: str, optimizer) -> int:
        """Load the newest step checkpoint under ``directory``; its step, or 0."""

    def save(self, directory: str, optimizer, step: int) -> None:
        """Write the step checkpoint of ``step`` steps done."""

    def finish(self, run: JobRun) -> Any:  # a RunResult on rank 0 (not imported: results imports this module)
        """Rank 0's result (None elsewhere); collective."""

    def close(self) -> None:
        """The end of the job: release the process groups the engine made."""


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drive_job(engine: Engine, options: "RunOptions", *, rank: int, comm: JobComm) -> Any:  # rank 0: a RunResult
    """Run one job on this rank through ``engine`` (module docstring); rank 0 returns its
    :class:`~graphpipe.runtime.results.RunResult`, other ranks ``None``. Collective."""
    from graphpipe.errors import PlanError
    from graphpipe.progress import step_done
    from graphpipe.runtime.step_checkpoints import check_steps_left

    engine.prepare()
    params = list(engine.parameters())
    optimizer = None
    if params:
        import torch

        optimizer = torch.optim.SGD(params, lr=options.lr)
    fault = options.fault
    start = 0
    if options.checkpoint_dir:
        start = engine.resume(options.checkpoint_dir, optimizer)
        check_steps_left(options.checkpoint_dir, start, options.steps, PlanError)
    clock = StepClock(comm)
    reports: list[StepReport] = []
    tally = CheckTally()
    for step in range(start, engine.num_steps()):
        reports.append(engine.step(step, clock))
        if fault is not None and fault.hits(rank, "grad"):  # a wrong gradient --check must catch
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        if options.check and (engine.checks_each_step or step == start):
            found = engine.check(step, first=step == start)
            if found is not None:
                tally = tally + found
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        if options.checkpoint_dir and (step + 1) % options.checkpoint_every == 0:
            engine.save(options.checkpoint_dir, optimizer, step + 1)
        if fault is not None and fault.hits(rank, "kill") and step == start + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        step_done()
    measured = options
    if start:  # the run's steps (and the reference's losses they are checked against) begin at the resumed step
        measured = replace(options, steps=options.steps - start,
                           warmup_steps=min(options.warmup_steps, options.steps - start - 1))
    memory = _gather_memory(reports, options.warmup_steps, comm)
    result = engine.finish(JobRun(start, measured, tuple(reports), tally, memory,
                                  resumed=bool(options.checkpoint_dir)))
    engine.close()
    return result


def _gather_memory(reports: Sequence[StepReport], warmup_steps: int, comm: JobComm) -> JobMemory:
    """Every rank's peaks over its steps after the warm-up (all of them when there are no others)."""
    timed = list(reports[warmup_steps:]) or list(reports)
    mine = (float(max((r.peak_saved_bytes for r in timed), default=0)),
            float(max((r.cuda_peak_bytes or 0 for r in timed), default=0)), float(peak_rss_bytes()))
    every = comm.all_gather(mine)
    return JobMemory(peak_activation_bytes=tuple(m[0] for m in every), cuda_peak_bytes=tuple(m[1] for m in every),
                     peak_rss_bytes=tuple(m[2] for m in every),
                     on_cuda=any(r.cuda_peak_bytes is not None for r in timed))
