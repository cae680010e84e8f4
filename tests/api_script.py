"""Run under torchrun by tests/test_api.py: train through graphpipe.Pipeline, write losses and final weights.

    torchrun --nproc-per-node 3 tests/api_script.py PLAN.json OUT.pt STEPS [--save DIR] [--load DIR] [--resume-at K]
             [--meta]

``--meta`` builds the model on the meta device on every rank (a seed checkpoint given to ``--load`` fills it);
the output then also says, per rank, which of the model's tensors were ever given storage.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import api_models  # noqa: E402

import graphpipe  # noqa: E402
from graphpipe.runtime import teardown  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--resume-at", type=int, default=0)
    p.add_argument("--meta", action="store_true")
    args = p.parse_args()
    if args.meta:
        with torch.device("meta"):
            model = api_models.TwoBranch()
    else:
        torch.manual_seed(1 + int(os.environ.get("RANK", 0)))  # the ranks' models differ: rank 0's weights are sent
        model = api_models.TwoBranch()
        if int(os.environ.get("RANK", 0)) == 0:
            torch.manual_seed(0)
            model = api_models.TwoBranch()
    made = []  # with --meta: parameters given real storage while the Pipeline is built (the plan's spec included)
    register = torch.nn.Module.register_parameter
    if args.meta:
        def spy(module, name, param):
            if param is not None and param.device.type != "meta":
                made.append(name)
            return register(module, name, param)

        torch.nn.Module.register_parameter = spy
    pipe = graphpipe.Pipeline(args.plan, model, api_models.loss_fn, timeout_s=120)
    torch.nn.Module.register_parameter = register
    losses, norms = [], []
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if args.load:
        pipe.load(args.load, optimizer=opt)
        for _ in range(args.resume_at):
            sched.step()
    for step in range(args.resume_at, args.resume_at + args.steps):
        x, y = api_models.data(step)
        losses.append(pipe.step(x, y).item())
        norms.append(pipe.clip_grad_norm_(1.0).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    if args.save:
        pipe.save(args.save, optimizer=opt)
    weights = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    # which of the model's tensors this rank gave storage to, and which its stages hold
    allocated = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta")
    hosted = sorted({name for name, _ in pipe.named_parameters()})
    memory = [None] * dist.get_world_size()
    dist.all_gather_object(memory, (allocated, hosted, made))
    out = pipe.forward(api_models.data(999)[0])
    if dist.get_rank() == 0:
        merged = {}
        for w in gathered:
            merged.update(w)
        torch.save({"losses": losses, "norms": norms, "weights": merged, "eval": out, "memory": memory}, args.out)
    pipe.close()  # every rank meets, then the process groups go
    # a group alive at interpreter exit can abort this rank after a successful run (graphpipe.runtime.teardown)
    left = teardown.gloo_threads()
    if left:
        sys.exit(f"rank {os.environ.get('RANK')}: {left} gloo worker thread(s) outlive Pipeline.close()")


if __name__ == "__main__":
    main()
