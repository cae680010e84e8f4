"""Run under torchrun by tests/test_intra_stage.py: train ``file.py:factory`` through graphpipe.Pipeline on a
plan with FSDP / tensor-parallel stages; rank 0 writes the losses and the final weights, whole, by name.

    torchrun --nproc-per-node N tests/intra_stage_script.py PLAN.json OUT.pt STEPS [--meta] [--save DIR] [--load DIR]

``--meta``: the model is built on the meta device (each rank materializes its own stages). ``--save DIR``: a
checkpoint after the steps; ``--load DIR``: load one before them (any layout wrote it). Each rank also reports
its share of its stages' parameters, gradients and optimizer state (``shares``).
"""

import sys

import torch
import torch.distributed as dist

import graphpipe
from graphpipe.capture import load_factory
from graphpipe.plan import read_plan


def _whole(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _meta_copy(module):
    """The same architecture with every tensor on the meta device (what a user builds under torch.device('meta'))."""
    import copy

    return copy.deepcopy(module).to("meta")


def main() -> None:
    import faulthandler, os
    if os.environ.get("GP_DUMP"):
        faulthandler.dump_traceback_later(int(os.environ["GP_DUMP"]), exit=True)
    plan_path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = sys.argv[4:]
    made = load_factory(read_plan(plan_path).model)
    model = made.module
    if "--meta" in args:
        model = _meta_copy(made.module)
    pipe = graphpipe.Pipeline(plan_path, model, made.loss_fn, example_inputs=made.example_inputs,
                              example_target=made.example_target, timeout_s=120)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    if "--load" in args:
        pipe.load(args[args.index("--load") + 1], opt)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(made.example_inputs, made.example_target).item())
        opt.step()
        opt.zero_grad(set_to_none=False)
    if "--save" in args:
        pipe.save(args[args.index("--save") + 1], opt)
    params = list(pipe.named_parameters())
    shares = {"params": sum(_local(p).numel() for _, p in params),
              "grads": sum(_local(p.grad).numel() for _, p in params if p.grad is not None),
              "optim": sum(_local(v).numel() for _, p in params for v in opt.state[p].values()
                           if isinstance(v, torch.Tensor) and v.dim())}
    weights = {name: _whole(p.detach()).clone() for name, p in params}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((weights, shares), gathered, dst=0)
    if dist.get_rank() == 0:
        merged = {name: w for part, _ in gathered for name, w in part.items()}
        torch.save({"losses": losses, "weights": merged, "shares": [s for _, s in gathered]}, out)
    pipe.close()


if __name__ == "__main__":
    main()
