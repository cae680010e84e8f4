"""What one forward saves for backward, per aten op, on each device and precision (the memory model's inputs).

``graphpipe.frontend.capture`` charges every op the bytes its forward saves for
backward (``act_bytes``), measured once on the meta device with the CPU
kernels' saves at fp32. This module measures the same quantity on a real
device and precision. Each saved storage is labelled with the aten op
dispatched last when autograd saved it (the op itself, or the one before it
for an input saved before the op runs: a label, not an exact attribution);
the totals are exact:

* ``cpu/fp32`` is capture's reference: the total equals the graph's summed
  ``act_bytes`` times the batch (tested).
* ``cuda/fp32`` differs by the attention kernel (CUDA's efficient attention
  pads the log-sum-exp and keeps the RNG state; about +1% on mmt:small, an H100).
* ``bf16`` (``torch.autocast``): matmuls save bf16 inputs; the bf16 copy of
  their weights lives in autocast's cast cache for the whole autocast region
  (the runtime's iteration), once per step, so it is model state (2 bytes per
  parameter in a bf16 plan), not counted here. Capture at ``--precision bf16``
  charges exactly what this measures on CPU (tested).

Usage::

    python -m graphpipe.evals.saved_bytes mmt:small dlrm:small --batch-size 4

Model parameters and the input batch are not counted (capture charges
neither); storages are counted once each, by the runtime's own
:class:`graphpipe.runtime.measure.SavedBytesMeter`.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["saved_by_op", "compare"]

SETTINGS = (("cpu", "fp32"), ("cuda", "fp32"), ("cpu", "bf16"), ("cuda", "bf16"))


class _LastOp(TorchDispatchMode):
    """Remembers the aten op running now: autograd packs an op's saves right after the op returns."""

    name = "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.name = func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def saved_by_op(spec: str, device: str, precision: str, batch_size: int = 4, seed: int = 0) -> dict[str, int]:
    """``{"aten_op:dtype": bytes}`` saved for backward by one forward and loss of ``spec`` on ``batch_size`` samples."""
    from graphpipe.frontend import zoo
    from graphpipe.runtime.measure import SavedBytesMeter

    built = zoo.build(spec, device, seed)
    inputs = built.make_inputs(batch_size, seed)
    meter = SavedBytesMeter(built.module.parameters())
    meter.reset(inputs)  # the batch is resident: not counted, as in a run
    per_op: collections.Counter = collections.Counter()
    last = _LastOp()

    def pack(t: torch.Tensor):
        before = meter.live
        held = meter.hold(t)  # each storage once
        if meter.live > before:
            per_op[f"{last.name}:{str(t.dtype).removeprefix('torch.')}"] += meter.live - before
        return held

    dev = torch.device(device)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held), last:
        loss = built.loss_fn(built.module(*inputs))  # its graph keeps every saved tensor alive while counting
    del loss
    return dict(per_op)


def compare(spec: str, batch_size: int = 4) -> dict[str, Any]:
    """Totals per device/precision available here, and each one's per-op differences from ``cpu/fp32``."""
    runs = {f"{d}/{p}": saved_by_op(spec, d, p, batch_size) for d, p in SETTINGS
            if d == "cpu" or torch.cuda.is_available()}
    base = runs["cpu/fp32"]
    out: dict[str, Any] = {"model": spec, "batch_size": batch_size,
                           "total_bytes": {k: sum(v.values()) for k, v in runs.items()}, "differs": {}}
    for name, per_op in runs.items():
        keys = sorted(set(per_op) | set(base))
        out["differs"][name] = {k: [base.get(k, 0), per_op.get(k, 0)] for k in keys
                                if base.get(k, 0) != per_op.get(k, 0)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.saved_bytes", description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="zoo specs, e.g. mmt:small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = [compare(m, args.batch_size) for m in args.models]
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    for r in results:
        totals = "  ".join(f"{k} {v / 1e6:.3f} MB" for k, v in r["total_bytes"].items())
        print(f"{r['model']} (batch {r['batch_size']}): {totals}")
        for name, diff in r["differs"].items():
            if diff:
                print(f"  {name} vs cpu/fp32: " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in diff.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
