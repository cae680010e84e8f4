"""Runtime pieces that need no second process: stage cutting, routing, refusals, one-rank execution.

Oracles: the captured module's own output (stage programs chained in one
process must reproduce it exactly), the definition of a piece (rows of the
intersection of a producer shard and a consumer shard), and the
single-process loss and gradients (``RunOptions.check``) for plans whose
stages all live on one rank, which exercises the executor's local hand-over
with fan-out, per-stage micro-batch sizes and sequential relays.
"""

from __future__ import annotations

import random

import pytest
import torch

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.errors import PlanError
from graphpipe.plan import Plan, plan_to_dict, write_plan
from graphpipe.runtime.baseline import torch_refusal
from graphpipe.runtime.executor import flat_grad_buffer, zero_grads
from graphpipe.runtime.routing import Routing, edge_pieces
from graphpipe.runtime.stage_modules import check_op_names, split_model
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.runnable import load_runnable
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

SMALL = ("mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small")


def contiguous_stages(num_ops: int, num_stages: int, rng: random.Random) -> list[tuple[int, ...]]:
    """A random cut of the topological order into contiguous (hence convex) ranges."""
    cuts = sorted(rng.sample(range(1, num_ops), num_stages - 1))
    bounds = [0, *cuts, num_ops]
    return [tuple(range(bounds[i], bounds[i + 1])) for i in range(num_stages)]


def make_sg(graph, op_groups, devices, mbs, batch_size, num_devices, shared=False, sequential=False):
    stages = [Stage(i, ops, tuple(devs), mb) for i, (ops, devs, mb) in enumerate(zip(op_groups, devices, mbs))]
    return StageGraph.build(graph, stages, batch_size, num_devices, allow_shared_devices=shared, sequential=sequential)


def run_programs_in_order(split, sg, inputs):
    """Chain the stage programs on the whole batch in one process (no pipelining)."""
    values, out = {}, None
    for prog in split.programs:
        args = [inputs[dict(prog.model_inputs)[n]] if n in dict(prog.model_inputs) else values[n] for n in prog.input_names]
        sent, model_out = prog.module(*args)
        values.update(zip(prog.output_names, sent))
        if prog.is_sink:
            out = model_out
    return out


@pytest.mark.parametrize("spec", SMALL)
@pytest.mark.parametrize("sequential", [False, True])
def test_stage_programs_reproduce_the_module(spec, sequential):
    runnable = load_runnable(spec, seed=0)
    graph = zoo.load_graph(spec)
    inputs = runnable.make_inputs(4, 7)
    with torch.no_grad():
        expected = runnable.module(*inputs)
        rng = random.Random(hash((spec, sequential)) % 1000)
        for k in (2, min(4, graph.num_ops)):
            sg = make_sg(graph, contiguous_stages(graph.num_ops, k, rng), [(i,) for i in range(k)], [4] * k, 4, k,
                         sequential=sequential)
            split = split_model(runnable.gm, runnable.op_nodes, sg)
            torch.testing.assert_close(runnable.output(run_programs_in_order(split, sg, inputs)), expected, rtol=0, atol=0)
            # Each stage holds exactly the parameters of its own ops: together, every parameter once.
            names = [n for p in split.programs for n, _ in p.module.named_parameters()]
            assert sorted(names) == sorted(n for n, _ in runnable.module.named_parameters())
            if sequential:
                assert all(c == p + 1 for p in range(k) for c, _ in split.programs[p].send_values)


@pytest.mark.parametrize("spec", SMALL)
@pytest.mark.parametrize("sequential", [False, True])
def test_checkpoint_segments_reproduce_each_stage(spec, sequential):
    """Stages cut at random checkpoints: the segments run in order, each on stage inputs and earlier
    segments' values only, then ``assemble``, give exactly the stage module's output; a segment hands on
    (holds) no value the stage sends anyway."""
    from dataclasses import replace

    runnable = load_runnable(spec, seed=0)
    graph = zoo.load_graph(spec)
    inputs = runnable.make_inputs(4, 7)
    rng = random.Random(hash((spec, sequential, "segments")) % 1000)
    k = 2
    sg = make_sg(graph, contiguous_stages(graph.num_ops, k, rng), [(i,) for i in range(k)], [4] * k, 4, k,
                 sequential=sequential)
    stages = tuple(replace(st, recompute=True, checkpoints=tuple(rng.sample(st.op_ids[1:], min(2, len(st.op_ids) - 1))))
                   for st in sg.stages)
    sg = replace(sg, stages=stages)
    assert any(st.checkpoints for st in sg.stages), "premise: some stage has checkpoints"
    split = split_model(runnable.gm, runnable.op_nodes, sg)
    values = {}
    with torch.no_grad():
        for prog in split.programs:
            model_inputs = dict(prog.model_inputs)
            args = [inputs[model_inputs[n]] if n in model_inputs else values[n] for n in prog.input_names]
            expected = prog.module(*args)
            if not prog.segments:
                values.update(zip(prog.output_names, expected[0]))
                continue
            assert len(prog.segments) == len(sg.stages[prog.stage_id].checkpoints) + 1
            env = dict(zip(prog.input_names, args))
            for seg in prog.segments:
                assert set(seg.handed) <= set(seg.output_names) and not set(seg.handed) & set(prog.output_names)
                env.update(zip(seg.output_names, seg.module(*(env[n] for n in seg.input_names))))
            got = prog.assemble(*(env[n] for n in prog.gathers))
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            values.update(zip(prog.output_names, got[0]))


def test_sequential_plan_relays_skip_values():
    """twobranch cut after embed and after branch0: branch1 reads embed's output through stage 1."""
    runnable = load_runnable("twobranch:small")
    graph = zoo.load_graph("twobranch:small")
    ids = lambda *names: tuple(graph.op_id(n) for n in names)  # noqa: E731
    groups = [ids("embed"), ids("branch0.layer0", "branch0.layer1"), ids("branch1.layer0", "branch1.layer1", "concat", "head")]
    sg = make_sg(graph, groups, [(0,), (1,), (2,)], [2, 2, 2], 4, 3, sequential=True)
    split = split_model(runnable.gm, runnable.op_nodes, sg)
    relayed = set(split.programs[1].input_names) & set(split.programs[1].output_names)
    assert relayed and relayed <= set(split.programs[0].output_names)


@pytest.mark.parametrize("seed", range(40))
def test_edge_pieces_cover_each_sample_once_inside_both_shards(seed):
    rng = random.Random(seed)
    batch = rng.choice([8, 12, 16, 24])
    sizes = [b for b in range(1, batch + 1) if batch % b == 0]
    bp, bc = rng.choice(sizes), rng.choice(sizes)
    rp = rng.choice([r for r in (1, 2, 3, 4) if bp % r == 0])
    rc = rng.choice([r for r in (1, 2, 3, 4) if bc % r == 0])
    graph = zoo.load_graph("transformer:small")
    sg = make_sg(graph, [tuple(range(3)), tuple(range(3, graph.num_ops))], [tuple(range(rp)), tuple(range(rp, rp + rc))],
                 [bp, bc], batch, rp + rc)
    covered = []
    for piece in edge_pieces(sg, 0, 1):
        p_lo = piece.producer_mb * bp + piece.producer_replica * (bp // rp)
        c_lo = piece.consumer_mb * bc + piece.consumer_replica * (bc // rc)
        assert p_lo <= piece.lo < piece.hi <= p_lo + bp // rp
        assert c_lo <= piece.lo < piece.hi <= c_lo + bc // rc
        rows = piece.producer_rows
        assert rows.stop - rows.start == piece.hi - piece.lo == piece.consumer_rows.stop - piece.consumer_rows.start
        covered.extend(range(piece.lo, piece.hi))
    assert covered == list(range(batch))


def test_routing_sends_every_piece_once_per_value_and_direction():
    graph = zoo.load_graph("mmt:small")
    ids = lambda *names: tuple(graph.op_id(n) for n in names)  # noqa: E731
    sg = make_sg(graph, [ids("branch0.layer0", "branch0.layer1"), ids("branch1.layer0", "branch1.layer1"), ids("concat", "head")],
                 [(0,), (1,), (2, 3)], [2, 4, 4], 8, 4)
    schedule = make_schedule("graph-1f1b", sg, preset("v100", 4))
    routing = Routing(sg, schedule, {(0, 2): ("a",), (1, 2): ("b", "c")}, grad_values=("a", "b"))
    expected = {("F", p.producer, p.consumer, p.producer_mb, p.producer_replica, p.consumer_mb, p.consumer_replica, v)
                for e, vals in {(0, 2): ("a",), (1, 2): ("b", "c")}.items() for p in edge_pieces(sg, *e) for v in vals}
    expected |= {("B",) + k[1:] for k in expected if k[7] in ("a", "b")}
    sent = [k for keys in routing.links.values() for k in keys]
    assert sorted(sent) == sorted(expected)
    for (src, dst), keys in routing.links.items():
        for k in keys:
            producer_rank = sg.stages[k[1]].devices[k[4]]
            consumer_rank = sg.stages[k[2]].devices[k[6]]
            assert (src, dst) == ((producer_rank, consumer_rank) if k[0] == "F" else (consumer_rank, producer_rank))


def test_op_names_that_are_not_the_models_are_refused():
    with pytest.raises(PlanError, match="branch9.layer0") as info:
        check_op_names(["branch0.layer0", "branch9.layer0"], ["branch0.layer0", "concat"], "mmt:small")
    assert "concat" in str(info.value) and "graphpipe plan" in str(info.value)


def _plan(spec, groups, devices, mbs, batch, num_devices, schedule="graph-1f1b", shared=False, sequential=False):
    graph = zoo.load_graph(spec)
    ids = [tuple(graph.op_id(n) for n in g) for g in groups]
    sg = make_sg(graph, ids, devices, mbs, batch, num_devices, shared=shared, sequential=sequential)
    cluster = preset("v100", num_devices)
    return Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


def test_torch_refusals_name_the_reason():
    tb = ["embed"], ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    fan_out = _plan("twobranch:small", tb, [(0,), (1,), (2,), (3,)], [2] * 4, 8, 4)
    assert "fans out" in torch_refusal(fan_out)
    chain = (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"])
    assert torch_refusal(_plan("transformer:small", chain, [(0,), (1,)], [2, 2], 8, 2, "1f1b")) is None
    assert "micro-batch sizes" in torch_refusal(_plan("transformer:small", chain, [(0,), (1,)], [2, 4], 8, 2))
    assert "replicated" in torch_refusal(_plan("transformer:small", chain, [(0,), (1, 2)], [2, 2], 8, 3, "1f1b"))
    skip = (["embed", "layer0"], ["layer1", "layer2"], ["layer3", "head"])
    assert torch_refusal(_plan("transformer:small", skip, [(0,), (2,), (1,)], [2] * 3, 8, 3, "1f1b")).startswith("stage 1 is on device 2")


def test_unknown_op_plan_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    from graphpipe.cli import main
    import graphpipe.runtime as runtime

    plan = _plan("transformer:small", (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"]), [(0,), (1,)], [2, 2], 8, 2)
    doc = plan_to_dict(plan)
    doc["graph"]["ops"][1]["name"] = "layerX"
    for e in doc["graph"]["edges"]:
        for end in ("src", "dst"):
            if e.get(end) == "layer0":
                e[end] = "layerX"
    doc["stages"][0]["ops"] = ["embed", "layerX", "layer1"]
    path = tmp_path / "bad.json"
    import json

    path.write_text(json.dumps(doc))
    monkeypatch.setattr(runtime, "launch", lambda *a, **k: pytest.fail("launched a plan that does not match its model"))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layerX" in err and "does not match model" in err


def test_rank_cpus_gives_each_rank_its_own_run_of_cpus():
    from graphpipe.errors import InputError
    from graphpipe.runtime.worker import rank_cpus

    allowed = [9, 1, 3, 5, 7, 11]  # an affinity set need not start at 0 nor be contiguous
    per_rank = [rank_cpus(r, 2, allowed) for r in range(3)]
    assert per_rank == [[1, 3], [5, 7], [9, 11]]
    assert rank_cpus(5, 1, allowed) == [11]
    with pytest.raises(InputError, match="rank 3 needs CPUs up to the 8th, but this process may use 6"):
        rank_cpus(3, 2, allowed)
    with pytest.raises(InputError, match="--cpus-per-rank"):
        RunOptions(cpus_per_rank=-1)


def test_pinning_more_cpus_than_the_host_has_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    from graphpipe.cli import main
    import graphpipe.runtime as runtime

    plan = _plan("transformer:small", (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"]), [(0,), (1,)], [2, 2], 8, 2)
    write_plan(str(tmp_path / "p.json"), plan)
    monkeypatch.setattr(runtime, "launch", lambda *a, **k: pytest.fail("launched ranks the host cannot pin"))
    assert main(["run", str(tmp_path / "p.json"), "--cpus-per-rank", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cpus-per-rank 100000: rank 1 needs" in err


def test_graph_file_model_is_refused(tmp_path, capsys):
    from graphpipe.cli import main

    plan = _plan("transformer:small", (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"]), [(0,), (1,)], [2, 2], 8, 2)
    from dataclasses import replace

    write_plan(str(tmp_path / "p.json"), replace(plan, model="some/graph.json"))
    assert main(["run", str(tmp_path / "p.json")]) == 2
    assert "no module to run" in capsys.readouterr().err


# ---------------------------------------------------------------- one rank, in process
@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    from graphpipe.runtime.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


ONE_RANK_CASES = {
    # fan-out from embed, join at concat; consumer micro-batch larger than its producers'
    "twobranch-fanout-mb": ("twobranch:small", (["embed"], ["branch0.layer0", "branch0.layer1"],
                                                ["branch1.layer0", "branch1.layer1"], ["concat", "head"]), [2, 2, 4, 8], "gpipe", False),
    # consumer micro-batch smaller than its producer's
    "mmt-slice": ("mmt:small", (["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]),
                  [4, 8, 2], "gpipe", False),
    # sequential relay of embed's output through branch0's stage
    "twobranch-sequential": ("twobranch:small", (["embed"], ["branch0.layer0", "branch0.layer1"],
                                                 ["branch1.layer0", "branch1.layer1", "concat", "head"]), [2, 2, 2], "gpipe", True),
    "dlrm-many-inputs": ("dlrm:small", (["dense0.layer0", "dense0.layer1", "dense1.layer0", "dense1.layer1"], ["emb0", "emb1"],
                                        ["interaction", "top.layer0", "top.layer1"]), [2, 4, 2], "gpipe", False),
}


@pytest.mark.parametrize("case", sorted(ONE_RANK_CASES))
def test_all_stages_on_one_rank_match_single_process(case, one_rank_group):
    from graphpipe.runtime.worker import run_job

    spec, groups, mbs, schedule, sequential = ONE_RANK_CASES[case]
    plan = _plan(spec, groups, [(0,)] * len(groups), mbs, 8, 1, schedule, shared=True, sequential=sequential)
    result = run_job(0, 1, plan, RunOptions(steps=2, check=True), torch.device("cpu"), "gloo")
    check = result.check
    assert check.passed, check
    assert check.num_params_checked == check.num_params > 0
    assert len(result.losses) == 2 and result.losses[1] != result.losses[0]  # the optimizer stepped


def test_flat_grad_buffer_holds_the_accumulated_gradients():
    """Gradients stay views of the stage's buffer through backward passes, so all-reducing the
    buffer reduces them; the sum over two passes equals two separate backward passes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    expected = [torch.zeros_like(p) for p in params]
    for x in (x1, x2):
        for e, g in zip(expected, torch.autograd.grad(model(x).sum(), params)):
            e += g
    flat = flat_grad_buffer(params)
    assert flat is not None and flat.numel() == sum(p.numel() for p in params) and not flat.any()
    for x in (x1, x2):
        model(x).sum().backward()
    assert all(p.grad._base is flat for p in params)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e)
    flat.mul_(2.0)  # what an all-reduce does to the buffer reaches every .grad
    torch.testing.assert_close(params[0].grad, 2 * expected[0])


def test_flat_grad_buffer_refuses_mixed_dtypes_and_zero_grads_allocates_then_clears():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    assert flat_grad_buffer([a, b]) is None and a.grad is None and flat_grad_buffer([]) is None
    zero_grads([a, b])
    assert a.grad is not None and b.grad.dtype == torch.float64 and not a.grad.any()
    kept = a.grad
    (a.sum() * 3).backward()
    zero_grads([a, b])
    assert a.grad is kept and not a.grad.any()


class _Work:
    """A stand-in for a process group's work handle: records how it was waited on."""

    def __init__(self):
        self.waits = []

    def wait(self, *args):
        self.waits.append(args)
        return True


@pytest.mark.parametrize("device,host_blocks", [("cpu", True), ("cuda", False)])
def test_waits_on_cuda_are_the_streams_not_the_hosts(device, host_blocks):
    """On CUDA a wait with a timeout would hold the host until the transfer ends; a stream wait lets it queue
    the next kernels (the NCCL watchdog bounds a silent peer at the group's timeout). On CPU (gloo) the wait
    carries the timeout, so a silent peer is named."""
    from graphpipe.runtime.comm import Mailbox

    routing = Routing(*_two_stage_chain())
    box = Mailbox(0, routing, lambda key: ((1,), torch.float32), torch.device(device), 5.0)
    work = _Work()
    box.wait_work(work, "a test message")
    assert work.waits == ([(box.timeout,)] if host_blocks else [()])


def _two_stage_chain():
    plan = _plan("transformer:small", (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"]), [(0,), (1,)],
                 [2, 2], 8, 2, "1f1b")
    return plan.stage_graph, plan.schedule, {(0, 1): ("x",)}, ["x"]


def test_gradients_rebind_into_the_same_buffer_after_the_optimizer_drops_them(one_rank_group):
    """A timed run (``measure``, what the profile accumulated into): ``opt.zero_grad()`` sets ``.grad = None``;
    the next step's gradients go back into the stage's flat buffer (the one replicas all-reduce), zeroed, as the
    same views: no reallocation per step. Untimed (the training API) on a stage of one replica, the step's first
    backward creates the gradients instead (as a plain loop's): the same numbers, bit for bit."""
    from graphpipe.runtime.api import JobModel, Pipeline

    plan = _plan("transformer:small", (["embed", "layer0", "layer1", "layer2", "layer3", "head"],), [(0,)], [4], 8, 1,
                 "gpipe")
    runnable = load_runnable(plan.model, 0)
    inputs = runnable.make_inputs(8, 0)
    got = {}
    for measure in (True, False):
        pipe = Pipeline(plan, _job=JobModel(runnable, measure=measure))
        params = list(pipe.parameters())
        pipe._train(inputs)
        views = [p.grad for p in params]
        first = [g.clone() for g in views]
        for p in params:
            p.grad = None
        pipe._train(inputs)
        assert all((p.grad is v) == measure for p, v in zip(params, views))
        for p, g in zip(params, first):  # zeroed before the step: the same data gives the same gradients, not twice
            torch.testing.assert_close(p.grad, g)
        got[measure] = [p.grad.clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


def test_bound_forward_equals_the_stage_module_and_reads_live_parameters():
    """BoundForward (parameters passed in, no attribute chains) gives the module's outputs and gradients bit for
    bit, in train and eval mode (a BatchNorm kept as a shared sub-module), on a captured graph and on the stage
    programs cut from it, and sees a parameter replaced after it was built (as a checkpoint load may)."""
    from graphpipe.frontend.exporting import export_model
    from graphpipe.runtime.stage_modules import BoundForward

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                            torch.nn.Dropout(0.0))
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(x)).sum(-1)

    torch.manual_seed(0)
    x = torch.randn(5, 6)
    modules = [export_model(Net(), (torch.randn(4, 6),)).gm]
    runnable = load_runnable("mmt:small")
    graph = zoo.load_graph("mmt:small")
    sg = make_sg(graph, contiguous_stages(graph.num_ops, 3, random.Random(0)), [(i,) for i in range(3)], [4] * 3, 4, 3)
    programs = split_model(runnable.gm, runnable.op_nodes, sg).programs
    cases = [(modules[0], (x,))]
    inputs, values = runnable.make_inputs(4, 3), {}
    with torch.no_grad():  # each stage's inputs: the stages chained on the whole batch
        for prog in programs:
            args = tuple(inputs[dict(prog.model_inputs)[n]] if n in dict(prog.model_inputs) else values[n]
                         for n in prog.input_names)
            cases.append((prog.module, tuple(t.detach().requires_grad_(t.is_floating_point()) for t in args)))
            values.update(zip(prog.output_names, prog.module(*args)[0]))
    assert len(cases) == 4
    for module, args in cases:
        bound = BoundForward(module)
        assert bound.bound is not None  # nothing here needs the fallback
        for train in (True, False):
            module.train(train)
            module.zero_grad()
            want = module(*args)
            want_loss = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(want)
                            if isinstance(t, torch.Tensor) and t.requires_grad)
            want_loss.backward()
            want_grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
            module.zero_grad()
            got = bound(*args)
            got_loss = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(got)
                           if isinstance(t, torch.Tensor) and t.requires_grad)
            got_loss.backward()
            flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(flat_got, flat_want))
            assert all((p.grad is None and g is None) or torch.equal(p.grad, g)
                       for p, g in zip(module.parameters(), want_grads))
        module.train()
    gm = modules[0]
    bound = BoundForward(gm)
    before = bound(x)
    target = next(n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("weight"))
    owner, _, name = target.rpartition(".")
    holder = gm.get_submodule(owner) if owner else gm
    holder._parameters[name] = torch.nn.Parameter(torch.zeros_like(holder._parameters[name]))
    got, want = torch.utils._pytree.tree_leaves(bound(x)), torch.utils._pytree.tree_leaves(gm(x))
    assert torch.equal(got[0], want[0]) and not torch.equal(got[0], torch.utils._pytree.tree_leaves(before)[0])


class _Posted:
    """A stand-in for ``dist``'s point-to-point calls: records every posted receive, in order."""

    def __init__(self):
        self.receives = []  # (source, tag, work)

    def irecv(self, buf, src, group=None, tag=0):
        work = _Work()
        self.receives.append((src, tag, work))
        return work


@pytest.mark.parametrize("post_early", [True, False])
def test_prefetched_receives_are_posted_in_link_order_and_waited_only_when_consumed(monkeypatch, post_early):
    """A CUDA rank posts the next action's receives early (every earlier message of the link too, in the order
    NCCL matches them); nothing waits until a message is consumed, and consuming one waits on that one only.
    A lazy rank (gloo) posts nothing ahead."""
    import graphpipe.runtime.comm as comm

    fake = _Posted()
    monkeypatch.setattr(comm.dist, "irecv", fake.irecv)
    routing = Routing(*_two_stage_chain())
    keys = routing.links[(0, 1)]
    assert len(keys) >= 3
    box = comm.Mailbox(1, routing, lambda key: ((2,), torch.float32), torch.device("cpu"), 5.0, post_early=post_early)
    box.prefetch(0, keys[2])
    assert [(s, t) for s, t, _ in fake.receives] == ([(0, 0), (0, 1), (0, 2)] if post_early else [])
    assert all(not w.waits for _, _, w in fake.receives)
    buf = box.recv(0, keys[0])
    assert buf.shape == (2,) and [len(w.waits) for _, _, w in fake.receives] == [1] + [0] * (2 if post_early else 0)
    box.recv(0, keys[1])  # already posted (early) or posted now: never posted twice
    assert [t for _, t, _ in fake.receives] == [0, 1, 2] if post_early else [0, 1]
    box.prefetch(0, keys[1])  # a consumed message is not posted again
    assert len(fake.receives) == (3 if post_early else 2)
