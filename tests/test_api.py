"""The training API (``graphpipe.Pipeline``) under torchrun on CPU ranks.

Oracle: plain single-process PyTorch training of the same model on the same data with the same AdamW, global
gradient clipping and StepLR (the model has no dropout or BatchNorm, so the two are the same algorithm): per-step
losses, gradient norms, final weights and an evaluation forward equal at fp32 tolerances.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "api_script.py")
SPEC = os.path.join(HERE, "api_models.py") + ":branchy"
sys.path.insert(0, HERE)
import api_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(tmp_path, strategy: str, devices: int = 3) -> str:
    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.plan import write_plan
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    source = load_model(SPEC)
    plan = make_plan(source.model_id, source.graph, preset("v100", devices), api_models.BATCH, strategy,
                     SearchOptions(micro_batch_size=2))
    assert plan.stage_graph.num_stages > 1 or any(s.num_replicas > 1 for s in plan.stage_graph.stages)
    path = str(tmp_path / f"{strategy}.json")
    write_plan(path, plan)
    return path


def torchrun(plan: str, out: str, steps: int, *extra: str, ranks: int = 3, check: bool = True, script: str = SCRIPT):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(_port()), script, plan, out, str(steps), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def reference(steps: int):
    torch.manual_seed(0)
    model = api_models.TwoBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses, norms = [], []
    for step in range(steps):
        x, y = api_models.data(step)
        loss = api_models.loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        model.eval()
        evaluation = model(api_models.data(999)[0])
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}, evaluation


def assert_same(got: dict, ref, steps: int) -> None:
    losses, norms, weights, evaluation = ref
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64), torch.tensor(losses[-steps:], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64), torch.tensor(norms[-steps:], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert set(got["weights"]) == set(weights)
    for name, w in weights.items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["eval"], evaluation, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gpp", "pipedream", "gpipe"])
def test_training_through_the_api_equals_single_process_training(tmp_path, strategy):
    plan = _plan(tmp_path, strategy)
    out = str(tmp_path / "out.pt")
    torchrun(plan, out, 4)
    assert_same(torch.load(out, weights_only=False), reference(4), 4)


@pytest.mark.slow
def test_checkpoint_resume_equals_straight_training_and_loads_into_another_plan(tmp_path):
    gpp, pipedream = _plan(tmp_path, "gpp"), _plan(tmp_path, "pipedream")
    ckpt = str(tmp_path / "ckpt")
    first, second, third = (str(tmp_path / f"{n}.pt") for n in ("first", "second", "third"))
    torchrun(gpp, first, 3, "--save", ckpt)
    assert os.path.isdir(ckpt) and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    torchrun(gpp, second, 3, "--load", ckpt, "--resume-at", "3")  # a fresh torchrun: equal to 6 steps straight
    ref = reference(6)
    assert_same(torch.load(second, weights_only=False), ref, 3)
    torchrun(pipedream, third, 3, "--load", ckpt, "--resume-at", "3")  # another partition of the same model
    assert_same(torch.load(third, weights_only=False), ref, 3)


def _seed_checkpoint(tmp_path, fmt: str) -> str:
    """The reference's initial weights (seed 0) saved by one process as a plain state dict."""
    torch.manual_seed(0)
    state = api_models.TwoBranch().state_dict()
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        path = str(tmp_path / "seed-dcp")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = str(tmp_path / "seed.safetensors")
        save_file(state, path)
    else:  # a Hugging Face save_pretrained folder, sharded: two files and the index naming them
        import json

        from safetensors.torch import save_file

        path = str(tmp_path / "seed-hf")
        os.makedirs(path)
        names = sorted(state)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in halves.items():
            save_file({k: state[k] for k in keys}, os.path.join(path, file))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}, fh)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "hf-sharded"])
def test_a_meta_model_from_a_seed_checkpoint_trains_like_one_process(tmp_path, fmt):
    """Every rank builds the model on the meta device and loads only its stages from a checkpoint that one
    process wrote from the plain model: training equals single-process training from those weights, and no rank
    ever gives storage to a tensor of a stage it does not host."""
    plan = _plan(tmp_path, "gpp")
    out = str(tmp_path / "out.pt")
    torchrun(plan, out, 3, "--meta", "--load", _seed_checkpoint(tmp_path, fmt))
    got = torch.load(out, weights_only=False)
    assert_same(got, reference(3), 3)
    every = {n for n, _ in api_models.TwoBranch().named_parameters()}
    for rank, (allocated, hosted, made) in enumerate(got["memory"]):
        assert allocated == hosted, (rank, allocated, hosted)
        assert not made, (rank, made)  # building the Pipeline (the plan's own model spec too) allocated no weights
    assert set().union(*(set(h) for _, h, _ in got["memory"])) == every
    assert all(len(h) < len(every) for _, h, _ in got["memory"])  # each rank holds a part of the model


def test_bad_inputs_are_clear_errors(tmp_path):
    """In one process (a world of one rank): a batch larger than the plan's or too small to give each micro-batch a
    row, missing target, a checkpoint of another model."""
    import torch.distributed as dist

    from graphpipe.errors import InputError
    from graphpipe.runtime.api import Pipeline

    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.plan import write_plan
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    source = load_model(SPEC)
    p = make_plan(source.model_id, source.graph, preset("v100", 1), api_models.BATCH, "gpipe",
                  SearchOptions(micro_batch_size=4))
    plan = str(tmp_path / "one.json")
    write_plan(plan, p)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1")
    try:
        torch.manual_seed(0)
        pipe = Pipeline(plan, api_models.TwoBranch(), api_models.loss_fn, timeout_s=30)
        x, y = api_models.data(0)
        with pytest.raises(InputError, match="mini-batch of 24 rows, but the plan is for batch size 12"):
            pipe.step(torch.cat([x, x]), torch.cat([y, y]))
        with pytest.raises(InputError, match=r"partial mini-batch of 2 rows, but the plan cuts its batch into 3 "
                                             r"micro-batch shards.*drop_last=True"):
            pipe.step(x[:2], y[:2])
        with pytest.raises(InputError, match="the loss takes a target"):
            pipe.step(x)
        assert pipe.step(x, y) > 0
        stray = torch.optim.SGD(list(pipe.parameters()) + [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        with pytest.raises(InputError, match="does not own: build it from pipe.parameters"):
            pipe.save(str(tmp_path / "c"), optimizer=stray)
        other = tmp_path / "other"
        import torch.distributed.checkpoint as dcp

        dcp.save({"model/some.weight": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(str(other)))
        with pytest.raises(InputError, match=r"does not fit this model: \d+ tensor\(s\) missing: model/"):
            pipe.load(str(other))
        pipe.close()  # the Pipeline created the group: close ends it
        assert not dist.is_initialized()
        with pytest.raises(InputError, match="this Pipeline was closed"):
            pipe.step(x, y)
        assert sum(p.numel() for p in pipe.parameters()) > 0  # its weights stay readable
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
        mine = Pipeline(plan, api_models.TwoBranch(), api_models.loss_fn, timeout_s=30)
        mine.close()  # the caller's group stays the caller's
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k in ("RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)


@pytest.mark.slow
def test_two_torchrun_nodes_of_two_ranks_train_like_one_process(tmp_path):
    """A 4-rank plan as two torchrun nodes of 2 ranks on localhost (c10d rendezvous): the multi-node path. The
    gpp plan's stages are replicated, so gradients are all-reduced across the two nodes."""
    plan = _plan(tmp_path, "gpp", devices=4)
    out = str(tmp_path / "out.pt")
    port = _port()
    procs, logs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"graphpipe-test-{port}", SCRIPT, plan, out, "3"]
        # output to files, not pipes: a node whose pipe nobody drains while the other is awaited would block
        logs.append(open(tmp_path / f"node{node}.log", "w+"))
        procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    deadline = time.monotonic() + 600
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    tails = []
    for node, (p, log) in enumerate(zip(procs, logs)):
        if p.poll() is None:  # still running at the deadline: the failure shows what each node printed
            p.kill()
            p.wait()
        log.seek(0)
        tails.append(f"node {node} (exit {p.returncode}):\n{log.read()[-2000:]}")
        log.close()
    assert all(p.returncode == 0 for p in procs), "\n".join(tails)
    assert_same(torch.load(out, weights_only=False), reference(3), 3)


@pytest.mark.slow
def test_digits_example_reaches_the_single_process_accuracy(tmp_path):
    """examples/digits.py: 4 CPU ranks through a gpp plan (the two branches on two devices) against the same
    training in one process: per-epoch losses equal to fp32 tolerance, the same test accuracy."""
    pytest.importorskip("sklearn")
    import json

    example = os.path.join(os.path.dirname(HERE), "examples", "digits.py")
    plan = str(tmp_path / "digits.json")
    proc = subprocess.run([sys.executable, "-m", "graphpipe", "plan", f"{example}:factory", "--devices", "4",
                           "--batch-size", "64", "--micro-batch-size", "16", "--out", plan],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(open(plan).read())
    stages = doc["stages"]
    assert len(stages) >= 2
    pipe, single = str(tmp_path / "pipe.json"), str(tmp_path / "single.json")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
                          "127.0.0.1", "--master-port", str(_port()), example, "train", plan, "--epochs", "2",
                          "--out", pipe], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run([sys.executable, example, "single", "--epochs", "2", "--out", single],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = (json.loads(open(p).read()) for p in (pipe, single))
    torch.testing.assert_close(torch.tensor(a["loss"]), torch.tensor(b["loss"]), rtol=1e-5, atol=1e-6)
    assert a["accuracy"] == b["accuracy"] > 0.8
