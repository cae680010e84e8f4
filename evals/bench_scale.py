"""Search at scale: each zoo paper model x strategy x device count, search time and peak memory.

    python -m graphpipe.evals.bench_scale [--repeat 3] [--devices 128,256,512,1024]
                                          [--models mmt,dlrm,...] [--strategies gpp,pipedream,piper,gpipe]
                                          [--timeout 120] [--cli [--cli-devices 128,...]] [--out evals]
                                          [--name bench_scale]

Each point is what ``graphpipe plan MODEL --devices N --batch-size 16N
--strategy S`` searches (v100 preset, batch 16 per device): the model is
captured once, then every run of ``make_plan`` goes in a process forked from
that one, so each starts from the same state and the row records

* ``median_search_s`` (and min, max): ``make_plan``'s wall time, median of ``--repeat`` runs;
* ``peak_rss_gb``: the largest peak resident size (``ru_maxrss``) of the forked processes, which
  includes everything the command line holds too (Python, torch, the captured graph);
* ``outcome``: ``ok``, ``refused`` (a one-line error: the plan does not fit, or a search limit),
  ``stopped`` (the memory guard), ``timeout`` (killed after ``--timeout`` s), ``killed`` (a signal,
  e.g. the kernel's out-of-memory kill) or ``traceback`` (any other exception: our bug); and the
  error's first line.

The command line adds starting Python and capturing the model (torch.export) to these times:
``--cli`` also times the whole ``graphpipe plan`` per model and strategy (piper aside) at the largest
count (``--cli-devices`` names others), ``--repeat`` times without the captured-graph cache and
``--repeat`` times with it filled.

Timings are of the machine it runs on (``cpus`` and ``load_average`` are
recorded beside them): medians of several runs, since other jobs share it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time

from .common import write_result

__all__ = ["main", "MODELS", "STRATEGIES", "run_point"]

MODELS = ("mmt", "dlrm", "candle-uno", "transformer", "twobranch")
STRATEGIES = ("gpp", "pipedream", "piper", "gpipe")


def _child(graph, model: str, strategy: str, n: int, write_fd: int) -> None:
    """In the forked process: one ``make_plan``, its figures written as JSON to ``write_fd``."""
    from graphpipe.cluster import preset
    from graphpipe.errors import GraphpipeError
    from graphpipe.search.memory_guard import MemoryBudgetError
    from graphpipe.search.planner import make_plan

    started = time.perf_counter()
    out: dict = {}
    try:
        plan = make_plan(model, graph, preset("v100", n), 16 * n, strategy)
        out = {"outcome": "ok", "throughput": plan.predicted.throughput}
    except MemoryBudgetError as exc:
        out = {"outcome": "stopped", "error": str(exc)}
    except GraphpipeError as exc:
        out = {"outcome": "refused", "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 -- recorded: a traceback is a finding of this eval
        out = {"outcome": "traceback", "error": f"{type(exc).__name__}: {exc}"}
    out["search_s"] = time.perf_counter() - started
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    os.write(write_fd, json.dumps(out).encode())


def _one(graph, model: str, strategy: str, n: int, timeout_s: float) -> dict:
    """One forked ``make_plan``; killed after ``timeout_s``."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        try:
            _child(graph, model, strategy, n, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    started = time.perf_counter()
    status = None
    while time.perf_counter() - started < timeout_s:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        return {"outcome": "timeout", "search_s": timeout_s, "peak_rss_bytes": None}
    chunks = []
    while True:
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    if not chunks:
        return {"outcome": "killed", "error": f"wait status {status}", "search_s": time.perf_counter() - started,
                "peak_rss_bytes": None}
    return json.loads(b"".join(chunks))


def run_point(graph, model: str, strategy: str, n: int, repeat: int, timeout_s: float) -> dict:
    """Median search time and the largest peak RSS of ``repeat`` runs of one (model, strategy, devices) point.

    A point whose first run times out is not repeated (it would only time out again)."""
    runs = [_one(graph, model, strategy, n, timeout_s)]
    if runs[0]["outcome"] != "timeout":
        runs += [_one(graph, model, strategy, n, timeout_s) for _ in range(repeat - 1)]
    times = [r["search_s"] for r in runs]
    row = {"model": model, "strategy": strategy, "devices": n, "batch_size": 16 * n, "runs": len(runs),
           "median_search_s": statistics.median(times), "min_search_s": min(times), "max_search_s": max(times),
           "peak_rss_gb": max((r["peak_rss_bytes"] or 0.0) for r in runs) / 2**30,
           "outcome": runs[-1]["outcome"], "outcomes": sorted({r["outcome"] for r in runs})}
    if "throughput" in runs[-1]:
        row["throughput"] = runs[-1]["throughput"]
    if runs[-1].get("error"):
        row["error"] = runs[-1]["error"].splitlines()[0]
    return row


def _cli_once(model: str, n: int, strategy: str, cache: str) -> tuple[float, int, float | None, str]:
    cmd = [sys.executable, "-m", "graphpipe", "plan", model, "--devices", str(n), "--batch-size", str(16 * n),
           "--strategy", strategy, "--json"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GRAPHPIPE_CACHE_DIR": cache})
    wall = time.perf_counter() - started
    search = json.loads(proc.stdout)["search"]["time_s"] if proc.returncode == 0 else None
    return wall, proc.returncode, search, (proc.stderr.strip().splitlines() or [""])[-1]


def cli_time(model: str, counts: tuple[int, ...], strategies: tuple[str, ...] = ("gpp",),
             repeat: int = 3) -> list[dict]:
    """Wall time of the whole ``graphpipe plan`` command, one row per device count and strategy:
    ``median_cold_wall_s`` over ``repeat`` runs without the captured-graph cache (``GRAPHPIPE_CACHE_DIR=off``:
    each run captures the model with torch.export, as a model's first plan on a machine does),
    ``median_wall_s`` over ``repeat`` runs with the model's graph cached (:mod:`graphpipe.frontend.graph_cache`,
    filled once per model: its key does not hold the device count)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-cache-") as cache:
        _cli_once(model, counts[0], strategies[0], cache)  # fills the cache
        for n in counts:
            for strategy in strategies:
                colds = [_cli_once(model, n, strategy, "off")[0] for _ in range(repeat)]
                runs = [_cli_once(model, n, strategy, cache) for _ in range(repeat)]
                walls = [r[0] for r in runs]
                rows.append({"model": model, "strategy": strategy, "devices": n,
                             "median_cold_wall_s": statistics.median(colds), "max_cold_wall_s": max(colds),
                             "median_wall_s": statistics.median(walls), "max_wall_s": max(walls),
                             "rc": runs[-1][1], "search_s": runs[-1][2],
                             "error": runs[-1][3] if runs[-1][1] else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--devices", default="128,256,512,1024")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--timeout", type=float, default=120.0, help="kill a run still going after this many seconds")
    ap.add_argument("--cli", action="store_true", help="also time the whole graphpipe plan command per model")
    ap.add_argument("--cli-devices", default=None,
                    help="with --cli: comma-separated device counts to time it at (default: the largest of --devices)")
    ap.add_argument("--out", default="evals")
    ap.add_argument("--name", default="bench_scale", help="result file name under OUT/results")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    try:
        devices = [int(x) for x in args.devices.split(",")]
        cli_devices = [int(x) for x in args.cli_devices.split(",")] if args.cli_devices else [max(devices)]
    except ValueError:
        ap.error(f"--devices and --cli-devices must be comma-separated integers, got {args.devices!r} and "
                 f"{args.cli_devices!r}")
    strategies = args.strategies.split(",")
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; one of {', '.join(STRATEGIES)}")
    from graphpipe.cluster import preset
    from graphpipe.models import load_model

    rows, cli = [], []
    for model in args.models.split(","):
        graph = load_model(model, preset("v100", 1).device).graph
        for strategy in strategies:
            for n in devices:
                row = run_point(graph, model, strategy, n, args.repeat, args.timeout)
                rows.append(row)
                print(f"{model:11s} {strategy:9s} {n:5d}  {row['median_search_s']:7.2f} s  "
                      f"[{row['min_search_s']:.2f}, {row['max_search_s']:.2f}]  {row['peak_rss_gb']:5.2f} GB  "
                      f"{row['outcome']}" + (f"  {row['error'][:100]}" if row.get("error") else ""), flush=True)
        if args.cli:
            for row in cli_time(model, tuple(cli_devices), tuple(s for s in strategies if s != "piper"), args.repeat):
                cli.append(row)
                print(f"{model:11s} graphpipe plan --devices {row['devices']} --strategy {row['strategy']}: "
                      f"cold median {row['median_cold_wall_s']:.2f} s (max {row['max_cold_wall_s']:.2f}), cached "
                      f"median {row['median_wall_s']:.2f} s wall (exit {row['rc']}, search {row['search_s']})",
                      flush=True)
    path = write_result(args.out, args.name, {"repeat": args.repeat, "devices": devices, "models": args.models,
                                              "strategies": args.strategies, "cpus": os.cpu_count(),
                                              "load_average": os.getloadavg(), "samples_per_device": 16,
                                              "cluster": "v100", "timeout_s": args.timeout, "cli": cli}, rows)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
