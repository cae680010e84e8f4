"""The flags of a run, declared once for ``graphpipe run`` and ``python -m graphpipe.runtime``.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_run_arguments(parser)
>>> options = options_from_args(parser.parse_args(["--steps", "4", "--check"]))
>>> options.steps, options.check, options.warmup_steps
(4, True, 1)
"""

from __future__ import annotations

import argparse

from graphpipe.runtime.options import RunOptions

__all__ = ["add_run_arguments", "options_from_args"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags that become a :class:`~graphpipe.runtime.options.RunOptions` (not the outputs)."""
    parser.add_argument("--steps", type=int, default=5, help="training iterations (default 5; the first is a warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations excluded from the measurement (default 1)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="auto: nccl when every rank has its own GPU, else gloo")
    parser.add_argument("--check", action="store_true",
                        help="compare the first iteration's loss and every gradient with a single-process run")
    parser.add_argument("--baseline", default=None, choices=("torch",),
                        help="run on torch.distributed.pipelining instead (sequential plans only)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="process-group timeout in seconds: a rank waiting longer fails the run (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="model weights and data seed (default 0)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--cpus-per-rank", type=int, default=0, metavar="N",
                        help="pin each rank to N CPUs of its own (default 0: no pinning); steadier CPU timings")
    parser.add_argument("--precision", default="fp32", metavar="fp32|bf16",
                        help="training precision: fp32 (default) or bf16 (torch.autocast); recorded in the output, "
                             "warned about when the plan's profile was measured at another")
    # Not argparse choices: a bad value is the one-line InputError of RunOptions (exit 2) like every other flag.
    parser.add_argument("--batchnorm", default=None, metavar="MODE",
                        help="BatchNorm under micro-batching: per-micro-batch (normalise each replica's rows; running "
                             "statistics over the mini-batch) or sync (statistics across a stage's replicas); "
                             "default: the plan's (per-micro-batch)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="train as the Python API does: no device synchronisation per action and no saved-tensor "
                             "meter (step times stay; per-action times on a GPU are then host times, and the report "
                             "has no activation memory)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every stage's forward and backward with torch.compile (inductor); refused for "
                             "split-backward (zero bubble) schedules")


BF16_CHECK_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}
"""``--check`` at bf16: the run and its single-process reference round differently (micro-batches, sums in another
order), by up to a bfloat16 ulp (2^-7 relative) per value; torch.testing's bf16 rtol, an atol of the same size."""


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """The :class:`RunOptions` of parsed :func:`add_run_arguments` flags (checked in its ``__post_init__``)."""
    precision = getattr(args, "precision", "fp32")
    return RunOptions(**(BF16_CHECK_TOLERANCE if precision == "bf16" else {}),
                      steps=args.steps, warmup_steps=args.warmup, backend=args.backend, check=args.check,
                      timeout_s=args.timeout, seed=args.seed, lr=args.lr, num_threads=args.threads,
                      cpus_per_rank=args.cpus_per_rank, baseline=args.baseline,
                      batchnorm=getattr(args, "batchnorm", None), precision=precision,
                      measure=getattr(args, "measure", True), compile=getattr(args, "compile", False))
