"""graphpipe: graph pipeline parallelism (GraphPipe, Jeon et al., ASPLOS'25).

Capture a branchy network as a DAG of ops, cut it into a *graph* of pipeline
stages, choose micro-batch sizes and a schedule, simulate the result and run
it for real on ``torch.distributed``.

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
__all__ = ["__version__", "Pipeline"]


def __getattr__(name: str):
    """``graphpipe.Pipeline``, the training API (:mod:`graphpipe.runtime.api`), imported on first use only:
    the core stays free of the runtime (and of torch.distributed) for planning."""
    if name == "Pipeline":
        from graphpipe.runtime.api import Pipeline

        return Pipeline
    raise AttributeError(f"module 'graphpipe' has no attribute {name!r}")
