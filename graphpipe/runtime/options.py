"""The settings of one run (``graphpipe run``'s flags, the training API's checks), free of torch.

:class:`RunOptions` and the test hook :class:`FaultInjection` live apart
from :mod:`graphpipe.runtime.jobs` so that building the command line (every
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

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from graphpipe.errors import InputError

if TYPE_CHECKING:
    from graphpipe.plan import Plan

__all__ = ["RunOptions", "FaultInjection", "fault_from_env", "PRECISIONS", "FAULT_POINTS", "CHECK_RTOL", "CHECK_ATOL"]

CHECK_RTOL = 1.3e-6
CHECK_ATOL = 1e-5

FAULT_POINTS = ("F", "B", "setup", "hang")


@dataclass(frozen=True, slots=True)
class FaultInjection:
    """Make rank ``rank`` fail on purpose, to test that failures never hang.

    ``at``: ``F`` or ``B`` raise at the rank's first action of that kind,
    ``setup`` raises before joining the process group, ``hang`` stops
    answering at the first F (its peers must time out).
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
    """The test hook's way in: ``GRAPHPIPE_FAIL_RANK=R`` and ``GRAPHPIPE_FAIL_AT=F|B|setup|hang``.

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


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    steps: int = 3
    """Training iterations to run (the first ``warmup_steps`` are not measured)."""
    warmup_steps: int = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """gloo, nccl, or auto (nccl when every rank has its own GPU, else gloo)."""
    check: bool = False
    """Compare the first iteration's loss and gradients with a single-process run."""
    timeout_s: float = 60.0
    """Process-group timeout: any wait longer than this fails the run."""
    seed: int = 0
    lr: float = 0.01
    """SGD learning rate of the per-rank optimizer step."""
    num_threads: int = 1
    """torch intra-op threads per rank (1: ranks share the host's cores fairly)."""
    cpus_per_rank: int = 0
    """Pin each rank to this many CPUs of its own (0: no pinning); see :func:`rank_cpus`."""
    baseline: str | None = None
    """None for our executor, ``"torch"`` for torch.distributed.pipelining."""
    rtol: float = CHECK_RTOL
    atol: float = CHECK_ATOL
    fault: FaultInjection | None = None
    """Test hook: make one rank fail on purpose (:class:`FaultInjection`); None in real runs."""
    batchnorm: str | None = None
    """BatchNorm semantics, ``per-micro-batch`` or ``sync`` (:mod:`graphpipe.runtime.batchnorm`); None: the plan's."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision: ``fp32``, or ``bf16`` under ``torch.autocast`` (forward, backward and the --check reference)."""
    measure: bool = True
    """Time every action (synchronising the device first) and meter saved activations (``--no-measure``: off,
    as in the training API; the report then has step times but no per-action records' device times or memory)."""
    compile: bool = False
    """Compile every stage's forward and backward with ``torch.compile`` (inductor; :mod:`graphpipe.runtime.compiled`)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

        if not isinstance(self.steps, int) or self.steps < 1:
            raise InputError(f"--steps must be a positive integer, got {self.steps!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise InputError(f"--warmup must be a non-negative integer, got {self.warmup_steps!r}")
        if not self.warmup_steps < self.steps:  # one step: it is measured; the CLI refuses other cases
            object.__setattr__(self, "warmup_steps", 0 if self.steps == 1 else min(self.warmup_steps, self.steps - 1))
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InputError(f"--backend must be gloo, nccl or auto, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise InputError(f"--timeout must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise InputError(f"--threads must be >= 1, got {self.num_threads!r}")
        if not isinstance(self.cpus_per_rank, int) or self.cpus_per_rank < 0:
            raise InputError(f"--cpus-per-rank must be a non-negative integer, got {self.cpus_per_rank!r}")
        if self.compile and self.baseline is not None:
            raise InputError("--compile compiles graphpipe's own stages; --baseline torch runs torch's runtime: "
                             "drop one of them")
        if self.baseline not in (None, "torch"):
            raise InputError(f"--baseline must be 'torch', got {self.baseline!r}")
        if self.batchnorm is not None:
            from graphpipe.runtime.batchnorm import check_batchnorm_mode

            check_batchnorm_mode(self.batchnorm)

    def batchnorm_for(self, plan: Plan) -> str:
        """The BatchNorm mode of a run of ``plan``: this option, else the plan's, else per-micro-batch."""
        return self.batchnorm or getattr(plan, "batchnorm", None) or "per-micro-batch"
