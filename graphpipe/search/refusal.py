"""Why a search found no plan: the binding constraint, with its numbers (docs/limits.md, "Refusals").

A search that finds nothing raises one error whose message names the
constraint that rules out every plan and the figures behind it, so the user
knows which flag to change:

* **micro-batch divisibility** (:func:`divisor_error`): ``--micro-batch-size``
  must cut the mini-batch into equal micro-batches;
* **replicas vs micro-batches** (:func:`replicas_refusal`): PipeDream's
  round-robin replicas each take whole micro-batches, so a stage replicated
  ``r`` times needs at least ``r`` micro-batches per mini-batch;
* **memory** (:func:`pipedream_refusal`, :func:`sequential_memory_refusal`):
  the largest need of a device against the device's memory. These raise
  :class:`~graphpipe.errors.DeviceMemoryError`, to which the command line
  adds where the device (and its memory) came from.

Device counts a strategy cannot place (PipeDream's node levels) are refused
where the levels are built (:func:`graphpipe.search.pipedream.cluster_levels`),
before any of these.

Only message building lives here: the searches call these when they have
nothing to return, so none of this runs on a search that succeeds.

Example
-------
>>> str(divisor_error(3, 8))
'--micro-batch-size 3 does not divide the batch size 8: a mini-batch is cut into equal micro-batches; use one of 1, 2, 4, 8'
"""

from __future__ import annotations

import logging
from typing import Sequence

from graphpipe import costs
from graphpipe.cluster import Cluster
from graphpipe.errors import DeviceMemoryError, GraphpipeError, InfeasibleError, InputError
from graphpipe.graph import OpGraph

__all__ = ["divisor_error", "replicas_refusal", "pipedream_refusal", "sequential_memory_refusal", "memory_floor",
           "Tried"]

log = logging.getLogger(__name__)

Tried = tuple[int, str, object]
"""One micro-batch size a search tried and why it failed: ``(b, kind, detail)``. Kinds: ``"memory"`` (nothing
fits; detail None), ``"replicas"`` (detail: the most replicas of a stage), ``"simulated"`` (the plan's simulated
peak overflows; detail: its :class:`~graphpipe.stages.StageGraph`)."""


def _gb(num_bytes: float) -> str:
    gb = num_bytes / 1e9
    return f"{gb:,.0f} GB" if gb >= 100 else f"{gb:.3g} GB"


def _sizes(values: Sequence[int]) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if len(values) <= 8 else f"{values[0]}, {values[1]}, ... {values[-1]}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _either(options: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b, or c``."""
    options = list(options)
    if len(options) <= 2:
        return " or ".join(options)
    return ", ".join(options[:-1]) + ", or " + options[-1]


def divisor_error(micro_batch_size: int, batch_size: int) -> InputError:
    """``--micro-batch-size`` that does not cut ``--batch-size`` into equal parts, with the sizes that do."""
    return InputError(f"--micro-batch-size {micro_batch_size} does not divide the batch size {batch_size}: a "
                      f"mini-batch is cut into equal micro-batches; use one of {_sizes(_divisors(batch_size))}")


def replicas_refusal(strategy: str, graph: OpGraph, cluster: Cluster, batch_size: int, micro_batch_size: int,
                     replicas: int, num_stages: int) -> InfeasibleError:
    """A round-robin stage with more replicas than the mini-batch has micro-batches.

    PipeDream's optimizer chooses the replica counts for throughput alone
    (its DP has no notion of the batch), so on a small model it replicates
    one stage on every device; 1F1B-RR gives each replica whole
    micro-batches, so with fewer micro-batches than replicas some replica
    would get none. The fixes: a micro-batch no larger than the
    data-parallel share ``B / N`` (then there are at least ``N`` micro-batches,
    as many as any stage's replicas), a larger batch, or fewer devices.
    """
    n = cluster.num_devices
    num_mb = batch_size // micro_batch_size
    share = max([d for d in _divisors(batch_size) if d <= max(1, batch_size // n)] or [1])
    layout = (f"one stage replicated on {replicas} devices (data parallelism)" if num_stages == 1
              else f"a stage replicated on {replicas} of the {n} devices")
    fixes = []
    if share < micro_batch_size:
        exact = "" if batch_size % n == 0 and share == batch_size // n else ", rounded down to a divisor"
        fixes.append(f"--micro-batch-size {share} (the data-parallel share {batch_size} / {n} devices{exact})")
    fixes.append(f"--batch-size {replicas * micro_batch_size} or more")
    if num_mb < n:
        fixes.append(f"--devices {num_mb}")
    return InfeasibleError(
        f"{strategy}: PipeDream's optimizer lays out {graph.name!r} as {layout}, but --batch-size {batch_size} at "
        f"micro-batch {micro_batch_size} makes only {num_mb} micro-batch{'es' if num_mb != 1 else ''}, and each "
        f"round-robin replica needs one of its own; use " + _either(fixes))


def _fullest_device(sg, cluster: Cluster, schedule_name: str) -> tuple[int, float, str]:
    """(device, simulated peak bytes, "stage s: k ops") of the device with the largest peak under the schedule.

    Memory only, from the action order (:func:`~graphpipe.sched.simulator.peak_memory_in_order`): a refusal at
    1024 devices and 16k micro-batches then costs the schedule's construction, not a timed simulation.
    """
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import peak_memory_in_order

    peaks = peak_memory_in_order(sg, make_schedule(schedule_name, sg, cluster, validate=False), cluster)
    device = max(range(len(peaks)), key=lambda d: peaks[d])
    stages = sg.stages_on_device(device)
    what = "; ".join(f"stage {s}: {len(sg.stages[s].op_ids)} op{'s' if len(sg.stages[s].op_ids) != 1 else ''}"
                     + (f", {len(sg.stages[s].devices)} replicas" if len(sg.stages[s].devices) > 1 else "")
                     for s in stages)
    return device, peaks[device], what


def memory_floor(graph: OpGraph, cluster: Cluster, micro_batch_size: int) -> tuple[float, str]:
    """A lower bound of the fullest device's bytes in any plan, and what it is made of.

    Every op's model state (weights, gradients, optimizer) sits on at least
    one device, so some device holds ``total / N`` or more, and the device of
    the heaviest op holds at least that op alone at one micro-batch in
    flight, re-materialized (:func:`graphpipe.costs.stage_memory`).
    Replicas, more micro-batches in flight and stages' other ops only add.
    """
    n = cluster.num_devices
    total = sum(cluster.state_bytes(op.param_bytes) for op in graph.ops)
    alone = [(costs.stage_memory(graph, [i], 1, micro_batch_size, 1, cluster, True), op.name)
             for i, op in enumerate(graph.ops)]
    op_bytes, op_name = max(alone, default=(0.0, ""))
    if total / n >= op_bytes:
        return total / n, (f"the model state, {_gb(total)} of weights, gradients and optimizer state, spread "
                           f"evenly over {n} device{'s' if n != 1 else ''}")
    return op_bytes, f"op {op_name!r} alone at micro-batch {micro_batch_size}, re-materialized"


def _memory_message(strategy: str, graph: OpGraph, cluster: Cluster, sizes: Sequence[int], need: str,
                    forced: bool, fixes: Sequence[str] | None = None) -> DeviceMemoryError:
    b = min(sizes)
    if fixes is None:
        fixes = ["more devices", "more memory per device"]
    fixes = (["a smaller --micro-batch-size"] if forced and b > 1 else []) + list(fixes)
    at = f"at micro-batch {b}" + ("" if forced or len(sizes) == 1 else f" (the smallest tried of {_sizes(sizes)})")
    return DeviceMemoryError(
        f"{strategy}: no plan of {graph.name!r} fits in {cluster.memory_bytes / 1e9:g} GB per device on "
        f"{cluster.num_devices} device{'s' if cluster.num_devices != 1 else ''}: {at} {need}; use {_either(fixes)}")


def pipedream_refusal(graph: OpGraph, cluster: Cluster, batch_size: int, tried: Sequence[Tried], forced: bool,
                      states, levels, replica_mode: str, schedule_name: str) -> InfeasibleError:
    """PipeDream found no plan: replicas vs micro-batches if that is what failed, else memory with its numbers.

    ``tried``: every micro-batch size in the order tried, with why it failed.
    A size fails on replicas only when it is forced (a size at most the
    data-parallel share ``B / N`` makes at least ``N`` micro-batches), so
    the two kinds never mix. For memory, the fullest device of PipeDream's
    layout at the smallest size is simulated: the DP's answer without the
    memory constraint when nothing fitted it, else the plan that overflowed. ``replica_mode`` and
    ``schedule_name``: PipeDream's (:mod:`graphpipe.search.pipedream`, which calls this).
    """
    from graphpipe.search.pipedream_dp import solve_levels
    from graphpipe.stages import Stage, StageGraph

    for b, kind, detail in tried:
        if kind == "replicas":
            stages = solve_levels(states, graph, b, levels)
            return replicas_refusal("pipedream", graph, cluster, batch_size, b, int(detail),
                                    len(stages.stages) if stages is not None else 2)
    sizes = [b for b, _, _ in tried]
    b, kind, sg = min(tried, key=lambda t: t[0])
    try:
        if kind == "memory":
            sol = solve_levels(states, graph, b, levels)
            sg = StageGraph.build(graph, [Stage(q, ops, devices, b, replica_mode=replica_mode if r > 1 else "split")
                                          for q, (ops, r, devices) in enumerate(sol.stages)],
                                  batch_size, cluster.num_devices, sequential=True)
        device, peak, what = _fullest_device(sg, cluster, schedule_name)
        if kind == "memory" and peak <= cluster.memory_bytes:
            # The DP's memory model rejected every layout, but its unconstrained optimum fits once simulated: the
            # model's in-flight count (one more than the devices after a stage) is a bound, loose when later stages
            # are replicated. Say so, rather than blame the device's memory.
            return DeviceMemoryError(
                f"pipedream: PipeDream's memory model finds no layout of {graph.name!r} within "
                f"{cluster.memory_bytes / 1e9:g} GB per device on {cluster.num_devices} devices at micro-batch {b}: "
                f"it counts a replica as holding one micro-batch more than the devices after its stage (up to its "
                f"share of the iteration), a bound; its layout without that bound simulates to {_gb(peak)} on its "
                f"fullest device, device {device} ({what}); use --strategy gpp, or a smaller --batch-size (fewer "
                "micro-batches in flight)")
        need = f"PipeDream's layout needs {_gb(peak)} on its fullest device, device {device} ({what})"
    except (GraphpipeError, AttributeError, ValueError) as exc:  # no layout to show: fall back to the bound
        log.debug("pipedream refusal: no unconstrained layout at micro-batch %d (%s)", b, exc)
        floor, why = memory_floor(graph, cluster, b)
        need = f"some device needs at least {_gb(floor)} ({why})"
    return _memory_message("pipedream", graph, cluster, sizes, need, forced)


def sequential_memory_refusal(strategy: str, graph: OpGraph, cluster: Cluster, sizes: Sequence[int],
                              forced: bool, batch_size: int | None = None) -> DeviceMemoryError:
    """No partition of a sequential strategy (gpipe, piper, linear-dp) fits at any micro-batch size tried.

    States the :func:`memory_floor` when it alone overflows the device;
    otherwise the model state fits and it is the activations of the
    micro-batches in flight that do not, which the message says with the
    floor for scale. GPipe holds every micro-batch of the mini-batch in
    flight and never replicates a stage, so there the count is the batch's
    and the fix is a smaller ``--batch-size`` (or a strategy that replicates):
    more devices only help while there are fewer devices than ops.
    """
    b = min(sizes)
    floor, why = memory_floor(graph, cluster, b)
    fixes = None
    if floor > cluster.memory_bytes:
        need = f"some device needs at least {_gb(floor)} ({why})"
    else:
        held = ""
        if strategy == "gpipe" and batch_size:
            held = f"GPipe holds all {batch_size // b:,} micro-batches of the batch in flight; "
            fixes = (["a smaller --batch-size"] + (["more devices"] if cluster.num_devices < len(graph.ops) else [])
                     + ["more memory per device", "--strategy gpp (it replicates stages)"])
        need = (f"every partition's fullest device overflows once the activations of its micro-batches in flight "
                f"are counted ({held}the least any device can hold is {_gb(floor)}: {why})")
    return _memory_message(strategy, graph, cluster, sizes, need, forced, fixes)
