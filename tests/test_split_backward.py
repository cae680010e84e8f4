"""Runtime split backward: I then W gives exactly the gradients of one ordinary backward (torch oracle)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphpipe.frontend.split_backward import backward_input, backward_weight  # noqa: E402


class _Block(torch.nn.Module):
    """Linear layers, a LayerNorm, a residual, one weight used twice, and a parameter off the input path."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.b = torch.nn.Linear(6, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        h = torch.tanh(self.a(x)) + x
        h = self.norm(self.a(h)) * self.scale
        return self.b(h) + y.sum(-1, keepdim=True)


@pytest.mark.parametrize("inputs_need_grad", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("with_loss", [False, True])
def test_split_equals_one_backward(inputs_need_grad, with_loss):
    torch.manual_seed(0)
    model = _Block()
    x0, y0 = torch.randn(5, 6), torch.randn(5, 3)
    gout = torch.randn(5, 4)

    def run():
        x = x0.clone().requires_grad_(inputs_need_grad[0])
        y = y0.clone().requires_grad_(inputs_need_grad[1])
        out = model(x, y)
        roots, grads = ([(out * gout).sum()], [None]) if with_loss else ([out], [gout])
        return x, y, roots, grads

    model.zero_grad(set_to_none=True)
    x, y, roots, grads = run()
    torch.autograd.backward(roots, grads)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_inputs = [t.grad for t in (x, y)]

    model.zero_grad(set_to_none=True)
    x, y, roots, grads = run()
    leaves = [t for t in (x, y) if t.requires_grad]
    dinputs, pending = backward_input(roots, grads, leaves, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # I leaves the weights alone
    # Every parameter's gradient path crosses x's input-gradient path: I captured what W needs, so W does not
    # walk the input path again; with x a data input (no gradient) W falls back to a backward from the roots.
    assert (pending.captured is not None) == inputs_need_grad[0]
    backward_weight(pending)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    got = dict(zip([id(t) for t in leaves], dinputs))
    for t, w in zip((x, y), want_inputs):
        if t.requires_grad:
            torch.testing.assert_close(got[id(t)], w)
