"""The one cost and memory model (docs/design.md#the-cost-model): stage time, all-reduce, per-device memory.

Every partitioner, the simulator and the CP-SAT model take their numbers
from here, so that a plan's estimate and its simulation cannot drift apart.
The formulas are written once, as functions of plain numbers that work on
numpy arrays too; :class:`CostArrays` evaluates the same functions on arrays
of candidate stages (the DPs score millions of them), and the scalar
helpers (:func:`stage_tps`, :func:`stage_memory`) evaluate them for one
stage of a graph.

Time (one replica, ``s = b / r`` samples per micro-batch of size ``b`` over
``r`` replicas, ops with affine ``t(s) = alpha + beta s``):

* ``F = fwd(s)``; ``B = bwd(s)``, plus ``fwd(s)`` again when the stage
  **re-materializes** (GPipe §2.3): its forward runs a second time inside B
  to rebuild the activations it did not keep (:func:`action_times`);
* a stage's time per sample is ``(F + B) / b + allreduce / batch``
  (:func:`time_per_sample`; GraphPipe §4's bottleneck TPS);
* ring all-reduce of ``P`` bytes over ``r`` devices:
  ``2 (r - 1) latency + 2 (r - 1) / r * P / bandwidth`` (:func:`ring_allreduce_s`).

Memory on one device of a stage (:func:`memory_bytes`):

* model state: ``param_bytes / 4 * bytes_per_param`` (weights, gradients,
  Adam moments of fp32 parameters);
* communication buffers: one micro-batch of the stage's inputs being
  received and one of its output gradients being received,
  ``(in + out) * s`` (docs/design.md#the-cost-model's buffer term);
* activations of ``k`` micro-batches in flight (F started, B not ended):
  without re-materialization ``act * s * k``; with it only the stage's
  inputs are stashed, ``in * s * k``, plus one micro-batch's full
  activations while its backward runs, ``act * s``
  (:func:`activation_bytes`).
* re-materialization in *segments* (Chen et al. 2016, "Training Deep Nets
  with Sublinear Memory Cost"): a stage whose checkpoints cut its ops into
  segments also keeps, per in-flight micro-batch, the tensors one segment
  hands to a later one, and rebuilds one segment at a time inside B, so its
  working set is the largest segment's activations, not the stage's:
  ``stash = in + boundaries``, ``working = max_j act_j``
  (:func:`segment_bytes`). With one micro-batch in flight (a data-parallel
  stage) that is what lowers memory at all: whole-stage re-materialization
  then keeps exactly what no re-materialization keeps.
  :func:`best_checkpoints` places them for a stage's in-flight count.

``act`` is the stage's saved-activation bytes per sample: its ops'
``act_bytes`` plus :func:`received_saved_bytes`, the received copies its ops
save of tensors another stage's op was charged for (a cut between a ReLU,
which saves its output, and the Linear after it, which saves the same tensor
as its input: one tensor on one device, two on two). ``in``/``out`` are the
bytes per sample on the stage's incoming/outgoing edges.

Example
-------
>>> time_per_sample(1e-3, 1e-3, 2e-3, 2e-3, 0.0, 1, 4, 8, 0.0, 1.0, False)   # (1e-3+4e-3 + 2e-3+8e-3) / 4
0.00375
>>> activation_bytes(act=10.0, inputs=1.0, samples=2, in_flight=3, recompute=False)
60.0
>>> activation_bytes(act=10.0, inputs=1.0, samples=2, in_flight=3, recompute=True)    # 3 stashed inputs + one working set
26.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence, get_args

import numpy as np

# Affine, Cluster, Op and OpGraph are only named in annotations (strings): cluster.py imports this module, and the
# package's import graph must stay acyclic (tests/test_package_edges.py).

__all__ = [
    "Recompute",
    "RECOMPUTE_CHOICES",
    "ring_allreduce_s",
    "action_times",
    "WEIGHT_GRAD_SHARE",
    "split_backward",
    "op_weight_grad",
    "weight_grad_model",
    "weight_grad_time",
    "time_per_sample",
    "state_bytes",
    "activation_bytes",
    "stashed_bytes",
    "buffer_bytes",
    "memory_bytes",
    "weight_versions_bytes",
    "StageSums",
    "received_saved_bytes",
    "range_received_saved",
    "stage_sums",
    "stage_tps",
    "stage_memory",
    "segment_bytes",
    "best_checkpoints",
    "CostArrays",
    "TP_BLOCK_SUFFIXES",
    "TP_LINEAR_KINDS",
    "TP_EMBEDDING_KINDS",
    "tp_rule",
    "tp_collectives_s",
    "tp_affine",
    "tp_state_share",
    "TP_BLOCK_WHOLE_ACTIVATIONS",
    "TP_BLOCK_WHOLE_ACTIVATIONS_SP",
    "TP_REBUILT_INPUTS",
    "tp_saved_bytes",
    "ring_allgather_s",
    "step_gather_s",
    "fsdp_micro_batch_s",
    "sync_s",
    "layout_state_bytes",
    "tp_layer",
]

Recompute = Literal["none", "all", "auto"]
"""``--recompute``: no stage, every stage, or where memory or throughput asks for it (the search decides)."""

RECOMPUTE_CHOICES: tuple[Recompute, ...] = get_args(Recompute)
"""The values of :data:`Recompute`, in the order the CLI lists them."""


# ------------------------------------------------------------------ formulas
# Each works on Python floats and on numpy arrays alike (broadcasting), so
# the vectorised form below is these functions and nothing else.

def ring_allreduce_s(num_replicas, latency_s, bandwidth_Bps, nbytes):
    """Ring all-reduce seconds: ``2(r-1) latency + 2(r-1)/r * bytes / bandwidth``; 0 for one replica or no bytes."""
    r = num_replicas
    if not any(isinstance(v, np.ndarray) for v in (r, latency_s, bandwidth_Bps, nbytes)):
        if r <= 1 or not nbytes > 0:
            return 0.0
        return 2 * (r - 1) * latency_s + 2 * (r - 1) / r * nbytes / bandwidth_Bps
    r = np.maximum(np.asarray(r, dtype=float), 1.0)
    t = 2 * (r - 1) * latency_s + 2 * (r - 1) / r * nbytes / bandwidth_Bps
    return np.where((r > 1) & (np.asarray(nbytes) > 0), t, 0.0)


def action_times(fwd_alpha, fwd_beta, bwd_alpha, bwd_beta, samples, recompute):
    """(F, B) seconds of one micro-batch on one replica; B includes the re-run forward when ``recompute``."""
    fwd = fwd_alpha + fwd_beta * samples
    bwd = bwd_alpha + bwd_beta * samples + recompute * fwd
    return fwd, bwd


WEIGHT_GRAD_SHARE = 0.5
"""Share of an op's backward that computes its weight gradients (zero bubble's W), for ops whose profile
times only B (analytical costs, profiles without a weight-gradient measurement, PipeDream profiles).

For a linear or matmul layer ``Y = X Wᵀ`` the input gradient ``dX = dY W`` and
the weight gradient ``dW = dYᵀ X`` are two matmuls of the same FLOPs, so B
splits evenly; an op without parameters has no W and its whole backward is
input gradient (I). Zero Bubble (Qi et al. ICLR'24 §2) assumes the same even
split (T_B = T_W) for transformer layers. ``graphpipe profile`` measures the
split instead (:attr:`graphpipe.graph.Op.wgrad`)."""


def split_backward(bwd, weight_bwd, fwd, recompute):
    """(I, W) seconds of a backward split for zero bubble: ``W = weight_bwd``, ``I = bwd - W`` plus the
    re-run forward of a re-materializing stage (I needs the activations first; W reuses them).

    >>> split_backward(bwd=4.0, weight_bwd=2.0, fwd=1.0, recompute=False), split_backward(4.0, 2.0, 1.0, True)
    ((2.0, 2.0), (3.0, 2.0))
    """
    return bwd - weight_bwd + recompute * fwd, weight_bwd


def op_weight_grad(op: "Op", samples: float) -> float:
    """Seconds of the weight-gradient part (W) of one op's backward on ``samples`` samples.

    The measured model ``op.wgrad`` where the profile timed it, capped at the
    op's whole backward (W and B are fitted apart, so at a size far from the
    measured ones the two lines may cross); otherwise
    :data:`WEIGHT_GRAD_SHARE` of the backward of an op with parameters, and 0
    for an op without.

    >>> from graphpipe.graph import Op, Affine
    >>> op_weight_grad(Op("a", "x", bwd=Affine(1.0, 1.0), param_bytes=4), 3.0)   # the share of B = 4
    2.0
    >>> op_weight_grad(Op("a", "x", bwd=Affine(1.0, 1.0), param_bytes=4, wgrad=Affine(0.5, 0.25)), 3.0)
    1.25
    """
    if op.wgrad is not None:
        return min(op.wgrad(samples), op.bwd(samples))
    return WEIGHT_GRAD_SHARE * op.bwd(samples) if op.param_bytes > 0 else 0.0


def weight_grad_model(op: "Op") -> "Affine":
    """:func:`op_weight_grad` as a time model (uncapped), for ops merged into one: the measured W or the share.

    >>> from graphpipe.graph import Op, Affine
    >>> weight_grad_model(Op("a", "x", bwd=Affine(1.0, 2.0), param_bytes=4))
    Affine(alpha=0.5, beta=1.0)
    >>> weight_grad_model(Op("b", "x", bwd=Affine(1.0, 2.0)))   # no parameters, no W
    Affine(alpha=0.0, beta=0.0)
    """
    if op.wgrad is not None:
        return op.wgrad
    return op.bwd.scaled(WEIGHT_GRAD_SHARE if op.param_bytes > 0 else 0.0)


def weight_grad_time(graph: "OpGraph", op_ids: Iterable[int], samples: float) -> float:
    """Seconds of the weight-gradient part (W) of the backward of ``op_ids`` on ``samples`` samples:
    the sum of :func:`op_weight_grad`, the measured W where an op has one and the share otherwise.

    Every I/W split (the simulator through :meth:`graphpipe.stages.StageGraph.split_backward_times`, the
    CP-SAT model) takes W from here.
    """
    return float(sum(op_weight_grad(graph.ops[i], samples) for i in op_ids))


def time_per_sample(fwd_alpha, fwd_beta, bwd_alpha, bwd_beta, param_bytes, num_replicas, micro_batch_size,
                    batch_size, link_latency_s, link_bandwidth_Bps, recompute):
    """Seconds per sample a stage needs: ``(F + B) / b + allreduce / batch`` (module docstring).

    ``link_*`` describe the link the stage's all-reduce runs over (inter-node
    when its devices span nodes, :meth:`graphpipe.cluster.Cluster.allreduce_link`).
    """
    fwd, bwd = action_times(fwd_alpha, fwd_beta, bwd_alpha, bwd_beta, micro_batch_size / num_replicas, recompute)
    allreduce = ring_allreduce_s(num_replicas, link_latency_s, link_bandwidth_Bps, param_bytes)
    return (fwd + bwd) / micro_batch_size + allreduce / batch_size


def state_bytes(param_bytes, bytes_per_param):
    """Weights + gradients + optimizer state of ``param_bytes`` of fp32 parameters."""
    return param_bytes / 4.0 * bytes_per_param


def stashed_bytes(act, inputs, samples, recompute):
    """Bytes one in-flight micro-batch keeps from its F to its B: all activations, or only the inputs."""
    return (inputs * recompute + act * (1 - recompute)) * samples


def activation_bytes(act, inputs, samples, in_flight, recompute):
    """Peak activation bytes of a stage with ``in_flight`` micro-batches (module docstring)."""
    working = act * samples * recompute  # the re-materialized micro-batch during its B
    return stashed_bytes(act, inputs, samples, recompute) * in_flight + working


def buffer_bytes(inputs, outputs, samples):
    """Communication buffers: one micro-batch of inputs and one of output gradients being received."""
    return (inputs + outputs) * samples


def weight_versions_bytes(param_bytes, versions):
    """Stashed weight versions of an asynchronous pipeline (PipeDream weight stashing, 2BW's second buffer).

    A version is a copy of the weights only (no gradients, no optimizer
    state): ``param_bytes`` per version kept besides the live weights.

    >>> weight_versions_bytes(4e6, 2)
    8000000.0
    """
    return float(param_bytes) * versions


def memory_bytes(param_bytes, act, inputs, outputs, samples, in_flight, recompute, bytes_per_param):
    """Peak bytes on one device of a stage: state + buffers + activations (module docstring)."""
    return (state_bytes(param_bytes, bytes_per_param) + buffer_bytes(inputs, outputs, samples)
            + activation_bytes(act, inputs, samples, in_flight, recompute))


# ---------------------------------------------------------- one stage of a graph
@dataclass(frozen=True, slots=True)
class StageSums:
    """Per-sample sums over a stage's ops: what every formula above needs."""

    fwd_alpha: float
    fwd_beta: float
    bwd_alpha: float
    bwd_beta: float
    param_bytes: float
    act: float
    """Saved-activation bytes per sample: the ops' ``act_bytes`` + :func:`received_saved_bytes`."""
    inputs: float
    """Bytes per sample on edges entering the stage from other ops."""
    outputs: float
    """Bytes per sample on edges leaving the stage to other ops."""


def received_saved_bytes(graph: "OpGraph", op_ids: Iterable[int]) -> float:
    """Bytes per sample a stage of ``op_ids`` saves of its received tensors beyond its ops' ``act_bytes``.

    The sum of :attr:`graphpipe.graph.Edge.saved` over the op edges entering
    the stage: each such tensor was charged to an op elsewhere (its producer,
    or an earlier consumer), and the stage keeps its own received copy. A sum
    over edges, so that the DPs take it as prefix sums like the edge bytes:
    when two ops of one stage save the same received tensor it is charged
    twice (an upper bound; no plan of the zoo's small models has such a stage).

    >>> from graphpipe.graph import Op, OpGraph
    >>> g = OpGraph.build("relu-linear", [Op("a", "mlp", act_bytes=8.0), Op("b", "mlp", act_bytes=1.0)],
    ...                   [("a", "b", 8.0, 8.0)])
    >>> received_saved_bytes(g, (0, 1)), received_saved_bytes(g, (1,))
    (0.0, 8.0)
    """
    members = set(op_ids)
    return float(sum(e.saved for e in graph.saved_edges if e.dst in members and e.src not in members))


def range_received_saved(graph: "OpGraph", order: Sequence[int], start: int) -> np.ndarray:
    """:func:`received_saved_bytes` of the stages ``order[start..j]``, for ``j = start .. n-1`` (sequential cuts).

    >>> from graphpipe.graph import Op, OpGraph
    >>> g = OpGraph.build("chain", [Op(n, "mlp") for n in "abc"], [("a", "b", 8.0, 8.0), ("b", "c", 4.0, 2.0)])
    >>> range_received_saved(g, (0, 1, 2), 1).tolist(), range_received_saved(g, (0, 1, 2), 2).tolist()
    ([8.0, 8.0], [2.0])
    """
    pos = {v: i for i, v in enumerate(order)}
    gained = np.zeros(len(order) - start)
    for e in graph.saved_edges:
        if pos[e.src] < start <= pos[e.dst]:
            gained[pos[e.dst] - start] += e.saved
    return np.cumsum(gained)


def stage_sums(graph: "OpGraph", op_ids: Iterable[int], inputs: float | None = None,
               outputs: float | None = None) -> StageSums:
    """Sum the ops' coefficients; ``inputs``/``outputs`` default to the op edges crossing the stage boundary.

    A sequential pipeline relays every activation crossing a cut, so its
    stage graph passes its own (relayed) edge bytes instead.
    """
    op_ids = tuple(op_ids)
    ops = [graph.ops[i] for i in op_ids]
    if inputs is None or outputs is None:
        members = set(op_ids)
        into = sum(e.bytes for e in graph.edges if e.dst in members and e.src not in members)
        out_of = sum(e.bytes for e in graph.edges if e.src in members and e.dst not in members)
        inputs = into if inputs is None else inputs
        outputs = out_of if outputs is None else outputs
    return StageSums(sum(o.fwd.alpha for o in ops), sum(o.fwd.beta for o in ops), sum(o.bwd.alpha for o in ops),
                     sum(o.bwd.beta for o in ops), float(sum(o.param_bytes for o in ops)),
                     float(sum(o.act_bytes for o in ops)) + received_saved_bytes(graph, op_ids), float(inputs),
                     float(outputs))


def stage_tps(graph: "OpGraph", op_ids: Iterable[int], devices: Sequence[int], micro_batch_size: int,
              batch_size: int, cluster: "Cluster", recompute: bool = False) -> float:
    """:func:`time_per_sample` of the ops ``op_ids`` on ``devices``.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> from graphpipe.cluster import preset
    >>> g = OpGraph.build("one", [Op("a", "x", Affine(1e-3, 1e-3), Affine(2e-3, 2e-3))], [])
    >>> round(stage_tps(g, (0,), (0,), 4, 8, preset("v100", 1)), 6), round(stage_tps(g, (0,), (0,), 4, 8, preset("v100", 1), True), 6)
    (0.00375, 0.005)
    """
    s = stage_sums(graph, op_ids, 0.0, 0.0)
    link = cluster.allreduce_link(devices)
    return float(time_per_sample(s.fwd_alpha, s.fwd_beta, s.bwd_alpha, s.bwd_beta, s.param_bytes, len(devices),
                                 micro_batch_size, batch_size, link.latency_s, link.bandwidth_Bps, bool(recompute)))


def stage_memory(graph: "OpGraph", op_ids: Iterable[int], num_replicas: int, micro_batch_size: int,
                 in_flight: int, cluster: "Cluster", recompute: bool = False, inputs: float | None = None,
                 outputs: float | None = None) -> float:
    """:func:`memory_bytes` of one device of the stage with ``in_flight`` micro-batches alive."""
    s = stage_sums(graph, op_ids, inputs, outputs)
    return float(memory_bytes(s.param_bytes, s.act, s.inputs, s.outputs, micro_batch_size / num_replicas, in_flight,
                              bool(recompute), cluster.bytes_per_param))


def replica_link_tables(cluster: "Cluster") -> tuple[np.ndarray, np.ndarray]:
    """``(latency, bandwidth)`` arrays indexed by ``r``: the link of an all-reduce over devices ``0 .. r-1``
    (:meth:`graphpipe.cluster.Cluster.first_devices_link`), the canonical device set the searches cost ``r``
    replicas on. Index 0 is unused (latency 0, bandwidth 1)."""
    n = cluster.num_devices
    lat, bandwidth = np.zeros(n + 1), np.ones(n + 1)
    for r in range(1, n + 1):
        link = cluster.first_devices_link(r)
        lat[r], bandwidth[r] = link.latency_s, link.bandwidth_Bps
    return lat, bandwidth


# ------------------------------------------------ re-materialization in segments
def _segment_tables(graph: "OpGraph", order: Sequence[int]):
    """Per-sample arrays over the stage's ops in ``order``: what :func:`segment_bytes` and
    :func:`best_checkpoints` sum.

    ``act_prefix[i]``: act_bytes of ``order[:i]``. ``saved[q, p + 1]``: saved bytes of received tensors op
    ``order[q]`` keeps whose producer sits at position ``p`` (-1: outside the stage). ``hand[p]``, ``last[p]``:
    bytes of the tensor ``order[p]`` hands to later ops of the stage and the last position reading it; a
    tensor the stage also sends out (kept as its output anyway) or nobody in the stage reads hands 0.
    """
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    act_prefix = np.concatenate([[0.0], np.cumsum([float(graph.ops[v].act_bytes) for v in order])])
    saved = np.zeros((n, n + 1))
    for e in graph.saved_edges:
        if e.dst in pos:
            saved[pos[e.dst], pos.get(e.src, -1) + 1] += e.saved
    sent = {e.src for e in graph.edges if e.src in pos and e.dst not in pos}
    hand, last = np.zeros(n), np.full(n, -1)
    for e in graph.edges:
        if e.src in pos and e.dst in pos and e.src not in sent:
            p = pos[e.src]
            hand[p] = max(hand[p], float(e.bytes))
            last[p] = max(last[p], pos[e.dst])
    return act_prefix, saved, hand, last


def segment_bytes(graph: "OpGraph", op_ids: Iterable[int], checkpoints: Iterable[int], inputs: float
                  ) -> tuple[float, float]:
    """(stash, working) bytes per sample of a re-materializing stage whose segments start at ``checkpoints``.

    ``stash``, kept per in-flight micro-batch from F to the end of B: the
    stage's inputs ``inputs`` plus every tensor one segment hands to a later
    one (once, however many segments read it; not the tensors the stage
    sends on, which it keeps as outputs anyway). ``working``, while B runs:
    the largest segment's saved activations, its ops' ``act_bytes`` plus the
    received tensors they save (:func:`received_saved_bytes` of the
    segment). No checkpoints: ``(inputs, act)``, whole-stage re-materialization.

    >>> from graphpipe.graph import Op, OpGraph
    >>> g = OpGraph.build("chain", [Op(n, "mlp", act_bytes=10.0) for n in "abcd"],
    ...                   [("a", "b", 2.0), ("b", "c", 2.0), ("c", "d", 2.0)])
    >>> segment_bytes(g, range(4), (), 1.0), segment_bytes(g, range(4), (2,), 1.0)   # cut before c: b hands 2
    ((1.0, 40.0), (3.0, 20.0))
    """
    order = sorted(op_ids)
    starts = sorted({order.index(c) for c in checkpoints} - {0})
    act_prefix, saved, hand, last = _segment_tables(graph, order)
    bounds = [0, *starts, len(order)]
    stash, working = float(inputs), 0.0
    for a, b in zip(bounds, bounds[1:]):
        received = saved[a:b, : a + 1].sum() + saved[a:b, b + 1:].sum()
        working = max(working, act_prefix[b] - act_prefix[a] + received)
        stash += float(hand[a:b][last[a:b] >= b].sum())
    return stash, float(working)


def best_checkpoints(graph: "OpGraph", op_ids: Iterable[int], inputs: float, in_flight: int) -> tuple[int, ...]:
    """Segment starts minimizing a re-materializing stage's peak ``in_flight * stash + working``
    (:func:`segment_bytes`); ``()`` (the whole stage, GPipe's re-materialization) unless cutting is strictly lower.

    Exact for every bound the largest segment may take (a dynamic program over
    cut positions per bound: least hand-over bytes with every segment's
    working set within it); stages with many distinct segment sizes try 64 of
    them (quantiles). Ties go to fewer cuts, then to earlier ones.

    >>> from graphpipe.graph import Op, OpGraph
    >>> g = OpGraph.build("chain", [Op(n, "mlp", act_bytes=10.0) for n in "abcd"],
    ...                   [("a", "b", 2.0), ("b", "c", 2.0), ("c", "d", 2.0)])
    >>> best_checkpoints(g, range(4), 1.0, 1)   # one in flight: 1 * (1 + 3 * 2) + 10 = 17 against 1 + 40
    (1, 2, 3)
    >>> best_checkpoints(g, range(4), 1.0, 8), best_checkpoints(g, range(4), 1.0, 20)   # 8 * 3 + 20 < 8 + 40
    ((2,), ())
    """
    order = sorted(op_ids)
    n = len(order)
    if n < 2:
        return ()
    act_prefix, saved, hand, last = _segment_tables(graph, order)
    # working[a, b] of the segment order[a:b] and hand-over[a, b] of it, for 0 <= a < b <= n
    rows = np.concatenate([[0.0], np.cumsum(saved.sum(axis=1))])  # rows[q]: received-saved bytes of ops < q
    inner = np.zeros((n + 1, n + 1))  # inner[q, p]: saved bytes of ops < q of tensors made by ops < p
    inner[1:, 1:] = np.cumsum(np.cumsum(saved[:, 1:], axis=0), axis=1)
    a, b = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    inside = inner[b, b] - inner[a, b] - inner[b, a] + inner[a, a]  # consumer and producer both in a..b-1
    work = np.where(a < b, act_prefix[b] - act_prefix[a] + rows[b] - rows[a] - inside, np.inf)
    cost = np.zeros((n + 1, n + 1))  # cost[a, b]: bytes ops a..b-1 hand past b
    for end in range(1, n + 1):
        handed = np.concatenate([[0.0], np.cumsum(np.where(last[:end] >= end, hand[:end], 0.0))])
        cost[:end, end] = handed[end] - handed[:end]
    whole = float(inputs) * in_flight + work[0, n]
    bounds = np.unique(work[np.isfinite(work)])
    if len(bounds) > 64:
        bounds = np.unique(np.quantile(bounds, np.linspace(0, 1, 64), method="lower"))
    best, best_cuts = whole, ()
    for w in bounds:
        total, prev = np.full(n + 1, np.inf), np.full(n + 1, -1)
        total[0] = 0.0
        for end in range(1, n + 1):
            cand = np.where(work[:end, end] <= w, total[:end] + cost[:end, end], np.inf)
            k = int(np.argmin(cand))  # first minimum: the earliest start
            total[end], prev[end] = cand[k], k
        if not np.isfinite(total[n]):
            continue
        cuts, end = [], n
        while end > 0:
            end = int(prev[end])
            if end > 0:
                cuts.append(end)
        cuts.reverse()
        widest = max(work[i, j] for i, j in zip([0, *cuts], [*cuts, n]))
        peak = (float(inputs) + total[n]) * in_flight + widest
        if peak < best - 1e-9 * max(1.0, best) or (peak <= best and best_cuts and len(cuts) < len(best_cuts)):
            best, best_cuts = peak, tuple(order[c] for c in cuts)
    return best_cuts


# ------------------------------------------------------------- vectorised form
@dataclass(frozen=True, slots=True)
class CostArrays:
    """The formulas on arrays of candidate stages, with per-replica-count constants of one cluster.

    ``per-op`` arrays (``fwd_alpha`` ... ``act``) are indexed by op id, so a
    stage's sums are prefix differences or dot products; the all-reduce of
    ``r`` replicas is costed on the canonical device set ``0..r-1`` (inside
    one node when ``r <= devices_per_node``): ``link_latency[r]`` and
    ``link_bandwidth[r]`` are that set's link. Index 0 of the per-``r`` arrays is unused.
    """

    fwd_alpha: np.ndarray
    fwd_beta: np.ndarray
    bwd_alpha: np.ndarray
    bwd_beta: np.ndarray
    params: np.ndarray
    act: np.ndarray
    num_devices: int
    link_latency: np.ndarray
    link_bandwidth: np.ndarray
    bytes_per_param: float
    memory_capacity: float

    @classmethod
    def of(cls, graph: "OpGraph", cluster: "Cluster") -> "CostArrays":
        n = cluster.num_devices
        lat, bandwidth = replica_link_tables(cluster)
        ops = graph.ops
        return cls(np.array([o.fwd.alpha for o in ops], dtype=float), np.array([o.fwd.beta for o in ops], dtype=float),
                   np.array([o.bwd.alpha for o in ops], dtype=float), np.array([o.bwd.beta for o in ops], dtype=float),
                   np.array([float(o.param_bytes) for o in ops], dtype=float),
                   np.array([float(o.act_bytes) for o in ops], dtype=float),
                   n, lat, bandwidth, float(cluster.bytes_per_param), float(cluster.memory_bytes))

    @property
    def compute_alpha(self) -> np.ndarray:
        """fwd.alpha + bwd.alpha per op (seconds per call)."""
        return self.fwd_alpha + self.bwd_alpha

    @property
    def compute_beta(self) -> np.ndarray:
        """fwd.beta + bwd.beta per op (seconds per sample)."""
        return self.fwd_beta + self.bwd_beta

    def tps(self, fwd_alpha, fwd_beta, bwd_alpha, bwd_beta, params, r, micro_batch_size: int, batch_size: int,
            recompute=False):
        """:func:`time_per_sample` of stages given by their sums; ``r`` an int or an int array (broadcast)."""
        return time_per_sample(fwd_alpha, fwd_beta, bwd_alpha, bwd_beta, params, r, micro_batch_size, batch_size,
                               self.link_latency[r], self.link_bandwidth[r], recompute)

    def memory(self, params, act, r, micro_batch_size: int, in_flight, inputs=0.0, outputs=0.0, recompute=False):
        """:func:`memory_bytes` of stages given by their sums (broadcast)."""
        return memory_bytes(params, act, inputs, outputs, micro_batch_size / r, in_flight, recompute,
                            self.bytes_per_param)

    def max_in_flight(self, params, act, r, micro_batch_size: int, cap: int, inputs=0.0, outputs=0.0,
                      recompute=False) -> np.ndarray:
        """Most micro-batches in flight (``<= cap``) within memory; -1 where not even one fits.

        Memory is affine in the in-flight count, so this inverts
        :func:`memory_bytes` and then settles on the exact float test (the
        division may be one step off).
        """
        samples = micro_batch_size / np.asarray(r, dtype=float)
        base = self.memory(params, act, r, micro_batch_size, 0, inputs, outputs, recompute)
        per_mb = np.asarray(stashed_bytes(act, inputs, samples, recompute), dtype=float)
        base, per_mb = np.broadcast_arrays(np.asarray(base, dtype=float), per_mb)
        capacity = self.memory_capacity
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.floor(np.where(per_mb > 0, (capacity - base) / np.where(per_mb > 0, per_mb, 1.0), cap))
        k = np.clip(k, -1, cap)
        k = np.where((k < cap) & (base + per_mb * (k + 1) <= capacity), k + 1, k)
        k = np.where((k >= 1) & (base + per_mb * k > capacity), k - 1, k)
        # one micro-batch must fit; with re-materialization its working set is in ``base``
        k = np.where(base + per_mb > capacity, -1, np.maximum(k, 1))
        return k.astype(np.int64)


# ------------------------------------------------------ parallelism inside a stage
# A stage's devices are ``num_replicas`` groups of ``tp`` devices (graphpipe.stages.Stage.tp_groups). Tensor
# parallelism (TP) splits each splittable layer's weights over a group (Megatron-LM, Shoeybi et al. 2019, §3);
# FSDP / ZeRO-3 (Rajbhandari et al. SC'20 §5; Zhao et al. VLDB'23 "PyTorch FSDP" §3) shards the model state of
# the stage over its replicas and gathers it for compute. Each formula is a pure function of plain numbers.

TP_BLOCK_SUFFIXES = ("layer", "block", "transformer")
"""Op kinds (lower case) taken for transformer-like blocks: Megatron splits their attention by heads (QKV
column-wise, output projection row-wise) and their MLP column- then row-wise, so a block all-reduces its
output twice in forward (the ``g`` operators after attention and after the MLP) and twice in backward (the
``f`` operators before them): Megatron-LM §3, Figure 3. ``llamadecoderlayer``, ``t5block``, zoo ``transformer``."""

TP_LINEAR_KINDS = ("linear", "mlp", "head", "lmhead", "conv1d")
"""Op kinds split as one column-then-row pair (or one column-parallel layer whose output is gathered): one
all-reduce of the output in forward, one of the input gradient in backward (Megatron-LM §3, the MLP case)."""

TP_EMBEDDING_KINDS = ("embedding",)
"""Vocab-parallel embeddings: each device holds a slice of the vocabulary, looks up its rows and the group
all-reduces the output once in forward; backward needs no collective (Megatron-LM §3, "input embedding")."""


def _tp_block(kind: str) -> bool:
    """Whether an op kind is a transformer-like block (:data:`TP_BLOCK_SUFFIXES`, norms excepted)."""
    k = kind.lower()
    return any(k.endswith(suffix) for suffix in TP_BLOCK_SUFFIXES) and "norm" not in k


def tp_rule(kind: str, param_bytes: float) -> tuple[int, int, str]:
    """(all-reduces in forward, all-reduces in backward, why not split) of one op under tensor parallelism.

    An op splits when it has weights and its kind is a transformer-like block
    (:data:`TP_BLOCK_SUFFIXES`: 2 and 2), a linear layer or MLP
    (:data:`TP_LINEAR_KINDS`: 1 and 1) or an embedding (:data:`TP_EMBEDDING_KINDS`:
    1 and 0). Any other op is replicated inside the tp group: its compute and
    activations are whole on each device, its weights whole copies, and the
    third value says why (``graphpipe inspect`` prints it).

    >>> tp_rule("llamadecoderlayer", 8.0), tp_rule("linear", 8.0), tp_rule("embedding", 8.0)
    ((2, 2, ''), (1, 1, ''), (1, 0, ''))
    >>> tp_rule("glue", 0.0)[2], tp_rule("llamarmsnorm", 8.0)[2]
    ('no weights to split: replicated in the tp group', 'no Megatron split for llamarmsnorm (norms, convolutions, pooling, recurrent and other layers keep whole weights): replicated in the tp group')
    """
    k = kind.lower()
    if not param_bytes > 0:
        return 0, 0, "no weights to split: replicated in the tp group"
    if _tp_block(k):
        return 2, 2, ""
    if k in TP_LINEAR_KINDS:
        return 1, 1, ""
    if k in TP_EMBEDDING_KINDS or k.endswith("embedding"):
        return 1, 0, ""
    return 0, 0, (f"no Megatron split for {kind} (norms, convolutions, pooling, recurrent and other layers keep "
                  f"whole weights): replicated in the tp group")


def tp_collectives_s(num_collectives, tp, latency_s, bandwidth_Bps, nbytes):
    """Seconds of ``num_collectives`` ring all-reduces of ``nbytes`` each inside a tp group of ``tp`` devices
    (Megatron-LM §3; with sequence parallelism, Korthikanti et al. 2022 §4.2.2, each becomes a reduce-scatter and
    an all-gather of the same total volume): ``n (2 (t-1) latency + 2 (t-1)/t bytes / bandwidth)``.

    >>> tp_collectives_s(2, 4, 0.0, 1.0, 8.0)   # 2 * 2 * 3/4 * 8
    24.0
    """
    return num_collectives * ring_allreduce_s(tp, latency_s, bandwidth_Bps, nbytes)


def tp_affine(alpha, beta, tp, splittable, num_collectives, latency_s, bandwidth_Bps, out_bytes):
    """(alpha, beta) of one op's forward or backward on one device of a tp group: a splittable op's per-sample
    compute divided by ``tp`` (its fixed per-call part is not: kernels launch on every device), plus its
    collectives on ``out_bytes`` per sample (:func:`tp_collectives_s`, affine in the samples).

    >>> tp_affine(1.0, 8.0, 4, True, 2, 0.5, 1.0, 4.0)   # alpha 1 + 2*2*3*0.5, beta 8/4 + 2*2*3/4*4
    (7.0, 14.0)
    """
    if tp <= 1:
        return alpha, beta
    per_call = num_collectives * 2 * (tp - 1) * latency_s
    per_sample = num_collectives * 2 * (tp - 1) / tp * out_bytes / bandwidth_Bps
    return alpha + per_call, (beta / tp if splittable else beta) + per_sample


TP_BLOCK_WHOLE_ACTIVATIONS = 10 / 34
"""Share of a transformer block's saved activations every device of a tp group keeps whole: Korthikanti et al.
2022, Table 2, count ``34 s b h`` bytes per layer (attention scores aside); tensor parallelism without sequence
parallelism splits the ``24 s b h`` inside attention and the MLP and keeps the ``10 s b h`` of the layer norms,
the two blocks' inputs and their dropout masks whole (a stage with ``sequence_parallel`` false)."""

TP_BLOCK_WHOLE_ACTIVATIONS_SP = 2 / 34
"""The same share under sequence parallelism as graphpipe's runtime runs it (:mod:`graphpipe.runtime.intra_stage`,
a stage with ``sequence_parallel`` true), for a block that draws dropout (:attr:`graphpipe.graph.Op.dropout`): the
tokens between a row-wise and the next column-wise layer are split over the group, so the layer norms' inputs are
split too, and each column-wise layer keeps its all-gathered input as this device's piece, gathering it again in
backward (Korthikanti et al. 2022 §4.2.3); the two dropout masks (``2 s b h``) stay whole, drawn over the whole
tokens as one process draws them. A block without dropout (Llama's) keeps nothing whole: ``34 s b h / t``."""

TP_REBUILT_INPUTS = 4 / 34
"""What a sequence-parallel block keeps whole on top when it does not gather again in backward
(:func:`tp_saved_bytes` without ``regather``): the two column-wise layers' gathered inputs (``2 s b h`` each),
saved whole by a stage that keeps them (:attr:`Stage.keep_gathered <graphpipe.stages.Stage.keep_gathered>`) and by
a re-materializing stage's rebuild inside backward (the runtime's ``Regather`` is off there, as torch's checkpoint
takes the saved tensors itself)."""


def tp_saved_bytes(act_bytes, tp, kind, sequence_parallel=False, dropout=False, regather=True):
    """Saved-activation bytes one device of a tp group keeps for an op that splits (:func:`tp_rule`): a
    transformer block its :data:`TP_BLOCK_WHOLE_ACTIVATIONS` whole and the rest over ``tp``; with
    ``sequence_parallel`` the 2 bytes of its dropout masks where it draws ``dropout``
    (:data:`TP_BLOCK_WHOLE_ACTIVATIONS_SP`), and without ``regather`` (a stage keeping the column-wise layers'
    gathered inputs whole, or re-materializing, whose rebuild keeps them) those inputs' 4 more; a linear layer
    or an embedding all of it (a column-parallel linear saves its input, gathered whole on every device; an
    embedding its indices).
    Where that errs it errs high: a row-parallel linear's or an MLP pair's hidden activations are split, and so
    are a block's attention scores where it keeps them (eager attention), both charged here at the block's or
    the linear's share.

    >>> round(tp_saved_bytes(34.0, 2, "transformer"), 9), tp_saved_bytes(34.0, 2, "linear")   # 10 + 24/2
    (22.0, 34.0)
    >>> tp_saved_bytes(34.0, 2, "transformer", True), tp_saved_bytes(34.0, 2, "transformer", True, True)
    (17.0, 18.0)
    >>> round(tp_saved_bytes(34.0, 2, "transformer", True, True, regather=False), 9)   # 2 + 4 + 28/2
    20.0
    """
    if tp <= 1 or not _tp_block(kind):
        return act_bytes
    if not sequence_parallel:
        whole = TP_BLOCK_WHOLE_ACTIVATIONS
    else:
        whole = (TP_BLOCK_WHOLE_ACTIVATIONS_SP if dropout else 0.0) + (0.0 if regather else TP_REBUILT_INPUTS)
    return act_bytes * (whole + (1 - whole) / tp)


def tp_state_share(param_bytes, tp, splittable):
    """Parameter bytes one device of a tp group holds: a splittable op's weights over ``tp``, others whole.

    >>> tp_state_share(8.0, 4, True), tp_state_share(8.0, 4, False)
    (2.0, 8.0)
    """
    return param_bytes / tp if splittable and tp > 1 else param_bytes


def ring_allgather_s(num_replicas, latency_s, bandwidth_Bps, nbytes):
    """Ring all-gather (or reduce-scatter) of ``nbytes`` (the whole tensor) over ``r`` devices:
    ``(r-1) latency + (r-1)/r bytes / bandwidth``, half a ring all-reduce (Thakur et al. 2005); 0 for one device.

    >>> ring_allgather_s(4, 0.0, 1.0, 8.0), ring_allgather_s(1, 1.0, 1.0, 8.0)
    (6.0, 0.0)
    """
    if num_replicas <= 1 or not nbytes > 0:
        return 0.0
    return (num_replicas - 1) * latency_s + (num_replicas - 1) / num_replicas * nbytes / bandwidth_Bps


def fsdp_micro_batch_s(param_bytes, num_replicas, reshard_after_forward, latency_s, bandwidth_Bps):
    """(forward, backward) seconds of FSDP collectives one micro-batch adds on a replica, charged exposed (an
    upper bound: FSDP's prefetching hides part of it behind compute, FSDP paper §3.3).

    ``reshard_after_forward`` (ZeRO-3): the stage's parameters (``param_bytes``, one tp rank's share) are
    all-gathered before every forward, again before every backward, and the gradients reduce-scattered after
    it; without it they are gathered once per step and kept (:func:`step_gather_s`, :func:`sync_s`), nothing per
    micro-batch.

    >>> fsdp_micro_batch_s(8.0, 4, True, 0.0, 1.0), fsdp_micro_batch_s(8.0, 4, False, 0.0, 1.0)
    ((6.0, 12.0), (0.0, 0.0))
    """
    if not reshard_after_forward:
        return 0.0, 0.0
    gather = ring_allgather_s(num_replicas, latency_s, bandwidth_Bps, param_bytes)
    return gather, 2 * gather


def sync_s(param_bytes, num_replicas, shard, reshard_after_forward, latency_s, bandwidth_Bps):
    """Seconds of a stage's once-per-step collective after its last backward, on one tp rank's share
    ``param_bytes``: data parallelism's ring all-reduce of the gradients (:func:`ring_allreduce_s`); FSDP
    gathered for the step, the gradients' reduce-scatter (:func:`ring_allgather_s`), its all-gather being
    :func:`step_gather_s`'s at the step's start (the two move an all-reduce's volume, ZeRO §5: ZeRO-3 moves
    1.5x DP's only when it gathers twice per step); FSDP resharding after forward does all of it per
    micro-batch (:func:`fsdp_micro_batch_s`), nothing here.

    >>> sync_s(8.0, 4, "none", True, 0.0, 1.0), sync_s(8.0, 4, "fsdp", False, 0.0, 1.0), sync_s(8.0, 4, "fsdp", True, 0.0, 1.0)
    (12.0, 6.0, 0.0)
    """
    if shard == "fsdp":
        return 0.0 if reshard_after_forward else ring_allgather_s(num_replicas, latency_s, bandwidth_Bps, param_bytes)
    return ring_allreduce_s(num_replicas, latency_s, bandwidth_Bps, param_bytes)


def step_gather_s(param_bytes, num_replicas, shard, reshard_after_forward, latency_s, bandwidth_Bps):
    """Seconds of a stage's all-gather at the step's start: FSDP gathered for the step gathers its parameters
    (one tp rank's share ``param_bytes``) over the replicas as the step begins, while the pipeline fills (the
    runtime starts it before any forward, :meth:`graphpipe.runtime.intra_stage.IntraStage.before_iteration`),
    and the stage's first forward waits for it; 0 for any other layout.

    >>> step_gather_s(8.0, 4, "fsdp", False, 0.0, 1.0), step_gather_s(8.0, 4, "none", True, 0.0, 1.0)
    (6.0, 0.0)
    """
    if shard != "fsdp" or reshard_after_forward:
        return 0.0
    return ring_allgather_s(num_replicas, latency_s, bandwidth_Bps, param_bytes)


def layout_state_bytes(param_bytes, largest_op_bytes, num_replicas, shard, reshard_after_forward, bytes_per_param):
    """Model-state bytes on one device of a stage, ``param_bytes`` being one tp rank's share (ZeRO §5.3, FSDP §3.2).

    * ``none``: :func:`state_bytes`, whole copies;
    * ``fsdp`` resharding after forward: the state over the replicas, plus the gathered unit while it
      computes, weights and gradient of the largest op (``largest_op_bytes``, fp32-sized: 2x);
    * ``fsdp`` without resharding: weights and gradients gathered for the whole step (2x ``param_bytes``),
      only the rest of the state (the optimizer's) sharded.

    >>> layout_state_bytes(8.0, 2.0, 4, "none", True, 16.0)
    32.0
    >>> layout_state_bytes(8.0, 2.0, 4, "fsdp", True, 16.0), layout_state_bytes(8.0, 2.0, 4, "fsdp", False, 16.0)
    (12.0, 20.0)
    """
    whole = state_bytes(param_bytes, bytes_per_param)
    if shard != "fsdp":
        return whole
    if reshard_after_forward:
        return whole / num_replicas + 2.0 * largest_op_bytes
    kept = min(whole, 2.0 * param_bytes)
    return kept + (whole - kept) / num_replicas


def tp_layer(op: "Op", tp: int, latency_s: float, bandwidth_Bps: float, sequence_parallel: bool = False,
             regather: bool = True) -> "Op":
    """``op`` as one device of a tp group of ``tp`` runs it over a link of ``latency_s``/``bandwidth_Bps`` (the
    node's): :func:`tp_rule`'s split, :func:`tp_affine` times (the weight-gradient part W split the same way, the
    collectives falling on the input-gradient part), :func:`tp_state_share` weights, and a splittable op's saved
    activations as :func:`tp_saved_bytes` has them: plain tensor parallelism keeps a block's layer-norm and
    dropout activations whole, ``sequence_parallel`` splits them too. Sequence parallelism's reduce-scatters
    and all-gathers move what the all-reduces did (the same time), and with ``regather`` (the runtime's
    ``Regather``: a column-wise layer keeps its gathered input as this device's piece) backward gathers each
    column-wise input again, one ring all-gather of ``out_bytes`` per backward collective (a schedule splitting
    the backward gathers it in W too, which is not charged). A stage keeping its gathered inputs whole, or
    re-materializing, runs without it (``regather`` false): no second gather, and those inputs are kept whole.
    ``tp`` 1: ``op`` itself.

    >>> from graphpipe.graph import Op, Affine
    >>> op = Op("b", "transformer", Affine(0.0, 8.0), Affine(0.0, 16.0), 64.0, 32.0, 4.0)
    >>> t = tp_layer(op, 4, 0.0, 1.0)
    >>> t.fwd, t.bwd, t.param_bytes, round(t.act_bytes, 9)   # 8/4 + 2*2*3/4*4, 16/4 + 12, 32 * (10 + 24/4) / 34
    (Affine(alpha=0.0, beta=14.0), Affine(alpha=0.0, beta=16.0), 16.0, 15.058823529)
    >>> t = tp_layer(op, 4, 0.0, 1.0, sequence_parallel=True)
    >>> t.bwd, t.act_bytes   # 16 + 2 gathers again of 3/4 * 4, all 32 bytes over 4
    (Affine(alpha=0.0, beta=22.0), 8.0)
    """
    from dataclasses import replace as _replace  # stdlib; the module keeps graph types out of its imports

    if tp <= 1:
        return op
    n_fwd, n_bwd, why = tp_rule(op.kind, op.param_bytes)
    split = not why
    f_alpha, f_beta = tp_affine(op.fwd.alpha, op.fwd.beta, tp, split, n_fwd, latency_s, bandwidth_Bps, op.out_bytes)
    b_alpha, b_beta = tp_affine(op.bwd.alpha, op.bwd.beta, tp, split, n_bwd, latency_s, bandwidth_Bps, op.out_bytes)
    if sequence_parallel and regather and split:
        # one ring all-gather of the layer input per backward collective (:func:`ring_allgather_s`, affine in the
        # samples): ``(t-1) latency`` per call, ``(t-1)/t bytes / bandwidth`` per sample
        b_alpha += n_bwd * (tp - 1) * latency_s
        b_beta += n_bwd * (tp - 1) / tp * op.out_bytes / bandwidth_Bps
    affine = type(op.fwd)
    w = weight_grad_model(op)
    return _replace(op, fwd=affine(f_alpha, f_beta), bwd=affine(b_alpha, b_beta),
                    wgrad=affine(w.alpha, w.beta / tp if split else w.beta),
                    param_bytes=float(tp_state_share(op.param_bytes, tp, split)),
                    act_bytes=float(tp_saved_bytes(op.act_bytes, tp, op.kind, sequence_parallel, op.dropout, regather)
                                    if split else op.act_bytes))
