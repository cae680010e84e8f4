"""``Pipeline(plan, model, loss_fn, compile=True)`` against a plain eager loop, 3 SGD steps (docs/limits.md).

Every rank prints its loss beside the eager loop's and the largest difference of its parameters' gradients. For
models without dropout (the pipeline draws its own masks)::

    graphpipe plan evals/compile_heldout_models.py:qwen3 --devices 2 -b 8 --micro-batch-size 2 --out q.json
    torchrun --nproc-per-node 2 evals/compile_heldout_api.py q.json qwen3
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys

import torch

__all__ = ["main"]


def main(plan: str, name: str, steps: int = 3) -> None:
    import graphpipe

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_heldout_models.py")
    spec = importlib.util.spec_from_file_location("compile_heldout_models", path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    model, inputs, loss_fn, target = getattr(models, name)()
    ref = copy.deepcopy(model)
    pipe = graphpipe.Pipeline(plan, model, loss_fn, compile=True)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(steps):
        loss = pipe.step(inputs, target)
        ref_loss = loss_fn(ref(**inputs) if isinstance(inputs, dict) else ref(*inputs), target)
        ref_loss.backward()
        eager = dict(ref.named_parameters())
        worst = max(float((p.grad - eager[n].grad).abs().max()) for n, p in pipe.named_parameters()
                    if p.grad is not None)
        print(f"rank {pipe.rank} step {step} loss {float(loss):.6f} eager {float(ref_loss):.6f} "
              f"worst gradient difference {worst:.2e}", flush=True)
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
    pipe.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
