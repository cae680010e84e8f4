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
        lat, bandwidth = np.zeros(n + 1), np.ones(n + 1)
        first, crossed = cluster.node_of(0), False
        for r in range(1, n + 1):  # cluster.allreduce_link(range(r)), one device at a time: O(n), not O(n^2)
            crossed = crossed or cluster.node_of(r - 1) != first
            link = cluster.inter_node if crossed else cluster.intra_node
            lat[r], bandwidth[r] = link.latency_s, link.bandwidth_Bps
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
