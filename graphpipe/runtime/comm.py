"""Point-to-point messaging for one rank: sends that never block, receives in link order.

A :class:`Mailbox` is the executor's only view of the network. Every message
has a :data:`~graphpipe.runtime.routing.MessageKey`; the
:class:`~graphpipe.runtime.routing.Routing` tells both ends where that key
sits in its link's sequence.

* ``send`` posts ``dist.isend`` and returns at once (the tensor is kept alive
  until :meth:`Mailbox.flush`), so compute overlaps communication, as in the
  simulator's semantics. On CUDA no wait blocks the host either
  (:meth:`Mailbox.wait_work`): receives and all-reduces are ordered on the
  device's stream.
* ``recv`` posts ``dist.irecv`` for every not-yet-posted message of the link
  up to the one it needs (receive buffers are sized from the step's input
  shapes and the captured symbolic shapes, so no metadata travels), then
  waits on it. Messages posted early just land in their buffers and are
  picked up later.
* A value whose size depends on the data (export's unbacked ``u0``: the
  positions a ``nonzero`` kept) cannot be sized that way: its shape travels
  ahead of it, a header of one int64 per dim (:func:`send_header`). Both ends
  know from the capture which values those are, so every other message
  carries none; the receiver waits for the header before it posts the
  payload's receive (its size), which keeps NCCL's per-pair issue order.
* ``prefetch`` (CUDA ranks): the executor posts the receives of its *next*
  action before it computes the current one, so the transfer runs on NCCL's
  stream while this rank's kernels run, and ``recv`` then only makes the
  compute stream wait for a message already in flight. On a CPU (gloo) a
  posted receive gains nothing the lazy post does not, so gloo keeps posting
  at ``recv``; so does a measuring run (``graphpipe run`` without
  ``--no-measure``), whose device synchronisation after every action would
  otherwise wait for a posted receive whose sender is waiting for this rank.
* Messages between two stages on the same rank (interleaved virtual stages)
  never touch the network: they are handed over in a local dictionary.

Tags: the position of the message in its link's sequence (unique per link
and iteration) — gloo matches on (source, tag). NCCL ignores tags and
matches per pair in issue order, which the link order already guarantees;
with NCCL each direction of each pair gets its own process group so that a
posted receive never sits in front of a send on the same stream.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from graphpipe.runtime.routing import MessageKey, Routing

__all__ = ["Mailbox", "make_link_groups", "send_header", "recv_header", "HEADER_TAG"]

HEADER_TAG = 1 << 22
"""Added to a message's tag for its header: positions in a link's sequence stay far below it."""


def send_header(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Post the send of ``tensor``'s shape (one int64 per dim) ahead of it; returns the work and the header
    (keep it alive until the work completes)."""
    header = torch.tensor(tensor.shape, dtype=torch.int64, device=tensor.device)
    return dist.isend(header, dst=dst, group=group, tag=HEADER_TAG + tag), header


def recv_header(ndim: int, src: int, device: torch.device, group=None, tag: int = 0,
                wait: Callable[[object], None] | None = None) -> tuple[int, ...]:
    """Receive the shape :func:`send_header` sent (``ndim`` dims), waiting for it: the payload's buffer needs it."""
    header = torch.empty(ndim, dtype=torch.int64, device=device)
    work = dist.irecv(header, src=src, group=group, tag=HEADER_TAG + tag)
    (wait or (lambda w: w.wait()))(work)
    return tuple(int(d) for d in header.tolist())


def make_link_groups(routing: Routing, world_size: int, backend: str) -> dict[tuple[int, int], object]:
    """One process group per directed rank pair for NCCL (``{}`` for gloo: the world group suffices).

    Every rank must call this with the same routing: ``new_group`` is collective.
    """
    if backend != "nccl":
        return {}
    groups = {}
    for link in sorted(routing.links):
        groups[link] = dist.new_group(sorted(link))
    return groups


class Mailbox:
    """Sends and receives of one rank during one iteration (call :meth:`reset` per iteration)."""

    def __init__(self, rank: int, routing: Routing, buffer_spec: Callable[[MessageKey], tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device, timeout_s: float, groups: Mapping[tuple[int, int], object] | None = None,
                 post_early: bool | None = None, sized_ahead: Callable[[MessageKey], bool] | None = None):
        self.rank = rank
        self.sized_ahead = sized_ahead or (lambda key: False)
        """Whether message ``key``'s shape travels ahead of it (a value sized by the data; module docstring)."""
        self.post_early = device.type == "cuda" if post_early is None else post_early
        """Whether :meth:`prefetch` posts receives ahead of use (CUDA by default; see the module docstring)."""
        self.routing = routing
        self.buffer_spec = buffer_spec
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.groups = dict(groups or {})
        self.reset()

    def reset(self) -> None:
        self._posted: dict[int, int] = {}
        self._pending: dict[MessageKey, tuple[object, torch.Tensor]] = {}
        self._local: dict[MessageKey, torch.Tensor] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []

    def send(self, dst: int, key: MessageKey, tensor: torch.Tensor) -> None:
        """Post a send (non-blocking); ``dst == rank`` hands the tensor over locally."""
        tensor = tensor.detach()
        if dst == self.rank:
            self._local[key] = tensor
            return
        link = (self.rank, dst)
        tag = self.routing.position[link][key]
        tensor = tensor.contiguous()
        if self.sized_ahead(key):
            self._sends.append(send_header(tensor, dst, self.groups.get(link), tag))
        work = dist.isend(tensor, dst=dst, group=self.groups.get(link), tag=tag)
        self._sends.append((work, tensor))
        if len(self._sends) >= 64:  # release finished sends' tensors (their activations) early
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def recv(self, src: int, key: MessageKey) -> torch.Tensor:
        """The tensor of message ``key`` from ``src``, waiting for it if needed."""
        if src == self.rank:
            try:
                return self._local.pop(key)
            except KeyError:
                raise RuntimeError(f"rank {self.rank}: local message {key} was not produced before it was needed "
                                   "(the schedule runs a consumer before its producer on this device)") from None
        self._post_through(src, key)
        work, buf = self._pending.pop(key)
        self.wait_work(work, f"message {_describe(key)} from rank {src}")
        return buf

    def prefetch(self, src: int, key: MessageKey) -> None:
        """Post the receive of ``key`` (and of every earlier message of its link) now, without waiting for it;
        nothing on a rank that posts lazily (:attr:`post_early` false) or for a local message."""
        if self.post_early and src != self.rank:
            self._post_through(src, key)

    def _post_through(self, src: int, key: MessageKey) -> None:
        """``dist.irecv`` for every not-yet-posted message of the link from ``src`` up to ``key``, in link order
        (the order NCCL matches them in)."""
        link = (src, self.rank)
        keys = self.routing.links.get(link, ())
        target = self.routing.position.get(link, {}).get(key)
        if target is None:
            raise RuntimeError(f"rank {self.rank}: rank {src} never sends {key}; routing and schedule disagree")
        posted = self._posted.get(src, 0)
        while posted <= target:
            k = keys[posted]
            shape, dtype = self.buffer_spec(k)
            if self.sized_ahead(k):
                shape = recv_header(len(shape), src, self.device, self.groups.get(link), posted,
                                    lambda w: self.wait_work(w, f"size of message {_describe(k)} from rank {src}"))
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=src, group=self.groups.get(link), tag=posted)
            self._pending[k] = (work, buf)
            posted += 1
        self._posted[src] = posted

    def wait_work(self, work, what: str) -> None:
        """Wait with the process-group timeout; name the peer when it does not answer.

        On CUDA the wait is the stream's, not the host's: ``work.wait()``
        makes the current stream wait for NCCL's, so the host goes on
        queueing kernels while messages travel (a wait with a timeout would
        block the host until the transfer ends). A silent peer is then caught
        by NCCL's watchdog at the process group's timeout, which aborts the
        rank and so the job.
        """
        limit = self.timeout.total_seconds()
        try:
            ok = work.wait() if self.device.type == "cuda" else work.wait(self.timeout)
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(f"no {what} within {limit:g} s (peer silent or dead)") from None
            raise RuntimeError(f"{what} failed: {exc}") from None
        if ok is False:
            raise TimeoutError(f"no {what} within {limit:g} s (peer silent or dead)")

    def flush(self) -> None:
        """Wait for every posted send to complete (end of iteration)."""
        for work, _ in self._sends:
            self.wait_work(work, "completion of a send")
        self._sends.clear()
        if self._pending or self._local:
            left = list(self._pending)[:3] + list(self._local)[:3]
            raise RuntimeError(f"rank {self.rank}: iteration ended with unconsumed messages, e.g. {left}")


def _describe(key: MessageKey) -> str:
    """``3F2->5F1 (x)``-style name of a message: producer stage/mb to consumer stage/mb, value."""
    direction, p, c, pmb, _, cmb, _, value = key
    return (f"activation {p}F{pmb}->{c}F{cmb}" if direction == "F" else f"gradient {c}B{cmb}->{p}B{pmb}") + f" ({value})"
