"""Runtime benchmark: real runs on CPU ranks, measured side by side.

::

    python -m graphpipe.evals.bench_runtime                 # writes out/results/bench_runtime.json, prints the summary
    python -m graphpipe.evals.bench_runtime --quick         # smaller models and fewer steps (smoke run)

What it measures (all on ``--ranks`` gloo processes, one torch thread each, pinned):

(a) GraphPipe vs PipeDream: the ``gpp`` and ``pipedream`` plans of a branchy
    model (CANDLE-Uno, sized so compute dominates communication), both planned
    on the same calibrated cost model and for the same host
    (``SearchOptions.host``: the measured CPU share below; either may leave
    ranks idle when the host's cores, not the ranks, are the limit), measured
    throughput ratio (target >= 1.15).
(b) Simulator error ``|predicted - measured| / measured`` of every plan run,
    with the cost model calibrated first: op times from
    :func:`graphpipe.frontend.profile.profile_model` (CPU, one thread, fitted
    ``alpha + beta*b``) applied with :func:`graphpipe.frontend.profile.apply_profile`,
    and a custom cluster whose link latency and bandwidth come from gloo
    between local processes (:func:`measure_link`) (target < 20%). A profile taken by
    one process on an idle core overstates the speed of a rank that shares
    the host's cores with ``ranks - 1`` others, so the device is calibrated
    too: the slowdown of the model's training step run by ``k`` processes at
    once over one alone (:func:`measure_cpu_share`, ``k = 1..ranks``) becomes
    the simulator's :class:`graphpipe.sched.SharedHost`, so every action is
    slowed by the number of ranks computing at that instant
    (:func:`predict_calibrated`). Three errors are reported: profile only;
    the previous calibration (every op scaled by the slowdown at the plan's
    mean number of busy ranks, :func:`predict_mean_share`); and the shared
    host, the one quoted.
(c) Our runtime vs ``torch.distributed.pipelining`` on the sequential
    transformer, same partition, schedule (1F1B), data and ranks: throughput
    ratio (target >= 0.95).

Side by side: every plan is a job of one spawned world and jobs are repeated
round-robin (``--rounds``). Iteration times are medians over all measured
steps of all rounds; ratios are the median over rounds of the ratio of the
two jobs' medians in that round (run back to back), so load drifting on a
shared host between rounds cancels out; ``a_ci95``/``c_ci95`` are percentile
bootstrap 95% intervals of those medians over the rounds. With
``--cpus-per-rank`` (default auto) every rank, the profile and the
calibration processes run on CPUs of their own (:func:`auto_cpus_per_rank`),
which on a 2-core host made runs faster and steadier: ranks stop migrating
and sharing a core. Pinned to one CPU, a rank's gloo thread shares its
core, so the ping-pong latency measured for the cluster rises (0.1 ms to
about 1 ms here); in pipelined runs that latency overlaps compute.
The result file records the resolved config, versions, git SHA, the host's
CPU count and load average (a 2-core host runs 4 ranks time-shared: say so
when quoting the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from typing import Any

__all__ = ["main", "measure_link", "cpu_cluster_doc"]

UNO = "candle-uno:small,branches=4,layers=3,hidden=1024,features=512,head_layers=2"
UNO_QUICK = "candle-uno:small,branches=4,layers=2,hidden=128,features=64"
GPT = "transformer:small,layers=8,hidden=128,seq=32,heads=4,ffn=512,vocab=256"
GPT_QUICK = "transformer:small,layers=4,hidden=64,seq=16,heads=4,ffn=128,vocab=100"
BUSY_S = 0.03
"""Seconds the ranks outside a ping-pong compute after each start (longer than the largest round trip)."""


# ------------------------------------------------------------------ link calibration
def _linkbench(rank: int, world: int, port: int, sizes: list[int], ar_sizes: list[int], repeats: int, out,
               cpus_per_rank: int = 0) -> None:
    import torch
    import torch.distributed as dist

    from graphpipe.runtime.worker import pin_rank

    pin_rank(rank, cpus_per_rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    p2p, ar = {}, {}
    work = torch.randn(128, 128)
    for n in sizes:  # ping-pong between ranks 0 and 1; one-way time = round trip / 2
        buf = torch.zeros(n // 4, dtype=torch.float32)
        samples = []
        for i in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            else:  # the other ranks compute meanwhile, as in a run: the two must win cores to move the bytes
                while time.perf_counter() - t0 < BUSY_S:
                    work = torch.tanh(work @ work * 0.01)
            if i >= 3:
                samples.append((time.perf_counter() - t0) / 2)
        p2p[n] = statistics.median(samples)
    for n in ar_sizes:  # ring all-reduce among every rank, as a replicated stage does
        buf = torch.ones(n // 4, dtype=torch.float32)
        samples = []
        for i in range(max(3, repeats // 4) + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if i >= 1:
                samples.append(time.perf_counter() - t0)
        ar[n] = statistics.median(samples)
    if rank == 0:
        out.put((p2p, ar))
    dist.destroy_process_group()


def measure_link(ranks: int = 2, sizes=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22),
                 ar_sizes=(1 << 20, 1 << 22, 1 << 24), repeats: int = 20, cpus_per_rank: int = 0) -> dict[str, Any]:
    """Calibrate the cluster's link from gloo between local processes.

    Latency: intercept of the ping-pong one-way time vs bytes. Bandwidth: the
    smaller of the ping-pong bandwidth and the *effective* ring all-reduce
    bandwidth of ``ranks`` processes (``2(r-1)/r * bytes / time``). On one
    CPU host, moving and summing bytes costs the same cores that compute, so
    a bulk all-reduce is far slower than the loopback wire; the cost model
    has one bandwidth per link, and the bulk transfers a plan makes are its
    gradient all-reduces (activations are small here).
    """
    import multiprocessing as mp

    import numpy as np

    from graphpipe.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    world = max(2, ranks)
    procs = [ctx.Process(target=_linkbench, args=(r, world, port, list(sizes), list(ar_sizes), repeats, q, cpus_per_rank))
             for r in range(world)]
    for p in procs:
        p.start()
    p2p, ar = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)

    def fit(xs, ys):
        (slope, intercept), *_ = np.linalg.lstsq(np.stack([xs, np.ones_like(xs)], axis=1), ys, rcond=None)
        return float(slope), float(intercept)

    x = np.array(sorted(p2p), dtype=float)
    slope, intercept = fit(x, np.array([p2p[n] for n in sorted(p2p)]))
    latency = max(intercept, min(p2p.values()) * 0.5, 1e-6)
    bw_p2p = 1.0 / max(slope, 1e-12)
    xa = np.array(sorted(ar), dtype=float) * 2 * (world - 1) / world
    slope_ar, _ = fit(xa, np.array([ar[n] for n in sorted(ar)]))
    bw_ar = 1.0 / max(slope_ar, 1e-12)
    return {"latency_s": latency, "bandwidth_Bps": min(bw_p2p, bw_ar), "p2p_bandwidth_Bps": bw_p2p,
            "allreduce_bandwidth_Bps": bw_ar, "one_way_s": {str(k): v for k, v in p2p.items()},
            "allreduce_s": {str(k): v for k, v in ar.items()}, "ranks": world}


def cpu_cluster_doc(link: dict[str, Any], ranks: int) -> dict[str, Any]:
    """A custom cluster of single-thread CPU ranks on one host (op times come from the profile)."""
    lk = {"latency_s": link["latency_s"], "bandwidth_Bps": link["bandwidth_Bps"]}
    return {"name": "cpu-loopback", "num_devices": ranks, "devices_per_node": ranks,
            "device": {"name": "cpu-1thread", "memory_bytes": 8e9, "peak_flops": 2e10, "op_overhead_s": 2e-5, "mfu": 0.5},
            "intra_node": lk, "inter_node": lk, "bytes_per_param": 8.0}


# ------------------------------------------------------------------ CPU share
def _burn(rank: int, seconds_out, ready, start, n: int, spec: str | None, batch_size: int, cpus_per_rank: int) -> None:
    import torch

    from graphpipe.runtime.worker import pin_rank

    pin_rank(rank, cpus_per_rank)
    torch.set_num_threads(1)
    if spec is None:
        a = torch.randn(192, 192)

        def work() -> None:
            nonlocal a
            a = torch.tanh(a @ a * 0.01)
    else:
        from graphpipe.frontend import zoo
        from graphpipe.runtime.executor import zero_grads

        built = zoo.build(spec, device="cpu", seed=rank)
        inputs = built.make_inputs(batch_size, rank)
        params = list(built.module.parameters())

        def work() -> None:  # one training step on persistent gradient buffers, as a rank runs its stage
            zero_grads(params)
            built.loss_fn(built.module(*inputs)).backward()
    for _ in range(2):
        work()
    ready.put(rank)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        work()
    seconds_out.put(time.perf_counter() - t0)


def measure_cpu_share(ranks: int, n: int = 1500, spec: str | None = None, batch_size: int = 16,
                      cpus_per_rank: int = 0) -> dict[str, Any]:
    """How much slower one rank computes when ``k = 1..ranks`` single-thread processes compute at once.

    A fixed workload is timed alone and in ``k`` concurrent processes;
    ``slowdown[k]`` is the ratio of medians, for ``k`` in 1, 2, 4, ... and
    ``ranks`` (:func:`shared_host` makes it the simulator's table). A simulated device is a
    dedicated processor; a rank on a host with fewer free cores than ranks
    (oversubscription, SMT siblings, other work) is not, and neither is one
    whose memory bandwidth and last-level cache the other ranks share. How
    much it is slowed depends on how many ranks compute at the same moment
    and on the workload: a small matmul that lives in a core's cache only
    sees lost cores, so with ``spec`` the workload is ``n`` training steps
    of that model at ``batch_size`` (its weights stream from memory as a
    stage's do); without, ``n`` products of a 192x192 matrix. With
    ``cpus_per_rank`` process ``r`` is pinned as rank ``r`` of a run would be.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def run(k: int) -> float:
        out, ready, start = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_burn, args=(r, out, ready, start, n, spec, batch_size, cpus_per_rank))
                 for r in range(k)]
        for p in procs:
            p.start()
        waiting, deadline = k, time.monotonic() + 300
        while waiting:  # every process has imported torch, built its workload and warmed up
            try:
                ready.get(timeout=1.0)
                waiting -= 1
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"CPU-share workers did not start (exit codes {dead})")
        start.set()
        times = [out.get(timeout=300) for _ in range(k)]
        for p in procs:
            p.join(timeout=60)
        return statistics.median(times)

    counts = sorted({1, ranks} | {k for k in (2, 4, 8, 16) if k < ranks})
    times = {k: run(k) for k in counts}
    return {"workload": spec or "matmul 192x192", "seconds": {str(k): t for k, t in times.items()},
            "slowdown": {str(k): max(1.0, t / times[1]) for k, t in times.items()}}


def shared_host(share: dict[str, Any]):
    """The measured slowdown table as the simulator's :class:`graphpipe.sched.SharedHost`."""
    from graphpipe.sched import SharedHost

    return SharedHost(tuple(sorted((int(k), float(v)) for k, v in share["slowdown"].items())))


def predict_calibrated(plan, raw_graph, share: dict[str, Any]) -> tuple[float, float, float]:
    """``(iteration time, mean slowdown, mean busy ranks)`` of ``plan`` on the host the share was measured on.

    The plan is simulated with profile-only op times on a
    :class:`graphpipe.sched.SharedHost` built from the measured slowdown
    table: while ``k`` ranks compute, each runs ``slowdown(k)`` times
    slower, at every instant of the iteration. So when more ranks than cores
    are busy, concurrent branch stages take turns on the cores, as they do.
    The mean slowdown is compute time on the shared host over compute time
    alone; the mean busy ranks, compute time over iteration time.
    """
    alone = simulated_with(plan, raw_graph)
    shared = simulated_with(plan, raw_graph, shared_host(share))
    busy = sum(shared.busy_s)
    return shared.iteration_time_s, busy / sum(alone.busy_s), busy / shared.iteration_time_s


def predict_mean_share(plan, raw_graph, share: dict[str, Any]) -> float:
    """The previous calibration, kept for comparison: every op scaled by the slowdown at the plan's *mean* concurrency.

    A fixed point in two steps: simulate, take ``sum(busy) / iteration`` as
    the number of busy ranks, scale every op time by the slowdown there,
    simulate again. It ignores when the ranks are busy, so it credits
    concurrent branches with cores the host does not have.
    """
    host, factor = shared_host(share), 1.0
    for _ in range(2):
        tl = simulated_with(plan, scaled_graph(raw_graph, factor))
        factor = _interpolated(host, sum(tl.busy_s) / tl.iteration_time_s)
    return simulated_with(plan, scaled_graph(raw_graph, factor)).iteration_time_s


def _interpolated(host, concurrency: float) -> float:
    """``host.slowdown`` at a fractional number of busy ranks (linear between the integers)."""
    lo = max(1, int(concurrency))
    return host.slowdown(lo) + (host.slowdown(lo + 1) - host.slowdown(lo)) * max(0.0, concurrency - lo)


def scaled_graph(graph, factor: float):
    """Every op's forward and backward time (and measured W) multiplied by ``factor`` (the measured CPU-share slowdown)."""
    from dataclasses import replace

    return graph.with_ops([replace(op, fwd=op.fwd.scaled(factor), bwd=op.bwd.scaled(factor),
                                   wgrad=op.wgrad.scaled(factor) if op.wgrad is not None else None)
                           for op in graph.ops])


# ------------------------------------------------------------------ planning
def calibrated_graph(spec: str, batch_sizes, repeats: int, cpus_per_rank: int = 0):
    """``spec``'s graph costed by ``graphpipe profile`` on one thread (pinned as rank 0 when ranks are)."""
    import torch

    from graphpipe.frontend import zoo
    from graphpipe.frontend.profile import apply_profile, profile_model
    from graphpipe.runtime.worker import pin_rank

    torch.set_num_threads(1)  # the ranks run with one thread each
    allowed = os.sched_getaffinity(0)
    try:
        pin_rank(0, cpus_per_rank)
        profile = profile_model(spec, "cpu", batch_sizes=batch_sizes, repeats=repeats)
    finally:
        os.sched_setaffinity(0, allowed)
    return apply_profile(zoo.load_graph(spec), profile)


def auto_cpus_per_rank(ranks: int) -> int:
    """Two CPUs per rank when the host has them (compute thread + gloo's threads), else one, else 0 (no pinning)."""
    return min(2, len(os.sched_getaffinity(0)) // ranks)


def plan_for(spec: str, graph, cluster, batch: int, strategy: str, schedule: str | None = None, mbs: int | None = None,
             host=None, recompute: str | None = None):
    from graphpipe.frontend import zoo
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    return make_plan(zoo.canonical_spec(spec), graph, cluster, batch, strategy,
                     SearchOptions(micro_batch_size=mbs, host=host, recompute=recompute), schedule=schedule)


def torch_comparable_plan(spec: str, graph, cluster, batch: int):
    """(c)'s plan, run by our executor and by ``torch.distributed.pipelining``: the gpipe partitioner's even
    chain (one stage per rank, 8 micro-batches), 1F1B, without GPipe's default re-materialization (torch's
    pipelining does not recompute, and (c) compares the same work)."""
    return plan_for(spec, graph, cluster, batch, "gpipe", schedule="1f1b", mbs=batch // 8, recompute="none")


def simulated_with(plan, graph, host=None):
    """The plan's simulated :class:`~graphpipe.sched.Timeline` with another costing of the same ops (on ``host``)."""
    from dataclasses import replace

    from graphpipe.sched import simulate

    return simulate(replace(plan.stage_graph, graph=graph), plan.schedule, plan.cluster, host=host)


def describe(plan) -> dict[str, Any]:
    sg = plan.stage_graph
    return {"strategy": plan.strategy, "schedule": plan.schedule.name, "num_stages": sg.num_stages, "depth": sg.depth(),
            "stages": [{"ops": [sg.graph.ops[i].name for i in s.op_ids], "devices": list(s.devices),
                        "micro_batch_size": s.micro_batch_size} for s in sg.stages],
            "predicted_iteration_time_s": plan.predicted.get("iteration_time_s"),
            "predicted_throughput": plan.predicted.get("throughput")}


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the median of ``values`` (seeded: same values, same interval)."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    lo = medians[int((1 - level) / 2 * (resamples - 1))]
    hi = medians[int((1 + level) / 2 * (resamples - 1))]
    return [lo, hi]


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.bench_runtime", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out", help="results go to OUT/results/bench_runtime.json")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per job and round (first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=8, help="round-robin repetitions of all jobs")
    parser.add_argument("--cpus-per-rank", default="auto",
                        help="pin each rank (and the profile and calibration processes) to N CPUs of its own; "
                             "auto: 2 when the host has 2 per rank, else 1, else 0 (no pinning)")
    parser.add_argument("--quick", action="store_true", help="small models, 2 rounds of 3 steps")
    args = parser.parse_args(argv)

    from graphpipe.cluster import cluster_from_dict
    from graphpipe.runtime import RunOptions, run_plans

    from .common import environment, write_result

    if args.cpus_per_rank == "auto":
        pin = auto_cpus_per_rank(args.ranks)
    elif args.cpus_per_rank.isdigit():
        pin = int(args.cpus_per_rank)
    else:
        parser.error(f"--cpus-per-rank must be auto or a non-negative integer, got {args.cpus_per_rank!r}")
    uno, gpt = (UNO_QUICK, GPT_QUICK) if args.quick else (UNO, GPT)
    steps, rounds = (3, 2) if args.quick else (args.steps, args.rounds)
    started = time.perf_counter()
    sys.stderr.write(f"pinning: {pin} CPU(s) per rank\n" if pin else "pinning: off\n")
    sys.stderr.write("measuring the loopback link...\n")
    link = measure_link(args.ranks, cpus_per_rank=pin)
    cluster = cluster_from_dict(cpu_cluster_doc(link, args.ranks))
    sys.stderr.write(f"link: latency {link['latency_s'] * 1e6:.1f} us, bandwidth {link['bandwidth_Bps'] / 1e9:.2f} GB/s "
                     f"(point-to-point {link['p2p_bandwidth_Bps'] / 1e9:.2f}, all-reduce {link['allreduce_bandwidth_Bps'] / 1e9:.2f})\n")
    sizes = sorted({1, 2, 4, 8, 16, args.batch_size // 4, args.batch_size // 2})
    sys.stderr.write("profiling ops...\n")
    uno_raw = calibrated_graph(uno, sizes, 5, pin)
    gpt_raw = calibrated_graph(gpt, sizes, 5, pin)
    sys.stderr.write("measuring the CPU share of one rank (each model's training step in k processes at once)...\n")
    shares = {"uno": measure_cpu_share(args.ranks, n=4 if args.quick else 30, spec=uno, cpus_per_rank=pin),
              "gpt": measure_cpu_share(args.ranks, n=4 if args.quick else 30, spec=gpt, cpus_per_rank=pin)}
    for key, share in shares.items():
        sys.stderr.write(f"cpu share ({key}): slowdown with k ranks busy "
                         + ", ".join(f"k={k}: {v:.2f}x" for k, v in share["slowdown"].items()) + "\n")
    # (a) Both strategies plan for the host they run on: profile-only op times on the measured shared host,
    # each free to leave ranks idle when the cores are the limit. (c) needs one stage per rank (torch's
    # pipelining has no idle ranks), so that plan is made with every rank busy: op times scaled by the slowdown
    # with all ranks computing. Predictions use each plan's own concurrency at every instant.
    uno_host = shared_host(shares["uno"])
    gpt_graph = scaled_graph(gpt_raw, shares["gpt"]["slowdown"][str(args.ranks)])
    raw_graphs = {"uno": uno_raw, "gpt": gpt_raw}
    plans = {
        "uno/gpp": plan_for(uno, uno_raw, cluster, args.batch_size, "gpp", host=uno_host),
        "uno/pipedream": plan_for(uno, uno_raw, cluster, args.batch_size, "pipedream", host=uno_host),
        "gpt/ours": torch_comparable_plan(gpt, gpt_graph, cluster, args.batch_size),
    }
    plans["gpt/torch"] = plans["gpt/ours"]
    names = list(plans)
    jobs = []
    for _ in range(rounds):
        for name in names:
            jobs.append((name, plans[name], RunOptions(steps=steps, warmup_steps=1, timeout_s=300, cpus_per_rank=pin,
                                                        baseline="torch" if name == "gpt/torch" else None)))
    sys.stderr.write(f"running {len(jobs)} jobs on {args.ranks} ranks...\n")
    raw = run_plans([(p, o) for _, p, o in jobs], args.ranks)
    step_times: dict[str, list[float]] = {n: [] for n in names}
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for (name, plan, _), result in zip(jobs, raw):
        step_times[name].extend(result.measured.step_times_s)
        per_round[name].append(result.measured.iteration_time_s)

    def paired(a: str, b: str) -> float:
        """Median over rounds of the throughput ratio a/b, each round's two jobs run back to back.

        Robust to the host's load drifting between rounds (other work on a
        shared machine), which a ratio of overall medians is not.
        """
        return statistics.median(round_ratios(a, b))

    def round_ratios(a: str, b: str) -> list[float]:
        return [tb / ta for ta, tb in zip(per_round[a], per_round[b])]
    rows = []
    for name in names:
        med = statistics.median(step_times[name])
        model_key = name.split("/")[0]
        raw_graph = raw_graphs[model_key]
        pred, factor, concurrency = predict_calibrated(plans[name], raw_graph, shares[model_key])
        pred_raw = simulated_with(plans[name], raw_graph).iteration_time_s
        pred_mean = predict_mean_share(plans[name], raw_graph, shares[model_key])
        rows.append({"job": name, "measured_iteration_time_s": med, "measured_throughput": args.batch_size / med,
                     "num_steps": len(step_times[name]), "step_times_s": step_times[name],
                     "round_medians_s": per_round[name],
                     "predicted_iteration_time_s": pred, "simulator_error": abs(pred - med) / med,
                     "calibration_slowdown": factor, "predicted_mean_busy_ranks": concurrency,
                     "predicted_profile_only_s": pred_raw, "simulator_error_profile_only": abs(pred_raw - med) / med,
                     "predicted_mean_share_s": pred_mean, "simulator_error_mean_share": abs(pred_mean - med) / med,
                     "plan": describe(plans[name])})
    by = {r["job"]: r for r in rows}
    summary = {
        "a_gpp_over_pipedream_throughput": paired("uno/gpp", "uno/pipedream"),
        "a_ratio_of_medians": by["uno/gpp"]["measured_throughput"] / by["uno/pipedream"]["measured_throughput"],
        "a_predicted_gpp_over_pipedream": by["uno/pipedream"]["predicted_iteration_time_s"] / by["uno/gpp"]["predicted_iteration_time_s"],
        "b_simulator_error": {n: by[n]["simulator_error"] for n in ("uno/gpp", "uno/pipedream", "gpt/ours")},
        "b_simulator_error_profile_only": {n: by[n]["simulator_error_profile_only"]
                                           for n in ("uno/gpp", "uno/pipedream", "gpt/ours")},
        "b_simulator_error_mean_share": {n: by[n]["simulator_error_mean_share"]
                                         for n in ("uno/gpp", "uno/pipedream", "gpt/ours")},
        "a_predicted_mean_share": by["uno/pipedream"]["predicted_mean_share_s"] / by["uno/gpp"]["predicted_mean_share_s"],
        "cpu_slowdown": {key: share["slowdown"] for key, share in shares.items()},
        "c_ours_over_torch_throughput": paired("gpt/ours", "gpt/torch"),
        "c_ratio_of_medians": by["gpt/ours"]["measured_throughput"] / by["gpt/torch"]["measured_throughput"],
        "a_ci95": bootstrap_ci(round_ratios("uno/gpp", "uno/pipedream")),
        "c_ci95": bootstrap_ci(round_ratios("gpt/ours", "gpt/torch")),
        "a_round_ratios": round_ratios("uno/gpp", "uno/pipedream"),
        "c_round_ratios": round_ratios("gpt/ours", "gpt/torch"),
        "targets": {"a": ">= 1.15", "b": "< 0.20", "c": ">= 0.95"},
        "wall_s": time.perf_counter() - started,
    }
    config = {"ranks": args.ranks, "batch_size": args.batch_size, "steps": steps, "rounds": rounds, "uno": uno, "gpt": gpt,
              "threads_per_rank": 1, "cpus_per_rank": pin, "rank_cpus": raw[0].rank_cpus, "backend": "gloo",
              "link": link, "cluster": cpu_cluster_doc(link, args.ranks),
              "profile_batch_sizes": sizes, "cpu_share": shares, "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
              "command": "python -m graphpipe.evals.bench_runtime" + (" --quick" if args.quick else "")
              + f" --ranks {args.ranks} --batch-size {args.batch_size} --steps {steps} --rounds {rounds} --cpus-per-rank {pin}"}
    path = write_result(args.out, "bench_runtime", config, rows, summary)
    json.dump({"summary": summary, "result_file": path, "environment": environment()}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
