"""Helpers shared by the CLI verbs: resolving MODEL, printing JSON, the shared-host option."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from graphpipe.cluster import DeviceSpec
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph, read_graph_json

__all__ = ["ModelSource", "load_model", "print_json", "add_model_argument", "shared_host"]

MODEL_HELP = ("zoo name with options (mmt, mmt:small, candle-uno:branches=3), a graph JSON file, "
              "a PipeDream graph.txt, or path/to/file.py:factory")


@dataclass(frozen=True, slots=True)
class ModelSource:
    graph: OpGraph
    model_id: str
    """What a plan records in ``model`` so the runtime can rebuild the module."""
    kind: str
    """zoo | factory | graph-json | pipedream"""


def add_model_argument(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)


def load_model(spec: str, device: DeviceSpec | None = None, pipedream_batch_size: int = 128) -> ModelSource:
    """Resolve MODEL: ``file.py:factory``, a graph JSON, a PipeDream graph.txt, or a zoo spec.

    ``device`` sets the analytical costs of captured modules (zoo, factory);
    files carry their own costs.
    """
    if ".py:" in spec:
        from graphpipe.capture import graph_from_factory

        return ModelSource(graph_from_factory(spec, device=device), os.path.abspath(spec.split(":")[0]) + ":" + spec.rsplit(":", 1)[1], "factory")
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "graph.txt")):
        spec = os.path.join(spec, "graph.txt")
    if os.path.exists(spec) or spec.endswith((".json", ".txt")):
        if not os.path.isfile(spec):
            raise InputError(f"no such file: {spec}")
        if spec.endswith(".json"):
            return ModelSource(read_graph_json(spec), spec, "graph-json")
        from graphpipe.pipedream import read_pipedream

        return ModelSource(read_pipedream(spec, batch_size=pipedream_batch_size), spec, "pipedream")
    from graphpipe import zoo

    return ModelSource(zoo.load_graph(spec, device=device), zoo.canonical_spec(spec), "zoo")


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


def shared_host(host_cores: int | None):
    """``--host-cores N`` as a :class:`graphpipe.sched.SharedHost` (None when not given)."""
    if host_cores is None:
        return None
    if host_cores < 1:
        raise InputError(f"--host-cores must be at least 1, got {host_cores}")
    from graphpipe.sched import SharedHost

    return SharedHost.cores(host_cores)
