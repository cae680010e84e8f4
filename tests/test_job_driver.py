"""The job driver's cadence over a fake engine, without torch.distributed (graphpipe.runtime.driver).

The driver owns what every engine shares: a barrier before each step's
timed part, the warm-up left out of the memory peaks, ``--check`` after
every step (or the first only), the optimizer after the check, step
checkpoints every ``checkpoint_every`` steps, the ``grad`` and ``kill``
fault hooks, and the job's close. A fake engine records what it was asked
and when; the assertions state the cadence's defining properties.
"""

from __future__ import annotations

import pytest
import torch

from graphpipe.runtime.driver import CheckTally, JobRun, StepReport, drive_job
from graphpipe.runtime.options import FaultInjection, RunOptions


class LocalComm:
    """One rank's collectives: a barrier counter, an all-gather of itself."""

    world_size = 1

    def __init__(self, log: list) -> None:
        self.log = log

    def barrier(self) -> None:
        self.log.append(("barrier",))

    def all_gather(self, values):
        self.log.append(("gather",))
        return [tuple(values)]


class FakeEngine:
    """Steps that report their index as their time and loss; a parameter whose gradient is 1 after each step."""

    def __init__(self, log: list, *, steps: int, checks_each_step: bool = True, resume_at: int = 0) -> None:
        self.log, self.steps, self.checks_each_step, self.resume_at = log, steps, checks_each_step, resume_at
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.run: JobRun | None = None

    def prepare(self) -> None:
        self.log.append(("prepare",))

    def num_steps(self) -> int:
        return self.steps

    def parameters(self):
        return [self.weight]

    def resume(self, directory, optimizer) -> int:
        self.log.append(("resume", directory, optimizer is not None))
        return self.resume_at

    def save(self, directory, optimizer, step: int) -> None:
        self.log.append(("save", step, float(self.weight.detach())))

    def step(self, step: int, clock) -> StepReport:
        self.log.append(("untimed", step))  # an engine's data and zeroed gradients come before the shared start
        clock.start()
        self.log.append(("step", step))
        self.weight.grad = torch.ones(())
        return StepReport(float(step + 1), float(step), peak_saved_bytes=100 * (step + 1))

    def check(self, step: int, first: bool) -> CheckTally:
        self.log.append(("check", step, first, float(self.weight.grad)))
        return CheckTally(0.1 * step, 0, int(first), 2 * int(first))

    def finish(self, run: JobRun):
        self.log.append(("finish",))
        self.run = run
        return "result"

    def close(self) -> None:
        self.log.append(("close",))


def _drive(engine, **options):
    log = engine.log
    result = drive_job(engine, RunOptions(**options), rank=0, comm=LocalComm(log))
    return result, log


def _kinds(log, kind):
    return [e for e in log if e[0] == kind]


def test_each_step_starts_at_a_barrier_after_its_untimed_part_then_checks_steps_and_finishes():
    engine = FakeEngine([], steps=4)
    result, log = _drive(engine, steps=4, warmup_steps=1, check=True, lr=0.5)
    assert result == "result"
    assert log[0] == ("prepare",) and log[-2:] == [("finish",), ("close",)]
    for k in range(4):  # untimed part, barrier, timed part, check: in that order, once per step
        i = log.index(("untimed", k))
        assert log[i + 1] == ("barrier",) and log[i + 2] == ("step", k)
        assert log[i + 3][:3] == ("check", k, k == 0)
        assert log[i + 3][3] == 1.0  # the check sees the step's gradient, before the optimizer steps it away
    assert float(engine.weight.detach()) == pytest.approx(-0.5 * 4)  # SGD at --lr after every step
    run = engine.run
    assert [r.iteration_time_s for r in run.reports] == [1.0, 2.0, 3.0, 4.0]
    # the tally sums every step's comparison; each tensor is counted at the first step only
    assert run.tally == CheckTally(pytest.approx(0.3), 0, 1, 2)
    # memory peaks leave the warm-up step out
    assert run.memory.peak_activation_bytes == (400.0,)
    assert run.start == 0 and run.options.steps == 4 and not run.resumed


def test_a_one_step_reference_is_checked_after_the_first_step_only():
    engine = FakeEngine([], steps=3, checks_each_step=False)
    _, log = _drive(engine, steps=3, check=True)
    assert [e[1] for e in _kinds(log, "check")] == [0]
    _, log = _drive(FakeEngine([], steps=3), steps=3, check=False)
    assert not _kinds(log, "check")


def test_checkpoints_every_k_steps_after_the_optimizer_and_a_resumed_run_counts_from_its_step():
    engine = FakeEngine([], steps=7, resume_at=2)
    _, log = _drive(engine, steps=7, warmup_steps=2, checkpoint_dir="ckpt", checkpoint_every=2, lr=1.0)
    assert _kinds(log, "resume") == [("resume", "ckpt", True)]  # with the driver's optimizer, before any step
    assert [e[1] for e in _kinds(log, "step")] == [2, 3, 4, 5, 6]
    # saved at every multiple of 2 steps done, after that step's update (the weight went down by one per step)
    assert _kinds(log, "save") == [("save", 4, -2.0), ("save", 6, -4.0)]
    run = engine.run
    assert run.start == 2 and run.resumed
    assert (run.options.steps, run.options.warmup_steps) == (5, 2)  # the figures cover the resumed steps
    assert run.memory.peak_activation_bytes == (700.0,)  # warm-up counted from the resumed step


def test_a_resumed_run_with_nothing_left_is_refused():
    from graphpipe.errors import PlanError

    with pytest.raises(PlanError, match="already holds step 3"):
        _drive(FakeEngine([], steps=3, resume_at=3), steps=3, checkpoint_dir="ckpt")


def test_the_grad_fault_halves_the_faulty_rank_gradients_before_the_check():
    engine = FakeEngine([], steps=2)
    _, log = _drive(engine, steps=2, check=True, fault=FaultInjection(0, "grad"))
    assert [e[3] for e in _kinds(log, "check")] == [0.5, 0.5]
    engine = FakeEngine([], steps=2)
    _, log = _drive(engine, steps=2, check=True, fault=FaultInjection(1, "grad"))  # another rank's fault
    assert [e[3] for e in _kinds(log, "check")] == [1.0, 1.0]


def test_the_kill_fault_ends_the_rank_after_its_second_step_and_that_step_checkpoint(monkeypatch):
    import os

    killed = []

    class Killed(Exception):
        pass

    def kill(pid, sig):
        killed.append((pid, sig))
        raise Killed

    monkeypatch.setattr(os, "kill", kill)
    engine = FakeEngine([], steps=5, resume_at=1)
    with pytest.raises(Killed):
        _drive(engine, steps=5, checkpoint_dir="ckpt", fault=FaultInjection(0, "kill"))
    log = engine.log
    assert [e[1] for e in _kinds(log, "step")] == [1, 2]  # the second step run after the resume
    assert [e[1] for e in _kinds(log, "save")] == [2, 3]  # its checkpoint was written before the kill
    assert killed and ("finish",) not in log
