"""Stage graphs: a partition of an OpGraph into convex stages (docs/design.md#partitioners).

A :class:`Stage` is a convex set of ops placed on a set of devices (several
devices = data parallelism inside the stage: each replica runs every action
of the stage on ``micro_batch_size / len(devices)`` samples and gradients are
all-reduced) with its own micro-batch size. Stage edges follow op edges; the
stage graph is a DAG and stage ids are a topological order of it.

Two stages may share the *same* device set only as virtual stages of an
interleaved schedule (``allow_shared_devices=True``); otherwise device sets
are pairwise disjoint.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> g = OpGraph.build("chain", [Op("a", "x"), Op("b", "x")], [("a", "b", 4.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], batch_size=8, num_devices=2)
>>> sg.edges, sg.num_micro_batches(0), sg.edge_bytes(0, 1)
(((0, 1),), 4, 4.0)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, Sequence, get_args

from graphpipe import costs
from graphpipe.errors import PlanError
from graphpipe.graph import OpGraph

if TYPE_CHECKING:
    from graphpipe.cluster import Cluster

__all__ = ["Stage", "StageGraph", "covered_mbs", "ReplicaMode", "REPLICA_MODES", "ShardMode", "SHARD_MODES"]

ShardMode = Literal["none", "fsdp"]
SHARD_MODES: tuple[ShardMode, ...] = get_args(ShardMode)
"""How a stage's replicas hold its model state: ``none``, each replica a whole copy (data parallelism, gradients
all-reduced), or ``fsdp``, parameters, gradients and optimizer state sharded over the replicas and gathered for
compute (FSDP / ZeRO-3: torch's ``fully_shard`` over the stage's replica group)."""

ReplicaMode = Literal["split", "round-robin"]
REPLICA_MODES: tuple[ReplicaMode, ...] = get_args(ReplicaMode)
"""How a replicated stage shares work: ``split`` every micro-batch evenly over its replicas (gpp), or
``round-robin`` whole micro-batches, micro-batch ``i`` to replica ``i mod r`` (PipeDream's 1F1B-RR)."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: ``op_ids`` (sorted), ``devices`` (sorted), micro-batch size, re-materialization."""

    id: int
    op_ids: tuple[int, ...]
    devices: tuple[int, ...]
    micro_batch_size: int
    recompute: bool = False
    """Re-materialize (GPipe §2.3): keep only the stage's inputs per in-flight micro-batch and run its
    forward again inside B (:mod:`graphpipe.costs`; torch.utils.checkpoint in the runtime)."""
    replica_mode: ReplicaMode = "split"
    """:data:`REPLICA_MODES`: ``split`` micro-batches over the replicas, or ``round-robin`` whole ones."""
    checkpoints: tuple[int, ...] = ()
    """Ops (ids, none the stage's first) where a re-materializing stage starts a new segment: B rebuilds one
    segment at a time (:func:`graphpipe.costs.segment_bytes`); ``()``: the whole stage at once."""
    tp: int = 1
    """Tensor-parallel degree: ``devices`` split into groups of ``tp`` consecutive devices, each group one
    replica that splits the stage's weights (Megatron-style column/row-wise layers) over its devices."""
    shard: ShardMode = "none"
    """:data:`SHARD_MODES`: whole copies per replica, or FSDP-sharded model state across the replicas."""
    reshard_after_forward: bool = True
    """FSDP only: free the gathered parameters after each forward (gather again for backward, per
    micro-batch), or keep them gathered for the whole step (torchtitan's choice under pipelining: one
    all-gather per step, more memory): all-gathered at the step's start, while the pipeline fills, and the
    gradients reduce-scattered after the stage's last backward. Only the latter on a round-robin stage, whose
    replicas run different micro-batches at different times but start and end the step together."""
    sequence_parallel: bool = False
    """TP only: the tokens between a row-wise layer and the next column-wise one are split over the tp group
    (Korthikanti et al. 2022 §4.2.2): the row-wise layer's all-reduce becomes a reduce-scatter, the column-wise
    layer's input is all-gathered, and the norms, residual adds and dropout between them keep a tp-th of their
    activations (:data:`graphpipe.costs.TP_BLOCK_WHOLE_ACTIVATIONS_SP`). The planner sets it on every TP stage;
    false (plans written before it, or by hand) runs plain tensor parallelism."""
    keep_gathered: bool = False
    """Sequence parallelism only: each column-wise layer saves its all-gathered input whole for backward instead
    of this device's piece, which backward gathers again (Megatron's choice and the default). Whole inputs
    cost ``4 s b h`` more bytes per block (:data:`graphpipe.costs.TP_REBUILT_INPUTS`) and save backward one
    all-gather per column-wise input: the search keeps them where memory allows and that is faster."""
    split: int = 1
    """Round-robin only: replicas per round-robin group. The stage's replicas form ``num_replicas / split``
    groups of ``split`` consecutive replicas; micro-batch ``i`` goes to group ``i mod groups``, whose replicas
    split it evenly (each ``micro_batch_size / split`` samples). 1: PipeDream's 1F1B-RR, each replica a group.
    Groups let a stage's device count be any multiple of a group while each replica still runs few samples."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "op_ids", tuple(sorted(self.op_ids)))
        object.__setattr__(self, "checkpoints", tuple(sorted(self.checkpoints)))
        object.__setattr__(self, "devices", tuple(sorted(self.devices)))
        if not self.op_ids:
            raise PlanError(f"stage {self.id} has no ops")
        if not self.devices:
            raise PlanError(f"stage {self.id} has no devices")
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"stage {self.id} lists a device twice: {self.devices}")
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise PlanError(f"stage {self.id}: micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if not isinstance(self.recompute, bool):
            raise PlanError(f"stage {self.id}: recompute must be true or false, got {self.recompute!r}")
        if self.replica_mode not in REPLICA_MODES:
            raise PlanError(f"stage {self.id}: replica_mode must be one of {', '.join(REPLICA_MODES)}, "
                            f"got {self.replica_mode!r}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise PlanError(f"stage {self.id}: tp must be a positive integer, got {self.tp!r}")
        if len(self.devices) % self.tp:
            raise PlanError(f"stage {self.id}: tp {self.tp} does not divide its {len(self.devices)} devices "
                            f"{list(self.devices)}; give it a multiple of {self.tp} devices or another tp")
        if self.shard not in SHARD_MODES:
            raise PlanError(f"stage {self.id}: shard must be one of {', '.join(SHARD_MODES)}, got {self.shard!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise PlanError(f"stage {self.id}: reshard_after_forward must be true or false, "
                            f"got {self.reshard_after_forward!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"stage {self.id}: sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp < 2:
            raise PlanError(f"stage {self.id}: sequence_parallel splits tokens over a tensor-parallel group, but the "
                            f"stage has tp {self.tp}; set sequence_parallel false or tp 2 or more")
        if not isinstance(self.keep_gathered, bool):
            raise PlanError(f"stage {self.id}: keep_gathered must be true or false, got {self.keep_gathered!r}")
        if self.keep_gathered and not self.sequence_parallel:
            raise PlanError(f"stage {self.id}: keep_gathered keeps sequence parallelism's gathered inputs whole, but "
                            f"the stage is not sequence parallel; set keep_gathered false or sequence_parallel true")
        if self.round_robin and self.shard != "none" and self.reshard_after_forward:
            raise PlanError(f"stage {self.id}: a round-robin stage's replicas run different micro-batches at "
                            f"different times, so they cannot gather FSDP-sharded weights together for every "
                            f"micro-batch; set reshard_after_forward false (gathered once at the step's start), "
                            f"shard none, or replica_mode split")
        if not isinstance(self.split, int) or isinstance(self.split, bool) or self.split < 1:
            raise PlanError(f"stage {self.id}: split must be a positive integer, got {self.split!r}")
        if self.split > 1 and not self.round_robin:
            raise PlanError(f"stage {self.id}: split {self.split} groups round-robin replicas; a split stage "
                            f"already splits every micro-batch over all its replicas: set split 1")
        if self.split > 1 and (self.num_replicas % self.split or self.micro_batch_size % self.split):
            raise PlanError(f"stage {self.id}: split {self.split} must divide its {self.num_replicas} replicas and "
                            f"its micro-batch size {self.micro_batch_size}")
        if self.checkpoints and not self.recompute:
            raise PlanError(f"stage {self.id}: checkpoints need recompute (they cut its re-materialization)")
        stray = sorted(set(self.checkpoints) - set(self.op_ids[1:]))
        if stray or len(set(self.checkpoints)) != len(self.checkpoints):
            raise PlanError(f"stage {self.id}: checkpoints must be distinct ops of the stage other than its first, "
                            f"got {list(self.checkpoints)}")

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas: the stage's devices over its tensor-parallel degree."""
        return len(self.devices) // self.tp

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The replicas' device groups: ``tp`` consecutive devices each (one device each when tp is 1)."""
        return tuple(self.devices[i:i + self.tp] for i in range(0, len(self.devices), self.tp))

    @property
    def parallel(self) -> bool:
        """Whether the stage is parallel inside itself (tensor parallel or sharded), not only replicated."""
        return self.tp > 1 or self.shard != "none"

    @property
    def shards_per_micro_batch(self) -> int:
        """Replicas one micro-batch is split over: a round-robin group's ``split``, a split stage's all."""
        return self.split if self.round_robin else self.num_replicas

    @property
    def samples_per_replica(self) -> float:
        """Samples one device processes per micro-batch of this stage (a group's share under round-robin)."""
        return self.micro_batch_size / self.shards_per_micro_batch

    @property
    def group_size(self) -> int:
        """Round-robin: devices per group (``split`` tp groups of ``tp``), consecutive in ``devices``."""
        return self.split * self.tp

    @property
    def round_robin_groups(self) -> tuple[tuple[int, ...], ...]:
        """Round-robin: the groups that take micro-batches in turn, :attr:`group_size` devices each."""
        size = self.group_size
        return tuple(self.devices[i:i + size] for i in range(0, len(self.devices), size))

    @property
    def num_groups(self) -> int:
        """Round-robin groups taking micro-batches in turn (``num_replicas / split``); 1 for a split stage."""
        return self.num_replicas // self.split if self.round_robin else 1

    @property
    def round_robin(self) -> bool:
        return self.replica_mode == "round-robin"

    @property
    def regathers(self) -> bool:
        """Whether backward gathers the column-wise layers' inputs again (the runtime's ``Regather``, and what
        the cost model charges): a sequence-parallel stage that neither re-materializes (its checkpoint's
        rebuild keeps them whole) nor keeps them (:attr:`keep_gathered`)."""
        return self.sequence_parallel and not (self.recompute or self.keep_gathered)

    def replica_of(self, mb_id: int) -> tuple[int, ...]:
        """The devices (one group: ``split`` tp groups) that run micro-batch ``mb_id`` of a round-robin stage
        (PipeDream: replica ``i mod r``)."""
        return self.round_robin_groups[mb_id % self.num_groups]


@dataclass(frozen=True, slots=True)
class StageGraph:
    """A DAG of stages over ``graph`` for one mini-batch of ``batch_size`` samples.

    Construct with :meth:`build`, which derives the stage edges, renumbers
    nothing, and checks every invariant (stages partition the ops, are convex,
    stage ids are topological, device sets disjoint and inside the cluster,
    micro-batch sizes divide the batch and are divisible by the replica count).
    """

    graph: OpGraph
    stages: tuple[Stage, ...]
    batch_size: int
    num_devices: int
    edges: tuple[tuple[int, int], ...] = ()
    allow_shared_devices: bool = False
    sequential: bool = False
    """Sequential pipeline (SPP: PipeDream, Piper, GPipe, torch.distributed.pipelining):
    stage i feeds only stage i+1, which relays every activation crossing the cut
    after stage i. Edges are then the chain (i, i+1) and ``edge_bytes(i, i+1)`` is
    the bytes per sample of all op edges from stages <= i to stages > i."""
    cluster: "Cluster | None" = field(default=None, compare=False, repr=False)
    """The cluster a stage parallel inside itself (tp > 1 or fsdp) prices its collectives on (tensor parallelism
    on the node's link, FSDP on its replicas' link); needed only when some stage is parallel."""
    _stage_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _edge_bytes: Mapping[tuple[int, int], float] = field(init=False, repr=False, compare=False)
    _on_device: Mapping[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _costed: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g = self.graph
        object.__setattr__(self, "_costed", {})
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise PlanError(f"batch size must be a positive integer, got {self.batch_size!r}")
        # Stage ids are 0..n-1 in order.
        for position, stage in enumerate(self.stages):
            if stage.id != position:
                raise PlanError(f"stage ids must be 0..{len(self.stages) - 1} in order; position {position} has id {stage.id}")
        # Partition of the ops.
        stage_of = [-1] * g.num_ops
        for stage in self.stages:
            for op_id in stage.op_ids:
                if not 0 <= op_id < g.num_ops:
                    raise PlanError(f"stage {stage.id} refers to op {op_id}, graph has {g.num_ops} ops")
                if stage_of[op_id] != -1:
                    raise PlanError(f"op {g.ops[op_id].name!r} is in stages {stage_of[op_id]} and {stage.id}: stages must partition the ops")
                stage_of[op_id] = stage.id
        missing = [g.ops[i].name for i, s in enumerate(stage_of) if s == -1]
        if missing:
            raise PlanError(f"ops not in any stage: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        # Devices inside the cluster, disjoint (or identical for virtual stages).
        # (at thousands of devices a stage graph is rebuilt for every candidate a search scores: the common case,
        # devices in range and disjoint, is checked with set operations, the per-device loop only names the fault)
        every = [d for stage in self.stages for d in stage.devices]
        disjoint = len(set(every)) == len(every)
        in_range = not every or (min(every) >= 0 and max(every) < self.num_devices)
        owner: dict[int, tuple[int, ...]] = {}
        for stage in () if disjoint and in_range else self.stages:
            for d in stage.devices:
                if not 0 <= d < self.num_devices:
                    raise PlanError(f"stage {stage.id} uses device {d}, cluster has devices 0..{self.num_devices - 1}")
                if d in owner and (not self.allow_shared_devices or owner[d] != stage.devices):
                    raise PlanError(f"device {d} is used by two stages with different device sets {owner[d]} and {stage.devices}"
                                    if self.allow_shared_devices else f"device {d} is used by more than one stage (device sets must be disjoint)")
                owner[d] = stage.devices
        # Micro-batch sizes.
        for stage in self.stages:
            if self.batch_size % stage.micro_batch_size:
                raise PlanError(f"stage {stage.id}: micro-batch size {stage.micro_batch_size} does not divide the batch size {self.batch_size}")
            if stage.round_robin and self.batch_size // stage.micro_batch_size < stage.num_groups:
                raise PlanError(f"stage {stage.id}: {stage.num_groups} round-robin replicas (groups) but only "
                                f"{self.batch_size // stage.micro_batch_size} micro-batches; each replica needs one")
            if not stage.round_robin and stage.micro_batch_size % stage.num_replicas:
                raise PlanError(f"stage {stage.id}: micro-batch size {stage.micro_batch_size} is not divisible by its {stage.num_replicas} replicas")
        # Convexity of each stage: no path leaves the stage and comes back.
        for stage in self.stages:
            _check_convex(g, stage, stage_of)
        # Stage edges from op edges.
        edge_bytes: dict[tuple[int, int], float] = {}
        for e in g.edges:
            a, b = stage_of[e.src], stage_of[e.dst]
            if a != b:
                edge_bytes[(a, b)] = edge_bytes.get((a, b), 0.0) + e.bytes
        derived = tuple(sorted(edge_bytes))
        if self.sequential:
            for a, b in derived:
                if a >= b:
                    raise PlanError(f"stage edge {a}->{b} goes backwards: a sequential pipeline needs topological stage ids")
            cut = {(i, i + 1): 0.0 for i in range(len(self.stages) - 1)}
            for (a, b), nbytes in edge_bytes.items():
                for i in range(a, b):
                    cut[(i, i + 1)] += nbytes
            edge_bytes = cut
            derived = tuple(sorted(cut))
        if self.edges and tuple(sorted(self.edges)) != derived:
            raise PlanError(f"stage_edges {sorted(self.edges)} do not match the edges implied by the ops {list(derived)}")
        for a, b in derived:
            if a >= b:
                raise PlanError(f"stage edge {a}->{b} goes backwards: stage ids must be topological"
                                " (or the stage graph has a cycle: stages not convex)")
        n = len(self.stages)
        succs: list[list[int]] = [[] for _ in range(n)]
        preds: list[list[int]] = [[] for _ in range(n)]
        for a, b in derived:
            succs[a].append(b)
            preds[b].append(a)
        object.__setattr__(self, "edges", derived)
        object.__setattr__(self, "_stage_of", tuple(stage_of))
        object.__setattr__(self, "_succs", tuple(tuple(s) for s in succs))
        object.__setattr__(self, "_preds", tuple(tuple(p) for p in preds))
        object.__setattr__(self, "_edge_bytes", edge_bytes)
        on_device: dict[int, tuple[int, ...]] = {}
        for stage in self.stages:  # in stage order, so each device's tuple is sorted
            if disjoint:  # one stage per device
                on_device.update(dict.fromkeys(stage.devices, (stage.id,)))
            else:
                for d in stage.devices:
                    on_device[d] = on_device.get(d, ()) + (stage.id,)
        object.__setattr__(self, "_on_device", on_device)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, graph: OpGraph, stages: Sequence[Stage], batch_size: int, num_devices: int,
              allow_shared_devices: bool = False, sequential: bool = False, cluster: "Cluster | None" = None
              ) -> "StageGraph":
        """Build from stages in any order: renumbers them topologically (ties by smallest op id).

        A ``sequential`` pipeline keeps the given order (it is the pipeline's order);
        it must be topological.
        """
        stage_of: dict[int, int] = {}
        for idx, stage in enumerate(stages):
            for op_id in stage.op_ids:
                stage_of[op_id] = idx
        n = len(stages)
        succs: list[set[int]] = [set() for _ in range(n)]
        indeg = [0] * n
        for e in graph.edges:
            a, b = stage_of.get(e.src), stage_of.get(e.dst)
            if a is not None and b is not None and a != b and b not in succs[a]:
                succs[a].add(b)
                indeg[b] += 1
        key = [min(s.op_ids) if s.op_ids else 0 for s in stages]
        ready = [(key[i], i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, i = heapq.heappop(ready)
            order.append(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, (key[j], j))
        if len(order) < n:
            stuck = sorted(i for i in range(n) if indeg[i] > 0)
            raise PlanError(f"stage graph has a cycle among stages {stuck}: some stage is not convex")
        if sequential:
            order = list(range(n))
        renumbered = [replace(stages[old], id=new) for new, old in enumerate(order)]
        return cls(graph, tuple(renumbered), batch_size, num_devices, allow_shared_devices=allow_shared_devices,
                   sequential=sequential, cluster=cluster)

    # ----------------------------------------------------------------- access
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self, op_id: int) -> int:
        return self._stage_of[op_id]

    def succs(self, stage_id: int) -> tuple[int, ...]:
        return self._succs[stage_id]

    def preds(self, stage_id: int) -> tuple[int, ...]:
        return self._preds[stage_id]

    def edge_bytes(self, src: int, dst: int) -> float:
        """Bytes per sample flowing from stage ``src`` to stage ``dst``."""
        return self._edge_bytes[(src, dst)]

    def num_micro_batches(self, stage_id: int) -> int:
        return self.batch_size // self.stages[stage_id].micro_batch_size

    def busiest_replica_micro_batches(self, stage_id: int) -> int:
        """Micro-batches the busiest replica of a stage runs: all ``M`` where replicas split them, ``ceil(M / g)``
        where ``g`` round-robin groups take them in turn."""
        m, st = self.num_micro_batches(stage_id), self.stages[stage_id]
        return -(-m // st.num_groups) if st.round_robin else m

    def devices_used(self) -> tuple[int, ...]:
        return tuple(sorted({d for s in self.stages for d in s.devices}))

    def stages_on_device(self, device_id: int) -> tuple[int, ...]:
        """The ids of the stages ``device_id`` holds, in increasing order (a table: schedules ask per device)."""
        return self._on_device.get(device_id, ())

    def fwd_time(self, stage_id: int) -> float:
        """Seconds for one forward micro-batch on one replica of the stage."""
        return self._action_times(stage_id)[0]

    def bwd_time(self, stage_id: int) -> float:
        """Seconds for one backward micro-batch on one replica, the re-run forward included when the stage recomputes."""
        return self._action_times(stage_id)[1]

    def recompute_time(self, stage_id: int) -> float:
        """Seconds of re-run forward at the start of each B (0 without re-materialization)."""
        return self.fwd_time(stage_id) if self.stages[stage_id].recompute else 0.0

    def costed_graph(self, stage_id: int) -> OpGraph:
        """The op graph as one device of the stage runs it: ``graph`` itself for tp 1, else every op as one
        device of a tp group (:func:`graphpipe.costs.tp_layer` on the node's link); one copy per tp degree,
        sequence parallelism and re-gathering (a sequence-parallel stage that re-materializes, or keeps its gathered
        inputs whole, gathers no input again in backward and keeps the gathered ones whole)."""
        st = self.stages[stage_id]
        tp, sp, regather = st.tp, st.sequence_parallel, st.regathers
        if tp == 1:
            return self.graph
        costed = self._costed.get((tp, sp, regather))
        if costed is None:
            if self.cluster is None:
                raise PlanError(f"stage {stage_id} is tensor parallel (tp {tp}): its collectives need the cluster; "
                                f"build the stage graph with cluster= (a Plan attaches its own)")
            link = self.cluster.intra_node
            costed = replace(self.graph, ops=tuple(costs.tp_layer(op, tp, link.latency_s, link.bandwidth_Bps, sp,
                                                                  regather) for op in self.graph.ops))
            self._costed[(tp, sp, regather)] = costed
        return costed

    def _replica_link(self, stage_id: int):
        """The link one tp rank's replicas (FSDP's shard group, the gradient all-reduce's ring) run over."""
        s = self.stages[stage_id]
        if self.cluster is None:
            raise PlanError(f"stage {stage_id} is sharded (fsdp): its collectives need the cluster; build the stage "
                            f"graph with cluster= (a Plan attaches its own)")
        return self.cluster.allreduce_link(s.devices[::s.tp])

    def _compute_times(self, stage_id: int) -> tuple[float, float]:
        s = self.stages[stage_id]
        sums = costs.stage_sums(self.costed_graph(stage_id), s.op_ids, 0.0, 0.0)
        return costs.action_times(sums.fwd_alpha, sums.fwd_beta, sums.bwd_alpha, sums.bwd_beta,
                                  s.samples_per_replica, s.recompute)

    def fsdp_times(self, stage_id: int) -> tuple[float, float]:
        """(forward, backward) seconds of FSDP collectives per micro-batch (:func:`graphpipe.costs.fsdp_micro_batch_s`;
        0 unless the stage shards with resharding after forward)."""
        s = self.stages[stage_id]
        if s.shard != "fsdp" or s.num_replicas < 2:
            return 0.0, 0.0
        link = self._replica_link(stage_id)
        return costs.fsdp_micro_batch_s(self.layout_param_bytes(stage_id), s.num_replicas, s.reshard_after_forward,
                                        link.latency_s, link.bandwidth_Bps)

    def _action_times(self, stage_id: int) -> tuple[float, float]:
        fwd, bwd = self._compute_times(stage_id)
        if self.stages[stage_id].shard == "fsdp":
            gather_f, gather_b = self.fsdp_times(stage_id)
            return fwd + gather_f, bwd + gather_b
        return fwd, bwd

    def split_backward_times(self, stage_id: int) -> tuple[float, float]:
        """(I, W) seconds of one split backward micro-batch on one replica (:func:`graphpipe.costs.split_backward`):
        I + W = :meth:`bwd_time`. FSDP's per-micro-batch gather and reduce-scatter fall on I."""
        s = self.stages[stage_id]
        fwd, bwd = self._compute_times(stage_id)
        weight = costs.weight_grad_time(self.costed_graph(stage_id), s.op_ids, s.samples_per_replica)
        i, w = costs.split_backward(bwd - s.recompute * fwd, weight, fwd, s.recompute)
        return i + self.fsdp_times(stage_id)[1], w

    def param_bytes(self, stage_id: int) -> float:
        """Bytes of the stage's parameters (the whole stage, every tp rank's share together)."""
        return sum(self.graph.ops[i].param_bytes for i in self.stages[stage_id].op_ids)

    def layout_param_bytes(self, stage_id: int) -> float:
        """Parameter bytes one tp rank holds (:func:`graphpipe.costs.tp_state_share` summed; :meth:`param_bytes`
        at tp 1)."""
        g = self.costed_graph(stage_id)
        return sum(g.ops[i].param_bytes for i in self.stages[stage_id].op_ids)

    def sync_time(self, stage_id: int, cluster) -> float:
        """Seconds of the stage's once-per-step collective after its last backward: the gradients' ring
        all-reduce over its devices for whole copies (``cluster.allreduce_time``, as always), else
        :func:`graphpipe.costs.sync_s` on one tp rank's share over the replicas."""
        s = self.stages[stage_id]
        if not s.parallel:
            return cluster.allreduce_time(s.devices, self.param_bytes(stage_id)) if s.num_replicas > 1 else 0.0
        return self._replica_collective(costs.sync_s, stage_id, cluster)

    def gather_time(self, stage_id: int, cluster) -> float:
        """Seconds of the stage's all-gather at the step's start, which its first forward waits for
        (:func:`graphpipe.costs.step_gather_s`: FSDP gathered for the step; 0 otherwise)."""
        s = self.stages[stage_id]
        if s.shard != "fsdp" or s.reshard_after_forward or s.num_replicas < 2:
            return 0.0
        return self._replica_collective(costs.step_gather_s, stage_id, cluster)

    def gather_times(self, cluster) -> list[float]:
        """:meth:`gather_time` of every stage, in stage order."""
        return [self.gather_time(s, cluster) for s in range(self.num_stages)]

    def _replica_collective(self, seconds, stage_id: int, cluster) -> float:
        """``seconds`` (:func:`graphpipe.costs.sync_s` or :func:`~graphpipe.costs.step_gather_s`) on one tp
        rank's parameter share over the stage's replicas, on the link joining its tp groups' first devices."""
        s = self.stages[stage_id]
        link = cluster.allreduce_link(s.devices[::s.tp])
        return seconds(self.layout_param_bytes(stage_id), s.num_replicas, s.shard, s.reshard_after_forward,
                       link.latency_s, link.bandwidth_Bps)

    def state_bytes(self, stage_id: int, cluster) -> float:
        """Model-state bytes on one device of the stage: ``cluster.state_bytes`` of its parameters for whole
        copies, else :func:`graphpipe.costs.layout_state_bytes` (tp share, FSDP sharding, gathered unit)."""
        if not self.stages[stage_id].parallel:
            return cluster.state_bytes(self.param_bytes(stage_id))
        return self.model_state_bytes(stage_id, cluster.bytes_per_param)

    def model_state_bytes(self, stage_id: int, bytes_per_param: float) -> float:
        """:func:`graphpipe.costs.layout_state_bytes` of the stage at ``bytes_per_param`` bytes of state per
        4 bytes of parameters (16: Adam in fp32; 8: weights and gradients, ``graphpipe run``'s SGD)."""
        s = self.stages[stage_id]
        g = self.costed_graph(stage_id)
        largest = max(g.ops[i].param_bytes for i in s.op_ids)
        return float(costs.layout_state_bytes(self.layout_param_bytes(stage_id), largest, s.num_replicas, s.shard,
                                              s.reshard_after_forward, bytes_per_param))

    def device_memory(self, stage_id: int, cluster, in_flight: int) -> float:
        """Peak bytes on one device of the stage with ``in_flight`` micro-batches alive: :meth:`state_bytes` +
        buffers + activations (:func:`graphpipe.costs.memory_bytes`'s terms, layout-aware)."""
        s = self.stages[stage_id]
        sums = self.stage_sums(stage_id)
        kept, rebuilt = self.activation_terms(stage_id)
        samples = s.samples_per_replica
        return (self.state_bytes(stage_id, cluster) + costs.buffer_bytes(sums.inputs, sums.outputs, samples)
                + kept * samples * in_flight + rebuilt * samples)

    def act_bytes_per_sample(self, stage_id: int) -> float:
        """Saved-activation bytes per sample on one device: the ops' ``act_bytes`` (a tp rank's share) +
        :func:`graphpipe.costs.received_saved_bytes`."""
        op_ids = self.stages[stage_id].op_ids
        g = self.costed_graph(stage_id)
        return sum(g.ops[i].act_bytes for i in op_ids) + costs.received_saved_bytes(g, op_ids)

    def input_bytes_per_sample(self, stage_id: int) -> float:
        """Bytes per sample the stage receives along its stage edges (relayed bytes in a sequential pipeline)."""
        return float(sum(self._edge_bytes[(p, stage_id)] for p in self._preds[stage_id]))

    def output_bytes_per_sample(self, stage_id: int) -> float:
        """Bytes per sample the stage sends along its stage edges."""
        return float(sum(self._edge_bytes[(stage_id, c)] for c in self._succs[stage_id]))

    def stage_sums(self, stage_id: int) -> costs.StageSums:
        """The stage's cost coefficients (:class:`graphpipe.costs.StageSums`), inputs and outputs as its edges carry."""
        return costs.stage_sums(self.costed_graph(stage_id), self.stages[stage_id].op_ids, self.input_bytes_per_sample(stage_id),
                                self.output_bytes_per_sample(stage_id))

    def activation_terms(self, stage_id: int) -> tuple[float, float]:
        """(stash, working) bytes per sample: what one in-flight micro-batch keeps from F to B, and what B
        rebuilds while it runs (the module docstring of :mod:`graphpipe.costs`)."""
        s = self.stages[stage_id]
        sums = self.stage_sums(stage_id)
        if not s.recompute:
            return sums.act, 0.0
        if not s.checkpoints:  # the whole stage: what segment_bytes gives for one segment, without its tables
            return sums.inputs, sums.act
        return costs.segment_bytes(self.costed_graph(stage_id), s.op_ids, s.checkpoints, sums.inputs)

    def depth(self) -> int:
        """Stages on the longest source-to-sink path."""
        longest = [1] * self.num_stages
        for a in range(self.num_stages):
            for b in self._succs[a]:
                longest[b] = max(longest[b], longest[a] + 1)
        return max(longest, default=0)

    def is_chain(self) -> bool:
        """True when the stages form one sequential chain 0 -> 1 -> ... -> n-1."""
        return all(self._succs[i] == ((i + 1,) if i + 1 < self.num_stages else ()) for i in range(self.num_stages))

    def consumed_mbs(self, producer: int, consumer: int, consumer_mb: int) -> tuple[int, ...]:
        """Producer micro-batch ids whose samples consumer micro-batch ``consumer_mb`` covers.

        Micro-batch ``j`` of a stage with size ``b`` holds samples ``[j*b, (j+1)*b)``;
        a consumer with a larger micro-batch needs several producer micro-batches
        (docs/design.md#schedules-and-the-simulator: a consumer with micro-batch 4 needs two of its producer's 2s).
        """
        return tuple(covered_mbs(self.stages[producer].micro_batch_size, self.stages[consumer].micro_batch_size,
                                 consumer_mb))


def covered_mbs(producer_size: int, consumer_size: int, consumer_mb: int) -> range:
    """Producer micro-batches sharing samples with consumer micro-batch ``consumer_mb``, for any pair of sizes.

    Micro-batch ``j`` of size ``b`` holds samples ``[j*b, (j+1)*b)``. With
    the sizes swapped it gives the mirror image: the consumer micro-batches
    holding any sample of a producer micro-batch.

    >>> list(covered_mbs(2, 4, 1)), list(covered_mbs(4, 2, 3))
    ([2, 3], [1])
    """
    lo, hi = consumer_mb * consumer_size, (consumer_mb + 1) * consumer_size
    return range(lo // producer_size, (hi - 1) // producer_size + 1)


def _check_convex(graph: OpGraph, stage: Stage, stage_of: Sequence[int]) -> None:
    """Raise if some path leaves ``stage`` and re-enters it."""
    members = set(stage.op_ids)
    last = max(members)
    # Ops reachable from the stage through at least one outside op, limited to ids < last.
    frontier = [j for i in members for j in graph.succs(i) if j not in members and j < last]
    seen = set(frontier)
    while frontier:
        i = frontier.pop()
        for j in graph.succs(i):
            if j in members:
                raise PlanError(f"stage {stage.id} is not convex: a path leaves it through op "
                                f"{graph.ops[i].name!r} (stage {stage_of[i]}) and re-enters at {graph.ops[j].name!r}")
            if j < last and j not in seen:
                seen.add(j)
                frontier.append(j)


def iter_stage_ops(sg: StageGraph) -> Iterable[tuple[Stage, list[str]]]:
    for stage in sg.stages:
        yield stage, [sg.graph.ops[i].name for i in stage.op_ids]
