"""``python -m graphpipe.runtime PLAN.json``: one rank of a run started by torchrun.

::

    torchrun --nproc-per-node 4 -m graphpipe.runtime plan.json --steps 5 --check --json

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
torchrun), runs the same worker code as ``graphpipe run`` and prints the
summary (or JSON) on rank 0. The world size must equal the plan's device
count. Errors end this rank with exit 1 and the message on stderr; torchrun
then stops the other ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from graphpipe.runtime.flags import add_run_arguments

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.runtime", description=__doc__.split("\n")[0])
    parser.add_argument("plan", metavar="PLAN.json")
    add_run_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from graphpipe.errors import GraphpipeError
    from graphpipe.plan import plan_to_dict, read_plan
    from graphpipe.runtime import preflight
    from graphpipe.runtime.flags import options_from_args
    from graphpipe.runtime.options import fault_from_env
    from graphpipe.runtime.measure import format_summary, summarize
    from graphpipe.runtime.worker import run_rank

    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]  # noqa: B018 - fail early with a clear message
    except KeyError as exc:
        sys.stderr.write(f"graphpipe.runtime: error: environment variable {exc.args[0]} is not set; "
                         "start this module with torchrun (or use `graphpipe run`)\n")
        return 2
    try:
        plan = read_plan(args.plan)
        if world_size != plan.cluster.num_devices:
            raise GraphpipeError(f"WORLD_SIZE={world_size} but the plan has {plan.cluster.num_devices} devices; "
                                 f"use --nproc-per-node {plan.cluster.num_devices}")
        options = replace(options_from_args(args), fault=fault_from_env())
        if rank == 0:
            preflight(plan, options)
        result = run_rank(rank, world_size, [(plan_to_dict(plan), options)], "env://")[0]
    except GraphpipeError as exc:
        sys.stderr.write(f"graphpipe.runtime: error: rank {rank}: {exc}\n")
        return 2
    except Exception as exc:  # noqa: BLE001 - one line with the rank, torchrun stops the others
        sys.stderr.write(f"graphpipe.runtime: error: rank {rank} failed: {type(exc).__name__}: {exc}\n")
        return 1
    if rank == 0 and result is not None:
        summary = summarize(plan, result)
        if args.json:
            json.dump(summary.to_dict(), sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(format_summary(summary))
        if summary.check is not None and not summary.check.passed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
