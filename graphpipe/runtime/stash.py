"""Weight versions of one stage on one rank: PipeDream's weight stashing and 2BW's double buffer (docs/design.md, "Schedules and the simulator").

The version schedule (:class:`graphpipe.sched.async_pipe.VersionTable`) says
which version ``v(s, i)`` micro-batch ``i`` runs on at stage ``s``. A
:class:`WeightVersions` holds exactly the versions still needed on this rank:

* ``F s i`` calls the stage module with version ``v(s, i)``'s tensors
  (``torch.func.functional_call``), so the autograd graph of micro-batch
  ``i`` keeps *those* tensors for its backward — that is the stash;
* ``B s i`` adds the gradient of ``i`` to the update group's sum; when the
  group closes (after the replicas' all-reduce, a sum over their rows or
  micro-batches) the stage steps SGD on the latest version:
  ``W(k+1) = W(k) - lr * sum of the group's gradients``;
* the step is in place when no micro-batch still needs ``W(k)`` on this rank,
  otherwise ``W(k+1)`` is a new tensor set and ``W(k)`` stays until its last
  micro-batch's backward: the only copies made are the stashed versions the
  schedule needs, and :attr:`WeightVersions.peak_stashed_bytes` counts them
  (bytes of every version alive besides the latest, at their peak).

``stash=False`` is PipeDream's ablation: one tensor set, stepped in place
behind autograd's back (``.data``), so a backward uses the *latest* weights
where its forward used older ones.

Example
-------
>>> import torch
>>> from graphpipe.sched.async_pipe import AsyncSpec, VersionTable
>>> table = VersionTable(AsyncSpec(name="1f1b-async"), 2, ((0, 0),), (1,), ((1,),))
>>> lin = torch.nn.Linear(1, 1, bias=False)
>>> w = WeightVersions(0, lin, table, (0, 1), lr=1.0)
>>> with torch.no_grad():
...     _ = lin.weight.fill_(1.0)
>>> y0 = w.call(0, torch.ones(1, 1)); y1 = w.call(1, torch.ones(1, 1))   # both on version 0
>>> y0.sum().backward(); w.after_backward(0)     # W1 = W0 - 1 * 1, a copy: mb 1 still needs W0
>>> y1.sum().backward(); w.after_backward(1)     # W2 = W1 - 1 (gradient at W0), in place
>>> float(w.latest()["weight"].detach()), w.peak_stashed_versions, w.peak_stashed_bytes
(-1.0, 1, 4)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from graphpipe.sched.async_pipe import VersionTable

__all__ = ["WeightVersions"]


class WeightVersions:
    """The versions of stage ``stage_id``'s weights that this rank still needs (module docstring).

    ``mbs``: the micro-batches this rank runs for the stage (all, or a
    round-robin replica's share); ``replica_mbs``: the stage's replica count
    on a round-robin stage (each replica closes a group at its own last
    micro-batch of it), else 1; ``group``: the replicas' process group
    (None: not replicated); ``wait``: waits for an async collective with the
    run's timeout. The module's parameters always are the latest version.
    """

    def __init__(self, stage_id: int, module: torch.nn.Module, table: VersionTable, mbs: Sequence[int], lr: float,
                 replica_mbs: int = 1, group: Any = None, stash: bool = True,
                 wait: Callable[[Any, str], None] | None = None):
        self.stage_id = stage_id
        self.module = module
        self.table = table
        self.lr = lr
        self.replica_mbs = replica_mbs
        self.group = group
        self.stash = stash
        self._wait = wait or (lambda work, what: work.wait())
        self.names = tuple(n for n, p in module.named_parameters())
        # version 0 is the module's own parameters: no copy
        self._versions: dict[int, dict[str, torch.Tensor]] = {0: dict(module.named_parameters())}
        self._latest = 0
        self._pending: dict[int, int] = {}  # version -> micro-batches of this rank that still need it
        for i in mbs:
            v = self._version(i)
            self._pending[v] = self._pending.get(v, 0) + 1
        self._sum: dict[str, torch.Tensor] | None = None
        self.peak_stashed_versions = 0
        self.peak_stashed_bytes = 0

    def _version(self, mb_id: int) -> int:
        return self.table.version[self.stage_id][mb_id] if self.stash else 0

    def latest(self) -> dict[str, torch.Tensor]:
        """The newest version's tensors by parameter name (the stage's current weights)."""
        return self._versions[self._latest]

    def call(self, mb_id: int, *args, module=None):
        """The stage module (or ``module``, a segment sharing its parameter names) on micro-batch ``mb_id``'s
        version (the latest without stashing)."""
        params = self._versions[self._version(mb_id) if self.stash else self._latest]
        if module is None:
            return torch.func.functional_call(self.module, params, args)
        own = dict(module.named_parameters())
        return torch.func.functional_call(module, {n: t for n, t in params.items() if n in own}, args)

    def after_backward(self, mb_id: int) -> None:
        """Take ``mb_id``'s gradient into its group's sum; step when the group closes on this rank."""
        v = self._version(mb_id)
        used = self._versions[v if self.stash else self._latest]
        if self._sum is None:
            self._sum = {n: torch.zeros_like(t) for n, t in used.items() if t.requires_grad}  # frozen: no sum
        for n, t in used.items():
            if t.grad is not None and n in self._sum:
                self._sum[n].add_(t.grad)
                t.grad = None
        if self.stash:
            self._pending[v] -= 1
        if self.table.closes_group(self.stage_id, mb_id, self.replica_mbs):
            self._step()
        if self.stash and self._pending[v] == 0 and v != self._latest:
            self._versions.pop(v, None)  # its last micro-batch is done: the stash is freed (or it was stepped)
        self._count()

    def _step(self) -> None:
        grads = self._sum
        self._sum = None
        if grads and self.group is not None:  # replicas: the sum over their rows / micro-batches
            flat = torch.cat([g.reshape(-1) for g in grads.values()])
            self._wait(dist.all_reduce(flat, group=self.group, async_op=True),
                       f"per-update gradient all-reduce of stage {self.stage_id} with its replicas")
            offset = 0
            for g in grads.values():
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        old = self._versions[self._latest]
        new_id = self._latest + 1
        if not self.stash:  # behind autograd's back: in-flight backwards see the new values (the ablation)
            for n, t in old.items():
                if n in grads:
                    t.data.sub_(grads[n], alpha=self.lr)
            self._versions = {new_id: old}
        elif self._pending.get(self._latest, 0) > 0:  # someone still needs W(k): W(k+1) is a new tensor set
            new = {n: torch.nn.Parameter(t.detach() - self.lr * grads[n] if grads and n in grads else t.detach(),
                                         requires_grad=t.requires_grad) for n, t in old.items()}
            for n, t in new.items():  # the module holds the latest only; W(k) lives in the stash and its graphs
                owner, _, leaf = n.rpartition(".")
                self.module.get_submodule(owner).register_parameter(leaf, t)
            self._versions[new_id] = new
        else:
            with torch.no_grad():
                for n, t in old.items():
                    if grads and n in grads:
                        t.sub_(grads[n], alpha=self.lr)
            self._versions[new_id] = self._versions.pop(self._latest)
        self._latest = new_id

    def _count(self) -> None:
        stashed = [v for v in self._versions if v != self._latest]
        nbytes = sum(t.numel() * t.element_size() for v in stashed for t in self._versions[v].values())
        self.peak_stashed_versions = max(self.peak_stashed_versions, len(stashed))
        self.peak_stashed_bytes = max(self.peak_stashed_bytes, nbytes)
