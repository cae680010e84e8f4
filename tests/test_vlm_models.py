"""Vision-language models (a vision tower beside a text path) through capture, gpp and ``--check``.

Built from tiny configs in code (tests/vlm_models.py). Oracles: ``--check``'s single-process reference (loss,
every gradient, every buffer) on 3 CPU ranks (on 2, the tiny widths plan as one stage); the plan's stage graph
(the vision tower a branch of its own, the loss's inputs in one stage); the example's token structure (image
placeholders per row) in the run's synthetic data; the source line a batch-fixing refusal names.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from graphpipe.frontend.capture import captured_from_factory  # noqa: E402
from graphpipe.cluster import preset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "vlm_models.py")
BATCH = 8

pytestmark = pytest.mark.usefixtures("one_thread")


def _reaches(sg, src: int, dst: int) -> bool:
    todo, seen = [src], set()
    while todo:
        s = todo.pop()
        if s == dst:
            return True
        if s not in seen:
            seen.add(s)
            todo.extend(b for a, b in sg.edges if a == s)
    return False


def _gpp_with_the_tower_beside_the_text(name: str):
    """The captured model and its gpp plan on 3 devices, checked to run the vision tower in a stage of its own
    beside the text embedding's (neither feeds the other)."""
    from graphpipe.search.planner import make_plan

    spec = f"{SPEC}:{name}"
    cap = captured_from_factory(spec)
    graph = cap.graph
    plan = make_plan(spec, graph, preset("v100", 3), BATCH, "gpp")  # on 2, tiny widths plan as one stage
    sg = plan.stage_graph
    vision = {sg.stage_of(graph.op_id(op.name)) for op in graph.ops if "vision" in op.name}
    text = {sg.stage_of(graph.op_id(op.name)) for op in graph.ops if "embed_tokens" in op.name
            or "word_embeddings" in op.name}
    assert len(vision) == 1 and len(text) == 1, (name, vision, text)
    (v,), (t,) = vision, text
    assert v != t and not _reaches(sg, v, t) and not _reaches(sg, t, v), (name, sg.edges)
    return cap, plan


def test_paligemma_trains_like_one_process_with_its_vision_tower_beside_the_text_path():
    """PaliGemma scatters its projected image features into the text embeddings (``masked_scatter`` on the
    image placeholders): gpp runs the SigLIP tower beside the embedding, and 3 ranks train it with loss and
    every gradient equal to one process."""
    from graphpipe.runtime import RunOptions, run_plans

    _, plan = _gpp_with_the_tower_beside_the_text("paligemma")
    result, = run_plans([(plan, RunOptions(steps=1, warmup_steps=0, check=True, timeout_s=180))], 3)
    check = result.check
    assert check.passed and check.num_params_checked == check.num_params > 0, check


def test_a_loss_over_both_towers_is_computed_in_one_stage():
    """AltCLIP's loss reads the image and the text embeddings, the last ops of two branches: one node gathers
    them, so the plan that puts the towers on two stages still computes the loss in one (the runtime refused
    the plan, the output coming from two stages)."""
    from graphpipe.frontend.exporting import join_outputs
    from graphpipe.runtime.stage_modules import split_model

    cap, plan = _gpp_with_the_tower_beside_the_text("altclip")
    joins = [n for n in cap.gm.graph.nodes if n.target is join_outputs]
    assert len(joins) == 1 and len(joins[0].args) == 2
    sg = plan.stage_graph
    sinks = [s for s in range(sg.num_stages) if not any(a == s for a, _ in sg.edges)]
    assert len(sinks) == 1 and sg.stage_of(cap.graph.op_id("join_outputs")) == sinks[0]
    split_model(cap.gm, cap.op_nodes, sg)  # raised PlanError before the join


def test_synthetic_token_ids_keep_the_image_placeholders_of_every_row():
    """The run's data keeps each row's image placeholders (as many as the model has image features, where it
    scatters them) and the rows of the inputs drawn together; uniform draws scattered them at random."""
    import vlm_models

    from graphpipe.runtime.runnable import _synthetic_inputs

    _, inputs, _, target = vlm_models.mllama()
    example = (inputs["input_ids"], inputs["pixel_values"], inputs["cross_attention_mask"], target)
    make = _synthetic_inputs(example, "cpu", num_targets=1)
    for seed in range(3):
        ids, pixels, mask, y = make(BATCH, seed)
        assert ids.shape == (BATCH, example[0].shape[1]) and pixels.shape == (BATCH, *example[1].shape[1:])
        assert ((ids == vlm_models.IMAGE_TOKEN).sum(1) == 1).all() and (ids[:, 1] == vlm_models.IMAGE_TOKEN).all()
        assert all(any(torch.equal(row, e) for e in example[0]) for row in ids)  # rows of the example
        assert torch.equal(mask, torch.ones_like(mask)) and pixels.dtype == torch.float32
    a, b = make(BATCH, 4), make(BATCH, 4)
    assert all(torch.equal(x, z) for x, z in zip(a, b))


def _refusal(path, source: str) -> str:
    """The one-line message capture refuses the model of ``source`` (written to ``path``, factory ``make``) with."""
    from graphpipe.errors import UserCodeError

    path.write_text("import torch\n" + source)
    with pytest.raises(UserCodeError) as err:
        captured_from_factory(f"{path}:make")
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_value_read_on_the_meta_device_is_refused_in_one_line(tmp_path):
    """Tokens per expert read with .tolist() (JetMoE's experts split their inputs so): on the CPU the model
    captures; on the meta device there is no value to read, and the refusal says so and what to do."""
    path = tmp_path / "route.py"
    source = (
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = torch.nn.Linear(4, 4); self.b = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        sizes = torch.stack([(x[:, 0] >= 0).sum(), (x[:, 0] < 0).sum()]).tolist()\n"
        "        left, right = torch.split(x, sizes)\n"
        "        return torch.cat([self.a(left), self.b(right)])\n"
        "def make(device='meta'):\n"
        "    with torch.device(device):\n"
        "        return M(), (torch.zeros(3, 4),), lambda out: out.sum()\n"
        "def make_cpu():\n"
        "    return make('cpu')\n")
    message = _refusal(path, source)
    assert "reads a tensor's value (aten.item" in message and "on the CPU" in message
    assert captured_from_factory(f"{path}:make_cpu").graph.num_ops > 0


def test_a_model_that_fixes_the_batch_is_refused_naming_the_line(tmp_path, capfd):
    """A Python list of the batch's rows (LLaVA's image features) fixes the batch to the example's: the refusal
    names that line and quotes it, in one line, instead of torch's "Constraints violated"; torch's shape log,
    watched for it, prints nothing."""
    path = tmp_path / "rows.py"
    message = _refusal(path, (
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        rows = list(self.l(x))\n"
        "        return torch.cat(rows, dim=0)\n"
        "def make():\n"
        "    return M(), (torch.randn(3, 2, 4),), lambda out: out.sum()\n"))
    assert message.startswith(f"{path}:6: ") and "Constraints violated" not in message
    assert "`rows = list(self.l(x))` fixes the batch to the example's 3" in message
    assert "symbolic_shapes" not in capfd.readouterr().err


def test_a_model_running_vmap_is_refused_naming_the_module(tmp_path):
    """Export keeps torch.vmap as batching-level calls without data edges (Gemma-3's image-token mask given
    ``token_type_ids``): the refusal names the module running it, where the graph failed when run."""
    path = tmp_path / "vm.py"
    message = _refusal(path, (
        "class Mask(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.vmap(lambda r: r * (r > 0))(x)\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 4); self.mask = Mask()\n"
        "    def forward(self, x):\n"
        "        return self.l(x) + self.mask(x)\n"
        "def make():\n"
        "    return M(), (torch.randn(3, 4),), lambda out: out.sum()\n"))
    assert message.startswith(f"{path}: ") and "torch.vmap runs inside mask (Mask)" in message
