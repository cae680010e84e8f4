"""Zero bubble's split backward, ours against torch.distributed.pipelining's, on one stage in one process.

    python -m graphpipe.evals.bench_split_backward [--repeat 300]

A middle stage (two transformer layers of ``bench_api``'s 4-rank model, input
that needs its gradient) runs forward, I and W with
:func:`graphpipe.frontend.split_backward.backward_input` / ``backward_weight`` and with
torch's ``stage_backward_input`` / ``stage_backward_weight``, and forward plus
one ordinary backward for reference; the three alternate, and the figure is
each one's median. It isolates the split's own cost from the pipeline's
communication, which ``bench_api --ranks 4 --schedules zb-h1`` mixes in on
ranks that share cores. Benchmarks are not tests; prints only.
"""

from __future__ import annotations

import argparse
import statistics
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args(argv)
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from graphpipe.frontend import zoo
    from graphpipe.frontend.split_backward import backward_input, backward_weight

    torch.manual_seed(0)
    model = zoo.build("transformer:small,layers=8,hidden=128,seq=32,heads=4,ffn=512,vocab=256", seed=0).module
    stage = torch.nn.Sequential(*[m for name, m in model.named_modules() if name.endswith(("layer2", "layer3"))])
    params = list(stage.parameters())
    x0, g0 = torch.randn(4, 32, 128), torch.randn(4, 32, 128)

    def ours() -> None:
        x = x0.clone().requires_grad_(True)
        _, pending = backward_input([stage(x)], [g0], [x], params)
        backward_weight(pending)

    def torchs() -> None:
        x = x0.clone().requires_grad_(True)
        _, groups = stage_backward_input([stage(x)], [g0], [x], iter(params))
        stage_backward_weight(iter(params), groups)

    def unsplit() -> None:
        x = x0.clone().requires_grad_(True)
        torch.autograd.backward([stage(x)], [g0])

    contestants = (("graphpipe I+W", ours), ("torch I+W", torchs), ("one backward", unsplit))
    times: dict[str, list[float]] = {name: [] for name, _ in contestants}
    for i in range(10 + args.repeat):
        for name, fn in contestants:
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            fn()
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name:14s} forward + backward {statistics.median(ts) * 1e3:.3f} ms (median of {args.repeat})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
