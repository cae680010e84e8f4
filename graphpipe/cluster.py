"""Cluster and device cost model (docs/design.md, "The cost model").

A :class:`Cluster` is ``num_devices`` identical devices grouped
``devices_per_node`` to a node; communication between two devices costs
``latency + bytes / bandwidth`` (the paper's affine model) over the intra-node
link (NVLink) when both are on one node and the inter-node link (InfiniBand)
otherwise.

Presets
-------
``v100``  the GraphPipe paper's Summit nodes: 4 x V100-16GB per node (the
          paper uses 4 per node), NVLink 2 inside, 100 Gb/s InfiniBand between.
``a100``  8 x A100-80GB per node, NVLink 3 (300 GB/s per direction), 200 Gb/s IB.
``h100``  8 x H100-80GB SXM per node, NVLink 4 (450 GB/s per direction), 400 Gb/s IB.
``cpu``   CPU ranks under gloo (``graphpipe run``, ``Pipeline`` on CPU), one rank a device,
          64 to a host. Figures per rank: 4 GB of memory (``--memory-gb`` sets
          yours), 100 GFLOP/s fp32 peak (one core's AVX2 FMA at ~3 GHz: 2 units x
          8 lanes x 2 flops) at 30% of it, 50 us per layer call (Python and ATen
          dispatch); gloo over loopback 100 us and 1 GB/s (measured on this
          project's 2-core host: 0.42-0.50 GB/s for 1-16 MB messages with a
          neighbour's load, so a quiet host does better), 10 GbE between hosts.
          Planning from a ``graphpipe profile`` of the model replaces the compute
          figures with measured ones.

Peak FLOP/s are dense tensor-core peaks at the precision each preset states
(``device.precision``: v100 fp16, a100 and h100 bf16); ``mfu`` is the fraction of
peak a layer-sized kernel achieves, used by analytical costing.

Example
-------
>>> c = preset("v100", num_devices=8)
>>> c.node_of(5), c.link(0, 3) is c.intra_node, c.link(3, 4) is c.inter_node
(1, True, True)
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Literal, Sequence

from graphpipe import costs
from graphpipe.errors import FormatError, InputError

__all__ = ["DeviceSpec", "Link", "Cluster", "PRESETS", "PRECISIONS", "Precision", "MAX_DEVICES", "preset", "load_cluster", "cluster_to_dict", "cluster_from_dict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    name: str
    """Device model name, e.g. ``"V100-16GB"``."""
    memory_bytes: float
    """Usable device memory in bytes."""
    peak_flops: float
    """Peak dense FLOP/s at training precision."""
    op_overhead_s: float
    """Fixed cost of one layer-op call (kernel launches): the alpha of t(b)."""
    mfu: float = 0.5
    """Fraction of peak reached by layer-sized kernels (analytical costing)."""
    precision: Precision = "bf16"
    """The training precision ``peak_flops`` assumes (:data:`PRECISIONS`): a plan made with these costs is
    for runs at this precision (``graphpipe run --precision``)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"device.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for key in ("memory_bytes", "peak_flops"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"device.{key} must be > 0, got {value!r}")
        if not (math.isfinite(self.op_overhead_s) and self.op_overhead_s >= 0):
            raise InputError(f"device.op_overhead_s must be >= 0, got {self.op_overhead_s!r}")
        if not (0 < self.mfu <= 1):
            raise InputError(f"device.mfu must be in (0, 1], got {self.mfu!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    latency_s: float
    """Per-message latency (the alpha of comm time)."""
    bandwidth_Bps: float
    """Bytes per second, one direction."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise InputError(f"link latency_s must be >= 0, got {self.latency_s!r}")
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise InputError(f"link bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    name: str
    """Preset name or the custom file's device name."""
    num_devices: int
    """Devices available to the plan (from the command line)."""
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    inter_node: Link
    bytes_per_param: float = 16.0
    """Model-state bytes per fp32 parameter: weights 4 + grads 4 + Adam moments 8."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise InputError(f"number of devices must be a positive integer, got {self.num_devices!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise InputError(f"devices_per_node must be a positive integer, got {self.devices_per_node!r}")
        if not (math.isfinite(self.bytes_per_param) and self.bytes_per_param >= 0):
            raise InputError(f"bytes_per_param must be >= 0, got {self.bytes_per_param!r}")

    @property
    def memory_bytes(self) -> float:
        return self.device.memory_bytes

    def node_of(self, device_id: int) -> int:
        return device_id // self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    def transfer_time(self, src_devices: Sequence[int], dst_devices: Sequence[int], nbytes: float) -> float:
        """Seconds to move ``nbytes`` (one micro-batch's tensor) between two stages.

        With replicated stages the micro-batch is sharded, so the bytes move
        over ``min(len(src), len(dst))`` links in parallel; the slowest link
        class involved (inter-node if any pair crosses nodes) sets the speed.
        Same device set (virtual stages on one device): free.
        """
        if nbytes <= 0 or tuple(src_devices) == tuple(dst_devices):
            return 0.0
        cross = any(self.node_of(a) != self.node_of(b) for a in src_devices for b in dst_devices)
        link = self.inter_node if cross else self.intra_node
        lanes = max(1, min(len(src_devices), len(dst_devices)))
        return link.latency_s + nbytes / (link.bandwidth_Bps * lanes)

    def allreduce_link(self, devices: Iterable[int]) -> Link:
        """The link an all-reduce over ``devices`` runs at: the intra-node link when they share one node; across
        nodes, the inter-node latency and ``k`` times the inter-node bandwidth (at most the intra-node one), ``k``
        the fewest of the devices that any one node holds (:meth:`spanning_link`)."""
        per_node = Counter(self.node_of(d) for d in devices)
        return self.spanning_link(min(per_node.values()) if len(per_node) > 1 else 0)

    def first_devices_link(self, r: int) -> Link:
        """:meth:`allreduce_link` of devices ``0 .. r-1`` in O(1) (the searches' tables, one row per ``r``).

        >>> c = preset("h100", 32)
        >>> [c.first_devices_link(r) == c.allreduce_link(range(r)) for r in (1, 8, 9, 16, 20)]
        [True, True, True, True, True]
        """
        per = self.devices_per_node
        return self.spanning_link(0 if r <= per else (r % per or per))

    def spanning_link(self, fewest: int) -> Link:
        """The link of an all-reduce whose devices span nodes, ``fewest`` of them on the node holding fewest
        (0: they share one node, the intra-node link). The devices of one node each drive their own inter-node
        lane (the cost model's inter-node bandwidth is per device, as :meth:`transfer_time` has it), so ``k``
        devices per node move the cross-node part ``k`` times as fast: a hierarchical all-reduce (reduce-scatter
        inside the node, ``k`` all-reduces of ``1/k`` of the bytes across nodes in parallel, all-gather inside
        the node) or NCCL's ring over ``k`` channels, one per NIC. The intra-node link caps it."""
        if fewest <= 0:
            return self.intra_node
        if fewest == 1:
            return self.inter_node
        return Link(latency_s=self.inter_node.latency_s,
                    bandwidth_Bps=min(self.intra_node.bandwidth_Bps, fewest * self.inter_node.bandwidth_Bps))

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Ring all-reduce of ``nbytes`` over ``devices`` (:func:`graphpipe.costs.ring_allreduce_s`)."""
        link = self.allreduce_link(devices)
        return costs.ring_allreduce_s(len(devices), link.latency_s, link.bandwidth_Bps, nbytes)

    def state_bytes(self, param_bytes: float) -> float:
        """Weights + gradients + optimizer state for ``param_bytes`` of fp32 parameters."""
        return costs.state_bytes(param_bytes, self.bytes_per_param)

    def with_devices(self, num_devices: int) -> "Cluster":
        return replace(self, num_devices=num_devices)

    def with_memory(self, memory_bytes: float) -> "Cluster":
        return replace(self, device=replace(self.device, memory_bytes=memory_bytes))


PRESETS: dict[str, dict[str, Any]] = {
    "v100": {
        "devices_per_node": 4,
        "device": {"name": "V100-16GB", "memory_bytes": 16e9, "peak_flops": 125e12, "op_overhead_s": 2e-5, "mfu": 0.4,
                   "precision": "fp16"},
        "intra_node": {"latency_s": 5e-6, "bandwidth_Bps": 50e9},
        "inter_node": {"latency_s": 1e-5, "bandwidth_Bps": 12.5e9},
    },
    "a100": {
        "devices_per_node": 8,
        "device": {"name": "A100-80GB", "memory_bytes": 80e9, "peak_flops": 312e12, "op_overhead_s": 1e-5, "mfu": 0.5,
                   "precision": "bf16"},
        "intra_node": {"latency_s": 3e-6, "bandwidth_Bps": 300e9},
        "inter_node": {"latency_s": 8e-6, "bandwidth_Bps": 25e9},
    },
    "h100": {
        "devices_per_node": 8,
        "device": {"name": "H100-80GB", "memory_bytes": 80e9, "peak_flops": 989e12, "op_overhead_s": 8e-6, "mfu": 0.5,
                   "precision": "bf16"},
        "intra_node": {"latency_s": 2e-6, "bandwidth_Bps": 450e9},
        "inter_node": {"latency_s": 6e-6, "bandwidth_Bps": 50e9},
    },
    "cpu": {
        "devices_per_node": 64,
        "device": {"name": "CPU", "memory_bytes": 4e9, "peak_flops": 100e9, "op_overhead_s": 5e-5, "mfu": 0.3,
                   "precision": "fp32"},
        "intra_node": {"latency_s": 1e-4, "bandwidth_Bps": 1e9},
        "inter_node": {"latency_s": 2e-4, "bandwidth_Bps": 1.25e9},
    },
}


MAX_DEVICES = 16384
"""Most devices a cluster may have. The searches see at most 1,024 device groups whatever the count
(:data:`graphpipe.search.layouts.MAX_UNITS`: replicas taken together past it); gpp plans mmt:small on 1,024
devices at the largest batch in about 20 s on one core."""

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
"""A number format: what a device's peak FLOP/s assume, and what a run trains at."""
PRECISIONS: tuple[Precision, ...] = ("fp32", "tf32", "fp16", "bf16")
"""Training precisions a device's ``peak_flops`` may assume; runs take ``fp32`` or ``bf16`` (torch.autocast)."""

_DEVICE_KEYS = ("name", "memory_bytes", "peak_flops", "op_overhead_s", "mfu", "precision")
_LINK_KEYS = ("latency_s", "bandwidth_Bps")
_SHAPE = ("expected keys devices_per_node, device{name,memory_bytes,peak_flops,op_overhead_s}, "
          "intra_node{latency_s,bandwidth_Bps}, inter_node{...}")


def _fields(doc: Any, keys: Sequence[str], where: str, required: Sequence[str]) -> dict[str, Any]:
    from graphpipe import files as f

    f.mapping(doc, where)
    unknown = [k for k in doc if k not in keys]
    if unknown:
        raise FormatError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(keys)}")
    missing = [k for k in required if k not in doc]
    if missing:
        raise FormatError(f"{where}: missing key {missing[0]!r}; {_SHAPE}")
    return {k: (f.string(v, f"{where}.{k}") if k in ("name", "precision") else float(f.number(v, f"{where}.{k}")))
            for k, v in doc.items()}


def cluster_from_dict(doc: Any, num_devices: int | None = None, where: str = "cluster") -> Cluster:
    """Parse a cluster object: the custom-file shape, optionally with
    ``name``/``num_devices``/``bytes_per_param``, or ``{"preset": NAME, "num_devices": N}``.

    Every field is type-checked (``true`` is not a number, ``"4"`` is not a
    count) and the device count is at most :data:`MAX_DEVICES`.
    """
    from graphpipe import files as f

    f.mapping(doc, where)
    n = num_devices
    if n is None:
        n = f.integer(doc.get("num_devices", 1), f"{where}.num_devices", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"number of devices must be a positive integer, got {n!r}")
    if n > MAX_DEVICES:
        raise InputError(f"{n} devices is more than the {MAX_DEVICES} the planners handle in reasonable time")
    if "preset" in doc:
        return preset(f.string(doc["preset"], f"{where}.preset"), n)
    if "device" not in doc:
        raise FormatError(f"{where}: malformed cluster (missing key 'device'); {_SHAPE}")
    device = _fields(doc["device"], _DEVICE_KEYS, f"{where}.device", _DEVICE_KEYS[1:4])
    for key in ("devices_per_node", "intra_node", "inter_node"):
        if key not in doc:
            raise FormatError(f"{where}: malformed cluster (missing key {key!r}); {_SHAPE}")
    links = {key: _fields(doc[key], _LINK_KEYS, f"{where}.{key}", _LINK_KEYS) for key in ("intra_node", "inter_node")}
    name = f.string(doc.get("name", device.get("name", "custom")), f"{where}.name")
    device.setdefault("name", name)
    return Cluster(
        name=name,
        num_devices=n,
        devices_per_node=f.integer(doc.get("devices_per_node"), f"{where}.devices_per_node", 1),
        device=DeviceSpec(**device),
        intra_node=Link(**links["intra_node"]),
        inter_node=Link(**links["inter_node"]),
        bytes_per_param=float(f.number(doc.get("bytes_per_param", 16.0), f"{where}.bytes_per_param", 0)),
    )


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """Self-contained cluster object (custom-file shape plus name and num_devices)."""
    return {
        "name": cluster.name,
        "num_devices": cluster.num_devices,
        "devices_per_node": cluster.devices_per_node,
        "device": asdict(cluster.device),
        "intra_node": asdict(cluster.intra_node),
        "inter_node": asdict(cluster.inter_node),
        "bytes_per_param": cluster.bytes_per_param,
    }


def preset(name: str, num_devices: int = 1) -> Cluster:
    """A preset cluster (``v100``, ``a100``, ``h100``, ``cpu``) with ``num_devices`` devices."""
    key = name.lower()
    if key not in PRESETS:
        raise InputError(f"unknown cluster preset {name!r}; known: {', '.join(PRESETS)} (or a JSON file)")
    doc = dict(PRESETS[key], name=key)
    return cluster_from_dict(doc, num_devices=num_devices, where=f"preset {key}")


def load_cluster(spec: str, num_devices: int, memory_gb: float | None = None) -> Cluster:
    """A preset name or a path to a cluster JSON file; ``memory_gb`` overrides device memory."""
    import os

    if spec.lower() in PRESETS:
        cluster = preset(spec, num_devices)
    elif os.path.exists(spec):
        from graphpipe.files import read_json_file

        cluster = cluster_from_dict(read_json_file(spec, "cluster file"), num_devices=num_devices, where=spec)
    else:
        raise InputError(f"unknown cluster {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    if memory_gb is not None:
        if not (memory_gb > 0):
            raise InputError(f"--memory-gb must be > 0, got {memory_gb}")
        cluster = cluster.with_memory(memory_gb * 1e9)
    return cluster
