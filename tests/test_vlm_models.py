"""Vision-language models (a vision tower beside a text path) through capture, gpp and ``--check``.

Built from tiny configs in code (tests/vlm_models.py). Oracles: ``--check``'s single-process reference (loss,
every gradient, every buffer) on 3 CPU ranks (on 2 the
tiny widths plan as one stage); the plan's stage graph (the vision tower a branch of its own);
the example's token structure (image placeholders per row) in the run's synthetic data; the refusal's named
source line for a model that fixes the batch.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from graphpipe.capture import captured_from_factory  # noqa: E402
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


def test_vision_language_models_train_like_one_process():
    """PaliGemma (image features scattered into the text embeddings), Mllama (cross-attention) and AltCLIP (a
    loss over both towers' outputs) each get a gpp plan whose vision tower is a stage beside the text path's,
    and train through it on 3 ranks with loss and every gradient equal to one process."""
    from graphpipe.exporting import join_outputs
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.search.planner import make_plan

    plans = {}
    for name in ("paligemma", "mllama", "altclip"):
        spec = f"{SPEC}:{name}"
        cap = captured_from_factory(spec)
        graph = cap.graph
        plan = make_plan(spec, graph, preset("v100", 3), BATCH, "gpp")
        sg = plan.stage_graph
        vision = {sg.stage_of(graph.op_id(op.name)) for op in graph.ops if "vision" in op.name}
        text = {sg.stage_of(graph.op_id(op.name)) for op in graph.ops if "embed_tokens" in op.name
                or "word_embeddings" in op.name}
        assert len(vision) == 1 and len(text) == 1, (name, vision, text)
        (v,), (t,) = vision, text
        # the tower and the text embedding run side by side: neither stage feeds the other
        assert v != t and not _reaches(sg, v, t) and not _reaches(sg, t, v), (name, sg.edges)
        if name == "altclip":  # the loss reads both towers: one node gathers them, in one stage
            joins = [n for n in cap.gm.graph.nodes if n.target is join_outputs]
            assert len(joins) == 1 and len(joins[0].args) == 2
        plans[name] = plan
    names = sorted(plans)
    results = run_plans([(plans[n], RunOptions(steps=1, warmup_steps=0, check=True, timeout_s=180))
                         for n in names], 3)
    for name, result in zip(names, results):
        check = result.check
        assert check.passed and check.num_params_checked == check.num_params > 0, (name, check)


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


def test_a_model_that_fixes_the_batch_is_refused_naming_the_line(tmp_path):
    """A Python list of the batch's rows (LLaVA's image features) fixes the batch to the example's: the refusal
    names that line and quotes it, in one line, instead of torch's "Constraints violated"."""
    from graphpipe.errors import UserCodeError

    path = tmp_path / "rows.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        rows = list(self.l(x))\n"
        "        return torch.cat(rows, dim=0)\n"
        "def make():\n"
        "    return M(), (torch.randn(3, 2, 4),), lambda out: out.sum()\n")
    with pytest.raises(UserCodeError) as err:
        captured_from_factory(f"{path}:make")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:6: ") and "Constraints violated" not in message
    assert "`rows = list(self.l(x))` fixes the batch to the example's 3" in message
