"""Read the tensors of one rank's stages from a checkpoint, whatever wrote it (docs/design.md, "The runtime").

Three layouts are read, each tensor by its name in the model, reading only
the tensors asked for (the others are never loaded into memory):

* ``torch.distributed.checkpoint`` written by :meth:`graphpipe.Pipeline.save`
  (``model/NAME``, ``optim/NAME/KEY``, ``buffer/NAME``);
* ``torch.distributed.checkpoint`` of a plain model's ``state_dict()``
  written by one process (``dcp.save(model.state_dict(), checkpoint_id=DIR)``:
  keys are the module's own names) -- a *seed checkpoint*;
* safetensors: one ``.safetensors`` file (``safetensors.torch.save_file``),
  or a Hugging Face ``save_pretrained`` folder, sharded
  (``model.safetensors.index.json``) or not.

What is missing or has another shape is named in one
:class:`~graphpipe.errors.InputError`, before anything is overwritten.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from graphpipe.errors import InputError, some

__all__ = ["CheckpointLayout", "checkpoint_layout", "read_tensors"]

_HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Where a checkpoint's tensors are and how they are keyed."""

    kind: str
    """``graphpipe`` (Pipeline.save), ``dcp`` (a plain state dict) or ``safetensors``."""
    path: str
    shapes: Mapping[str, tuple[int, ...]]
    """Every tensor's shape, by its key in the checkpoint."""
    files: Mapping[str, str]
    """safetensors: key -> the file holding it (empty for DCP)."""

    def key(self, name: str, section: str = "model") -> str:
        """The checkpoint key of the model's tensor ``name`` (``section``: ``model`` or ``buffer``)."""
        return f"{section}/{name}" if self.kind == "graphpipe" else name


def checkpoint_layout(path: str | os.PathLike) -> CheckpointLayout:
    """Recognise the checkpoint at ``path`` (module docstring) and list its tensors' shapes (metadata only)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _safetensors_layout(path, [path])
    if not os.path.isdir(path):
        raise InputError(f"no checkpoint at {path}: give a torch.distributed.checkpoint folder, a .safetensors "
                         "file or a Hugging Face save_pretrained folder")
    index = os.path.join(path, _HF_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        return _safetensors_layout(path, sorted({os.path.join(path, f) for f in weight_map.values()}))
    if os.path.isfile(os.path.join(path, ".metadata")):
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        shapes = {k: tuple(m.size) for k, m in metadata.items() if hasattr(m, "size")}
        kind = "graphpipe" if any(k.startswith("model/") for k in shapes) else "dcp"
        return CheckpointLayout(kind, path, shapes, {})
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return _safetensors_layout(path, files)
    raise InputError(f"{path} holds no checkpoint: no .metadata (torch.distributed.checkpoint), no "
                     f"{_HF_INDEX} and no .safetensors file")


def _safetensors_layout(path: str, files: Sequence[str]) -> CheckpointLayout:
    from safetensors import safe_open

    shapes, where = {}, {}
    for f in files:
        if not os.path.isfile(f):
            raise InputError(f"checkpoint {path}: its index names {os.path.basename(f)}, which is not there")
        with safe_open(f, framework="pt", device="cpu") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
                where[k] = f
    return CheckpointLayout("safetensors", path, shapes, where)


def check_complete(layout: CheckpointLayout, wanted: Mapping[str, tuple[int, ...]], *,
                   optional: Sequence[str] = ()) -> None:
    """One error naming every wanted key the checkpoint lacks (``optional`` ones aside) or holds in another
    shape."""
    missing = sorted(k for k in wanted if k not in layout.shapes and k not in optional)
    wrong = sorted(f"{k} {list(layout.shapes[k])} (the model's: {list(wanted[k])})" for k in wanted
                   if k in layout.shapes and tuple(layout.shapes[k]) != tuple(wanted[k]))
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) missing: {some(missing, 5)}")
        if wrong:
            parts.append(f"{len(wrong)} of another shape: {some(wrong, 3, '; ')}")
        raise InputError(f"checkpoint {layout.path} does not fit this model: " + "; ".join(parts)
                         + " (is it of another model?)")


def read_tensors(layout: CheckpointLayout, into: Mapping[str, torch.Tensor]) -> None:
    """Fill each tensor of ``into`` (checkpoint key -> destination, any device) from the checkpoint, in place;
    only those keys are read."""
    if not into:
        return
    if layout.kind == "safetensors":
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for key in into:
            by_file.setdefault(layout.files[key], []).append(key)
        with torch.no_grad():
            for f, keys in by_file.items():
                with safe_open(f, framework="pt", device="cpu") as fh:
                    for key in keys:
                        into[key].copy_(fh.get_tensor(key))
        return
    import torch.distributed.checkpoint as dcp

    staged = {k: (t if t.device.type == "cpu" and t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype))
              for k, t in into.items()}
    # no_dist: each rank reads its own tensors; no collective (ranks load different keys)
    with warnings.catch_warnings():  # torch warns of no_dist, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(staged, storage_reader=dcp.FileSystemReader(layout.path), no_dist=True)
    with torch.no_grad():
        for k, t in into.items():
            if staged[k] is not t:
                t.copy_(staged[k])
