"""Periodic step checkpoints and resuming from the newest one (docs/semantics.md, "Surviving a failure").

:meth:`graphpipe.Pipeline.save` with ``step=N`` and :meth:`graphpipe.Pipeline.resume`
call these. A step checkpoint is the plain checkpoint (every stage's weights,
buffers and the optimizer's state, keyed by parameter name, so it loads into
any plan of the model) plus what the rest of training depends on:

* ``progress/step``: the steps done. Resuming sets the pipeline's step
  counter to it, and dropout masks are drawn from ``(seed, step, op, row)``
  (:mod:`graphpipe.runtime.rng`), so the steps after a resume draw the masks
  an uninterrupted run draws;
* ``rng/rank{R}/...``: each rank's torch CPU generator, its CUDA generator
  when it trains on a GPU, and Python's ``random`` state, so data order or
  augmentation drawn from the global generators continues as it would
  have. A rank with no saved state of its own (resuming on more ranks
  than saved) keeps its generators.

The folder's bookkeeping (``DIR/step-N``, sealed by a manifest, newest K
kept, incomplete ones skipped with a warning) is
:mod:`graphpipe.runtime.step_checkpoints`. With ``async_save=True`` the
state is copied to host memory and written by a background thread on a
process group of its own (torch.distributed.checkpoint's ``async_save``),
while training goes on; rank 0 seals it as soon as it is written (its write
returns only after every rank's), and the next save,
:meth:`graphpipe.Pipeline.wait_checkpoint` or ``close()`` waits for it.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import threading
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.runtime.step_checkpoints import check_keep, newest_complete, prune, publish, step_dir, temporary_dir

# ``pipe`` below is a graphpipe.Pipeline (not imported: api imports this module); only its public members are used.
Pipeline = Any
__all__ = ["PendingSave", "StepCheckpoints"]

log = logging.getLogger(__name__)

STEP_KEY = "progress/step"


@dataclass(slots=True)
class PendingSave:
    """An asynchronous save still being written. Rank 0 seals it in ``sealer`` as soon as its own write returns:
    torch.distributed.checkpoint's coordinator finishes only after every rank's files are written."""

    future: Any
    sealer: threading.Thread | None


def _rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    state = {f"rng/rank{rank}/cpu": torch.get_rng_state(),
             f"rng/rank{rank}/python": torch.frombuffer(bytearray(pickle.dumps(random.getstate())), dtype=torch.uint8)}
    if device.type == "cuda":
        state[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return state


def _broadcast(pipe: Pipeline, value: Any) -> Any:
    if pipe.world_size == 1:
        return value
    box = [value if pipe.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _seal(tmp: str, final: str, root: str, keep: int) -> None:
    """Rank 0, once its save returned (every rank's files are then written): manifest, rename, prune."""
    publish(tmp, final)
    prune(root, keep)


class StepCheckpoints:
    """One pipeline's step checkpoints: the asynchronous save still being written, and the process group its
    writer thread uses (made on the first asynchronous save). :class:`graphpipe.Pipeline` holds one and calls
    :meth:`save`, :meth:`finish` and :meth:`resume` from its own ``save``, ``wait_checkpoint`` and ``resume``."""

    __slots__ = ("pending", "group")

    def __init__(self) -> None:
        self.pending: PendingSave | None = None
        self.group = None

    def release_group(self) -> list:
        """The writer's process group, if one was made, which this object then forgets (``Pipeline.close``)."""
        group, self.group = self.group, None
        return [] if group is None else [group]

    def finish(self, pipe: Pipeline) -> None:
        """Wait for the asynchronous save, if any, and seal it (collective: every rank calls it)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.future.result()  # this rank's files are written (a failed write raises here)
        if pending.sealer is not None:
            pending.sealer.join()
        if pipe.world_size > 1:
            dist.barrier()  # the folder is sealed before anyone goes on to the next save or a resume

    def save(self, pipe: Pipeline, root: str | os.PathLike, step: int,
             optimizer: torch.optim.Optimizer | None = None, keep: int = 2, async_save: bool = False) -> str:
        """Write ``root/step-{step}`` (collective); returns its path. See the module docstring."""
        import torch.distributed.checkpoint as dcp

        root = os.fspath(root)
        final = step_dir(root, step)  # checks step
        check_keep(keep)  # before anything is written, not at the prune after it
        self.finish(pipe)
        token = _broadcast(pipe, uuid.uuid4().hex)
        tmp = temporary_dir(root, step, token)
        if pipe.rank == 0:
            os.makedirs(root, exist_ok=True)
        state = pipe.state_dict(optimizer)
        state.update(_rng_state(pipe.rank, pipe.device))
        if pipe.rank == 0:
            state[STEP_KEY] = torch.tensor(step, dtype=torch.int64)
        if not async_save:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
            if pipe.rank == 0:
                _seal(tmp, final, root, keep)
            if pipe.world_size > 1:
                dist.barrier()
            return final
        if self.group is None and pipe.world_size > 1:
            # the writer thread's collectives must not interleave with training's on the default group
            self.group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.group)
        sealer = None
        if pipe.rank == 0:
            def seal_when_written() -> None:
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - finish raises it on this rank's main thread
                    return
                _seal(tmp, final, root, keep)

            sealer = threading.Thread(target=seal_when_written, name="graphpipe-checkpoint-seal", daemon=True)
            sealer.start()
        self.pending = PendingSave(future, sealer)
        return final

    def resume(self, pipe: Pipeline, root: str | os.PathLike,
               optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """Load the newest complete ``root/step-N`` into ``pipe`` (and ``optimizer``), restore this rank's random
        generators, and return ``N``; None when there is none (collective). Newer incomplete checkpoints are
        named in a warning on rank 0 and skipped. The caller sets its step counter to the result."""
        import torch.distributed.checkpoint as dcp

        self.finish(pipe)
        found = None
        if pipe.rank == 0:
            found = newest_complete(root)  # rank 0 decides, so every rank loads the same one
        found = _broadcast(pipe, found)
        if found is None:
            return None
        step, path = found
        pipe.load(path, optimizer=optimizer)
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        wanted = {key: torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
                  for key in [STEP_KEY, *_rng_state(pipe.rank, pipe.device)] if key in metadata}
        if wanted:
            with warnings.catch_warnings():  # each rank reads its own keys alone, on purpose
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(wanted, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        if STEP_KEY in wanted and int(wanted[STEP_KEY]) != step:
            from graphpipe.errors import InputError

            raise InputError(f"checkpoint {path} holds step {int(wanted[STEP_KEY])}, not {step}; was it renamed?")
        prefix = f"rng/rank{pipe.rank}/"
        if prefix + "cpu" in wanted:
            torch.set_rng_state(wanted[prefix + "cpu"])
        if prefix + "cuda" in wanted and pipe.device.type == "cuda":
            torch.cuda.set_rng_state(wanted[prefix + "cuda"], pipe.device)
        if prefix + "python" in wanted:
            random.setstate(pickle.loads(wanted[prefix + "python"].numpy().tobytes()))
        if pipe.rank == 0:
            log.info("resumed from %s (step %d)", path, step)
        return step
