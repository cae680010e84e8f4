"""One pipeline stage as the rank hosting it holds it: :class:`HostedStage` (docs/design.md, "The runtime").

A rank hosts one or more stages (a stage's replica, virtual stages of an
interleaved schedule, branches sharing a device). Everything that belongs
to one of them lives in one object: its program and module, its parameters
and their flat gradient buffer, its BatchNorms, its bound forward, what its
re-materialization and zero bubble's split backward keep per micro-batch,
and the names its tensors have in the model (what a checkpoint keys them
by). The :class:`~graphpipe.runtime.executor.RankExecutor` keeps what is the
rank's, not a stage's: the action loop, the mailbox and the all-reduce order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphpipe.runtime.batchnorm import sharded_batchnorms
from graphpipe.runtime.stage_modules import BoundForward, StageProgram
from graphpipe.split_backward import PendingWeightGrad
from graphpipe.stages import Stage

__all__ = ["HostedStage", "zero_grads", "flat_grad_buffer"]


def zero_grads(params) -> None:
    """Zero each parameter's ``.grad`` in place, allocating it on first use (persistent buffers).

    With ``grad = None`` an iteration's first backward allocates (and, on a
    CPU, page-faults) fresh gradient tensors and only later micro-batches
    accumulate; with persistent buffers every backward accumulates, which is
    what ``graphpipe profile`` times.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def flat_grad_buffer(params) -> torch.Tensor | None:
    """One zeroed buffer holding every gradient of ``params``, each ``.grad`` a view into it.

    Autograd accumulates into an existing ``.grad`` in place, so the buffer
    always holds the current gradients and an all-reduce can take it as is.
    ``None`` (gradients left alone) when there are no parameters or they mix
    dtypes or devices.
    """
    if not params or len({(p.dtype, p.device) for p in params}) > 1:
        return None
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@dataclass(eq=False)
class HostedStage:
    """One stage on the rank hosting it (module docstring). Built by :meth:`of`."""

    stage: Stage
    program: StageProgram
    forward: BoundForward | Any
    """The stage's forward with its parameters passed in (no attribute chains per micro-batch)."""
    batchnorms: tuple
    """Its :class:`~graphpipe.runtime.batchnorm.ShardedBatchNorm` modules, in a fixed order."""
    grad_buffer: torch.Tensor | None = None
    """Every gradient of the stage, each ``.grad`` a view into it (None where dtypes or devices mix)."""
    grad_views: list[torch.Tensor] | None = None
    redo_bytes: int | list[int] | None = None
    """A re-materializing stage's working set in B (per segment with checkpoints), probed once."""
    weights: Any = None
    """Asynchronous schedules: the weight versions F and B run on (:mod:`graphpipe.runtime.stash`)."""
    stash: dict[int, list] = field(default_factory=dict)
    """Micro-batch -> inputs (and handed-over values) a re-materializing stage keeps until its B."""
    pending_w: dict[int, PendingWeightGrad] = field(default_factory=dict)
    """Micro-batch -> the weight gradient zero bubble's I left for its W."""
    segment_calls: dict[int, set[int]] = field(default_factory=dict)
    """Micro-batch -> the checkpoint segments that ran (a second call is a re-materialization)."""
    persistent_grads: bool = True
    """Whether the gradients live in one flat buffer kept across steps (:meth:`bind_grad_buffers`). Without
    (:meth:`leave_grads_to_autograd`), an iteration's first backward hands each parameter its freshly computed
    gradient, as in a plain training loop after ``optimizer.zero_grad()``."""
    _slots: tuple | None = field(default=None, repr=False)
    """(the module, the ``_parameters`` dicts of its sub-modules in ``modules()`` order), for :meth:`parameters`."""

    @classmethod
    def of(cls, stage: Stage, program: StageProgram, *, compile: bool = False) -> "HostedStage":
        """``compile``: the bound forward compiled by ``torch.compile`` (:mod:`graphpipe.runtime.compiled`)."""
        forward = BoundForward(program.module)
        if compile:
            from graphpipe.runtime.compiled import CompiledForward

            forward = CompiledForward(forward, stage.id)
        return cls(stage, program, forward, tuple(sharded_batchnorms(program.module)))

    @property
    def stage_id(self) -> int:
        return self.stage.id

    @property
    def module(self) -> torch.nn.Module:
        return self.program.module

    def parameters(self) -> list[torch.nn.Parameter]:
        """The stage module's parameters, each once, in ``module.parameters()``'s order.

        Read through the owners' ``_parameters`` dicts, found once per module
        (as :class:`~graphpipe.runtime.stage_modules.BoundForward` reads its
        tensors): ``module.parameters()`` walks every sub-module on each call,
        and the training API asks at every step (:meth:`RankExecutor.ensure_grads
        <graphpipe.runtime.executor.RankExecutor.ensure_grads>`). A parameter
        replaced later (a checkpoint load, a materialization, a weight
        version) is the one returned; the module's structure is fixed once
        built.
        """
        seen: set[int] = set()
        out = []
        for table in self._tables():
            for p in table.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _tables(self) -> list[dict]:
        """The ``_parameters`` dicts of the module's sub-modules, found once per module."""
        module = self.program.module
        if self._slots is None or self._slots[0] is not module:
            self._slots = (module, [m._parameters for m in module.modules() if m._parameters])
        return self._slots[1]

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that train: a frozen one (``requires_grad=False``) gets no gradient buffer, no
        all-reduce and so no optimizer state (optimizers skip a parameter whose ``.grad`` is None)."""
        return [p for p in self.parameters() if p.requires_grad]

    def param(self, name: str) -> torch.nn.Parameter:
        """The parameter called ``name`` in the stage module."""
        return self.program.module.get_parameter(name)

    def checkpoint_keys(self) -> dict[str, torch.Tensor]:
        """The stage's parameters and buffers by their names in the model (a tied copy by its original's):
        what a checkpoint stores them under."""
        names = self.program.param_names
        out = {names.get(n, n): p for n, p in self.program.module.named_parameters()}
        out.update(dict(self.program.module.named_buffers()))
        return out

    def bind_grad_buffers(self) -> None:
        """``.grad`` as views into one zeroed flat buffer (:func:`flat_grad_buffer`; an existing buffer and its
        views are reused), or zeroed per-parameter tensors where the stage mixes dtypes or devices."""
        params = self.trainable()
        if self.grad_views is not None:
            self.grad_buffer.zero_()
            for p, g in zip(params, self.grad_views):
                p.grad = g
            return
        flat = flat_grad_buffer(params)
        if flat is not None:
            self.grad_buffer, self.grad_views = flat, [p.grad for p in params]
        else:
            zero_grads(params)

    def leave_grads_to_autograd(self) -> None:
        """No flat buffer: a ``.grad`` that is None when an iteration starts (``optimizer.zero_grad()``) is
        created by autograd from the first micro-batch's gradient instead of being added to zeros.

        For a stage whose gradients are never all-reduced (one replica) and
        whose steps are not timed against a profile: it saves the memset of
        the buffer and one addition per parameter per step (a kernel each on
        a GPU), and the sums are the same numbers (``0 + g`` is ``g``).
        :meth:`fill_missing_grads` gives a parameter no micro-batch reached
        its zero gradient afterwards, as the buffer would have.
        """
        self.persistent_grads = False
        self.grad_buffer = self.grad_views = None
        for p in self.trainable():  # a new executor starts from no gradient, as a bound buffer starts zeroed
            p.grad = None

    def fill_missing_grads(self) -> None:
        """A zero ``.grad`` for every trainable parameter that has none after an iteration (one the stage's
        outputs do not depend on): every trainable parameter has a gradient after a step, with or without a
        persistent buffer."""
        for table in self._tables():  # straight from the tables: run after every step, it builds no list
            for p in table.values():
                if p is not None and p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            zero_grads(self.trainable())

    def idle(self) -> bool:
        """No micro-batch is waiting for its backward or its weight gradient."""
        return not self.pending_w
