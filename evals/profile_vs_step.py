"""Does ``graphpipe profile`` add up to what a training step costs? Per-op sums against the whole model.

One process, one device: the model's own forward and forward + backward
(medians over ``--steps`` after 5 warm-ups), beside the sums over ops of
:func:`graphpipe.frontend.profile.time_ops` at the same micro-batch size (B timed as
one call, W's share from the I/W split). A ratio near 1 says the per-op
costs a plan is built from are the costs of the model; pipeline stages add
their own (communication, the executor's per-action work), which
``graphpipe eval fidelity`` measures.

Usage::

    python -m graphpipe.evals.profile_vs_step mmt --device cuda --precision bf16 --batch-size 16
    python -m graphpipe.evals.profile_vs_step transformer:small --batch-size 4      # CPU, one thread

On an H100 (paper-size mmt, micro-batch 16) the sums were 1.07x (fp32) and
1.14x (bf16) the model's step; with B timed as I then W they had been 1.52x
and 2.02x (evals/results/device/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

__all__ = ["compare"]


def compare(spec: str, device: str = "cpu", precision: str = "fp32", batch_size: int = 4, steps: int = 20,
            repeats: int = 10) -> dict[str, Any]:
    """Whole-model forward / step seconds and the profile's per-op sums, at one micro-batch size."""
    from graphpipe.frontend import capture as cap
    from graphpipe.frontend import zoo
    from graphpipe.frontend.profile import time_ops

    dev = torch.device(device)
    built = zoo.build(spec, dev)
    captured = cap.capture(built.module, built.example_inputs, name=built.name)
    inputs = built.make_inputs(batch_size, 0)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    forward, step = [], []
    for i in range(5 + steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = built.loss_fn(built.module(*inputs))
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        if i >= 5:
            forward.append(t1 - t0)
            step.append(time.perf_counter() - t0)
    built.module.zero_grad(set_to_none=True)
    ops = time_ops(captured, lambda b: built.make_inputs(b, 0), [batch_size], repeats=repeats, warmup=3,
                   precision=precision)
    fwd = sum(t.fwd_s[0] for t in ops.values())
    bwd = sum(t.bwd_s[0] for t in ops.values())
    wgrad = sum(t.wgrad_s[0] for t in ops.values() if t.wgrad_s)
    whole = statistics.median(step)
    return {"model": built.name, "device": device, "precision": precision, "batch_size": batch_size,
            "model_forward_s": statistics.median(forward), "model_step_s": whole,
            "ops_forward_s": fwd, "ops_backward_s": bwd, "ops_weight_grad_s": wgrad,
            "ops_over_step": (fwd + bwd) / whole}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.profile_vs_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    r = compare(args.model, args.device, args.precision, args.batch_size, args.steps)
    ms = lambda s: f"{1e3 * s:.2f} ms"  # noqa: E731
    print(f"{r['model']} on {r['device']} at {r['precision']}, micro-batch {r['batch_size']}: model F "
          f"{ms(r['model_forward_s'])}, F+B {ms(r['model_step_s'])} | per-op F {ms(r['ops_forward_s'])}, "
          f"B {ms(r['ops_backward_s'])} (W {ms(r['ops_weight_grad_s'])}) -> {r['ops_over_step']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
