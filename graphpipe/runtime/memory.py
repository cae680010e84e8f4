"""What a run's ranks will hold in host memory, estimated before any of them starts.

A rank of ``graphpipe run`` holds its stages' weights and gradients (the
run trains with plain SGD: no optimizer state), the activations its
schedule keeps in flight (the plan's simulated ``peak_activation_bytes``),
a second copy of its largest op's gradients while autograd accumulates
them, and a fixed per-process base (Python, torch, gloo's buffers:
:data:`RANK_MEMORY_BYTES`). Every rank of
``graphpipe run`` lives on this host, so their sum must fit in what the
host has available, or the kernel's out-of-memory killer ends the run
minutes later; :func:`check_host_memory` refuses such a run up front, with
both figures and what would fit.

``--check`` also runs the whole model on one process (the single-process
reference) on each rank hosting a stage: :func:`reference_bytes` estimates
it, and the run skips the check, saying so, when the host cannot hold it.

Imports no torch (it runs before any rank starts).

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.plan import Plan
>>> from graphpipe.sched import make_schedule
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("two", [Op("a", "linear", param_bytes=4e6), Op("b", "linear", param_bytes=2e6)], [("a", "b", 8.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], 4, 2)
>>> plan = Plan(model="two", stage_graph=sg, cluster=preset("v100", 2), strategy="custom",
...             schedule=make_schedule("1f1b", sg, preset("v100", 2)))
>>> [r.state_bytes for r in rank_memory(plan)]
[8000000.0, 4000000.0]
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpipe.errors import InputError
from graphpipe.plan import Plan

__all__ = ["RANK_MEMORY_BYTES", "RankMemory", "rank_memory", "reference_bytes", "available_memory", "check_host_memory"]

GIB = 2**30
# A rank is a Python process with torch loaded: about 350 MB resident for the zoo's small models (measured with
# /usr/bin/time on 4-rank runs of mmt:small), before its stages' weights.
RANK_MEMORY_BYTES = 400 * 2**20


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's expected host memory, in bytes."""

    rank: int
    state_bytes: float
    """Its stages' weights and gradients (each replica holds its stage whole; tied copies included)."""
    activation_bytes: float
    """Activations its schedule keeps in flight at the peak (the plan's prediction)."""
    base_bytes: float
    """The process itself: interpreter, torch, communication buffers."""
    transient_bytes: float = 0.0
    """A gradient being made while ``.grad`` already holds one: its largest op's parameter bytes."""

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.base_bytes + self.transient_bytes


def _base_bytes() -> float:
    return float(RANK_MEMORY_BYTES)


def rank_memory(plan: Plan, state_per_weight: float = 2.0) -> list[RankMemory]:
    """Every rank's expected host memory for ``plan`` (module docstring).

    ``state_per_weight``: bytes of training state per byte of weights
    (2: weights and gradients, as ``graphpipe run``'s SGD keeps).
    """
    sg = plan.stage_graph
    graph = sg.graph
    weights = [0.0] * sg.num_devices
    transient = [0.0] * sg.num_devices
    for stage in sg.stages:
        stage_bytes = sg.param_bytes(stage.id)
        if stage.shard == "fsdp" and stage.num_replicas > 1:
            # a rank materializes its FSDP stage whole before sharding it, and a step adds the gathered op, its
            # unsharded gradient and FSDP's reduce-scatter buffer to the shards (per-op units) or keeps the whole
            # stage gathered (once per step): the peak holds about the whole stage and its shards
            # (evals/rank_rss: 2.2-2.6x the sharded estimate this replaced; docs/limits.md)
            stage_bytes = stage_bytes * (1.0 + 1.0 / stage.num_replicas)
        elif stage.parallel:  # one tp rank's share: the model's figure per weight byte
            stage_bytes = sg.model_state_bytes(stage.id, 4.0 * state_per_weight) / state_per_weight
        names = {graph.ops[i].name for i in stage.op_ids}
        for group in graph.shared:  # a stage reading tied weights whose first op is elsewhere holds a copy
            if names & set(group.ops) and group.ops[0] not in names:
                stage_bytes += group.bytes
        # From the second micro-batch on, autograd makes each gradient afresh and adds it into ``.grad``: for a
        # moment the op's gradients exist twice. The largest op dominates (an embedding's dense gradient, a
        # vocabulary head): evals/rank_rss measured embedding and head ranks 21% and 31% above the estimate
        # without this term, within 10% with it.
        largest = max((graph.ops[i].param_bytes for i in stage.op_ids), default=0.0)
        for d in stage.devices:
            weights[d] += stage_bytes
            transient[d] = max(transient[d], float(largest))
    acts = list(plan.predicted.peak_activation_bytes or []) if plan.predicted is not None else []
    acts += [0.0] * (sg.num_devices - len(acts))
    base = _base_bytes()
    return [RankMemory(d, state_per_weight * weights[d], float(acts[d]), base, transient[d])
            for d in range(sg.num_devices)]


def reference_bytes(plan: Plan, state_per_weight: float = 2.0) -> float:
    """``--check``'s single-process reference: the whole model's weights and gradients and the activations of
    the whole mini-batch (every op's saved bytes per sample times the batch)."""
    graph = plan.stage_graph.graph
    acts = sum(op.act_bytes for op in graph.ops) * plan.stage_graph.batch_size
    return state_per_weight * graph.param_bytes + acts


def available_memory() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            return float(next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")))
    except (OSError, StopIteration, ValueError):
        return None


def check_host_memory(plan: Plan, world_size: int | None = None, available: float | None = None) -> list[RankMemory]:
    """Refuse (:class:`~graphpipe.errors.InputError`, one line) a run whose ranks, all on this host, would need
    more memory than it has available; returns the per-rank estimate otherwise.

    ``world_size``: ranks started (a plan for fewer devices leaves the
    others idle: a base each). ``available``: bytes (default: ``MemAvailable``;
    None skips the check where it cannot be read).
    """
    ranks = rank_memory(plan)
    idle = max(0, (world_size or len(ranks)) - len(ranks))
    available = available_memory() if available is None else available
    if available is None:
        return ranks
    base = _base_bytes()
    n = len(ranks) + idle
    state = sum(r.state_bytes + r.transient_bytes for r in ranks)  # gradients being accumulated included
    acts = sum(r.activation_bytes for r in ranks)
    need = state + acts + n * base
    if need <= available:
        return ranks
    fits = []
    hosts = -(-int(need) // max(1, int(available)))
    if hosts > 1 and n > 1:
        fits.append(f"at most {max(1, n // hosts)} ranks per host (torchrun over {hosts} or more hosts)")
    room = available - state - n * base
    batch = plan.stage_graph.batch_size
    if acts > 0 and room > 0:
        fitting = int(batch * room / acts)
        if 1 <= fitting < batch:
            fits.append(f"a batch of about {fitting} (graphpipe plan --batch-size {fitting})")
    if room <= 0:
        fits.append(f"not this model on one host: its weights and gradients alone take {state / GIB:.1f} GiB")
    raise InputError(
        f"the run's {n} ranks would need about {need / GIB:.1f} GiB of host memory (stages' weights and gradients "
        f"{state / GIB:.1f} GiB, activations in flight {acts / GIB:.1f} GiB, {n} processes at "
        f"{base / GIB:.2f} GiB) but this host has {available / GIB:.1f} GiB available; what would fit: "
        + ("; ".join(fits) or "fewer ranks per host or a smaller batch"))
