"""Run under torchrun by tests: train a ``file.py:factory`` model through graphpipe.Pipeline, write what rank 0 saw.

    torchrun --nproc-per-node N tests/factory_pipeline_script.py PLAN.json OUT.pt STEPS

The plan's model spec names the factory; every rank builds it (rank 0's weights are the ones sent), takes
``STEPS`` SGD steps on the factory's example inputs, then one evaluation ``forward`` of them. Rank 0 writes the
losses (floats read from the tensors ``step`` returns), the evaluation output and the final weights by name.
"""

import sys

import torch
import torch.distributed as dist

import graphpipe
from graphpipe.frontend.capture import load_factory
from graphpipe.plan import read_plan


def main() -> None:
    plan_path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    made = load_factory(read_plan(plan_path).model)
    inputs = made.example_inputs
    pipe = graphpipe.Pipeline(plan_path, made.module, made.loss_fn, timeout_s=120)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = pipe.step(inputs)
        assert loss.shape == () and loss.device == pipe.device and not loss.requires_grad
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    evaluation = pipe.forward(inputs)
    weights = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(weights, gathered, dst=0)
    if dist.get_rank() == 0:
        merged = {name: w for part in gathered for name, w in part.items()}
        torch.save({"losses": losses, "eval": evaluation, "weights": merged}, out)
    pipe.close()


if __name__ == "__main__":
    main()
