"""The settings of one run (``graphpipe run``'s flags, the training API's checks), free of torch.

:class:`RunOptions` and the test hook :class:`FaultInjection` live apart
from the modules that run a job (:mod:`graphpipe.runtime.runnable`,
:mod:`graphpipe.runtime.reference`) so that building the command line (every
``graphpipe`` command builds every subcommand's flags) and planning never
import torch: a plan of a cached or file-given graph needs none of it.

Example
-------
>>> RunOptions(steps=2).warmup_steps
1
>>> fault_from_env({"GRAPHPIPE_FAIL_RANK": "1", "GRAPHPIPE_FAIL_AT": "B"})
FaultInjection(rank=1, at='B')
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from graphpipe.errors import InputError

if TYPE_CHECKING:
    from graphpipe.plan import Plan

__all__ = ["RunOptions", "flag", "FaultInjection", "fault_from_env", "PRECISIONS", "FAULT_POINTS", "CHECK_RTOL", "CHECK_ATOL"]

CHECK_RTOL = 1.3e-6
CHECK_ATOL = 1e-5

FAULT_POINTS = ("F", "B", "setup", "hang", "kill", "grad")

MAX_TIMEOUT_S = 86400.0
"""Longest --timeout (a day): a wait longer than that is a hang."""
DEFAULT_TIMEOUT_S = 60.0
"""--timeout when not given."""
COMPILE_TIMEOUT_S = 600.0
"""--timeout when not given with --compile: a rank's first step compiles every stage it hosts (minutes for a large
stage on a CPU) while the ranks waiting for its messages count that time against the timeout."""


@dataclass(frozen=True, slots=True)
class FaultInjection:
    """Make rank ``rank`` fail on purpose, to test that failures never hang.

    ``at``: ``F`` or ``B`` raise at the rank's first action of that kind,
    ``setup`` raises before joining the process group, ``hang`` stops
    answering at the first F (its peers must time out), ``kill`` SIGKILLs
    the rank at the end of its second training step (after that step's
    checkpoint, if any), as the out-of-memory killer would, and ``grad``
    halves the rank's gradients after every step (a wrong gradient, such as
    a micro-batch missed, which ``--check`` must report). A restarted run
    (``--max-restarts``) runs without it: the fault fires once.
    """

    rank: int
    at: str

    def __post_init__(self) -> None:
        if self.at not in FAULT_POINTS:
            raise InputError(f"fault injection point must be one of {', '.join(FAULT_POINTS)}, got {self.at!r}")

    def hits(self, rank: int, at: str) -> bool:
        return self.rank == rank and self.at == at

    def describe(self) -> str:
        return f"GRAPHPIPE_FAIL_RANK={self.rank}, GRAPHPIPE_FAIL_AT={self.at}"


def fault_from_env(environ=None) -> FaultInjection | None:
    """The test hook's way in: ``GRAPHPIPE_FAIL_RANK=R`` and ``GRAPHPIPE_FAIL_AT=F|B|setup|hang|kill|grad``.

    Read once at the edge (the launcher, ``python -m graphpipe.runtime``)
    and carried in :attr:`RunOptions.fault`; the executor never reads the
    environment.
    """
    env = os.environ if environ is None else environ
    rank, at = env.get("GRAPHPIPE_FAIL_RANK"), env.get("GRAPHPIPE_FAIL_AT")
    if rank is None or at is None:
        return None
    try:
        return FaultInjection(int(rank), at)
    except ValueError:
        raise InputError(f"GRAPHPIPE_FAIL_RANK must be an integer rank, got {rank!r}") from None


PRECISIONS = ("fp32", "bf16")
"""Precisions a run trains at (``graphpipe run --precision``)."""


def flag(name: str, *, help: str, **argparse_kwargs) -> dict:
    """A :class:`RunOptions` field's command-line flag: its name, its help, and argparse extras (``metavar``,
    ``choices``). Type and default come from the field itself (:mod:`graphpipe.runtime.flags` reads both), so an
    option is declared in one place. A ``bool`` field is a switch: ``--name`` sets a ``False`` default to True, and a
    ``--no-...`` name clears a ``True`` default."""
    return {"flag": name, "help": help, "argparse": argparse_kwargs}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """The settings of one run. Fields with a ``flag`` in their metadata are ``graphpipe run``'s (and
    ``python -m graphpipe.runtime``'s) options, generated from these declarations; the rest are set in code."""

    steps: int = field(default=5, metadata=flag(
        "--steps", metavar="K", help="training iterations, the first --warmup of them not measured"))
    warmup_steps: int = field(default=1, metadata=flag(
        "--warmup", metavar="N", help="iterations left out of the measurement"))
    backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata=flag(
        "--backend", choices=("auto", "gloo", "nccl"), help="auto: nccl when every rank has its own GPU, else gloo"))
    check: bool = field(default=False, metadata=flag(
        "--check", help="compare the loss, every gradient and every buffer with a single-process run after every step "
                        "(docs/semantics.md)"))
    baseline: str | None = field(default=None, metadata=flag(
        "--baseline", choices=("torch",),
        help="run on torch.distributed.pipelining instead (sequential plans only; gpipe, 1f1b and interleaved with "
             "torch's classes, any other flushing schedule from its CSV in _PipelineScheduleRuntime)"))
    timeout_s: float | None = field(default=None, metadata=flag(
        "--timeout", metavar="S", help="process-group timeout in seconds: a rank waiting longer fails the run "
                                       f"(default {DEFAULT_TIMEOUT_S:g}; {COMPILE_TIMEOUT_S:g} with --compile, whose "
                                       "first step compiles every stage while its peers wait)"))
    seed: int = field(default=0, metadata=flag("--seed", metavar="N", help="model weights and data seed"))
    lr: float = field(default=0.01, metadata=flag("--lr", help="SGD learning rate of the per-rank optimizer step"))
    num_threads: int = field(default=1, metadata=flag(
        "--threads", metavar="N", help="torch intra-op threads per rank; 1 lets ranks share the host's cores fairly"))
    cpus_per_rank: int = field(default=0, metadata=flag(
        "--cpus-per-rank", metavar="N", help="pin each rank to N CPUs of its own (0: no pinning); steadier CPU timings"))
    # Not argparse choices: a bad value is the one-line InputError of __post_init__ (exit 2) like every other check.
    precision: Literal["fp32", "bf16"] = field(default="fp32", metadata=flag(
        "--precision", metavar="fp32|bf16",
        help="training precision: fp32, or bf16 under torch.autocast (forward, backward and the --check reference); "
             "warned about when the plan's profile was measured at another"))
    check_tolerance: Literal["fp64", "fixed"] = field(default="fp64", metadata=flag(
        "--check-tolerance", choices=("fp64", "fixed"),
        help="--check's tolerance: fp64 adds to atol + rtol*|reference| eight times the reference's own fp32-vs-fp64 "
             "spread per tensor (a second reference run in float64), so ill-conditioned networks pass; fixed: "
             "atol + rtol*|reference| alone and no float64 run (faster; fails correct runs of ill-conditioned "
             "networks)"))
    batchnorm: str | None = field(default=None, metadata=flag(
        "--batchnorm", metavar="MODE",
        help="BatchNorm under micro-batching: per-micro-batch (normalise each replica's rows; running statistics over "
             "the mini-batch) or sync (statistics across a stage's replicas); default: the plan's (per-micro-batch)"))
    measure: bool = field(default=True, metadata=flag(
        "--no-measure", help="train as graphpipe.Pipeline does: no device synchronisation per action and no "
                             "saved-tensor meter (step times stay; per-action times on a GPU are then host times, and "
                             "the report has no activation memory)"))
    checkpoint_dir: str | None = field(default=None, metadata=flag(
        "--checkpoint-dir", metavar="DIR",
        help="save a step checkpoint (weights, optimizer state, step, random generators) under DIR every "
             "--checkpoint-every steps, keeping the newest 2, and start from DIR's newest complete one"))
    checkpoint_every: int = field(default=1, metadata=flag(
        "--checkpoint-every", metavar="K", help="steps between checkpoints with --checkpoint-dir"))
    compile: bool = field(default=False, metadata=flag(
        "--compile", help="compile every stage's forward and backward with torch.compile (inductor); refused for "
                          "split-backward (zero bubble) and PipeDream schedules"))
    max_restarts: int = field(default=0, metadata=flag(
        "--max-restarts", metavar="R",
        help="when a rank fails (killed, out of memory, an error), start every rank again up to R times, resuming "
             "from --checkpoint-dir's newest checkpoint (as torchrun --max-restarts does)"))
    vary_shapes: str | None = field(default=None, metadata=flag(
        "--vary-shapes", metavar="LO:HI[,ROWS_LO:ROWS_HI]",
        help="each step draws every varying length of the model (a token input's sequence) in LO..HI and its rows in "
             "ROWS_LO..ROWS_HI (default: the plan's batch; fewer rows make a partial batch), from the seed and the "
             "step; --check compares every step with one process on the same batch"))
    rtol: float = CHECK_RTOL
    """--check's relative tolerance (bf16 runs get a wider one, :data:`graphpipe.runtime.flags.BF16_CHECK_TOLERANCE`)."""
    atol: float = CHECK_ATOL
    fault: FaultInjection | None = None
    """Test hook: make one rank fail on purpose (:class:`FaultInjection`); None in real runs."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

        if not isinstance(self.steps, int) or self.steps < 1:
            raise InputError(f"--steps must be a positive integer, got {self.steps!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise InputError(f"--warmup must be a non-negative integer, got {self.warmup_steps!r}")
        if not self.warmup_steps < self.steps:  # one step: it is measured; the CLI refuses other cases
            object.__setattr__(self, "warmup_steps", 0 if self.steps == 1 else min(self.warmup_steps, self.steps - 1))
        if self.check_tolerance not in ("fp64", "fixed"):
            raise InputError(f"--check-tolerance must be fp64 or fixed, got {self.check_tolerance!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InputError(f"--backend must be gloo, nccl or auto, got {self.backend!r}")
        if self.timeout_s is None:
            object.__setattr__(self, "timeout_s", COMPILE_TIMEOUT_S if self.compile else DEFAULT_TIMEOUT_S)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # inf and 1e300 overflow the process group's timedelta
            raise InputError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {self.timeout_s!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise InputError(f"--lr must be a finite number >= 0, got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**31 <= self.seed < 2**31:
            raise InputError(f"--seed must be a 32-bit integer, got {self.seed!r}")
        if not isinstance(self.num_threads, int) or not 1 <= self.num_threads <= 4096:
            raise InputError(f"--threads must be between 1 and 4096, got {self.num_threads!r}")
        if not isinstance(self.cpus_per_rank, int) or self.cpus_per_rank < 0:
            raise InputError(f"--cpus-per-rank must be a non-negative integer, got {self.cpus_per_rank!r}")
        if self.compile and self.baseline is not None:
            raise InputError("--compile compiles graphpipe's own stages; --baseline torch runs torch's runtime: "
                             "drop one of them")
        if self.baseline not in (None, "torch"):
            raise InputError(f"--baseline must be 'torch', got {self.baseline!r}")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 1:
            raise InputError(f"--checkpoint-every must be a positive integer, got {self.checkpoint_every!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise InputError(f"--max-restarts must be a non-negative integer, got {self.max_restarts!r}")
        if self.max_restarts and self.checkpoint_dir is None:
            raise InputError("--max-restarts needs --checkpoint-dir: a restarted run resumes from its newest "
                             "checkpoint (without one it would start over)")
        if self.vary_shapes is not None:
            from graphpipe.frontend.shapes import ShapeDraw

            ShapeDraw.parse(self.vary_shapes)
            if self.baseline is not None:
                raise InputError("--vary-shapes runs graphpipe's own runtime: drop --baseline torch")
        if self.batchnorm is not None:
            from graphpipe.runtime.batchnorm import check_batchnorm_mode

            check_batchnorm_mode(self.batchnorm)

    def batchnorm_for(self, plan: Plan) -> str:
        """The BatchNorm mode of a run of ``plan``: this option, else the plan's, else per-micro-batch."""
        return self.batchnorm or getattr(plan, "batchnorm", None) or "per-micro-batch"
