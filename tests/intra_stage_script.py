"""Run under torchrun by tests/test_intra_stage.py: train ``file.py:factory`` models through graphpipe.Pipeline on
plans with FSDP / tensor-parallel stages, one plan after another in the same ranks; rank 0 writes, per plan, the
losses, the gradients' global norms, the final weights (whole, by name), each rank's share of its stages' state and
the bytes autograd saved for backward on it in the first step (counted per save, and per tensor stored), and
per step the FSDP all-gathers it issued before its first FSDP forward and in all.

    torchrun --nproc-per-node N tests/intra_stage_script.py STEPS OUT_DIR PLAN.json[,KEY=VALUE...] ...

Each plan's results go to ``OUT_DIR/<plan file name>.pt``. Options after a plan, comma-separated: ``steps=N``
(instead of STEPS), ``save=DIR`` (a checkpoint with the optimizer's state after the steps), ``load=DIR`` (one,
written under any layout or a plain model's seed checkpoint, loaded before them), ``meta=1`` (the model handed to
the Pipeline is built on the meta device: every weight comes from ``load``), ``precision=bf16`` (autocast; the
results go to ``<name>_bf16.pt``), ``resume=DIR`` (step checkpoints, as a job that survives a restart keeps them:
``Pipeline.resume`` from the newest ``DIR/step-N`` before the steps, which then run from step N to STEPS, only
those recorded, and ``Pipeline.save(DIR, step=STEPS)`` after them; the results say the step it ``start``-ed from).
"""

import contextlib
import copy
import os
import sys

import torch
import torch.distributed.nn  # noqa: F401  (before the group is up: see graphpipe.Pipeline.close)
import torch.distributed as dist

import graphpipe
from graphpipe.frontend.capture import load_factory
from graphpipe.plan import read_plan


def _whole(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _watch_gathers(pipe) -> list[int]:
    """The parameter elements an FSDP stage of this rank holds gathered, each time one of its FSDP modules starts
    a forward in a step (after FSDP's own hook gathered that module's): appended to the list returned."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    seen: list[int] = []
    intra = pipe._setup.executor.intra_stage
    roots = [p.fsdp for p in intra.parallel.values() if p.fsdp is not None] if intra else []
    groups = [m for r in roots for m in r.modules() if isinstance(m, FSDPModule)]

    def count(*_):
        seen.append(sum(fp.sharded_param.shape.numel() for m in groups
                        for g in [fully_shard.state(m)._fsdp_param_group] if g is not None
                        for fp in g.fsdp_params if fp.sharded_state == ShardedState.UNSHARDED))
    for m in groups:
        m.register_forward_pre_hook(count)
    return seen


class _GatherLog:
    """FSDP all-gathers on this rank, per step: how many were issued before the step's first forward of an FSDP
    stage (``early``: the gather a stage gathered for the step starts at the step's start) and in the whole step
    (``total``: the pre-forward hook must wait for that gather, not issue another)."""

    issued = 0
    """FSDP all-gathers issued by this process so far (:meth:`install` counts them)."""

    def __init__(self, pipe):
        from torch.distributed.fsdp import FSDPModule

        self.early: list[int] = []
        self.total: list[int] = []
        self._start = self._first = None
        intra = pipe._setup.executor.intra_stage
        for p in intra.parallel.values() if intra else ():
            if isinstance(p.fsdp, FSDPModule):  # before FSDP's own pre-forward hook, which may gather
                p.fsdp.register_forward_pre_hook(self._forward, prepend=True)

    @staticmethod
    def install() -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        gather = group.foreach_all_gather

        def counted(*args, **kwargs):
            _GatherLog.issued += 1
            return gather(*args, **kwargs)
        group.foreach_all_gather = counted

    def _forward(self, *_):
        if self._first is None:
            self._first = _GatherLog.issued - self._start

    def __enter__(self):
        self._start, self._first = _GatherLog.issued, None
        return self

    def __exit__(self, *exc):
        self.early.append(self._first if self._first is not None else 0)
        self.total.append(_GatherLog.issued - self._start)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward on this rank while it is entered (a DTensor: its local
    piece), each save counted: what sequence parallelism lowers; and the all-gathers its backward runs again.
    A sequence-parallel stage's own hooks (intra_stage.Regather) take precedence inside its forward: what they
    keep is counted there, a gathered tensor as the shard kept in its place."""

    active = None

    def __init__(self):
        self.total = 0
        self.regathers = 0
        self.storages = {}  # each tensor stored once, however many saves share it: its storage's bytes
        self.held = []  # ... kept alive while counted, so that no later tensor reuses a counted address

    def count(self, t):
        from graphpipe.runtime import intra_stage

        if isinstance(t, intra_stage._Regathered):
            t = t.entry.shard
        local = _local(t)
        self.total += local.numel() * local.element_size()
        storage = local.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        self.held.append(storage)

    def pack(self, t):
        self.count(t)
        return t

    def __enter__(self):
        _SavedBytes.active = self
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        self.gather = dist.all_gather

        def counted(*args, **kwargs):  # sequence parallelism's gathers again in backward (DTensor's own
            self.regathers += 1  # collectives go through its functional ones, not this)
            return self.gather(*args, **kwargs)
        dist.all_gather = counted
        return self

    def __exit__(self, *exc):
        self.held.clear()
        dist.all_gather = self.gather
        self.hooks.__exit__(*exc)
        _SavedBytes.active = None


def _count_regathered():
    from graphpipe.runtime import intra_stage

    pack = intra_stage.Regather.pack

    def counted(self, t):
        kept = pack(self, t)
        if _SavedBytes.active is not None:
            _SavedBytes.active.count(kept)
        return kept
    intra_stage.Regather.pack = counted


def train(plan_path: str, steps: int, out: str, save: str | None, load: str | None, meta: bool = False,
          precision: str = "fp32", resume: str | None = None) -> None:
    made = load_factory(read_plan(plan_path).model)
    # meta: the user's model built on the meta device, its weights only from the checkpoint ``load`` names
    module = copy.deepcopy(made.module).to("meta") if meta else made.module
    pipe = graphpipe.Pipeline(plan_path, module, made.loss_fn, idle_ranks=True, example_inputs=made.example_inputs,
                              example_target=made.example_target, timeout_s=120, precision=precision)
    idle = not list(pipe.parameters())  # a rank the plan leaves idle gets a stand-in optimizer
    opt = torch.optim.SGD(list(pipe.parameters()) or [torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    if load:
        pipe.load(load, None if idle else opt)
    start = pipe.resume(resume, None if idle else opt) if resume else 0
    gathered = _watch_gathers(pipe)
    gathers = _GatherLog(pipe)
    losses, norms = [], []
    saved = _SavedBytes()
    for step in range(start, steps):
        with saved if step == start else contextlib.nullcontext(), gathers:
            losses.append(pipe.step(made.example_inputs, made.example_target).item())
        norms.append(float(pipe.clip_grad_norm_(1e9)))  # the global norm: every parameter counted once
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated: their share is measured below
    if save:
        pipe.save(save, opt)
    if resume:
        pipe.save(resume, None if idle else opt, step=steps)
    evaluation = pipe.forward(made.example_inputs)
    params = list(pipe.named_parameters())
    shares = {"params": sum(_local(p).numel() for _, p in params),
              "grads": sum(_local(p.grad).numel() for _, p in params if p.grad is not None),
              "optim": sum(_local(v).numel() for _, p in params for v in opt.state[p].values()
                           if isinstance(v, torch.Tensor) and v.dim()),
              "gathered": max(gathered, default=0), "saved": saved.total, "regathers": saved.regathers,
              "stored": sum(saved.storages.values()), "early_gathers": gathers.early, "gathers": gathers.total}
    weights = {name: _whole(p.detach()).clone() for name, p in params}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((weights, shares), gathered, dst=0)
    if dist.get_rank() == 0:
        merged = {name: w for part, _ in gathered for name, w in part.items()}
        torch.save({"start": start, "losses": losses, "norms": norms, "eval": evaluation, "weights": merged,
                    "shares": [s for _, s in gathered]}, out)
    pipe.close()


def main() -> None:
    import faulthandler

    if os.environ.get("GP_DUMP"):  # debugging a stuck job: every thread's stack after that many seconds
        faulthandler.dump_traceback_later(int(os.environ["GP_DUMP"]), exit=True)
    steps, out_dir, plans = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    _count_regathered()
    _GatherLog.install()
    for item in plans:
        plan, *rest = item.split(",")
        options = dict(kv.split("=", 1) for kv in rest)
        name = os.path.splitext(os.path.basename(plan))[0]
        out = os.path.join(out_dir, name + ("_" + options["precision"] if "precision" in options else "") + ".pt")
        train(plan, int(options.get("steps", steps)), out, options.get("save"), options.get("load"),
              meta=options.get("meta") == "1", precision=options.get("precision", "fp32"),
              resume=options.get("resume"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
