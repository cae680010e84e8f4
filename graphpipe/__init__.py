"""graphpipe: graph pipeline parallelism (GraphPipe, Jeon et al., ASPLOS'25).

Capture a branchy network as a DAG of ops, cut it into a *graph* of pipeline
stages, choose micro-batch sizes and a schedule, simulate the result and run
it for real on ``torch.distributed``.

The front door (docs/api.md), each imported on first use so ``import graphpipe`` stays cheap and torch-free::

    plan = graphpipe.plan("mmt:small", devices=4, batch_size=32)   # graphpipe plan, as a function
    plan.simulate().throughput; plan.save("plan.json")             # graphpipe simulate; plan --out
    plan = graphpipe.load_plan("plan.json")
    pipe = graphpipe.Pipeline("plan.json", model, loss_fn)          # training, under torchrun

Glossary (names mean exactly this everywhere in the code):

op
    One layer-granularity node of an :class:`~graphpipe.graph.OpGraph`
    (a transformer block, an MLP layer, an embedding table). ``op_id`` is its
    index, ops are numbered in topological order.
stage
    A convex set of ops placed on a set of devices, with its own micro-batch
    size. ``stage_id`` indexes :attr:`StageGraph.stages`, also topological.
device
    One accelerator of the cluster, ``device_id`` in ``range(num_devices)``.
    Several devices on one stage = data parallelism inside the stage.
rank
    A process of the runtime. Rank ``r`` drives device ``r``; the two are
    never used interchangeably in the planning code.
mb
    Micro-batch. ``mb_id`` counts a stage's micro-batches; a stage with
    micro-batch size ``b`` has ``batch_size // b`` of them per iteration.
in-flight
    Micro-batches whose forward has run on a stage but whose backward has not
    (their activations are alive).
TPS
    Time per sample: a stage's compute time per micro-batch divided by the
    micro-batch size; the bottleneck TPS bounds pipeline throughput.
depth
    Number of stages on the longest source-to-sink path of the stage graph.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "plan", "load_plan", "Plan", "Pipeline"]

import sys as _sys
import types as _types


class _PlanModule(_types.ModuleType):
    """:mod:`graphpipe.plan` (the plan file's types) that is also the planning function: ``graphpipe.plan(model,
    devices=N, batch_size=B)`` calls :func:`graphpipe.search.api.plan`. One name for both because the module
    already held it; calling the module is the front door, ``from graphpipe.plan import Plan`` still works."""

    def __call__(self, model, /, **kwargs):
        from graphpipe.search.api import plan

        return plan(model, **kwargs)


class _Package(_types.ModuleType):
    """The package: whenever :mod:`graphpipe.plan` is bound to it (on import), that module becomes callable."""

    def __setattr__(self, name, value):
        if name == "plan" and isinstance(value, _types.ModuleType) and type(value) is _types.ModuleType:
            value.__class__ = _PlanModule
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
if "graphpipe.plan" in _sys.modules:  # imported already (never, from a fresh interpreter): bind it the same way
    plan = _sys.modules["graphpipe.plan"]


def __getattr__(name: str):
    """Imported on first use only, so ``import graphpipe`` stays cheap and torch-free:
    ``graphpipe.plan`` / ``load_plan`` / ``Plan``, the planning API (:mod:`graphpipe.search.api`), and
    ``graphpipe.Pipeline``, the training API (:mod:`graphpipe.runtime.api`)."""
    if name == "plan":
        import graphpipe.plan  # binds the callable module (``_Package.__setattr__``)

        return _sys.modules["graphpipe.plan"]
    if name in ("load_plan", "Plan"):
        from graphpipe.search import api

        return getattr(api, name)
    if name == "Pipeline":
        from graphpipe.runtime.api import Pipeline

        return Pipeline
    raise AttributeError(f"module 'graphpipe' has no attribute {name!r}")
