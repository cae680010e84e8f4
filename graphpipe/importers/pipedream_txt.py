"""Import PipeDream's per-layer profiles (``graph.txt``) as an :class:`OpGraph`.

PipeDream (Narayanan et al., SOSP'19) publishes one profile per model: one
line per layer, then one tab-indented line per edge
(``data/pipedream-profiles/README.md`` in the repository)::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=1.2, backward_compute_time=2.5, activation_size=822083584.0, parameter_size=7168.0
    \tnode4 -- node5

Times are milliseconds for one profiled *batch*, sizes are bytes for that
batch; ``activation_size`` may be a list ``[a; b; ...]`` (one entry per output
tensor, GNMT). Conversion to our per-sample cost model (docs/design.md, "The cost model"):

* ``beta = ms / 1000 / batch_size`` seconds per sample and ``alpha = 0``:
  PipeDream profiles a single batch size, so the fixed per-call part of
  ``t(b) = alpha + beta*b`` cannot be separated from the per-sample part; we
  attribute all of it to the per-sample term.
* ``act_bytes = out_bytes = sum(activation_size) / batch_size`` (PipeDream
  keeps a layer's output as its saved activation); edge bytes per sample are
  the source layer's activation size over the batch size;
  ``param_bytes = parameter_size``.
* ``batch_size`` defaults to 128 because the image profiles were taken at 128:
  VGG16's 128-channel 112x112 fp32 activation is 822,083,584 bytes =
  128 x 128 x 112 x 112 x 4 (README). Pass the right value for other profiles.
* **Input nodes cost nothing.** A node whose layer description starts with
  ``Input`` is the data loader: its ``forward_compute_time`` is the time to
  fetch a batch (alexnet's is 635.9 ms against 85.3 ms for the whole model;
  resnet18 and squeezenet about 474 ms), not work a pipeline stage does. The
  real optimizer (msr-fiddle/pipedream ``optimizer_graph_hierarchical.py``,
  ``main``) zeroes every Input source's times and sizes and drops it before
  its DP; we zero its forward/backward times and parameter bytes and keep
  its output bytes (the input tensor still reaches its consumers and is held
  while they run). :func:`zeroed_inputs` lists what was zeroed, which
  ``graphpipe inspect`` reports.

Op names are the file's node ids (``node4``), kinds the leading word of the
layer description (``Conv2d``; ``Input0`` -> ``Input``).

Example
-------
>>> import os, tempfile
>>> text = ("node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=0.0, parameter_size=0.000\\n"
...         "node2 -- Linear(4, 4) -- forward_compute_time=1.280, backward_compute_time=2.560, activation_size=[1024.0; 1024.0], parameter_size=80.000\\n"
...         "\\tnode1 -- node2\\n")
>>> path = os.path.join(tempfile.mkdtemp(), "graph.txt")
>>> _ = open(path, "w").write(text)
>>> g = read_pipedream(path, batch_size=128)
>>> g.ops[1].kind, g.ops[1].fwd.beta, g.ops[1].act_bytes, g.edges[0].bytes
('Linear', 1e-05, 16.0, 0.0)
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace

from graphpipe.errors import FormatError, InputError
from graphpipe.graph import Affine, Op, OpGraph

__all__ = ["read_pipedream", "parse_pipedream", "zeroed_inputs", "read_zeroed_inputs", "is_input_kind",
           "DEFAULT_BATCH_SIZE"]

DEFAULT_BATCH_SIZE = 128
"""Batch size of the published image-classification profiles (see module docstring)."""

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_KIND = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _number(text: str, where: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FormatError(f"{where}: {key}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise FormatError(f"{where}: {key}={text!r} must be a finite non-negative number")
    return value


def _activation(text: str, where: str) -> float:
    """Total bytes of ``a`` or ``[a; b; ...]`` (one entry per output tensor)."""
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise FormatError(f"{where}: activation_size list {text!r} is missing its closing ']'")
        entries = [e.strip() for e in text[1:-1].split(";") if e.strip()]
        if not entries:
            raise FormatError(f"{where}: activation_size list is empty")
        return sum(_number(e, where, "activation_size") for e in entries)
    return _number(text, where, "activation_size")


def _kind(description: str) -> str:
    match = _KIND.match(description.strip())
    if not match:
        return "op"
    word = match.group(0)
    # "Input0", "Input1": numbered graph inputs are one kind.
    stripped = word.rstrip("0123456789")
    return stripped if stripped and word.startswith("Input") else word


def is_input_kind(kind: str) -> bool:
    """True for the kind of a PipeDream Input node (``Input``, ``Input0``, ...); the importer zeroes those that are sources."""
    return kind == "Input"


def zeroed_inputs(text: str) -> list[tuple[str, float, float]]:
    """``(node id, forward ms, backward ms)`` of every Input source of ``text`` whose non-zero times the importer zeroes.

    >>> zeroed_inputs("node1 -- Input -- forward_compute_time=635.902, backward_compute_time=0.000, "
    ...               "activation_size=1.0, parameter_size=0.000")
    [('node1', 635.902, 0.0)]
    """
    lines = [raw for raw in text.splitlines() if raw.strip()]
    has_input = {raw.strip().split(" -- ")[-1].strip() for raw in lines if raw[0] in " \t"}
    out = []
    for raw in lines:
        if raw[0] in " \t":
            continue
        parts = raw.split(" -- ")
        if len(parts) < 3 or not is_input_kind(_kind(" -- ".join(parts[1:-1]))) or parts[0].strip() in has_input:
            continue
        fields = dict(item.strip().partition("=")[::2] for item in parts[-1].split(",") if "=" in item)
        try:
            fwd, bwd = float(fields.get("forward_compute_time", 0)), float(fields.get("backward_compute_time", 0))
        except ValueError:
            continue  # parse_pipedream reports the malformed number
        if fwd or bwd:
            out.append((parts[0].strip(), fwd, bwd))
    return out


def read_zeroed_inputs(path: str) -> list[tuple[str, float, float]]:
    """:func:`zeroed_inputs` of the file (or folder) :func:`read_pipedream` reads; [] if unreadable."""
    if os.path.isdir(path):
        path = os.path.join(path, "graph.txt")
    try:
        with open(path, encoding="utf-8") as fh:
            return zeroed_inputs(fh.read())
    except (OSError, UnicodeDecodeError):
        return []


def parse_pipedream(text: str, path: str = "graph.txt", batch_size: int = DEFAULT_BATCH_SIZE) -> OpGraph:
    """Parse the text of a PipeDream ``graph.txt``; errors name ``path:line``.

    Input nodes get zero compute time and parameters (module docstring).
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer (the profiled batch size), got {batch_size!r}")
    ops: list[Op] = []
    activation: dict[str, float] = {}
    edges: list[tuple[str, str, int]] = []  # (src, dst, line number)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{path}:{lineno}"
        if not raw.strip():
            continue
        if raw[0] in " \t":
            parts = [p.strip() for p in raw.strip().split(" -- ")]
            if len(parts) != 2 or not all(parts):
                raise FormatError(f"{where}: edge line must be '<tab>nodeA -- nodeB', got {raw.strip()!r}")
            edges.append((parts[0], parts[1], lineno))
            continue
        if edges:
            raise FormatError(f"{where}: node line after the edge lines; nodes must come first")
        parts = raw.rstrip("\n").split(" -- ")
        if len(parts) < 3:
            raise FormatError(f"{where}: node line must be 'nodeID -- <layer> -- forward_compute_time=..., ...', got {raw.strip()[:80]!r}")
        node_id, description, fields = parts[0].strip(), " -- ".join(parts[1:-1]), parts[-1]
        if not node_id or " " in node_id:
            raise FormatError(f"{where}: bad node id {node_id!r}")
        if node_id in activation:
            raise FormatError(f"{where}: node {node_id!r} is defined twice")
        values: dict[str, str] = {}
        for item in fields.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise FormatError(f"{where}: expected key=value, got {item.strip()!r}")
            values[key.strip()] = value.strip()
        missing = [k for k in _FIELDS if k not in values]
        if missing:
            raise FormatError(f"{where}: node {node_id!r} lacks {', '.join(missing)}")
        fwd_ms = _number(values["forward_compute_time"], where, "forward_compute_time")
        bwd_ms = _number(values["backward_compute_time"], where, "backward_compute_time")
        act = _activation(values["activation_size"], where)
        params = _number(values["parameter_size"], where, "parameter_size")
        activation[node_id] = act
        per_sample = act / batch_size
        ops.append(Op(node_id, _kind(description),
                      Affine(0.0, fwd_ms / 1000.0 / batch_size), Affine(0.0, bwd_ms / 1000.0 / batch_size),
                      params, per_sample, per_sample))
    if not ops:
        raise FormatError(f"{path}: no node lines; is this a PipeDream graph.txt?")
    seen: set[tuple[str, str]] = set()
    for src, dst, lineno in edges:
        for end in (src, dst):
            if end not in activation:
                raise FormatError(f"{path}:{lineno}: edge {src} -- {dst} names unknown node {end!r}")
        if (src, dst) in seen:
            raise FormatError(f"{path}:{lineno}: duplicate edge {src} -- {dst}")
        seen.add((src, dst))
    # Input sources are data loading, not stage work: the real optimizer zeroes them too (module docstring).
    has_input = {dst for _, dst, _ in edges}
    ops = [replace(op, fwd=Affine(0.0, 0.0), bwd=Affine(0.0, 0.0), param_bytes=0.0)
           if is_input_kind(op.kind) and op.name not in has_input else op for op in ops]
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "pipedream"
    return OpGraph.build(name, ops, [(s, d, activation[s] / batch_size) for s, d, _ in edges])


def read_pipedream(path: str, batch_size: int = DEFAULT_BATCH_SIZE) -> OpGraph:
    """Read a PipeDream ``graph.txt`` (or a folder holding one) as an :class:`OpGraph`.

    The graph is named after the folder (``.../resnet50/graph.txt`` -> ``resnet50``).
    A malformed line raises :class:`FormatError` ``"path:line: what is wrong"``;
    a cycle raises :class:`~graphpipe.errors.GraphCycleError` naming it.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "graph.txt")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise InputError(f"no such file: {path}") from None
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: not a text file ({exc.reason}); expected a PipeDream graph.txt") from None
    return parse_pipedream(text, path=path, batch_size=batch_size)
