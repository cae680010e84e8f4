"""Graph-1F1B: the 1F1B schedule generalised to a DAG of stages (GraphPipe §5, Alg. 2).

Sequential 1F1B gives stage ``i`` of ``K`` a warm-up of ``K - i`` forwards:
exactly the forwards that must be in flight downstream before the first
gradient can come back, plus one to keep the stage busy meanwhile. On a
stage *graph* "downstream" is no longer one chain. Graph-1F1B visits stages
from the sinks backwards and derives each stage's warm-up from *all* its
successors, measured in the stage's own micro-batches.

The warm-up rule
----------------
Let stage ``s`` have micro-batch size ``b_s`` and ``M_s`` micro-batches, and
let ``w_c`` be consumer ``c``'s warm-up. A stage's action list is

    F_0 .. F_{w-1},  then for k = 0..M-1:  B_k, F_{w+k} (while w+k < M).

Consider edge ``p -> c``. The gradient of ``p``'s micro-batch 0 needs the
``B`` of every consumer micro-batch covering its ``b_p`` samples: consumer
mbs ``0..k0`` with ``k0 = ceil(b_p / b_c) - 1``. Consumer ``c`` runs its
``B_{k0}`` only after its forwards ``F_0 .. F_{w_c + k0 - 1}``, which cover
the first ``(w_c + k0) * b_c`` samples, i.e. ``ceil((w_c + k0) * b_c / b_p)``
of ``p``'s micro-batches. ``p`` must have run those forwards before it blocks
on its first ``B`` (fewer deadlocks), and one more so that it computes while
the gradient travels back (fewer stretches the iteration: the stage would
idle for the consumer's round trip in every steady-state step). Hence

    w_sink = 1,
    w_p    = min(M_p, max over consumers c of ceil((w_c + k0(p, c)) * b_c / b_p) + 1).

With equal micro-batch sizes ``k0 = 0`` and this is ``w_p = max_c w_c + 1``:
the longest path to a sink, counted in stages. On a chain it is ``K - i``,
so graph-1F1B reduces exactly to 1F1B there; on a diamond the two branches
each get 2 and the source 3, where 1F1B on any linearisation of the same four
stages gives the source 4. The source's in-flight count is the depth of the
stage graph, the quantity GraphPipe's partitioner minimises (§4).

Round-robin replicas
--------------------
A stage whose ``r`` replicas take whole micro-batches in turn (PipeDream's
1F1B-RR, ``replica_mode="round-robin"``) sees only every ``r``-th
micro-batch on each device, so a stage-level warm-up of ``w`` leaves each
replica ``w / r`` in flight and it idles through every round trip (on two
stages of two replicas each: ``F0 B0 F2 B2`` per device; 23-35% longer
iterations than 1F1B-RR on pipedream's plans of the small zoo models).
With equal micro-batch sizes :func:`round_robin_warmups` therefore gives
each replica the warm-up its stage would have alone, ``r * depth`` for the
stage (``depth``: stages on the longest path to a sink), then keeps every
producer one above each consumer, and caps at ``M``; on a chain this is
exactly 1F1B-RR, so graph-1F1B still reduces to 1F1B. Stages that split
micro-batches are unchanged.

The rule is structural: it uses no times, so the cluster only has to match
the stage graph. Deadlock freedom is checked by the validator for every
generated schedule (and property-tested over random stage DAGs with mixed
micro-batch sizes).
"""

from __future__ import annotations

from typing import Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import ScheduleError
from graphpipe.stages import StageGraph

__all__ = ["graph_1f1b", "warmup_counts", "round_robin_warmups", "round_robin_rule_applies", "schedule_warmups",
           "one_f_one_b_sequence", "assemble"]


def warmup_counts(sg: StageGraph, successors: Sequence[Sequence[int]] | None = None) -> tuple[int, ...]:
    """Warm-up forwards per stage by the rule of the module docstring.

    ``successors`` overrides the stage edges (1F1B passes the chain of its
    linear order); stages are visited in reverse topological order.

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage, StageGraph
    >>> g = OpGraph.build("d", [Op(n, "x") for n in "abcd"],
    ...                   [("a", "b", 1), ("a", "c", 1), ("b", "d", 1), ("c", "d", 1)])
    >>> sg = StageGraph.build(g, [Stage(i, (i,), (i,), 2) for i in range(4)], 16, 4)
    >>> warmup_counts(sg)
    (3, 2, 2, 1)
    """
    n = sg.num_stages
    succs = [sg.succs(s) for s in range(n)] if successors is None else [tuple(x) for x in successors]
    order = _reverse_topological(succs)
    warm = [0] * n
    for p in order:
        bp = sg.stages[p].micro_batch_size
        need = 1
        for c in succs[p]:
            bc = sg.stages[c].micro_batch_size
            k0 = -(-bp // bc) - 1
            need = max(need, -(-(warm[c] + k0) * bc // bp) + 1)
        warm[p] = min(sg.num_micro_batches(p), need)
    return tuple(warm)


def round_robin_warmups(sg: StageGraph, successors: Sequence[Sequence[int]], warm: Sequence[int]) -> list[int]:
    """Warm-ups ``warm`` raised for round-robin replicas (module docstring, "Round-robin replicas").

    With equal micro-batch sizes :func:`warmup_counts` gives each stage its depth (stages on the longest
    path to a sink), capped at ``M``; a round-robin stage of ``r`` replicas admits ``r`` times that, so
    each replica has its own depth (PipeDream admits ceil(workers / input-stage replicas) per input
    replica); then, from the sinks back along ``successors``, each stage admits at least one more than
    each of its successors, which keeps the schedule deadlock-free as the plain rule does, and a
    round-robin stage one more per replica: with replica counts that differ along a chain (2 then 3) a
    replica otherwise waits on its turn at the consumer every round (2 then 3 replicas, 60 micro-batches:
    234 time units against fill-drain's 190; with the extra turn 190). Capped at the stage's ``M``.
    Meant for equal micro-batch sizes: callers apply it where :func:`round_robin_rule_applies`.

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage, StageGraph
    >>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x")], [("a", "b", 1.0)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0, 1), 2, replica_mode="round-robin"),
    ...                           Stage(1, (1,), (2, 3), 2, replica_mode="round-robin")], 8, 4)
    >>> round_robin_warmups(sg, [(1,), ()], warmup_counts(sg))
    [4, 2]
    """
    out = list(warm)
    for s in _reverse_topological(successors):
        st = sg.stages[s]
        following = max((out[c] for c in successors[s]), default=0)
        wanted = max(st.num_groups * warm[s], following + st.num_groups) if st.round_robin else out[s]
        out[s] = min(sg.num_micro_batches(s), max(wanted, out[s], following + 1))
    return out


def round_robin_rule_applies(sg: StageGraph) -> bool:
    """Whether :func:`round_robin_warmups` applies: some stage is round-robin and all share one micro-batch size."""
    return any(st.round_robin for st in sg.stages) and len({st.micro_batch_size for st in sg.stages}) == 1


def schedule_warmups(sg: StageGraph) -> tuple[int, ...]:
    """The warm-ups graph-1F1B (and graph-ZB) run: :func:`warmup_counts`, raised by
    :func:`round_robin_warmups` where :func:`round_robin_rule_applies`."""
    warm = warmup_counts(sg)
    if not round_robin_rule_applies(sg):
        return warm
    return tuple(round_robin_warmups(sg, [sg.succs(s) for s in range(sg.num_stages)], warm))


def _reverse_topological(succs: Sequence[Sequence[int]]) -> list[int]:
    """Sinks first; ties by larger stage id (deterministic)."""
    n = len(succs)
    indeg_out = [len(s) for s in succs]
    preds: list[list[int]] = [[] for _ in range(n)]
    for p, cs in enumerate(succs):
        for c in cs:
            preds[c].append(p)
    ready = sorted((s for s in range(n) if indeg_out[s] == 0), reverse=True)
    order = []
    while ready:
        s = ready.pop(0)
        order.append(s)
        for p in preds[s]:
            indeg_out[p] -= 1
            if indeg_out[p] == 0:
                ready.append(p)
        ready.sort(reverse=True)
    if len(order) != n:
        raise ScheduleError("stage order given to the warm-up rule has a cycle; pass a topological order")
    return order


def one_f_one_b_sequence(stage_id: int, num_mbs: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then ``B_k`` followed by the next forward, then the remaining backwards.

    ``warmup >= num_mbs`` is fill-drain (GPipe); ``warmup = 1`` alternates F, B.

    >>> " ".join(map(str, one_f_one_b_sequence(0, 4, 2)))
    '0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3'
    """
    warmup = max(1, min(warmup, num_mbs))
    # Built by slices, not one append per action: a search builds this for every stage of every plan it scores
    # (tuple.__new__ skips the named tuple's Python-level constructor; the objects are the same Actions).
    new = tuple.__new__
    fwd = [new(Action, (stage_id, "F", j)) for j in range(num_mbs)]
    bwd = [new(Action, (stage_id, "B", j)) for j in range(num_mbs)]
    steady = num_mbs - warmup  # B_k then F_{warmup + k}, for k < steady
    out = fwd[:warmup]
    alternating = [None] * (2 * steady)
    alternating[0::2] = bwd[:steady]
    alternating[1::2] = fwd[warmup:]
    out += alternating
    out += bwd[steady:]
    return out


def assemble(sg: StageGraph, name: str, per_stage: Sequence[Sequence[Action]]) -> Schedule:
    """Place each stage's action list on every device of the stage (one stage per device)."""
    lists: list[Sequence[Action]] = [[] for _ in range(sg.num_devices)]
    for st in sg.stages:
        for d in st.devices:
            if lists[d]:
                raise ScheduleError(f"{name}: device {d} hosts several stages ({list(sg.stages_on_device(d))}); "
                                    f"this schedule needs one stage per device — use 'interleaved' or 'gpipe' "
                                    f"for virtual stages")
        # Round-robin groups (PipeDream's 1F1B-RR) each run their own micro-batches, i mod g, in the
        # stage's order, one list shared by a group's devices; split replicas all run every action. One
        # pass deals the actions out (a pass per replica costs replicas x actions: minutes at 1024 devices).
        if st.round_robin:
            groups = st.round_robin_groups
            dealt: list[list[Action]] = [[] for _ in groups]
            for a in per_stage[st.id]:
                dealt[a.mb_id % len(groups)].append(a)  # st.replica_of(a.mb_id)'s list
            for group, own in zip(groups, dealt):
                shared = tuple(own)
                for d in group:
                    lists[d] = shared
        else:  # one tuple shared by the replicas: Schedule keeps it, and the simulator tells them alike by identity
            shared = tuple(per_stage[st.id])
            for d in st.devices:
                lists[d] = shared
    return Schedule.from_lists(name, lists)


def graph_1f1b(sg: StageGraph, cluster: Cluster | None = None) -> Schedule:
    """Graph-1F1B schedule of ``sg`` (see the module docstring for the warm-up rule).

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage, StageGraph
    >>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x")], [("a", "b", 1.0)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 3, 2)
    >>> print(graph_1f1b(sg).to_text())
    0: 0F0 0F1 0B0 0F2 0B1 0B2
    1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    warm = schedule_warmups(sg)
    per_stage = [one_f_one_b_sequence(s, sg.num_micro_batches(s), warm[s]) for s in range(sg.num_stages)]
    return assemble(sg, "graph-1f1b", per_stage)
