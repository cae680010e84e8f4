"""Helpers for the sched tests (no tests here): clusters, stage graphs, an oracle simulator.

The oracle re-derives the shared simulator semantics from their definition
(sample-interval overlap instead of the engine's index arithmetic, and
Bellman-Ford style relaxation instead of the engine's single topological
pass), so agreement between the two is evidence, not tautology.
"""

from __future__ import annotations

import itertools
import random

from graphpipe import costs
from graphpipe.actions import Action
from graphpipe.cluster import Cluster, DeviceSpec, Link
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.stages import Stage, StageGraph

from conftest import make_op, random_sp_graph


def free_cluster(n: int, memory: float = 1e12) -> Cluster:
    """Communication is free: zero latency, practically infinite bandwidth."""
    return Cluster(name="free", num_devices=n, devices_per_node=n,
                   device=DeviceSpec(name="x", memory_bytes=memory, peak_flops=1e15, op_overhead_s=0.0),
                   intra_node=Link(latency_s=0.0, bandwidth_Bps=1e30), inter_node=Link(latency_s=0.0, bandwidth_Bps=1e30))


def latency_cluster(n: int, latency: float, bandwidth: float = 1e30, per_node: int | None = None) -> Cluster:
    return Cluster(name="lat", num_devices=n, devices_per_node=per_node or n,
                   device=DeviceSpec(name="x", memory_bytes=1e12, peak_flops=1e15, op_overhead_s=0.0),
                   intra_node=Link(latency_s=latency, bandwidth_Bps=bandwidth),
                   inter_node=Link(latency_s=2 * latency, bandwidth_Bps=bandwidth / 2))


def uniform_chain(num_stages: int, batch_size: int, fwd: float = 1.0, bwd: float = 2.0, mb: int = 1) -> StageGraph:
    """``num_stages`` equal stages (one op each, per-sample times ``fwd``/``bwd``), one device each."""
    ops = [Op(f"l{i}", "x", Affine(0.0, fwd), Affine(0.0, bwd), 4e6, 1e5, 1e4) for i in range(num_stages)]
    g = OpGraph.build("chain", ops, [(f"l{i}", f"l{i + 1}", 1e4) for i in range(num_stages - 1)])
    return StageGraph.build(g, [Stage(i, (i,), (i,), mb) for i in range(num_stages)], batch_size, num_stages)


def one_stage_per_op(graph: OpGraph, batch_size: int, mb_sizes=None) -> StageGraph:
    n = graph.num_ops
    mb_sizes = mb_sizes or [1] * n
    return StageGraph.build(graph, [Stage(i, (i,), (i,), mb_sizes[i]) for i in range(n)], batch_size, n)


def random_stage_graph(seed: int, num_ops: int = 6, batch_size: int = 16, mixed: bool = True) -> StageGraph:
    """One stage per op of a random SP graph, micro-batch sizes from {1, 2, 4, 8} when ``mixed``."""
    rng = random.Random(seed)
    g = random_sp_graph(num_ops, seed)
    sizes = [rng.choice((1, 2, 4, 8)) if mixed else 2 for _ in range(g.num_ops)]
    return one_stage_per_op(g, batch_size, sizes)


def linearisations(sg: StageGraph):
    """Every topological order of the stage graph (brute force; small graphs only)."""
    for perm in itertools.permutations(range(sg.num_stages)):
        rank = {s: i for i, s in enumerate(perm)}
        if all(rank[p] < rank[c] for p, c in sg.edges):
            yield list(perm)


def _overlaps(a_lo, a_hi, b_lo, b_hi) -> bool:
    return a_lo < b_hi and b_lo < a_hi


def oracle_times(sg: StageGraph, schedule, cluster: Cluster, durations=None, releases=None) -> dict:
    """``{(device, action_str): (start, end)}`` by relaxation to a fixpoint (None if it never settles).

    ``durations(action)``: seconds of an action, derived by the caller (default: the stage graph's own times).
    ``releases[stage]``: no F of the stage starts before it (default :func:`oracle_gather`, FSDP's all-gather
    from the step's start).
    A message into or out of a round-robin stage carries a whole micro-batch from one group to one group: its
    bytes are ``edge_bytes * b`` on as many lanes as the smaller side has replicas holding it (a round-robin
    group's ``split``, one in PipeDream's one-replica groups; a split stage's devices)."""
    b = [st.micro_batch_size for st in sg.stages]
    # Zero bubble: a stage whose backward is split sends its gradients from I; its W waits for its own I.
    grad_kind = {a.stage_id: "I" for acts in schedule.device_actions for a in acts if a.kind == "I"}

    def delay(p, c):
        src, dst = sg.stages[p], sg.stages[c]
        nbytes = sg.edge_bytes(p, c) * b[p]
        if nbytes <= 0 or src.devices == dst.devices:
            return 0.0
        cross = any(cluster.node_of(x) != cluster.node_of(y) for x in src.devices for y in dst.devices)
        link = cluster.inter_node if cross else cluster.intra_node
        if src.round_robin or dst.round_robin:  # one group's share to one group's: as many lanes as the smaller
            lanes = min(src.split if src.round_robin else len(src.devices),
                        dst.split if dst.round_robin else len(dst.devices))
        else:
            lanes = min(len(src.devices), len(dst.devices))
        return link.latency_s + nbytes / (link.bandwidth_Bps * lanes)

    def deps(a):
        s, j = a.stage_id, a.mb_id
        out = []
        if a.kind == "W":
            return [((s, "I", j), 0.0)]
        if a.kind == "F":
            for p in sg.preds(s):
                for i in range(sg.num_micro_batches(p)):
                    if _overlaps(i * b[p], (i + 1) * b[p], j * b[s], (j + 1) * b[s]):
                        out.append(((p, "F", i), delay(p, s)))
        else:
            out.append(((s, "F", j), 0.0))
            for c in sg.succs(s):
                for k in range(sg.num_micro_batches(c)):
                    if _overlaps(k * b[c], (k + 1) * b[c], j * b[s], (j + 1) * b[s]):
                        out.append(((c, grad_kind.get(c, "B"), k), delay(s, c)))
        return out

    def dur(a):
        if durations is not None:
            return durations(a)
        if a.kind in ("I", "W"):  # the defining split: W is the parameterised ops' share of B, I the rest
            g, st = sg.graph, sg.stages[a.stage_id]
            w = sum(costs.WEIGHT_GRAD_SHARE * g.ops[i].bwd(st.samples_per_replica) for i in st.op_ids
                    if g.ops[i].param_bytes > 0)
            return w if a.kind == "W" else sg.bwd_time(a.stage_id) - w
        return sg.fwd_time(a.stage_id) if a.kind == "F" else sg.bwd_time(a.stage_id)

    if releases is None:
        releases = [oracle_gather(sg, cluster, s) for s in range(sg.num_stages)]
    start = {(d, k): 0.0 for d, acts in enumerate(schedule.device_actions) for k in range(len(acts))}
    n_actions = len(start)
    for _ in range(n_actions + 2):
        end = {key: start[key] + dur(schedule.device_actions[key[0]][key[1]]) for key in start}
        stage_end = {}
        for (d, k), e in end.items():
            a = schedule.device_actions[d][k]
            key = (a.stage_id, a.kind, a.mb_id)
            stage_end[key] = max(stage_end.get(key, 0.0), e)
        changed = False
        for (d, k) in start:
            a = schedule.device_actions[d][k]
            t = end[(d, k - 1)] if k else 0.0
            if a.kind == "F":
                t = max(t, releases[a.stage_id])
            for key, dl in deps(a):
                t = max(t, stage_end[key] + dl)
            if t > start[(d, k)] + 1e-12:
                start[(d, k)] = t
                changed = True
        if not changed:
            return {(d, str(schedule.device_actions[d][k])): (start[(d, k)], end[(d, k)]) for (d, k) in start}
    return None


def oracle_ring_allreduce(r: int, link: Link, nbytes: float) -> float:
    """A ring all-reduce by its definition: 2 (r - 1) steps, each a latency and a 1/r chunk of the bytes."""
    return 0.0 if r <= 1 or nbytes <= 0 else sum(link.latency_s + nbytes / r / link.bandwidth_Bps
                                                 for _ in range(2 * (r - 1)))


def oracle_ring_gather(r: int, link: Link, nbytes: float) -> float:
    """A ring all-gather (or reduce-scatter) by its definition: r - 1 steps of a 1/r chunk."""
    return 0.0 if r <= 1 or nbytes <= 0 else sum(link.latency_s + nbytes / r / link.bandwidth_Bps
                                                 for _ in range(r - 1))


def oracle_collective_link(cluster: Cluster, devices) -> Link:
    """The link a collective over ``devices`` runs at, by definition: one node's devices use the intra-node link;
    devices spanning nodes cross them at the inter-node latency, each of a node's ``k`` devices on its own lane,
    so ``k`` times the inter-node bandwidth (``k`` the fewest any node holds), never more than the intra-node one."""
    count: dict[int, int] = {}
    for d in devices:
        count[cluster.node_of(d)] = count.get(cluster.node_of(d), 0) + 1
    if len(count) == 1:
        return cluster.intra_node
    lanes = min(count.values())
    return Link(latency_s=cluster.inter_node.latency_s,
                bandwidth_Bps=min(cluster.intra_node.bandwidth_Bps, lanes * cluster.inter_node.bandwidth_Bps))


def oracle_sync(sg: StageGraph, cluster: Cluster, stage_id: int, param_bytes: float | None = None) -> float:
    """A stage's collective at the step's end, by definition: whole copies all-reduce their gradients over every
    device of the stage; a tp/fsdp stage's replicas (one tp rank's devices) all-reduce one rank's share
    ``param_bytes`` (or, FSDP keeping the step's parameters gathered, reduce-scatter it once, having gathered it
    at the step's start: :func:`oracle_gather`); FSDP resharding after every forward does nothing at the end."""
    st = sg.stages[stage_id]
    ring = st.devices[::st.tp]
    link = oracle_collective_link(cluster, ring)
    nbytes = sum(sg.graph.ops[i].param_bytes for i in st.op_ids) if param_bytes is None else param_bytes
    if st.shard == "fsdp":
        return 0.0 if st.reshard_after_forward else oracle_ring_gather(len(ring), link, nbytes)
    return oracle_ring_allreduce(len(ring), link, nbytes)


def oracle_gather(sg: StageGraph, cluster: Cluster, stage_id: int, param_bytes: float | None = None) -> float:
    """A stage's collective at the step's start, by definition: FSDP keeping the step's parameters gathered
    all-gathers one tp rank's share over its replicas once, from time 0; nothing for any other layout."""
    st = sg.stages[stage_id]
    if st.shard != "fsdp" or st.reshard_after_forward:
        return 0.0
    ring = st.devices[::st.tp]
    nbytes = sum(sg.graph.ops[i].param_bytes for i in st.op_ids) if param_bytes is None else param_bytes
    return oracle_ring_gather(len(ring), oracle_collective_link(cluster, ring), nbytes)


def oracle_iteration(sg: StageGraph, schedule, cluster: Cluster, durations=None, syncs=None, releases=None) -> float:
    """The iteration's end by :func:`oracle_times` (with ``releases``) plus each stage's step-end collective: it
    starts when the stage's last backward work ends on every replica -- its last W when the backward is split
    (the weight gradients are what it reduces), else its last B -- and lasts ``syncs[stage]`` (default
    :func:`oracle_sync`)."""
    times = oracle_times(sg, schedule, cluster, durations, releases)
    end = max(e for _, e in times.values())
    for st in sg.stages:
        if st.num_replicas < 2:
            continue
        kinds = ("W",) if any(a.kind == "W" and a.stage_id == st.id for acts in schedule.device_actions
                              for a in acts) else ("B",)
        last = max(e for (d, act), (_, e) in times.items()
                   if Action.parse(act).stage_id == st.id and Action.parse(act).kind in kinds)
        sync = oracle_sync(sg, cluster, st.id) if syncs is None else syncs[st.id]
        end = max(end, last + sync)
    return end


def make_op_graph_diamond(fwd: float = 1.0, edge_bytes: float = 1e4) -> OpGraph:
    ops = [Op(n, "x", Affine(0.0, fwd), Affine(0.0, 2 * fwd), 4e6, 1e5, 1e4) for n in ("in", "a", "b", "out")]
    return OpGraph.build("diamond", ops, [("in", "a", edge_bytes), ("in", "b", edge_bytes),
                                          ("a", "out", edge_bytes), ("b", "out", edge_bytes)])


__all__ = ["free_cluster", "latency_cluster", "uniform_chain", "one_stage_per_op", "random_stage_graph",
           "linearisations", "oracle_times", "make_op_graph_diamond", "make_op", "oracle_ring_allreduce",
           "oracle_ring_gather", "oracle_sync", "oracle_gather", "oracle_iteration"]
