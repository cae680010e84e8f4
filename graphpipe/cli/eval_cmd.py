"""``graphpipe eval NAME|all [--out DIR] [--quick]``: the paper's experiments, plots and REPORT.md."""

from __future__ import annotations

import os
import sys

from graphpipe.errors import InputError

__all__ = ["register", "DEFAULT_OUT"]

DEFAULT_OUT = "eval-out"
"""Results go under the working directory, never into the installed package."""


def register(sub) -> None:
    p = sub.add_parser("eval", help="reproduce the paper's evaluations (plots, tables, REPORT.md)",
                       description="Run one experiment or all of them; write results/<name>.json, <name>.png and REPORT.md.")
    p.add_argument("name", metavar="NAME", help="throughput, search-time, branches, ablation, case-study, memory, "
                                                "fidelity, memory-runtime, zero-bubble, async-throughput, staleness, or all")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default ./eval-out, ./eval-out/quick with --quick; --out evals regenerates "
                        "the repository's committed REPORT.md)")
    p.add_argument("--quick", action="store_true", help="small sizes and few devices (CI smoke test, ~3 min)")
    p.add_argument("--report-only", action="store_true",
                   help="do not run anything: redraw the figures and REPORT.md from the existing result files")
    p.set_defaults(func=run)


def run(args) -> int:
    from graphpipe.evals.experiments import ORDER, run_experiment
    from graphpipe.evals.notes import NOTES
    from graphpipe.evals.plots import plot_all
    from graphpipe.evals.report import write_report

    names = list(ORDER) if args.name == "all" else [args.name]
    for name in names:
        if name not in ORDER:
            raise InputError(f"unknown experiment {name!r}; known: {', '.join(ORDER)}, all")
    out = args.out or (os.path.join(DEFAULT_OUT, "quick") if args.quick else DEFAULT_OUT)
    if args.report_only:
        missing = [n for n in names if not os.path.exists(os.path.join(out, "results", f"{n}.json"))]
        if missing:
            raise InputError(f"no result files for {', '.join(missing)} in {out}/results; run without --report-only first")
    else:
        for name in names:
            path = run_experiment(name, out, args.quick)
            sys.stderr.write(f"wrote {path}\n")
    for path in plot_all(out, names):
        sys.stderr.write(f"wrote {path}\n")
    report = write_report(out, {} if args.quick else NOTES)
    sys.stderr.write(f"wrote {report}\n")
    return 0
