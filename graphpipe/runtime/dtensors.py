"""A parallel stage's DTensors beside whole tensors: a shard's piece of a whole tensor, a whole tensor laid out
as a shard (docs/design.md, "Parallelism inside a stage").

Apart from :mod:`graphpipe.runtime.intra_stage` so that the checkpoint reader and ``--check``'s reference can
compare and load shards without importing the stage set-up.
"""

from __future__ import annotations

import torch

__all__ = ["local_pair", "like"]


def local_pair(t, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(DTensor t's local shard, the same piece of the whole tensor whole)``: compares a shard with a
    single-process run's tensor without gathering it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return t.to_local(), whole[index]


def like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (a tensor of ``param``'s global shape, or a scalar) laid out as DTensor ``param`` is; ``whole``
    itself when ``param`` is a plain tensor: optimizer state read from a checkpoint of any layout."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or whole.shape != param.shape:
        return whole
    _, piece = local_pair(param, whole)
    return DTensor.from_local(piece.clone(), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
