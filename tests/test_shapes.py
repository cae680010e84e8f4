"""Batches whose shape changes from step to step, a last partial batch, evaluation at any shape.

Oracle: one process training the same model on the same batches (same rows, same lengths) with the same
optimizer: every step's loss, the final weights and an evaluation at a shape never seen must match. Single
process checks: the shape rules' refusals and the partial batch's routing against brute force.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shapes_models as sm  # noqa: E402
import shapes_script  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(name: str):
    """Losses, final weights and evaluation of one process over the script's steps."""
    model, _, loss_fn, _ = getattr(sm, name)()
    opt = torch.optim.SGD(model.parameters(), lr=shapes_script.LR)
    losses = []
    for inputs, target in shapes_script.steps(name):
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs) if isinstance(inputs, tuple) \
            else model(inputs)
        loss = loss_fn(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        x = shapes_script.evaluation_inputs(name)
        evaluation = model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, tuple) else model(x)
    return losses, dict(model.named_parameters()), evaluation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shapes") / "out.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), os.path.join(HERE, "shapes_script.py"), out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chain", "branchy", "hf_bert"])
def test_varying_lengths_and_a_partial_batch_train_like_one_process(trained, name):
    """Lengths change every step (two unrelated ones in the branchy model) and the last batch has 5 of 8 rows:
    each loss, the final weights and an evaluation at 3 rows of a new length equal one process's."""
    losses, weights, evaluation = _reference(name)
    got = trained[name]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert set(got["weights"]) == set(weights)
    for n, w in weights.items():
        torch.testing.assert_close(got["weights"][n], w.detach(), rtol=1e-5, atol=1e-6)
    ref = evaluation.logits if hasattr(evaluation, "logits") else evaluation
    out = got["eval"].logits if hasattr(got["eval"], "logits") else got["eval"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_length_the_model_pins_is_refused_in_one_line_on_every_rank(trained):
    refusal = trained["pinned"]["refusal"]
    assert refusal is not None and "dim 1 is 9" in refusal and "fixes it at 12" in refusal
