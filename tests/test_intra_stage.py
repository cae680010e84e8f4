"""FSDP and tensor-parallel stages (graphpipe/runtime/intra_stage.py) under torchrun on CPU ranks (gloo).

Oracle: plain single-process training of the same model on the same data with the same SGD (momentum): per-step
losses and final weights equal at fp32 tolerances. The plans are written by hand, as a person edits a plan's
devices, tp and shard per stage: an FSDP stage, TP stages of a plain MLP (column/row pairs found in the captured
graph) and of a Hugging Face Llama (its base_model_tp_plan, heads split by KV group), a branchy model whose
branches take different layouts, a chain mixing whole-copy replicas with a TP stage, and a checkpoint written
under one layout loaded under another; TP stages sequence parallel, whose saved activations shrink by a hand count;
round-robin stages FSDP-sharded over their replicas (gathered for the step), under B and split-backward schedules,
and one such stage checkpointed after a step and resumed (Pipeline.save(step=), Pipeline.resume), going on as the
uninterrupted run does. A stage gathered for the step is seen to start its one all-gather of the step before its
first forward.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import intra_stage_models as models  # noqa: E402
from test_api import torchrun  # noqa: E402

SCRIPT = os.path.join(HERE, "intra_stage_script.py")
SPEC = os.path.join(HERE, "intra_stage_models.py")
pytestmark = pytest.mark.usefixtures("one_thread")


def oracle(factory: str, steps: int, start: dict | None = None):
    model, x, loss_fn, y = getattr(models, factory)()
    if start is not None:
        model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        evaluation = model.eval()(x)
    return losses, {n: p.detach() for n, p in model.named_parameters()}, evaluation, norms


RR = {"replica_mode": "round-robin", "reshard_after_forward": False}
"""A stage's fields for round-robin replicas FSDP-sharded over them, gathered for the step."""


def write(tmp_path, name: str, factory: str, stages, **kw) -> str:
    from graphpipe.plan import write_plan

    path = str(tmp_path / f"{name}.json")
    write_plan(path, models.hand_plan(f"{SPEC}:{factory}", stages, **kw))
    return path


def actions(path: str) -> list[list[str]]:
    from graphpipe.plan import read_plan

    return [[str(a) for a in acts] for acts in read_plan(path).schedule.device_actions]


def check(out: str, factory: str, steps: int) -> dict:
    got = torch.load(out, weights_only=False)
    losses, weights, evaluation, norms = oracle(factory, steps)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses))
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(norms))  # each parameter counted once
    torch.testing.assert_close(got["eval"], evaluation)  # Pipeline.forward runs each stage on its whole group
    assert set(got["weights"]) == set(weights)
    for name, w in weights.items():
        torch.testing.assert_close(got["weights"][name], w, msg=name)
    return got


def test_fsdp_tp_and_mixed_layouts_train_as_one_process(tmp_path):
    """One job of 4 ranks, hand-written plans: TP and FSDP together (2-D) on an MLP and a Llama; FSDP, TP,
    replicas + TP on a chain; TP and FSDP branches; TP for a meta-device model loaded from a plain seed
    checkpoint; round-robin FSDP stages, one of them stopped after step 2 and resumed from its step
    checkpoint (:func:`_check_round_robin_fsdp_resumed`)."""
    plans = [
        # 2-D: the whole MLP tp 2 inside each of 2 FSDP replicas, and the same tp 2 alone on two ranks; a Llama's
        # two decoder layers 2-D (its base_model_tp_plan, a row-wise layer's output all-reduced before the next)
        write(tmp_path, "tp_fsdp", "mlp_chain", [(("",), (0, 1, 2, 3), 2, "fsdp")]),
        write(tmp_path, "tp_whole", "mlp_chain", [(("",), (0, 1), 2, "none")], devices=4),
        write(tmp_path, "llama_2d", "llama", [(("",), (0, 1, 2, 3), 2, "fsdp")]),
        write(tmp_path, "fsdp", "mlp_chain", [(("stem", "block0"), (0,), 1, "none"), (("",), (1, 2), 1, "fsdp")]),
        write(tmp_path, "tp", "mlp_chain", [(("stem",), (0,), 1, "none"), (("",), (1, 2), 2, "none")]),
        # the same TP stage sequence parallel; the Llama's 2-D stage too
        write(tmp_path, "tp_sp", "mlp_chain", [(("stem",), (0,), 1, "none"), (("",), (1, 2), 2, "none")],
              sequence_parallel=True),
        write(tmp_path, "llama_2d_sp", "llama", [(("",), (0, 1, 2, 3), 2, "fsdp")], sequence_parallel=True),
        write(tmp_path, "chain", "mlp_chain", [(("stem", "block0"), (0, 1), 1, "none"), (("",), (2, 3), 2, "none")]),
        write(tmp_path, "branchy", "branchy", [(("stem", "right"), (0, 1), 2, "none"),
                                                (("left", "head"), (2, 3), 1, "fsdp")]),
        # round-robin FSDP stages, gathered for the step: replicas taking whole micro-batches in turn (2, 1 and 1
        # of 4 under graph-1f1b; 2 and 2 under zero bubble's split backward) each reduce-scatter after their own
        # last B or W; and 2 replicas of tp 2 (2-D) in turn
        write(tmp_path, "rr_fsdp", "mlp_chain", [(("stem",), (0,), 1, "none"), (("",), (1, 2, 3), 1, "fsdp", RR)],
              schedule="graph-1f1b", micro_batch_size=2),
        write(tmp_path, "rr_fsdp_zb", "mlp_chain", [(("stem", "block0"), (0,), 1, "none"),
                                                    (("",), (1, 2), 1, "fsdp", RR)], schedule="zb-h1",
              micro_batch_size=2),
        write(tmp_path, "rr_2d", "mlp_chain", [(("",), (0, 1, 2, 3), 2, "fsdp", RR)], micro_batch_size=2),
    ]
    # the same FSDP stage gathered once per step (reshard_after_forward false): one unit, gradients reduced at
    # the step's end
    import json
    import shutil

    with open(plans[3]) as f:
        doc = json.load(f)
    doc["stages"][1]["reshard_after_forward"] = False
    with open(tmp_path / "fsdp_step.json", "w") as f:
        json.dump(doc, f)
    plans.append(str(tmp_path / "fsdp_step.json"))
    # the same TP layout for a model built on the meta device, its weights from a plain seed checkpoint

    import torch.distributed.checkpoint as dcp

    seed = str(tmp_path / "seed")
    dcp.save(models.mlp_chain()[0].state_dict(), checkpoint_id=seed, no_dist=True)
    shutil.copy(plans[4], tmp_path / "tp_meta.json")
    plans.append(f"{tmp_path / 'tp_meta.json'},meta=1,load={seed}")
    # the round-robin FSDP plan again, in fresh Pipelines: 2 steps saving a step checkpoint, then resumed from it
    # for the third; and that checkpoint read by the 2-replica layout (rr_fsdp_zb's) for the third step
    rr_ck = tmp_path / "rr_ck"
    for name, source in (("rr_first", "rr_fsdp"), ("rr_resumed", "rr_fsdp"), ("rr_zb_loaded", "rr_fsdp_zb")):
        shutil.copy(tmp_path / f"{source}.json", tmp_path / f"{name}.json")
    plans += [f"{tmp_path / 'rr_first.json'},steps=2,resume={rr_ck}",
              f"{tmp_path / 'rr_resumed.json'},resume={rr_ck}",
              f"{tmp_path / 'rr_zb_loaded.json'},steps=1,load={rr_ck / 'step-2'}"]
    torchrun(str(3), str(tmp_path), *plans, ranks=4, script=SCRIPT)
    check(str(tmp_path / "tp_meta.pt"), "mlp_chain", 3)
    fsdp = check(str(tmp_path / "fsdp.pt"), "mlp_chain", 3)
    step = check(str(tmp_path / "fsdp_step.pt"), "mlp_chain", 3)
    plain = check(str(tmp_path / "tp.pt"), "mlp_chain", 3)
    sequence = check(str(tmp_path / "tp_sp.pt"), "mlp_chain", 3)
    check(str(tmp_path / "llama_2d_sp.pt"), "llama", 3)
    # sequence parallelism, by hand: the TP stage (block0, block1, head) takes h whole (a micro-batch of 4 samples
    # x 16 floats, 256 bytes). h is the residual stream (block0's row-wise output is added to it), so each device
    # keeps its half of the tokens (the samples, for a 2-D tensor) from the start, and block0's row-wise layer
    # reduce-scatters into the same split: block0's and block1's column-wise layers, which gather their inputs but
    # keep this device's half for backward, and the head, which runs on the split tokens, each save 128 bytes
    # instead of 256; 3 x 128 bytes less per micro-batch on each TP rank, 2 micro-batches, the rest the same
    assert [s["saved"] for s in sequence["shares"]] == [plain["shares"][0]["saved"]] + \
        [p["saved"] - 3 * 128 * 2 for p in plain["shares"][1:3]] + [plain["shares"][3]["saved"]]
    check(str(tmp_path / "chain.pt"), "mlp_chain", 3)
    branchy = check(str(tmp_path / "branchy.pt"), "branchy", 3)
    check(str(tmp_path / "llama_2d.pt"), "llama", 3)
    # 2-D: each rank holds half of its TP rank's share (FSDP over the 2 replicas, up to FSDP's padding)
    two_d, tp_only = check(str(tmp_path / "tp_fsdp.pt"), "mlp_chain", 3), check(str(tmp_path / "tp_whole.pt"),
                                                                              "mlp_chain", 3)
    for share in two_d["shares"]:
        assert abs(share["params"] - tp_only["shares"][0]["params"] / 2) <= 16
        assert share["grads"] == share["params"] == share["optim"]
    # each rank of a sharded stage holds about half of that stage's parameters, gradients and optimizer state
    model = models.MLPChain()
    stage = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("stem", "block0")))
    for share in fsdp["shares"][1:3] + step["shares"][1:3]:
        assert abs(share["params"] - stage / 2) <= 16 and share["grads"] == share["params"] == share["optim"]
    # resharding after forward, a rank gathers one op's weights at a time (FSDP units per op: the largest op's,
    # block1.0's 16x32 linear); gathering once per step, the whole stage's
    named = dict(model.named_parameters())
    ops = [o for o in doc["stages"][1]["ops"]]
    largest = max(sum(p.numel() for n, p in named.items() if n.startswith(op + ".")) for op in ops)
    assert largest == 16 * 32 + 32
    assert [s["gathered"] for s in fsdp["shares"][1:3]] == [largest, largest]
    assert [s["gathered"] for s in step["shares"][1:3]] == [stage, stage]
    assert branchy["shares"][0]["params"] < sum(p.numel() for p in models.Branchy().parameters()) / 2
    # gathered for the step, the all-gather starts at the step's start, before the stage's first forward, and
    # that forward waits for it instead of gathering again: one per step; per-op units gather in their forwards
    assert [(s["early_gathers"], s["gathers"]) for s in step["shares"][1:3]] == [([1] * 3, [1] * 3)] * 2
    assert [s["early_gathers"] for s in fsdp["shares"][1:3]] == [[0] * 3] * 2
    _check_round_robin_fsdp(tmp_path, model)
    _check_round_robin_fsdp_resumed(tmp_path)


def _check_round_robin_fsdp(tmp_path, model) -> None:
    """The round-robin FSDP stages of test_fsdp_tp_and_mixed_layouts_train_as_one_process: as one process, each
    replica with its share of the stage, the whole stage gathered once per step, at the step's start."""
    # the replicas run different micro-batches (a whole-copy reduce would not make them train as one process)
    assert [a for a in actions(str(tmp_path / "rr_fsdp.json"))[1:]] == [["1F0", "1B0", "1F3", "1B3"],
                                                                        ["1F1", "1B1"], ["1F2", "1B2"]]
    assert actions(str(tmp_path / "rr_fsdp_zb.json"))[1][:4] == ["1F0", "1I0", "1F2", "1W0"]
    assert actions(str(tmp_path / "rr_2d.json"))[1] == ["0F0", "0B0", "0F2", "0B2"] != actions(
        str(tmp_path / "rr_2d.json"))[2]
    named = dict(model.named_parameters())
    for name, ranks, prefixes in (("rr_fsdp", (1, 2, 3), ("stem",)), ("rr_fsdp_zb", (1, 2), ("stem", "block0")),
                                  ("rr_2d", (0, 1, 2, 3), ())):
        got = check(str(tmp_path / f"{name}.pt"), "mlp_chain", 3)
        stage = sum(p.numel() for n, p in named.items() if not n.startswith(prefixes))
        shares = [got["shares"][r] for r in ranks]
        assert [(s["early_gathers"], s["gathers"]) for s in shares] == [([1] * 3, [1] * 3)] * len(ranks), name
        assert all(s["grads"] == s["params"] == s["optim"] for s in shares), name
        assert [s["gathered"] for s in shares] == [stage] * len(ranks), name
        if name != "rr_2d":  # FSDP over every replica: each holds its rows of every parameter (dim 0 cut in n)
            n = len(ranks)
            most = sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) for k, p in named.items()
                       if not k.startswith(prefixes))
            assert sum(s["params"] for s in shares) == stage and max(s["params"] for s in shares) <= most, name


def _check_round_robin_fsdp_resumed(tmp_path) -> None:
    """``rr_fsdp``'s round-robin FSDP stage (3 replicas taking micro-batches in turn, each holding its rows of the
    stage: 11, 11 and 10 of a 32-row weight, 1 of the head's 3), stopped after step 2 and resumed: a step
    checkpoint (Pipeline.save(step=2): each replica writes its shards and their momentum) read by a fresh
    Pipeline's resume, each replica taking its own rows back, ends step 3 with the uninterrupted run's loss, norm,
    weights and evaluation, and one process's; the checkpoint holds one process's weights after 2 steps, and
    read by the 2-replica layout (shards cut in 2) it trains on the same.

    What those comparisons catch, by the oracle: a resume that restored nothing would start from step 0's
    weights; one that lost the momentum, or gave two replicas each other's rows, takes another step 3."""
    from graphpipe.runtime.checkpoint import load_into_module

    straight = torch.load(str(tmp_path / "rr_fsdp.pt"), weights_only=False)
    first, resumed, loaded = (torch.load(str(tmp_path / f"{k}.pt"), weights_only=False)
                              for k in ("rr_first", "rr_resumed", "rr_zb_loaded"))
    losses, weights, evaluation, norms = oracle("mlp_chain", 3)
    assert (first["start"], len(first["losses"]), resumed["start"], len(resumed["losses"])) == (0, 2, 2, 1)
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(straight["losses"][:2]))
    for got in (resumed, loaded):
        for want in (straight, {"losses": losses, "norms": norms, "eval": evaluation, "weights": weights}):
            torch.testing.assert_close(got["losses"][0], want["losses"][2])
            torch.testing.assert_close(got["norms"][0], want["norms"][2])
            torch.testing.assert_close(got["eval"], want["eval"])
            assert set(got["weights"]) == set(want["weights"])
            for name, w in want["weights"].items():
                torch.testing.assert_close(got["weights"][name], w, msg=name)
    # the step-2 checkpoint, read whole by one process: one process's weights after 2 steps
    saved = models.MLPChain()
    load_into_module(saved, tmp_path / "rr_ck" / "step-2")
    at_two = {n: p.detach() for n, p in saved.named_parameters()}
    for name, w in oracle("mlp_chain", 2)[1].items():
        torch.testing.assert_close(at_two[name], w, msg=name)
    # the controls: each failure the comparisons above would see
    with pytest.raises(AssertionError):  # nothing restored: step 0's weights
        torch.testing.assert_close(losses[0], losses[2])
    fresh = oracle("mlp_chain", 1, start=at_two)[1]  # the weights without their momentum
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fresh, weights)
    swapped = {n: _swap_shards(w) if not n.startswith("stem") else w for n, w in at_two.items()}
    with pytest.raises(AssertionError):  # ranks 1 and 2, its first two replicas, holding each other's rows
        torch.testing.assert_close(oracle("mlp_chain", 1, start=swapped)[0][0], losses[2])


def _swap_shards(w: torch.Tensor, replicas: int = 3) -> torch.Tensor:
    """``w`` with the first two of FSDP's ``replicas`` dim-0 shards (``ceil(rows / replicas)`` rows each)
    swapped: what a rank reading another replica's rows back would hold."""
    rows = -(-w.shape[0] // replicas)
    return torch.cat([w[rows:2 * rows], w[:rows], w[2 * rows:]])


def test_llama_tp_and_a_checkpoint_across_layouts(tmp_path):
    """One job of 3 ranks: a tiny HF Llama whose first stage, the embedding and both decoder layers, is TP 2 (its
    base_model_tp_plan, 4 heads and 2 KV heads split by KV group); a whole GPT-2 TP 2 (its Conv1D pairs from the
    graph); an FSDP plan's checkpoint (weights and momentum) loaded by a TP plan, which goes on
    training as one process would have. GPT-2's embedding is tied to its head: split across a TP 2 stage and a
    whole one, and across a whole stage and an FSDP one, the copies' gradients are summed whole and each device
    keeps its piece (the global norm counts the parameter once); the FSDP plan's checkpoint loads into the TP
    one, which goes on as one process would; and two ranks hosting a whole-copy stage beside a TP stage
    reduce each stage's gradients its own way."""
    llama = write(tmp_path, "llama", "llama", [(("model.model.embed", "model.model.layers."), (0, 1), 2, "none"),
                                               (("",), (2,), 1, "none")])
    fsdp = write(tmp_path, "fsdp", "mlp_chain", [(("stem", "block0"), (0,), 1, "none"), (("",), (1, 2), 1, "fsdp")])
    tp = write(tmp_path, "tp", "mlp_chain", [(("stem",), (0,), 1, "none"), (("",), (1, 2), 2, "none")])
    llama_fsdp = write(tmp_path, "llama_fsdp", "llama", [(("model.model.embed", "model.model.layers.0"), (0, 1), 1,
                                                          "fsdp"), (("",), (2,), 1, "none")])
    gpt2 = write(tmp_path, "gpt2", "gpt2", [(("",), (0, 1), 2, "none")], devices=3)
    # the same Llama and GPT-2 stages sequence parallel
    llama_sp = write(tmp_path, "llama_sp", "llama", [(("model.model.embed", "model.model.layers."), (0, 1), 2,
                                                      "none"), (("",), (2,), 1, "none")], sequence_parallel=True)
    gpt2_sp = write(tmp_path, "gpt2_sp", "gpt2", [(("",), (0, 1), 2, "none")], devices=3, sequence_parallel=True)
    # and keeping the gathered inputs whole for backward instead of gathering them again
    llama_keep = write(tmp_path, "llama_keep", "llama", [(("model.model.embed", "model.model.layers."), (0, 1), 2,
                                                          "none"), (("",), (2,), 1, "none")], sequence_parallel=True,
                       keep_gathered=True)
    # with dropout on: the sequence-parallel stage draws the masks one device draws (over the whole tokens)
    drop_sp = write(tmp_path, "drop_sp", "gpt2_dropout", [(("",), (0, 1), 2, "none")], devices=3,
                    sequence_parallel=True)
    drop_one = write(tmp_path, "drop_one", "gpt2_dropout", [(("",), (0,), 1, "none")], devices=3)
    drop_keep = write(tmp_path, "drop_keep", "gpt2_dropout", [(("",), (0, 1), 2, "none")], devices=3,
                      sequence_parallel=True, keep_gathered=True)  # and keeping the fused c_attn's input whole
    front = ("model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0")
    tie_tp = write(tmp_path, "tie_tp", "gpt2", [(front, (0, 1), 2, "none"), (("",), (2,), 1, "none")])
    tie_fsdp = write(tmp_path, "tie_fsdp", "gpt2", [(front, (0,), 1, "none"), (("",), (1, 2), 1, "fsdp")])
    write(tmp_path, "tie_resumed", "gpt2", [(front, (0, 1), 2, "none"), (("",), (2,), 1, "none")])
    # devices 0 and 1 host a whole-copy stage and a TP stage (shared devices): each reduces its own gradients
    # (the whole copies' all-reduce ran on the TP stage's DTensor gradients too and crashed)
    shared = write(tmp_path, "tie_shared", "gpt2", [(front, (0, 1), 1, "none"), (("model.transformer.h.1",), (2,), 1,
                   "none"), (("",), (0, 1), 2, "none")], schedule="gpipe", shared_devices=True)
    ck, tie_ck = str(tmp_path / "ck"), str(tmp_path / "tie_ck")
    torchrun("2", str(tmp_path), llama, llama_sp, llama_keep, f"{llama},steps=1,precision=bf16",
             f"{llama_sp},steps=1,precision=bf16", f"{llama_keep},steps=1,precision=bf16",
             llama_fsdp, gpt2, gpt2_sp, drop_sp, drop_one, drop_keep, f"{fsdp},save={ck}", f"{tp},steps=1,load={ck}",
             tie_tp,
             f"{tie_fsdp},save={tie_ck}", f"{tmp_path / 'tie_resumed.json'},steps=1,load={tie_ck}", shared, ranks=3,
             script=SCRIPT)
    check(str(tmp_path / "tie_tp.pt"), "gpt2", 2)
    check(str(tmp_path / "tie_shared.pt"), "gpt2", 2)
    check(str(tmp_path / "tie_fsdp.pt"), "gpt2", 2)
    resumed = torch.load(str(tmp_path / "tie_resumed.pt"), weights_only=False)
    losses, weights, evaluation, _ = oracle("gpt2", 3)
    torch.testing.assert_close(torch.tensor(resumed["losses"][0]), torch.tensor(losses[2]))  # fp32 tolerances
    for name, w in weights.items():
        torch.testing.assert_close(resumed["weights"][name], w, msg=name)
    # GPT-2's Conv1D layers (transposed weights) pair as column-then-row from the graph: each TP rank holds half
    # of every projection's weight and of the column-wise biases, the rest whole
    two = check(str(tmp_path / "gpt2.pt"), "gpt2", 2)
    named = dict(models.gpt2()[0].named_parameters())
    split = sum(p.numel() for n, p in named.items() if any(k in n for k in ("c_attn.", "c_proj.weight", "c_fc.")))
    assert [s["params"] for s in two["shares"][:2]] == [sum(p.numel() for p in named.values()) - split // 2] * 2
    got = check(str(tmp_path / "llama.pt"), "llama", 2)
    # sequence parallel, the same numbers; each TP rank keeps less for backward: the norms' and residuals' tokens
    # after layer 0's attention split, the column-wise layers' gathered inputs kept as this device's half
    sequence = check(str(tmp_path / "llama_sp.pt"), "llama", 2)
    assert all(s["saved"] < 0.85 * p["saved"] for s, p in zip(sequence["shares"][:2], got["shares"][:2]))
    assert sequence["shares"][2]["saved"] == got["shares"][2]["saved"]  # the whole-copy stage: unchanged
    # backward gathers each column-wise input again once, as forward gathered it (Megatron): per decoder layer one
    # for attention's q, k and v and one for the MLP's gate and up; 2 layers, 2 micro-batches of 4; none for plain TP
    assert [s["regathers"] for s in sequence["shares"]] == [2 * 2 * 2] * 2 + [0]
    assert [s["regathers"] for s in got["shares"]] == [0, 0, 0]
    # keeping the gathered inputs: the same numbers, no gather again, and each column-wise layer's saved input
    # whole where sequence parallelism keeps half: q, k, v, gate and up save one each (5), of a micro-batch of
    # 4 samples x 12 tokens x hidden 32 in fp32, 2 layers x 2 micro-batches; the whole-copy stage unchanged
    kept = check(str(tmp_path / "llama_keep.pt"), "llama", 2)
    assert [s["regathers"] for s in kept["shares"]] == [0, 0, 0]
    extra = [k["saved"] - s["saved"] for k, s in zip(kept["shares"], sequence["shares"])]
    assert extra == [2 * 2 * 5 * (4 * 12 * 32 * 4) // 2] * 2 + [0]
    # counted once per tensor stored, not per save: the two gathered inputs per layer (what the cost model
    # charges, TP_REBUILT_INPUTS: 4 of a block's 34 bytes per token and hidden unit, 2 per input)
    stored = [k["stored"] - s["stored"] for k, s in zip(kept["shares"], sequence["shares"])]
    assert stored == [2 * 2 * 2 * (4 * 12 * 32 * 4) // 2] * 2 + [0]
    # under bf16 autocast the inputs are gathered in bf16 (cast first): kept whole at 2 bytes, half the extra
    halves = [torch.load(str(tmp_path / f"{k}_bf16.pt"), weights_only=False)["shares"]
              for k in ("llama_sp", "llama_keep")]
    assert [k["stored"] - s["stored"] for k, s in zip(halves[1], halves[0])] == [n // 2 for n in stored]
    assert all(k["saved"] < p["saved"] for k, p in zip(kept["shares"][:2], got["shares"][:2]))
    # under bf16 autocast as well: the gathered inputs are kept as pieces (cast before the gather, so autocast's
    # cast for the layer makes no whole copy), so sequence parallelism saves at least the share it saves in fp32
    half = [torch.load(str(tmp_path / f"{k}_bf16.pt"), weights_only=False)["shares"][0]["saved"] for k in ("llama", "llama_sp")]
    assert half[1] / half[0] <= sequence["shares"][0]["saved"] / got["shares"][0]["saved"]
    fused = check(str(tmp_path / "gpt2_sp.pt"), "gpt2", 2)
    assert [s["regathers"] for s in fused["shares"]] == [2 * 2 * 2] * 2 + [0]  # c_attn and c_fc per layer
    dropped = [torch.load(str(tmp_path / f"drop_{k}.pt"), weights_only=False) for k in ("sp", "one", "keep")]
    torch.testing.assert_close(torch.tensor(dropped[0]["losses"]), torch.tensor(dropped[1]["losses"]))
    torch.testing.assert_close(torch.tensor(dropped[2]["losses"]), torch.tensor(dropped[1]["losses"]))
    assert [s["regathers"] for s in dropped[2]["shares"]] == [0, 0, 0]
    assert dropped[0]["losses"] != check(str(tmp_path / "gpt2.pt"), "gpt2", 2)["losses"]  # the masks drop
    for name, w in dropped[1]["weights"].items():
        torch.testing.assert_close(dropped[0]["weights"][name], w, msg=name)
        torch.testing.assert_close(dropped[2]["weights"][name], w, msg=name)
    # the same Llama's first stage FSDP over two ranks, one FSDP unit per op: a rank gathers one op's weights at
    # a time (at most the largest op's, the decoder layer here), never the whole stage's
    sharded = check(str(tmp_path / "llama_fsdp.pt"), "llama", 2)
    stage_ops = models.hand_plan(f"{SPEC}:llama", [(("model.model.embed", "model.model.layers.0"), (0, 1), 1, "fsdp"),
                                                   (("",), (2,), 1, "none")]).stage_graph
    ops = [stage_ops.graph.ops[i].name for i in stage_ops.stages[0].op_ids]
    per_op = [sum(p.numel() for n, p in models.llama()[0].named_parameters() if n.startswith(op + "."))
              for op in ops]
    assert [s["gathered"] for s in sharded["shares"][:2]] == [max(per_op)] * 2
    assert max(per_op) < sum(per_op)  # the decoder layer (9,280) of the stage's 11,328
    named = dict(models.llama()[0].named_parameters())
    split = sum(p.numel() for n, p in named.items() if ".layers." in n and n.endswith("proj.weight"))
    whole = sum(p.numel() for n, p in named.items() if "lm_head" not in n) - split  # the final norm: layers.1's
    # each TP rank: half of every projection, the embedding and the norms whole
    assert got["shares"][0]["params"] == got["shares"][1]["params"] == whole + split // 2
    check(str(tmp_path / "fsdp.pt"), "mlp_chain", 2)
    resumed = torch.load(str(tmp_path / "tp.pt"), weights_only=False)
    losses, weights, evaluation, _ = oracle("mlp_chain", 3)
    torch.testing.assert_close(resumed["eval"], evaluation)
    torch.testing.assert_close(resumed["losses"][0], losses[2])
    for name, w in weights.items():
        torch.testing.assert_close(resumed["weights"][name], w, msg=name)


def test_a_tp_degree_the_heads_cannot_take_is_refused_naming_the_op():
    from graphpipe.errors import PlanError
    from graphpipe.runtime.intra_stage import tp_placements
    from graphpipe.runtime.stage_modules import split_model

    plan = models.hand_plan(f"{SPEC}:llama", [(("model.model.embed", "model.model.layers.0"), (0, 1, 2, 3), 4, "none"),
                                               (("",), (4,), 1, "none")])
    model = models.llama()[0]
    from graphpipe.frontend.capture import Granularity, trace_ops
    from graphpipe.runtime.runnable import plan_granularity

    exported, op_nodes, _ = trace_ops(model, models.llama()[1], models._next_token, models.llama()[3],
                                      Granularity.parse(plan_granularity(plan)))
    prog = split_model(exported.gm, op_nodes, plan.stage_graph).programs[0]
    with pytest.raises(PlanError, match=r"op model\.model\.layers\.0\.self_attn\.[kv]_proj .*num_key_value_heads is 2"):
        tp_placements(prog.module, dict(prog.param_names), 4, 0, model)


def test_graphpipe_run_check_passes_mixed_layouts():
    """``graphpipe run --check``'s path (run_plans, models built on meta and materialized per rank): a branchy
    model with a TP branch and an FSDP branch, a chain of whole-copy replicas then TP 2 under zero bubble's
    split backward, an FSDP stage and a TP stage re-materializing whole, zero bubble with FSDP gathered for the
    step (alone and 2-D), round-robin groups FSDP-sharded over all their replicas under zero bubble, and an FSDP
    stage resharding after forward under zero bubble refused in one line before any rank starts."""
    from dataclasses import replace

    from graphpipe.errors import InputError
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.sched.generators import make_schedule
    from graphpipe.stages import StageGraph

    branchy = models.hand_plan(f"{SPEC}:branchy", [(("stem", "right"), (0, 1), 2, "none"),
                                                    (("left", "head"), (2, 3), 1, "fsdp")])
    chain = models.hand_plan(f"{SPEC}:mlp_chain", [(("stem", "block0"), (0, 1), 1, "none"), (("",), (2, 3), 2, "none")],
                             schedule="zb-h1")
    # whole-stage re-materialization of an FSDP stage and of a TP stage (checkpoint segments are refused:
    # tests/test_stage_layout.py)
    recomputed = []
    for tp, shard in ((1, "fsdp"), (2, "none")):
        plan = models.hand_plan(f"{SPEC}:mlp_chain", [(("stem", "block0"), (0,), 1, "none"), (("",), (1, 2), tp, shard)])
        sg = plan.stage_graph
        sg = StageGraph.build(sg.graph, [sg.stages[0], replace(sg.stages[1], recompute=True)], sg.batch_size,
                              sg.num_devices)
        recomputed.append(replace(plan, stage_graph=sg, schedule=make_schedule("1f1b", sg)))
    # zero bubble's split backward with FSDP gathered for the step (the planner's FSDP), alone and 2-D with TP
    split = []
    for stages in ([(("stem", "block0"), (0,), 1, "none"), (("",), (1, 2), 1, "fsdp")],
                   [(("",), (0, 1, 2, 3), 2, "fsdp")]):
        plan = models.hand_plan(f"{SPEC}:mlp_chain", stages, schedule="zb-h1")
        sg = plan.stage_graph
        sg = StageGraph.build(sg.graph, [replace(s, reshard_after_forward=s.shard == "none") for s in sg.stages],
                              sg.batch_size, sg.num_devices)
        split.append(replace(plan, stage_graph=sg, schedule=make_schedule("zb-h1", sg)))
    # round-robin groups of 2 replicas splitting each micro-batch (split 2), FSDP over all 4, split backward
    groups = models.hand_plan(f"{SPEC}:mlp_chain", [(("",), (0, 1, 2, 3), 1, "fsdp", {**RR, "split": 2})],
                              micro_batch_size=2, schedule="zb-h1")
    assert [str(a) for a in groups.schedule.device_actions[2]][:3] == ["0F1", "0I1", "0W1"]
    options = RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=120)
    for result in run_plans([(p, options) for p in [branchy, chain, *recomputed, *split, groups]]):
        assert result.check.passed, result.check
    fsdp_zb = models.hand_plan(f"{SPEC}:mlp_chain", [(("stem", "block0"), (0,), 1, "none"), (("",), (1, 2), 1, "fsdp")],
                               schedule="zb-h1")
    with pytest.raises(InputError, match=r"^stage 1 is FSDP-sharded, resharding after forward, and the schedule "
                                         r"'zb-h1' splits its backward"):
        run_plans([(fsdp_zb, options)])


def test_round_robin_fsdp_with_work_after_its_last_backward_is_refused_naming_the_stage():
    """A round-robin FSDP stage sharing its devices with another stage whose actions come after its last backward
    there is refused before any rank starts (each replica's reduce-scatter waits for the others, which might
    wait for that work); with its last backward the device's last action, it runs (layout_refusal says None)."""
    from graphpipe.errors import InputError
    from graphpipe.runtime import RunOptions, layout_refusal, run_plans

    def plan(fsdp_first: bool):
        whole = {"replica_mode": "round-robin"}
        first, last = (RR, whole) if fsdp_first else (whole, RR)
        return models.hand_plan(f"{SPEC}:mlp_chain", [
            (("stem",), (0, 1), 1, "fsdp" if fsdp_first else "none", first), (("block0",), (2,), 1, "none"),
            (("",), (0, 1), 1, "none" if fsdp_first else "fsdp", last)],
            shared_devices=True, schedule="gpipe", micro_batch_size=2)

    assert layout_refusal(plan(fsdp_first=True)) is None  # stage 0's backward ends each device's step
    refused = plan(fsdp_first=False)
    assert [str(a) for a in refused.schedule.device_actions[0]][-3:] == ["2B2", "0B0", "0B2"]
    with pytest.raises(InputError, match=r"^stage 2 is round-robin and FSDP-sharded, and device 0 runs stage 0's B "
                                         r"of micro-batch 0 after the stage's last backward there: .*give the stage "
                                         r"devices of its own, or shard none$") as info:
        run_plans([(refused, RunOptions(steps=1, timeout_s=30))])
    assert "\n" not in str(info.value)


def _stage_graph(write: bool = False, view_of_weight: bool = False):
    """A hand-built stage module of three ops: op 0 ``y = a(x)``; op 1 ``z = b(x)``; op 2 ``c(tanh(y) + pad(z))``.
    ``write``: op 1 writes ``z`` into ``y``'s first columns in place instead (a slice ``copy_``), read by op 2.
    ``view_of_weight``: op 0 also hands op 2 ``a.weight.t()``, a view of its parameter."""
    import torch.fx as fx
    import torch.nn as nn

    from graphpipe.runtime.stage_modules import CTX_NAME

    torch.manual_seed(0)
    root = nn.Module()
    root.a, root.b, root.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 3)
    aten, g = torch.ops.aten, fx.Graph()
    x = g.placeholder("x")
    g.placeholder(CTX_NAME, default_value=None)
    attr = {n: g.get_attr(n) for n in ("a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias")}
    y = g.call_function(aten.linear.default, (x, attr["a.weight"], attr["a.bias"]))
    op_of = {y.name: 0}
    if view_of_weight:
        op_of[g.call_function(aten.t.default, (attr["a.weight"],)).name] = 0
    z = g.call_function(aten.linear.default, (x, attr["b.weight"], attr["b.bias"]))
    op_of[z.name] = 1
    if write:
        cols = g.call_function(aten.slice.Tensor, (y, 1, 0, 2))
        op_of[cols.name] = op_of[g.call_function(aten.copy_.default, (cols, z)).name] = 1
        h = g.call_function(aten.tanh.default, (y,))
    else:
        h = g.call_function(aten.add.Tensor, (g.call_function(aten.tanh.default, (y,)),
                                              g.call_function(aten.constant_pad_nd.default, (z, [0, 2]))))
    if view_of_weight:
        wt = next(n for n in g.nodes if n.target is aten.t.default)
        h = g.call_function(aten.mm.default, (h, wt))
    out = g.call_function(aten.linear.default, (h, attr["c.weight"], attr["c.bias"]))
    g.output(((h,), out))
    for n in g.nodes:
        if n.op == "call_function":
            op_of.setdefault(n.name, 2)
    return fx.GraphModule(root, g), op_of


def test_per_op_pieces_compute_the_stage_and_refuse_what_fsdp_cannot_cut():
    """The per-op cut of an FSDP stage (the pieces alone, no FSDP), run in order, computes what the stage module
    computes, values and gradients. A stage where one op writes in place into another op's output, or where a
    piece would hand on a view of a parameter (FSDP frees the gathered storage after the piece), is not cut:
    it stays one FSDP unit."""
    from graphpipe.runtime.intra_stage import _UnitChain, _fsdp_units

    gm, op_of = _stage_graph()
    units, assemble, gathers = _fsdp_units(gm, op_of)
    assert [sorted(p for o in owners for p, _ in o.named_parameters()) for _, _, owners in units] == \
        [["bias", "weight"]] * 3  # one unit per op, each owning its linear
    chain = _UnitChain([u[0] for u in units], [u[1] for u in units], assemble, gathers, ("x",))
    x, params = torch.randn(5, 4), list(gm.parameters())

    def run(fn):
        (h,), out = fn(x, None)
        return h.detach(), out.detach(), torch.autograd.grad(out.square().sum() + h.sum(), params)

    want, got = run(gm), run(chain)
    torch.testing.assert_close(got[:2], want[:2])
    for g_got, g_want in zip(got[2], want[2]):
        torch.testing.assert_close(g_got, g_want)
    assert _fsdp_units(*_stage_graph(write=True)) is None
    assert _fsdp_units(*_stage_graph(view_of_weight=True)) is None
