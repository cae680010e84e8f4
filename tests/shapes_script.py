"""Run under torchrun (3 ranks) by tests/test_shapes.py: train each model of tests/shapes_models.py through
graphpipe.Pipeline on batches whose lengths change every step and a last partial batch, evaluate at a new
shape, and write rank 0's losses, final weights and evaluation per model to OUT.pt.

    torchrun --nproc-per-node 3 tests/shapes_script.py OUT.pt
"""

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shapes_models as sm  # noqa: E402

import graphpipe  # noqa: E402
from graphpipe.errors import GraphpipeError  # noqa: E402

SPEC = os.path.join(HERE, "shapes_models.py")
LR = 0.1


def plans():
    """Hand-cut plans (the planner would keep such small models on one device): stage op groups, devices,
    micro-batch sizes."""
    return {
        # a replicated consumer with micro-batches twice the producer's: pieces split and joined per batch
        "chain": ((["embed", "pos", "block1.0"], ["block2.0", "head"]), [(0,), (1, 2)], [2, 4]),
        "branchy": ((["text", "text_block.0"], ["tags", "tags_block.0"], ["head"]), [(0,), (1,), (2,)], [2, 2, 4]),
        "hf_bert": ((["bert.embeddings.word_embeddings", "bert.embeddings.token_type_embeddings",
                      "bert.embeddings.position_embeddings", "bert.encoder.layer.0"], ["bert.encoder.layer.1"],
                     ["bert.pooler.dense", "classifier"]), [(0,), (1,), (2,)], [2, 2, 2]),
        "patches": ((["embed"], ["block.0", "head"]), [(0, 1), (2,)], [4, 2]),
        "pinned": ((["embed"], ["head"]), [(0,), (1,)], [2, 2]),
        # the value crossing the cut has a data-dependent length per micro-batch: its size travels ahead of it
        "trimmed": ((["embed", "block.0", "mix"], ["head.proj"]), [(0,), (1, 2)], [4, 4]),
    }


def hand_built(name, groups, devices, mbs):
    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.plan import Plan
    from graphpipe.sched.generators import make_schedule
    from graphpipe.stages import Stage, StageGraph

    spec = f"{SPEC}:{name}"
    graph = load_model(spec).graph
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), tuple(devs), mb)
              for i, (ops, devs, mb) in enumerate(zip(groups, devices, mbs))]
    n = max(3, 1 + max(d for devs in devices for d in devs))
    sg = StageGraph.build(graph, stages, sm.BATCH, n)
    cluster = preset("cpu", n)
    return Plan(model=spec, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("1f1b", sg, cluster))


def steps(name):
    """(inputs, target) per step: lengths that change every step, then a partial batch of 5 rows."""
    if name == "chain":
        return [(sm.tokens(i, r, n), sm.tokens(i, r, n, salt=1)) for i, (r, n) in
                enumerate([(8, 12), (8, 7), (8, 20), (5, 9)])]
    if name == "branchy":
        return [((sm.tokens(i, r, n), sm.tokens(i, r, m, salt=2)), sm.classes(i, r)) for i, (r, n, m) in
                enumerate([(8, 10, 5), (8, 6, 9), (8, 14, 3), (5, 8, 4)])]
    if name == "trimmed":
        return [(sm.padded_tokens(i, r, n), sm.classes(i, r)) for i, (r, n) in enumerate([(8, 12), (8, 7), (5, 9)])]
    if name == "patches":
        return [(sm.patch_batch(i, r, n), sm.classes(i, r)) for i, (r, n) in enumerate([(8, 9), (8, 4), (8, 16), (6, 5)])]
    return [({"input_ids": sm.tokens(i, r, n), "attention_mask": sm.mask(i, r, n)}, sm.classes(i, r))
            for i, (r, n) in enumerate([(8, 12), (8, 7), (8, 20), (5, 9)])]


def evaluation_inputs(name):
    if name == "chain":
        return sm.tokens(99, 3, 15)
    if name == "branchy":
        return (sm.tokens(99, 3, 11), sm.tokens(99, 3, 2, salt=2))
    if name == "patches":
        return sm.patch_batch(99, 3, 25)
    if name == "trimmed":
        return sm.padded_tokens(99, 3, 15)
    return {"input_ids": sm.tokens(99, 3, 15), "attention_mask": sm.mask(99, 3, 15)}


def main() -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # one group for every case's Pipeline
    out = {}
    loss_of = {"chain": sm.token_loss, "branchy": sm.class_loss, "hf_bert": sm.hf_loss, "pinned": sm.class_loss,
               "patches": sm.class_loss, "trimmed": sm.class_loss}
    only = os.environ.get("SHAPES_ONLY")  # a comma-separated subset, to debug one case
    for name, (groups, devices, mbs) in plans().items():
        if only and name not in only.split(","):
            continue
        plan = hand_built(name, groups, devices, mbs)
        model = getattr(sm, name)()[0]
        pipe = graphpipe.Pipeline(plan, model, loss_of[name], timeout_s=120, idle_ranks=True)
        if name == "pinned":
            try:
                pipe.step(sm.tokens(0, sm.BATCH, 9), sm.classes(0, sm.BATCH))
                out[name] = {"refusal": None}
            except GraphpipeError as exc:
                out[name] = {"refusal": str(exc)}
            pipe.close()
            continue
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        losses = []
        for inputs, target in steps(name):
            losses.append(float(pipe.step(inputs, target)))
            opt.step()
            opt.zero_grad()
        evaluation = pipe.forward(evaluation_inputs(name))
        weights = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, weights)
        if pipe.rank == 0:
            merged = {}
            for w in gathered:
                merged.update(w)
            out[name] = {"losses": losses, "eval": evaluation, "weights": merged}
        pipe.close()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
