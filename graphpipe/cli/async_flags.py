"""The flags of PipeDream's asynchronous schedules, shared by ``graphpipe plan`` and ``graphpipe simulate``.

``--schedule 1f1b-async [--vertical-sync]`` or ``--schedule 2bw
[--update-every M]`` turn a plan's 1F1B partition into a stream without
flushes (:mod:`graphpipe.sched.async_pipe`); the options are kept in the
plan's ``async`` object. Either flag with a flushing schedule is refused
with one line (exit 2).
"""

from __future__ import annotations

__all__ = ["add_async_arguments", "async_requested", "to_async"]


def add_async_arguments(parser) -> None:
    parser.add_argument("--vertical-sync", action="store_true",
                        help="1f1b-async: every stage runs a micro-batch on the weight version the input stage used")
    parser.add_argument("--update-every", type=int, default=None, metavar="M",
                        help="2bw: micro-batches per weight version (default: the micro-batches of one mini-batch)")
    parser.add_argument("--no-stash", action="store_true",
                        help="1f1b-async / 2bw without weight stashing: a backward runs on the latest weights "
                             "(PipeDream's ablation; its gradients are inconsistent)")


def async_requested(args) -> bool:
    """True for an asynchronous ``--schedule``; refuses the async flags with any other schedule."""
    from graphpipe.sched.async_pipe import ASYNC_SCHEDULES

    name = (args.schedule or "").lower()
    if name in ASYNC_SCHEDULES:
        if args.update_every is not None and args.update_every < 1:
            from graphpipe.errors import InputError

            raise InputError(f"--update-every (2bw's m) must be >= 1, got {args.update_every}")
        return True
    if args.vertical_sync or args.update_every is not None or args.no_stash:
        from graphpipe.errors import InputError

        flag = "--vertical-sync" if args.vertical_sync else "--update-every" if args.update_every is not None \
            else "--no-stash"
        what = f"schedule {args.schedule!r} flushes" if args.schedule else "without one the plan flushes"
        raise InputError(f"{flag} is for the asynchronous schedules (--schedule 1f1b-async or 2bw); {what} "
                         f"every mini-batch")
    return False


def to_async(plan, args, host=None):
    """``plan`` under ``args.schedule`` (an asynchronous one) with the flags' options and steady-state figures."""
    from graphpipe.sched.async_pipe import async_spec_for, with_async

    spec = async_spec_for(args.schedule.lower(), plan.stage_graph, args.vertical_sync, args.update_every,
                          stash=not args.no_stash)
    from dataclasses import replace

    from graphpipe.search.tied import charge_plan

    planned = with_async(plan, spec, host)
    return replace(planned, predicted=charge_plan(planned.predicted, planned))  # the tied-weight all-reduce too
