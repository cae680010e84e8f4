"""``graphpipe.Pipeline`` on one rank, eager and compiled: the path the training API's speed is measured on.

Oracle: a plain single-process loop over the same micro-batches (each loss scaled by its share of the
mini-batch, ``backward``, one AdamW step, ``zero_grad``), run on a copy of the same weights: the loss and every
gradient of each step equal it (``torch.testing.assert_close``; compiled stages within ``--check``'s fp32
tolerance, since inductor may fuse and reorder the arithmetic). Stages of one replica leave their gradients
to autograd (no persistent flat buffer); a parameter no micro-batch reaches still ends the step with a zero
gradient, as it did with the buffer.
"""

from __future__ import annotations

import types

import pytest
import torch

from graphpipe.frontend import zoo
from graphpipe.runtime.options import CHECK_ATOL, CHECK_RTOL

from test_runtime_units import _plan, one_rank_group  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "transformer:small"
BATCH, MICRO = 8, 2


def _reference_steps(steps: int):
    """Per step: the loss and every parameter's gradient of a plain micro-batched loop, by parameter name."""
    built = zoo.build(SPEC, seed=0)
    model = built.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x = built.make_inputs(BATCH, step)
        loss = 0.0
        for lo in range(0, BATCH, MICRO):
            term = built.loss_fn(model(*(t[lo:lo + MICRO] for t in x))) * (MICRO / BATCH)
            term.backward()
            loss += float(term.detach())
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("stages", [1, 3], ids=["one-stage", "three-stages"])
def test_one_rank_pipeline_trains_like_a_plain_loop(one_rank_group, compile, stages):
    """Two steps with AdamW and ``zero_grad()`` (``.grad = None``) between them: each step's loss and every
    gradient equal the plain loop's (three stages on the rank hand their activations and gradients over
    locally)."""
    from graphpipe.runtime.api import Pipeline

    groups = ((["embed", "layer0", "layer1", "layer2", "layer3", "head"],) if stages == 1 else
              (["embed", "layer0"], ["layer1", "layer2"], ["layer3", "head"]))
    plan = _plan(SPEC, groups, [(0,)] * stages, [MICRO] * stages, BATCH, 1, "gpipe", shared=stages > 1)
    built = zoo.build(SPEC, seed=0)
    pipe = Pipeline(plan, built.module, built.loss_fn, compile=compile)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    tol = {"rtol": CHECK_RTOL * 100, "atol": CHECK_ATOL} if compile else {}
    for step, (ref_loss, ref_grads) in enumerate(_reference_steps(2)):
        loss = pipe.step(built.make_inputs(BATCH, step))
        # a plain loop's loss: a detached 0-dim tensor on the device, read on the host only when the user asks
        assert loss.shape == () and loss.device == pipe.device and not loss.requires_grad
        torch.testing.assert_close(loss.item(), float(ref_loss), **tol)
        grads = {name: p.grad for name, p in pipe.named_parameters()}
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
        opt.step()
        opt.zero_grad()


def test_a_parameter_no_micro_batch_reaches_ends_the_step_with_a_zero_gradient():
    """Without a persistent buffer a parameter the stage's outputs do not depend on would keep ``.grad = None``
    (an optimizer would skip it); it gets zeros, as with the buffer, and a computed gradient is left alone."""
    from graphpipe.runtime.hosted import HostedStage

    module = torch.nn.Module()
    module.used, module.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    module.frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    hosted = HostedStage(stage=None, program=types.SimpleNamespace(module=module), forward=None, batchnorms=())
    module.used.weight.grad = torch.ones(2, 2)
    module.used.bias.grad = None
    module.unused.weight.grad = torch.full((2, 2), 3.0)
    hosted.leave_grads_to_autograd()  # a new executor starts from no gradient
    assert all(p.grad is None for p in module.parameters()) and not hosted.persistent_grads
    module.used(torch.ones(1, 2)).sum().backward()
    computed = module.used.weight.grad
    hosted.fill_missing_grads()
    assert module.used.weight.grad is computed
    assert torch.equal(module.unused.weight.grad, torch.zeros(2, 2))
    assert torch.equal(module.unused.bias.grad, torch.zeros(2))
    assert module.frozen.weight.grad is None and module.frozen.bias.grad is None
