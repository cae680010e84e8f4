"""A disk cache of captured zoo graphs, so that planning a built-in model again skips ``torch.export``.

Capturing a paper-size zoo model (``torch.export`` on the meta device, then
the op partition) takes seconds -- longer than the search itself at 1024
devices -- and gives the same :class:`~graphpipe.graph.OpGraph` every time
for the same inputs. The cache stores that graph as a ``graphpipe.graph/1``
document, keyed by everything the capture reads:

* the canonical zoo spec, the device's cost model (its ``repr``, its memory left out: the capture
  never reads it, so each ``--memory-gb`` reads the same entry), the
  precision and the granularity;
* the torch version (``torch.export``'s op sets move between releases);
* a fingerprint of graphpipe's own source: any change to the package (the
  capture, the zoo's models, the cost model) is a new key, so a stale graph
  is never read.

Location: ``$GRAPHPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphpipe``, else
``~/.cache/graphpipe``; ``GRAPHPIPE_CACHE_DIR=off`` turns it off. Only zoo
specs are cached (they are built in code from their spec); a user's
``file.py:factory`` is captured every time. The newest ``KEEP`` entries are
kept (older keys are never read again). Entries are written atomically;
an entry that cannot be read or parsed is ignored and captured anew, and a
cache folder that cannot be written is skipped without a word: the cache
only ever saves time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable

from graphpipe.graph import OpGraph, graph_from_dict, graph_to_dict

__all__ = ["cache_dir", "cached_graph"]

OFF = ("off", "0", "none", "")
KEEP = 256
"""Entries kept (the newest by modification time): each change to graphpipe or torch starts new keys."""


def cache_dir() -> str | None:
    """The cache folder, or ``None`` when ``GRAPHPIPE_CACHE_DIR`` turns the cache off."""
    chosen = os.environ.get("GRAPHPIPE_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphpipe")


@functools.lru_cache(maxsize=1)
def _source_fingerprint() -> str:
    """A digest of every ``.py`` file of the installed graphpipe package (names and bytes)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _torch_version() -> str:
    """The installed torch's version, from its package metadata: a plan from a cached graph then never
    imports torch (most of such a command's start-up). A torch without metadata (a source tree on
    ``PYTHONPATH``) is imported for its ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def _key(parts: tuple) -> str:
    text = json.dumps([repr(p) for p in parts] + [_torch_version(), _source_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_graph(parts: tuple, capture: Callable[[], OpGraph]) -> OpGraph:
    """The graph stored under ``parts`` (everything the capture depends on), else ``capture()``'s, stored."""
    folder = cache_dir()
    if folder is None:
        return graph_from_dict(graph_to_dict(capture()))  # the document's numbers, as a read entry has them
    path = os.path.join(folder, f"graph-{_key(parts)}.json")
    try:
        with open(path, encoding="utf-8") as fh:
            return graph_from_dict(json.load(fh), where=path)
    except Exception:  # missing, torn by another writer, or unreadable: capture anew
        pass
    doc = graph_to_dict(capture())
    try:
        from graphpipe.files import write_json_atomic

        os.makedirs(folder, exist_ok=True)
        write_json_atomic(path, doc)
        _prune(folder)
    except Exception:  # a read-only home, a full disk: the cache only saves time
        pass
    return graph_from_dict(doc)  # what a later read returns (integral floats as ints): the same plan bytes either way


def _prune(folder: str) -> None:
    """Remove all but the ``KEEP`` newest entries (a gone file is another process's prune)."""
    entries = []
    for name in os.listdir(folder):
        if name.startswith("graph-") and name.endswith(".json"):
            try:
                entries.append((os.stat(os.path.join(folder, name)).st_mtime, name))
            except FileNotFoundError:
                continue
    for _, name in sorted(entries, reverse=True)[KEEP:]:
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass
