"""Step checkpoints under one folder: ``DIR/step-N``, each complete or ignored, the newest K kept.

A training job that must survive a lost rank saves every few steps
(:meth:`graphpipe.Pipeline.save` with ``step=N``) and, when it starts again
(torchrun's ``--max-restarts``, or by hand on fewer ranks), resumes from the
newest complete one (:meth:`graphpipe.Pipeline.resume`). This module is the
folder's bookkeeping, free of torch and of the process group:

* a checkpoint is written into ``step-N.tmp-<token>`` beside its final name
  and renamed to ``step-N`` only when every rank has finished writing, with
  a manifest (:data:`MANIFEST`: every file's size) written last inside it.
  A folder without a manifest, or whose files no longer match it (cut off
  while written, truncated, a file gone), is *incomplete*: it is never
  loaded, and resuming names it in a warning and falls back to the one
  before;
* :func:`prune` keeps the newest ``keep`` complete checkpoints and removes
  older ones and the temporary folders of saves that died.

Example
-------
>>> import tempfile
>>> root = tempfile.mkdtemp()
>>> for step in (2, 4):
...     tmp = temporary_dir(root, step, "t")
...     os.makedirs(tmp)
...     with open(os.path.join(tmp, "data"), "w") as f:
...         _ = f.write("x" * step)
...     publish(tmp, step_dir(root, step))
>>> newest_complete(root)[0]
4
>>> prune(root, keep=1)
[2]
>>> [s for s, _, _ in list_steps(root)]
[4]
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Callable

from graphpipe.errors import InputError

__all__ = ["MANIFEST", "check_keep", "step_dir", "temporary_dir", "replace_dir", "publish", "is_complete",
           "list_steps", "newest_complete", "prune", "check_steps_left"]

log = logging.getLogger(__name__)

MANIFEST = "graphpipe-complete.json"
"""Written last into a step folder: ``{"step": N, "files": {relative path: size}}``."""

_STEP = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^step-(\d+)\.tmp-[0-9a-zA-Z]+$")


def step_dir(root: str | os.PathLike, step: int) -> str:
    """``root/step-N``: where step ``step``'s checkpoint lives once complete."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputError(f"a checkpoint's step must be a non-negative integer, got {step!r}")
    return os.path.join(os.fspath(root), f"step-{step}")


def temporary_dir(root: str | os.PathLike, step: int, token: str) -> str:
    """``root/step-N.tmp-TOKEN``: where ranks write before :func:`publish` (``token`` shared by all ranks)."""
    return f"{step_dir(root, step)}.tmp-{token}"


def _sizes(folder: str) -> dict[str, int]:
    sizes = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST:
                sizes[rel] = os.path.getsize(path)
    return sizes


def check_steps_left(folder: str | os.PathLike, done: int, steps: int, error: type[Exception] = InputError) -> None:
    """Refuse a run of ``steps`` steps resuming from ``folder`` whose newest checkpoint holds step ``done``
    (nothing would be trained): ``graphpipe run`` asks before it starts its ranks, each rank again once it has
    resumed (another job may have saved a newer step in between)."""
    if done >= steps:
        raise error(f"--checkpoint-dir {os.fspath(folder)} already holds step {done}, and the run has --steps "
                    f"{steps}; raise --steps or use another folder")


def replace_dir(tmp: str, final: str) -> None:
    """Rename the folder ``tmp`` to ``final``, replacing a ``final`` that exists: the old one is first renamed
    aside and removed only after the new one is in place, so a job killed at any point leaves a whole folder
    under ``final`` (the old or the new) or, between the two renames, the old one beside it."""
    old = None
    if os.path.exists(final):
        old = f"{tmp}.replaced"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def publish(tmp: str, final: str) -> None:
    """Seal a fully written checkpoint: write its manifest (fsynced), then rename ``tmp`` to ``final``.

    Called by one process after every rank finished writing. A ``final``
    that already exists (the same step saved again) is replaced; the rename
    is atomic, so a reader sees the old folder or the new one, never a mix.
    """
    step = int(_STEP.match(os.path.basename(final)).group(1))  # type: ignore[union-attr]
    manifest = os.path.join(tmp, MANIFEST)
    files = _sizes(tmp)
    with open(manifest + ".part", "w", encoding="utf-8") as f:
        json.dump({"step": step, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(manifest + ".part", manifest)
    replace_dir(tmp, final)
    try:  # the rename itself survives a power cut only once the parent folder is synced
        fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def is_complete(folder: str) -> tuple[bool, str]:
    """``(True, "")`` when ``folder`` is a sealed checkpoint whose files match its manifest, else
    ``(False, why)``."""
    manifest = os.path.join(folder, MANIFEST)
    try:
        with open(manifest, encoding="utf-8") as f:
            expected = json.load(f)["files"]
    except FileNotFoundError:
        return False, f"no {MANIFEST} (cut off while written)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable {MANIFEST} ({type(exc).__name__})"
    found = _sizes(folder)
    missing = sorted(set(expected) - set(found))
    if missing:
        return False, f"file {missing[0]} is missing"
    changed = sorted(name for name, size in expected.items() if found[name] != size)
    if changed:
        return False, f"file {changed[0]} has {found[changed[0]]} bytes, {expected[changed[0]]} when written"
    return True, ""


def list_steps(root: str | os.PathLike) -> list[tuple[int, str, bool]]:
    """``(step, folder, complete)`` of every ``step-N`` folder under ``root``, oldest first."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path, is_complete(path)[0]))
    return sorted(found)


def newest_complete(root: str | os.PathLike,
                    warn: Callable[[str], None] | None = None) -> tuple[int, str] | None:
    """The newest complete checkpoint ``(step, folder)`` under ``root``, or None when there is none.

    Every newer, incomplete one is named through ``warn`` (default: a
    logged warning) with the reason, and skipped.
    """
    warn = warn or log.warning
    for step, path, complete in reversed(list_steps(root)):
        if complete:
            return step, path
        warn(f"checkpoint {path} is incomplete ({is_complete(path)[1]}); skipping it, resuming from an older one")
    return None


def check_keep(keep: int) -> None:
    """Refuse a ``keep`` (checkpoints to keep) that is not a positive integer, before anything is written."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InputError(f"keep must be a positive integer (checkpoints to keep), got {keep!r}")


def prune(root: str | os.PathLike, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` complete checkpoints, incomplete ones older than the oldest kept, and
    the temporary folders of saves that died (steps up to the newest complete one); returns the steps removed."""
    check_keep(keep)
    steps = list_steps(root)
    complete = [s for s, _, ok in steps if ok]
    if len(complete) <= keep:
        kept_from = complete[0] if complete else None
    else:
        kept_from = complete[-keep]
    if kept_from is None:
        return []
    removed = []
    for step, path, _ in steps:
        if step < kept_from:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    root = os.fspath(root)
    for name in os.listdir(root):
        match = _TMP.match(name)
        if match and int(match.group(1)) <= complete[-1]:  # saves run in step order: one at or before the
            # newest complete step died
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed
