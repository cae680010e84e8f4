"""Resolve a MODEL spec into an :class:`~graphpipe.graph.OpGraph`: the one place that knows the spec forms.

A MODEL is one of

* a zoo name with options (``mmt``, ``mmt:small``, ``candle-uno:branches=3``),
  built on the meta device and costed analytically;
* a graph JSON file (``graphpipe.graph/1``) or a PipeDream ``graph.txt``
  (or the folder holding it), which carry their own costs;
* ``path/to/file.py:factory`` where ``factory()`` returns
  ``(module, example_inputs, loss_fn[, example_target])``, captured with
  ``torch.export`` (:mod:`graphpipe.frontend.capture`).

The CLI, the runtime and the evals all resolve models through
:func:`load_model`, so a spec means the same thing everywhere.

Example
-------
>>> source = load_model("twobranch:small")
>>> source.kind, source.model_id, source.graph.num_ops > 0
('zoo', 'twobranch:small', True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from graphpipe.cluster import DeviceSpec
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph, read_graph_json

__all__ = ["ModelSource", "load_model", "MODEL_HELP"]

MODEL_HELP = ("zoo name with options (mmt, mmt:small, candle-uno:branches=3), a graph JSON file, "
              "a PipeDream graph.txt, or path/to/file.py:factory")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved MODEL spec."""

    graph: OpGraph
    model_id: str
    """What a plan records in ``model`` so the runtime can rebuild the module."""
    kind: str
    """zoo | factory | graph-json | pipedream"""


def missing_factory(path: str) -> str:
    """The refusal of a ``.py`` model given without ``:factory``: the file's top-level functions, read without
    running it (its functions are candidates; which one builds the model only the user knows)."""
    import ast

    if not os.path.isfile(path):
        return f"no such file: {path} (a Python model is given as file.py:factory)"
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{path}: a Python model is given as {path}:FACTORY, and the file could not be read ({exc})"
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and not n.name.startswith("_")]
    found = (f"functions in it: {', '.join(names)}" if names else "it defines no top-level function; add one that "
             "returns (module, example_inputs, loss_fn[, example_target])")
    return f"{path} is a Python file: name the factory that builds the model, as {path}:FACTORY ({found})"


def load_model(spec: str, device: DeviceSpec | None = None, pipedream_batch_size: int = 128,
               precision: str = "fp32", granularity: str | None = None) -> ModelSource:
    """Resolve MODEL: ``file.py:factory``, a graph JSON, a PipeDream graph.txt, or a zoo spec.

    ``device`` sets the analytical costs of captured modules (zoo, factory);
    files carry their own costs. ``pipedream_batch_size`` is the batch a
    PipeDream profile was measured at (its times are per batch). Captured
    modules measure activation bytes at ``precision`` and are cut into ops
    at ``granularity`` (:meth:`graphpipe.frontend.capture.Granularity.parse`).
    """
    if ".py:" in spec:
        from graphpipe.frontend.capture import Granularity
        from graphpipe.frontend.capture_repeats import graph_from_factory

        path, factory = spec.rsplit(":", 1)
        from graphpipe.progress import slow_notice

        with slow_notice(f"capturing {spec} (torch.export)"):
            graph = graph_from_factory(spec, device=device, granularity=Granularity.parse(granularity),
                                       precision=precision)
        return ModelSource(graph, os.path.abspath(path) + ":" + factory, "factory")
    if spec.endswith(".py"):
        raise InputError(missing_factory(spec))
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "graph.txt")):
        spec = os.path.join(spec, "graph.txt")
    if os.path.exists(spec) or spec.endswith((".json", ".txt")):
        if not os.path.isfile(spec):
            raise InputError(f"no such file: {spec}")
        if spec.endswith(".json"):
            return ModelSource(read_graph_json(spec), spec, "graph-json")
        from graphpipe.importers.pipedream_txt import read_pipedream

        return ModelSource(read_pipedream(spec, batch_size=pipedream_batch_size), spec, "pipedream")
    if precision != "fp32" or granularity:
        if spec.endswith((".json", ".txt")):
            raise InputError("--precision and --granularity apply to captured modules, not to graph files")
    from graphpipe.frontend import zoo
    return ModelSource(zoo.load_graph(spec, device=device, precision=precision, granularity=granularity),
                       zoo.canonical_spec(spec), "zoo")
