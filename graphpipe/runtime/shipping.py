"""A model's capture, made once by the launcher and shipped to its ranks instead of exported again on each.

Every rank needs the model's captured graph to cut its stages, and
capturing is most of a rank's start-up: torch.export traces the whole model,
on every rank at once, on a host whose cores the ranks share. The launcher
has already captured the model in its preflight, so it packs that capture
into bytes (:func:`pack`) and each rank rebuilds it around the model it
builds itself (:func:`unpack`), a small fraction of an export's time
(evals/REPORT.md, ``bench_launch``).

What travels is the graph after export and op grouping, before the runtime's
instrumentation (which the rank runs as before): each node's kind, name,
target and arguments; the ops' node names; the input and output structure.
Tensors and modules the graph reads travel as *references* where they belong
to the user's model (its parameter, buffer or submodule of that name; the
rank's own model supplies the object, so the graph reads the rank's
tensors, as a capture on the rank would), and by value otherwise (constants
export lifted, with their kept values; the bodies of higher-order ops, packed
the same way). torch's operators travel by name. Of the node metadata only
each value's symbolic shape travels (as text): the runtime sizes every step's
messages from it (:mod:`graphpipe.frontend.shapes`).

The rank checks what it rebuilt against the sender's description (every
attribute's name, shape and dtype, every reference resolving to an object of
the kind sent); any difference, such as a model that registers a buffer in
its first forward, raises :class:`ShipMismatch` and the rank captures the
model itself, as it would have without a shipment.
"""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["pack", "unpack", "ShipMismatch"]


class ShipMismatch(Exception):
    """The shipped capture does not fit the model this process built (or cannot be read): capture instead."""


class _NodeRef:
    """A node named in a packed graph's arguments, resolved once the nodes before it exist."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _op_key(obj: Any) -> tuple | None:
    """torch's operators by name (their objects do not pickle)."""
    if isinstance(obj, torch._ops.OpOverload):
        return ("op", obj.name())
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return ("packet", obj._qualified_op_name)
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return ("hop", obj.name())
    return None


def _op(key: tuple) -> Any:
    kind, name = key
    if kind == "hop":
        return getattr(torch.ops.higher_order, name)
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), packet_name)
    return packet if kind == "packet" else getattr(packet, overload or "default")


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        return _op_key(obj)


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "node":
            return _NodeRef(pid[1])
        return _op(pid)


def _owned(module: nn.Module) -> dict[int, tuple[str, str]]:
    """``id -> (kind, name)`` of every parameter, buffer and submodule of ``module`` (first name of each)."""
    owned: dict[int, tuple[str, str]] = {}
    for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False)),
                        ("module", module.named_modules(remove_duplicate=False))):
        for name, obj in named:
            owned.setdefault(id(obj), (kind, name))
    return owned


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _describe(gm: nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer of ``gm`` by name: shape, dtype, device type, whether a parameter."""
    out = {}
    for kind, named in (("parameter", gm.named_parameters(remove_duplicate=False)),
                        ("buffer", gm.named_buffers(remove_duplicate=False))):
        for name, t in named:
            out[name] = (kind, tuple(t.shape), t.dtype, t.device.type)
    return out


def _pack_graph(gm: fx.GraphModule, owned: dict[int, tuple[str, str]]) -> dict:
    nodes = [(n.op, n.name, n.target, n.args, n.kwargs) for n in gm.graph.nodes]
    attrs: dict[str, tuple] = {}
    for n in gm.graph.nodes:
        if n.op not in ("get_attr", "call_module") or n.target in attrs:
            continue
        obj = _attr(gm, n.target)
        if id(obj) in owned:
            attrs[n.target] = ("ref",) + owned[id(obj)]
        elif isinstance(obj, fx.GraphModule):  # a higher-order op's body
            attrs[n.target] = ("graph", _pack_graph(obj, owned))
        else:
            attrs[n.target] = ("value", obj)
    from graphpipe.frontend.shapes import shape_records

    return {"nodes": nodes, "attrs": attrs, "class_name": type(gm).__name__, "described": _describe(gm),
            "order": _order(gm, owned), "shapes": shape_records(gm), "meta": dict(gm.meta)}


def _order(gm: fx.GraphModule, owned: dict[int, tuple[str, str]]) -> dict[str, tuple]:
    """The key order of each module fx made to hold the graph's attributes (``gm`` and its plain containers):
    the rank's graph module lists its parameters in the order the capture's did."""
    order = {}
    for path, m in gm.named_modules():
        if path and (id(m) in owned or isinstance(m, fx.GraphModule)):
            continue
        order[path] = (tuple(m._modules), tuple(m._parameters), tuple(m._buffers))
    return order


def _reorder(gm: fx.GraphModule, order: dict[str, tuple]) -> None:
    for path, (modules, parameters, buffers) in order.items():
        try:
            m = gm.get_submodule(path)
        except AttributeError as exc:
            raise ShipMismatch(f"the rebuilt graph has no module {path!r}") from exc
        for table, keys in ((m._modules, modules), (m._parameters, parameters), (m._buffers, buffers)):
            if set(table) != set(keys):
                raise ShipMismatch(f"the rebuilt graph's module {path!r} holds other attributes than the capture's")
            items = [(k, table[k]) for k in keys]
            table.clear()
            table.update(items)


def pack(module: nn.Module, gm: fx.GraphModule, op_nodes: dict, io_spec: Any) -> bytes:
    """``gm`` (captured from ``module``), its ops' node names and its :class:`~graphpipe.frontend.exporting.IOSpec` as bytes.

    Raises whatever pickling raises for an object that cannot travel (the
    caller then ships nothing).
    """
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(
        {"graph": _pack_graph(gm, _owned(module)), "op_nodes": op_nodes, "io": io_spec})
    return buffer.getvalue()


def _resolve(module: nn.Module, kind: str, name: str) -> Any:
    try:
        if kind == "parameter":
            return module.get_parameter(name)
        if kind == "buffer":
            return module.get_buffer(name)
        return module.get_submodule(name)
    except AttributeError as exc:
        raise ShipMismatch(f"the model built here has no {kind} {name!r}") from exc


def _unpack_graph(packed: dict, module: nn.Module) -> fx.GraphModule:
    root: dict[str, Any] = {}
    for target, entry in packed["attrs"].items():
        if entry[0] == "ref":
            root[target] = _resolve(module, entry[1], entry[2])
        elif entry[0] == "graph":
            root[target] = _unpack_graph(entry[1], module)
        else:
            root[target] = entry[1]
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def node_of(a: Any) -> Any:
        return env[a.name] if isinstance(a, _NodeRef) else a

    for op, name, target, args, kwargs in packed["nodes"]:
        node = graph.create_node(op, target, fx.node.map_aggregate(args, node_of),
                                 fx.node.map_aggregate(kwargs, node_of), name=name)
        if node.name != name:
            raise ShipMismatch(f"node {name!r} came out named {node.name!r}")
        env[name] = node
    gm = fx.GraphModule(root, graph, class_name=packed["class_name"])
    from graphpipe.frontend.shapes import apply_shape_records

    apply_shape_records(gm, packed.get("shapes", {}))  # the values' symbolic shapes: each step's sizes need them
    gm.meta.update(packed.get("meta", {}))
    _reorder(gm, packed["order"])
    if _describe(gm) != packed["described"]:
        raise ShipMismatch("the rebuilt graph's parameters and buffers differ from the capture's "
                           "(the model built here is not the one captured)")
    return gm


def unpack(blob: bytes, module: nn.Module) -> tuple[fx.GraphModule, dict, Any]:
    """``(gm, op_nodes, io)`` rebuilt from :func:`pack`'s bytes around ``module`` (its tensors and submodules).

    Raises :class:`ShipMismatch` where the shipment does not fit ``module``.
    """
    try:
        with warnings.catch_warnings():  # torch's pytree warns about its own leaf specs being rebuilt
            warnings.simplefilter("ignore", FutureWarning)
            data = _Unpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # noqa: BLE001 - an unreadable shipment is captured instead
        raise ShipMismatch(f"cannot read the shipped capture ({type(exc).__name__}: {exc})") from exc
    return _unpack_graph(data["graph"], module), data["op_nodes"], data["io"]
