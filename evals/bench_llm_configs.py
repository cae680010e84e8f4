"""Planning large language models nobody tuned for: each of :mod:`evals.llm_configs` through the whole cold command.

    python -m graphpipe.evals.bench_llm_configs [--configs NAME,...] [--devices 512,1024] [--repeat 2]
                                                [--batch-size 2048] [--cluster h100] [--out evals]

For every configuration and device count it runs ``graphpipe plan
evals/llm_configs.py:NAME --devices N --batch-size B --cluster C --json``
in a fresh process (no graph cache, so every run captures the model) and
records its wall and CPU seconds (user + system), its peak resident memory,
the plan's own search time (``search.time_s``), and whether the capture cut
the repeated blocks (:mod:`graphpipe.frontend.capture_repeats`; its log says so, or
why not). Medians over ``--repeat`` runs, the runs of one configuration
alternating between device counts so both see the same load. A command
that fails is recorded with its last error line and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import graphpipe

__all__ = ["main", "run_plan"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(graphpipe.__file__)))
"""The folder holding the ``graphpipe`` package (the clone's root in a checkout): the subprocesses' import path.
Not this file's parent: installed, this module is ``graphpipe/evals`` and its parent the package itself, whose
modules (``profile``, ``models``) would shadow the standard library's and other packages'."""

# the plan command, with graphpipe.frontend.capture_repeats' log on stderr (whether it cut the stacks, or why not)
_PLAN = ("import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s'); "
         "logging.getLogger('graphpipe.frontend.capture_repeats').setLevel(logging.INFO); "
         "sys.argv = ['graphpipe'] + sys.argv[1:]; from graphpipe.cli import console_main; console_main()")


def run_plan(name: str, devices: int, batch_size: int, cluster: str) -> dict:
    """One cold ``graphpipe plan evals/llm_configs.py:NAME`` in a fresh process: seconds, peak RSS, its search."""
    spec = f"{os.path.join(_HERE, 'llm_configs.py')}:{name}"
    cmd = [sys.executable, "-c", _PLAN, "plan", spec, "--devices", str(devices), "--batch-size", str(batch_size),
           "--cluster", cluster, "--json"]
    env = dict(os.environ, PYTHONPATH=_ROOT, GRAPHPIPE_CACHE_DIR="off", GRAPHPIPE_PROGRESS="off")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=_ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    row = {"config": name, "devices": devices, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
           "peak_rss_gb": usage.ru_maxrss / 2 ** 20, "shortcut": _shortcut(stderr)}
    if proc.returncode:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        row.update(outcome="failed", error=(lines[-1] if lines else f"exit {proc.returncode}")[:300])
        return row
    plan = json.loads(stdout)
    row.update(outcome="ok", search_s=plan["search"].get("time_s"), stages=len(plan["stages"]),
               throughput=plan["predicted"]["throughput"],
               plan=json.dumps({"stages": plan["stages"], "predicted": plan["predicted"]}, sort_keys=True))
    return row


def _shortcut(stderr: str) -> str:
    """What graphpipe.frontend.capture_repeats logged: ``yes: <stacks>`` or ``no: <why>``."""
    for line in stderr.splitlines():
        if line.startswith("graphpipe.frontend.capture_repeats: "):
            text = line.split(": ", 1)[1]
            return f"yes: {text[len('unrolled '):]}" if text.startswith("unrolled ") else f"no: {text}"
    return "no: not logged"


def _median_row(runs: list[dict], batch_size: int, cluster: str) -> dict:
    first = runs[0]
    row = {"config": first["config"], "devices": first["devices"], "batch_size": batch_size, "cluster": cluster,
           "runs": len(runs), "outcome": "ok" if all(r["outcome"] == "ok" for r in runs) else "failed",
           "shortcut": first["shortcut"]}
    for key in ("wall_s", "cpu_s", "peak_rss_gb"):
        row[f"median_{key}"] = statistics.median(r[key] for r in runs)
    ok = [r for r in runs if r["outcome"] == "ok"]
    if ok:
        row["median_search_s"] = statistics.median(r["search_s"] for r in ok)
        row["stages"], row["throughput"] = ok[-1]["stages"], ok[-1]["throughput"]
        row["same_plan"] = len({r["plan"] for r in ok}) == 1
    failed = [r for r in runs if r["outcome"] != "ok"]
    if failed:
        row["error"] = failed[-1]["error"]
    row["command"] = (f"graphpipe plan evals/llm_configs.py:{first['config']} --devices {first['devices']} "
                      f"--batch-size {batch_size} --cluster {cluster} --json")
    return row


def merge(args: argparse.Namespace, names: list[str], counts: list[int], rows: list[dict],
          update: bool) -> tuple[dict, list[dict]]:
    """The result's config and rows: ``rows`` of ``names`` alone, or, with ``update``, replacing only their rows
    in the results already written (the config records which were measured again, when the sweep started and
    under what load)."""
    from graphpipe.evals.common import read_result
    from graphpipe.evals.llm_configs import ARCHS, NAMES

    config = {"configs": names, "devices": counts, "batch_size": args.batch_size, "cluster": args.cluster,
              "repeat": args.repeat, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "shapes": {n: ARCHS[n][2] for n in names}}
    old = read_result(args.out, args.name) if update else None
    if old is None:
        return config, rows
    rows = [r for r in old["rows"] if r["config"] not in names] + rows
    rows.sort(key=lambda r: (NAMES.index(r["config"]) if r["config"] in NAMES else len(NAMES), r["devices"]))
    again = dict(old["config"].get("measured_again", {}))
    again.update({n: {"devices": counts, "repeat": args.repeat, "load_average": config["load_average"],
                      "when": args.started} for n in names})
    measured = set(old["config"]["configs"]) | set(names)   # a config measured for the first time joins
    return dict(old["config"], measured_again=again, configs=[n for n in NAMES if n in measured],
                shapes=dict(old["config"].get("shapes", {}), **config["shapes"])), rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphpipe.evals.bench_llm_configs",
                                description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=None, help="comma-separated names of evals/llm_configs.py (default: all)")
    p.add_argument("--devices", default="512,1024", help="device counts (default 512,1024)")
    p.add_argument("--repeat", type=int, default=2, help="cold commands per configuration and device count")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--cluster", default="h100")
    p.add_argument("--out", default="evals")
    p.add_argument("--name", default="bench_llm_configs")
    p.add_argument("--update", action="store_true",
                   help="replace only these configs' rows in the results already written (the others keep theirs, "
                        "and the config records which were measured again, when and under what load)")
    args = p.parse_args(argv)
    args.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # the sweep's start: "when" it was measured
    from graphpipe.evals.common import write_result
    from graphpipe.evals.llm_configs import ARCHS, NAMES

    names = args.configs.split(",") if args.configs else list(NAMES)
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        p.error(f"unknown configs {', '.join(unknown)}; known: {', '.join(NAMES)}")
    counts = [int(x) for x in args.devices.split(",")]
    rows: list[dict] = []
    path = None
    for name in names:
        runs: dict[int, list[dict]] = {n: [] for n in counts}
        for _ in range(args.repeat):
            for n in counts:
                runs[n].append(run_plan(name, n, args.batch_size, args.cluster))
        for n in counts:
            rows.append(_median_row(runs[n], args.batch_size, args.cluster))
            print(json.dumps(rows[-1]), flush=True)
        # written after every configuration, so a sweep stopped part way keeps the rows it measured
        done = names[:names.index(name) + 1]
        path = write_result(args.out, args.name, *merge(args, done, counts, rows, args.update))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
