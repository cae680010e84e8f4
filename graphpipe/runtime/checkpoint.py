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

A Pipeline checkpoint holds every parameter and persistent buffer of the
model, those no stage computes with included (a VLM's unused
``post_layernorm``: :func:`unused_state`, written by rank 0), so
:func:`load_into_module` fills a plain, single-process copy of the model.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from graphpipe.errors import InputError, some

__all__ = ["CheckpointLayout", "checkpoint_layout", "read_tensors", "unused_state", "load_into_module"]

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
                        _copy_whole(into[key], fh.get_tensor(key))
        return
    import torch.distributed.checkpoint as dcp

    staged = {k: (t if t.device.type == "cpu" and t.is_contiguous() and not hasattr(t, "device_mesh")
                  else torch.empty(t.shape, dtype=t.dtype)) for k, t in into.items()}
    # no_dist: each rank reads its own tensors; no collective (ranks load different keys)
    with warnings.catch_warnings():  # torch warns of no_dist, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(staged, storage_reader=dcp.FileSystemReader(layout.path), no_dist=True)
    with torch.no_grad():
        for k, t in into.items():
            if staged[k] is not t:
                _copy_whole(t, staged[k])


def _copy_whole(t: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the whole tensor ``whole`` into ``t``; a DTensor (an FSDP / TP stage's) takes its own piece."""
    if hasattr(t, "device_mesh"):
        from graphpipe.runtime.dtensors import local_pair

        local, piece = local_pair(t, whole)
        local.copy_(piece)
    else:
        t.copy_(whole)
def unused_state(model: nn.Module | None, programs: Iterable) -> dict[str, torch.Tensor]:
    """``model/NAME`` and ``buffer/NAME`` of the model's parameters and persistent buffers no stage program holds
    (the forward never reads them), from ``model``'s own tensors: what :meth:`graphpipe.Pipeline.state_dict`
    adds on rank 0 so a checkpoint has the whole model. Tensors still on the meta device have no values and are
    left out: a model built without weights has them made from the seed first
    (:func:`~graphpipe.runtime.materialize.materialize_unused`), and only those no initialiser can make (a
    buffer computed in ``__init__``) stay out; ``model=None`` gives nothing.
    """
    if model is None:
        return {}
    held_params, held_buffers = set(), set()
    for prog in programs:
        held_params.update(prog.param_names.get(n, n) for n, _ in prog.module.named_parameters())
        held_buffers.update(n for n, _ in prog.module.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name not in held_params and p.device.type != "meta":
            out[f"model/{name}"] = p.detach()
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers():
        if name in persistent and name not in held_buffers and b.device.type != "meta":
            out[f"buffer/{name}"] = b.detach()
    return out


def load_into_module(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Load a :meth:`graphpipe.Pipeline.save` checkpoint (or any layout :func:`checkpoint_layout` reads) into the
    plain ``module`` (one process, no process group): ``module.load_state_dict`` of its tensors.

    A tied parameter is saved once, under the module's first name for it; its other names take that tensor.
    With ``strict``, a key of ``module.state_dict()`` the checkpoint lacks is named in one error.

    >>> # pipe.save("ckpt"); then, in any process:
    >>> # model = build_model(); load_into_module(model, "ckpt"); model(x)
    """
    layout = checkpoint_layout(path)
    wanted = module.state_dict(keep_vars=True)
    first_name: dict[int, str] = {}
    for name, t in wanted.items():
        first_name.setdefault(id(t), name)
    buffers = {name for name, _ in module.named_buffers()}

    def key(name: str) -> str:
        return layout.key(name, "buffer" if name in buffers else "model")

    keys = {name: key(first_name[id(t)]) for name, t in wanted.items()}
    if strict:
        check_complete(layout, {keys[n]: tuple(t.shape) for n, t in wanted.items()})
    into = {k: torch.empty(tuple(layout.shapes[k]), dtype=wanted[n].dtype) for n, k in keys.items()
            if k in layout.shapes}
    read_tensors(layout, into)
    module.load_state_dict({n: into[k] for n, k in keys.items() if k in into}, strict=strict)
