"""Who sends which rows of which tensor to whom, and in what order (docs/design.md, "The runtime").

Pure planning code, no torch: from a stage graph, a schedule and the values
crossing every stage edge it derives

* the *pieces* of every stage edge. Micro-batch ``i`` of a stage with size
  ``b`` holds the samples ``[i*b, (i+1)*b)``; replica ``q`` of ``r`` holds
  the ``q``-th ``b/r`` of them (``split`` replicas); a ``round-robin``
  stage's micro-batch ``i`` is held whole by replica ``i mod r`` (PipeDream's
  1F1B-RR). A piece is the non-empty intersection of a
  producer (micro-batch, replica) with a consumer (micro-batch, replica): one
  rectangle of rows that travels as one message per value. This one rule
  covers equal micro-batch sizes (one piece per micro-batch), a consumer
  with a larger micro-batch (it concatenates several producer pieces), a
  smaller one (it takes a slice) and data-parallel stages on either side.
* the *link order*: for every ordered rank pair ``(src, dst)``, the exact
  sequence of messages ``src`` sends, obtained by walking ``src``'s action
  list (F sends activations to every consumer, B sends gradients to every
  producer). Both ends compute the same sequence, so the receiver can post
  its receives in the sender's order — what NCCL requires (it matches
  point-to-point operations per pair in issue order) and what makes gloo's
  tags unique (tag = position in the link's sequence).

Deadlock freedom: a rank needing message ``m`` posts receives for every
earlier message of that link first. The sender emits those before ``m`` in
its program order, so they cannot depend on anything the receiver has not
done yet unless ``m`` does too — in which case the schedule itself would
deadlock and :func:`graphpipe.sched.validate_schedule` refuses it.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("two", [Op("a", "x"), Op("b", "x")], [("a", "b", 4.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 4)], 8, 2)
>>> [(p.producer_mb, p.consumer_mb, p.lo, p.hi) for p in edge_pieces(sg, 0, 1)]
[(0, 0, 0, 2), (1, 0, 2, 4), (2, 1, 4, 6), (3, 1, 6, 8)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from graphpipe.actions import Schedule
from graphpipe.errors import PlanError
from graphpipe.stages import StageGraph

__all__ = ["Piece", "MessageKey", "edge_pieces", "shard_size", "least_rows", "rows_refusal", "Routing"]


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[lo, hi)`` of the mini-batch going from a producer shard to a consumer shard."""

    producer: int
    consumer: int
    producer_mb: int
    producer_replica: int
    consumer_mb: int
    consumer_replica: int
    lo: int
    hi: int
    producer_start: int
    """First sample held by the producer shard: its rows are ``[lo - producer_start, hi - producer_start)``."""
    consumer_start: int
    """First sample held by the consumer shard."""

    @property
    def producer_rows(self) -> slice:
        return slice(self.lo - self.producer_start, self.hi - self.producer_start)

    @property
    def consumer_rows(self) -> slice:
        return slice(self.lo - self.consumer_start, self.hi - self.consumer_start)


# (direction "F" | "B", producer stage, consumer stage, producer mb, producer replica,
#  consumer mb, consumer replica, value name)
MessageKey = tuple[str, int, int, int, int, int, int, str]


def _shard(stage, v: int) -> tuple[int, int]:
    """(micro-batch, replica) of a stage's ``v``-th shard in sample order (:func:`shard_size` rows each): split
    replicas hold the shards of every micro-batch in turn; round-robin micro-batch ``i`` is group ``i mod g``'s,
    whose ``split`` replicas hold its shards in turn."""
    if not stage.round_robin:
        return divmod(v, stage.num_replicas)
    mb, within = divmod(v, stage.split)
    return mb, (mb % stage.num_groups) * stage.split + within


def shard_size(stage) -> int:
    """Rows one replica holds per micro-batch: ``b / split`` round-robin (all of them in PipeDream's
    one-replica groups), ``b / r`` split."""
    return stage.micro_batch_size // stage.shards_per_micro_batch


def least_rows(sg: StageGraph) -> int:
    """The fewest rows a mini-batch may have so that every shard of every stage keeps at least one row when the
    plan's micro-batches shrink proportionally (:meth:`Routing.row`): the finest stage's number of shards."""
    return max(sg.batch_size // shard_size(stage) for stage in sg.stages)


def rows_refusal(sg: StageGraph, rows: int, batchnorm: bool) -> str | None:
    """Why a mini-batch of ``rows`` rows cannot train on stage graph ``sg`` (None: it can): more rows than the
    plan's batch, a partial batch with fewer rows than the finest stage's shards (each needs one), or a
    partial batch through BatchNorm (``batchnorm``: the model has one), whose statistics are per micro-batch of
    the plan's size."""
    if rows > sg.batch_size:
        return (f"mini-batch of {rows} rows, but the plan is for batch size {sg.batch_size}: its memory was "
                f"checked at {sg.batch_size} rows (re-plan with --batch-size {rows} to train at {rows})")
    if rows == sg.batch_size:
        return None
    least = least_rows(sg)
    if rows < least:
        return (f"a partial mini-batch of {rows} rows, but the plan cuts its batch into {least} micro-batch shards, "
                f"each of which needs a row: drop it (DataLoader(drop_last=True)) or give at least {least} rows")
    if batchnorm:
        return (f"a partial mini-batch of {rows} rows through a model with BatchNorm: its statistics are per "
                "micro-batch of the plan's size; drop it (DataLoader(drop_last=True))")
    return None


def edge_pieces(sg: StageGraph, producer: int, consumer: int) -> list[Piece]:
    """All pieces of stage edge ``producer -> consumer``, by consumer shard then sample.

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage, StageGraph
    >>> g = OpGraph.build("two", [Op("a", "x"), Op("b", "x")], [("a", "b", 4.0)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0, 1, 2), 2, replica_mode="round-robin"),
    ...                           Stage(1, (1,), (3,), 2)], 8, 4)
    >>> [(p.producer_mb, p.producer_replica, p.lo, p.hi) for p in edge_pieces(sg, 0, 1)]
    [(0, 0, 0, 2), (1, 1, 2, 4), (2, 2, 4, 6), (3, 0, 6, 8)]
    """
    ps, cs = sg.stages[producer], sg.stages[consumer]
    sp, sc = shard_size(ps), shard_size(cs)
    pieces = []
    for u in range(sg.batch_size // sc):  # consumer shards in sample order
        j, k = _shard(cs, u)
        c_lo, c_hi = u * sc, (u + 1) * sc
        for v in range(c_lo // sp, (c_hi - 1) // sp + 1):  # producer shards overlapping it
            i, q = _shard(ps, v)
            lo, hi = max(c_lo, v * sp), min(c_hi, (v + 1) * sp)
            pieces.append(Piece(producer, consumer, i, q, j, k, lo, hi, v * sp, c_lo))
    return pieces


class Routing:
    """Pieces of every stage edge and the message order of every rank pair.

    ``edge_values[(p, c)]`` lists the values crossing stage edge ``p -> c``;
    ``grad_values`` the subset that carries gradients back (floating point).
    """

    def __init__(self, sg: StageGraph, schedule: Schedule, edge_values: Mapping[tuple[int, int], Sequence[str]],
                 grad_values: Iterable[str], batch_rows: int | None = None):
        self.sg = sg
        self.schedule = schedule
        self.edge_values = {e: tuple(v) for e, v in edge_values.items()}
        self.grad_values = frozenset(grad_values)
        self.batch_rows = sg.batch_size if batch_rows is None else batch_rows
        """The mini-batch's rows: the plan's batch, or fewer (a last partial batch, :meth:`at_rows`)."""
        self.by_producer: dict[tuple[int, int, int, int], list[Piece]] = {}
        self.by_consumer: dict[tuple[int, int, int, int], list[Piece]] = {}
        for p, c in sg.edges:
            for piece in edge_pieces(sg, p, c):
                if self.batch_rows != sg.batch_size:
                    piece = self._shrunk(piece)
                    if piece is None:
                        continue
                self.by_producer.setdefault((p, c, piece.producer_mb, piece.producer_replica), []).append(piece)
                self.by_consumer.setdefault((p, c, piece.consumer_mb, piece.consumer_replica), []).append(piece)
        self.links: dict[tuple[int, int], list[MessageKey]] = {}
        self.rows: dict[MessageKey, int] = {}
        """Rows (samples) each message carries."""
        for rank, actions in enumerate(schedule.device_actions):
            for action in actions:
                for dst, key in self.sends(rank, action.stage_id, action.kind, action.mb_id):
                    if dst != rank:
                        self.links.setdefault((rank, dst), []).append(key)
        self.position: dict[tuple[int, int], dict[MessageKey, int]] = {
            link: {key: i for i, key in enumerate(keys)} for link, keys in self.links.items()}
        for link, keys in self.links.items():
            if len(self.position[link]) != len(keys):
                raise PlanError(f"schedule sends the same message twice on link {link[0]}->{link[1]}; "
                                "every (stage, micro-batch) must have exactly one F and one B per replica")

    def row(self, sample: int) -> int:
        """Where the plan's sample boundary ``sample`` falls in a mini-batch of :attr:`batch_rows` rows.

        A partial batch keeps every micro-batch (and replica shard) of every stage, each with proportionally
        fewer rows: boundary ``x`` of the plan's ``B`` rows moves to ``floor(x * rows / B)``. One monotone map
        for every stage keeps producer and consumer shards consistent, so a piece is still the overlap of
        the two; shards come out uneven by at most one row, as ``torch.tensor_split`` makes them.
        """
        return sample * self.batch_rows // self.sg.batch_size

    def at_rows(self, rows: int) -> "Routing":
        """This routing for a mini-batch of ``rows`` rows (:meth:`row`); pieces left with no row carry no
        message. ``rows`` must give every shard of every stage a row (:func:`least_rows`)."""
        if rows == self.batch_rows:
            return self
        return Routing(self.sg, self.schedule, self.edge_values, self.grad_values, rows)

    def _shrunk(self, piece: Piece) -> Piece | None:
        lo, hi = self.row(piece.lo), self.row(piece.hi)
        if lo == hi:
            return None
        return Piece(piece.producer, piece.consumer, piece.producer_mb, piece.producer_replica, piece.consumer_mb,
                     piece.consumer_replica, lo, hi, self.row(piece.producer_start), self.row(piece.consumer_start))

    def replica(self, stage_id: int, rank: int) -> int:
        stage = self.sg.stages[stage_id]
        return stage.devices.index(rank) // stage.tp  # a tensor-parallel group is one replica

    def outgoing(self, stage_id: int, mb_id: int, replica: int) -> list[Piece]:
        """Pieces a producer shard sends after its F, consumer by consumer."""
        return [piece for c in self.sg.succs(stage_id) for piece in self.by_producer.get((stage_id, c, mb_id, replica), ())]

    def incoming(self, stage_id: int, mb_id: int, replica: int) -> list[Piece]:
        """Pieces a consumer shard needs before its F, producer by producer."""
        return [piece for p in self.sg.preds(stage_id) for piece in self.by_consumer.get((p, stage_id, mb_id, replica), ())]

    def sends(self, rank: int, stage_id: int, kind: str, mb_id: int) -> list[tuple[int, MessageKey]]:
        """``(destination rank, key)`` of every message ``rank`` sends after one action, in send order."""
        stage = self.sg.stages[stage_id]
        q = self.replica(stage_id, rank)
        out = []
        if stage.tp > 1 and stage.tp_groups[q][0] != rank:
            return out  # a tensor-parallel group's messages leave once, from its first rank
        if kind == "F":
            for piece in self.outgoing(stage_id, mb_id, q):
                for value in self.edge_values[(piece.producer, piece.consumer)]:
                    key = self.key("F", piece, value)
                    self.rows[key] = piece.hi - piece.lo
                    # every rank of the consumer's TP group gets its own copy (one rank when tp is 1)
                    out.extend((dst, key) for dst in self.sg.stages[piece.consumer].tp_groups[piece.consumer_replica])
        elif kind in ("B", "I"):  # zero bubble's I sends the input gradients, W nothing
            for piece in self.incoming(stage_id, mb_id, q):
                for value in self.edge_values[(piece.producer, piece.consumer)]:
                    if value in self.grad_values:
                        key = self.key("B", piece, value)
                        self.rows[key] = piece.hi - piece.lo
                        out.extend((dst, key) for dst in self.sg.stages[piece.producer].tp_groups[piece.producer_replica])
        elif kind != "W":
            raise PlanError(f"action {stage_id}{kind}{mb_id} on device {rank}: the runtime executes F, B, I and W "
                            f"(stage {stage.id})")
        return out

    @staticmethod
    def key(direction: str, piece: Piece, value: str) -> MessageKey:
        return (direction, piece.producer, piece.consumer, piece.producer_mb, piece.producer_replica,
                piece.consumer_mb, piece.consumer_replica, value)

    def peers(self, rank: int) -> tuple[list[int], list[int]]:
        """Ranks ``rank`` sends to and receives from."""
        return (sorted(d for (s, d) in self.links if s == rank), sorted(s for (s, d) in self.links if d == rank))
