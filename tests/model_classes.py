"""Small models with what third-party networks have and graphpipe once mishandled (``file.py:factory`` contract).

* :func:`pos_table`: a learned position table ``(1, seq, d)`` and a relative
  position bias ``(1, heads, seq, seq)`` computed once and read by every
  block, so values without a batch dimension cross any cut;
* :func:`frozen`: the same model with a frozen token embedding, a frozen
  first block and a fixed (``requires_grad=False``) position table;
* :func:`row_scalar`: a scalar that depends on the rows (the batch's mean
  activation) read by a later layer;
* :func:`ill_conditioned`: BatchNorm over two rows of one value per channel,
  where fp32 rounding alone moves gradients past fp32 tolerances;
* :func:`chain_target` / :func:`chain_keywords`: a chain whose loss takes a
  target, and one whose keyword inputs are not in ``forward``'s order;
* :func:`untargeted`: a classifier whose factory loss takes no target;
* :func:`custom_op`: a layer calling a kernel of its own with no FLOP formula.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpipe.frontend.layer import Layer

BATCH = 8
SEQ = 5


class Block(nn.Module):
    """Single-head-pair attention with an additive bias, then a residual tanh projection."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.qkv = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x, bias):
        b, t, d = x.shape
        q = self.qkv(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = q @ q.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias
        y = (scores.softmax(-1) @ q).transpose(1, 2).reshape(b, t, d)
        return x + torch.tanh(self.out(y))


class PosTable(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.rel = nn.Embedding(2 * SEQ, 2)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 3)

    def forward(self, ids):
        t = ids.shape[1]
        pos = self.pos(torch.arange(t).unsqueeze(0))  # (1, t, d): no batch dimension
        r = torch.arange(t)
        bias = self.rel(r[None, :] - r[:, None] + t).permute(2, 0, 1).unsqueeze(0)  # (1, heads, t, t)
        x = self.tok(ids) + pos
        for block in self.blocks:
            x = block(x, bias) + pos
        return self.head(x.mean(1))


def _ids():
    ids = torch.randint(0, 16, (BATCH, SEQ))
    ids[0, 0] = 15  # the largest id in the rows the runtime resamples its data from
    return ids


def pos_table():
    torch.manual_seed(0)
    return PosTable(), (_ids(),), lambda out: out.pow(2).mean() + out[:, 0].mean()


def frozen():
    torch.manual_seed(0)
    model = PosTable()
    model.tok.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    model.pos.weight.requires_grad_(False)  # a fixed position table
    return model, (_ids(),), lambda out: out.pow(2).mean() + out[:, 0].mean()


class Level(Layer):
    """A layer whose output is one number per call: the mean square of its projected rows."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, h):
        return (h @ self.proj).pow(2).mean()


class RowScalar(nn.Module):
    def __init__(self, dim: int = 6):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.level = Level(dim)
        self.b = nn.Linear(dim, dim)
        self.c = nn.Linear(dim, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        level = self.level(h)  # depends on the micro-batch's rows, has no batch dimension
        return self.c(torch.tanh(self.b(h)) * level)


def row_scalar():
    torch.manual_seed(0)
    return RowScalar(), (torch.randn(BATCH, 6),), lambda out: out.pow(2).mean()


class IllConditioned(nn.Module):
    def __init__(self, dim: int = 6):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.b = nn.Linear(dim, dim)
        self.bn2 = nn.BatchNorm1d(dim)
        self.c = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.bn(self.a(x) * 1e-2 + 1000.0)  # rows a hundredth apart at 1000: fp32 keeps 3 digits of the gap
        return self.c(self.bn2(self.b(torch.tanh(h))).tanh())


def ill_conditioned():
    torch.manual_seed(0)
    return IllConditioned(), (torch.randn(BATCH, 6) * 0.01,), lambda out: out.pow(2).mean() + out[:, 0].mean()


class Chain(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x, scale=None):
        x = x if scale is None else x * scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def chain_target():
    torch.manual_seed(0)
    return Chain(), (torch.randn(BATCH, 8),), lambda out, y: F.mse_loss(out, y), torch.randn(BATCH, 8)


def chain_keywords():
    torch.manual_seed(0)
    inputs = dict(scale=torch.rand(BATCH, 8) + 1.0, x=torch.randn(BATCH, 8))  # not forward's order
    return Chain(), inputs, lambda out: out.pow(2).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.left = nn.Linear(12, 12)
        self.right = nn.Linear(12, 12)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        return self.head(torch.cat([torch.tanh(self.left(h)), torch.relu(self.right(h))], dim=-1))


def untargeted():
    torch.manual_seed(0)
    return Classifier(), (torch.randn(BATCH, 6),), lambda out: out.pow(2).mean()


def _fused_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A kernel of the model's own: torch's FLOP counter has no formula for it."""
    return x @ w


# Registered once per process: this file is imported as a module and again by every factory spec that names it,
# and defining an op anew replaces the kernels the dispatcher holds for the first (torch has crashed on that).
if hasattr(torch.ops.graphpipe_tests, "fused_scale"):
    fused_scale = torch.ops.graphpipe_tests.fused_scale
else:
    fused_scale = torch.library.custom_op("graphpipe_tests::fused_scale", mutates_args=())(_fused_scale)
    fused_scale.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[1]))


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return fused_scale(self.inp(x), self.w)


def custom_op():
    torch.manual_seed(0)
    return CustomOp(), (torch.randn(BATCH, 8),), lambda out: out.pow(2).mean()


class SEBlock(nn.Module):
    """A block whose own ops run between its children and after them (squeeze-and-excite, a residual)."""

    def __init__(self, c: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.BatchNorm2d(2 * c), nn.SiLU())
        self.project = nn.Sequential(nn.Conv2d(2 * c, c, 1), nn.BatchNorm2d(c))

    def forward(self, x):
        h = self.expand(x)
        s = torch.sigmoid(h.mean((2, 3), keepdim=True))
        return x + self.project(h * s)


class Reentrant(nn.Module):
    def __init__(self, c: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(SEBlock(c), SEBlock(c))
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def reentrant():
    torch.manual_seed(0)
    return Reentrant(), (torch.randn(BATCH, 3, 4, 4),), lambda out: out.pow(2).mean()


class PatchBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc = nn.Linear(c, c)

    def forward(self, t):
        return t + self.fc(self.norm(t))


class Patches(nn.Module):
    """MobileViT's shape: blocks of a ModuleList run on an image unfolded to ``(batch * 4 patches, tokens, c)``."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.mix = nn.ModuleList([PatchBlock(c), PatchBlock(c)])
        self.out = nn.Conv2d(c, c, 1)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        h = self.stem(x)
        b, c, hh, ww = h.shape
        t = h.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 3, 5, 2, 4, 1).reshape(b * 4, -1, c)
        for block in self.mix:
            t = block(t)
        h = t.reshape(b, 2, 2, hh // 2, ww // 2, c).permute(0, 5, 3, 1, 4, 2).reshape(b, c, hh, ww)
        return self.head(self.out(h).mean((2, 3)))


def patches():
    torch.manual_seed(0)
    return Patches(), (torch.randn(BATCH, 3, 4, 4),), lambda out: out.pow(2).mean()


class SeqFirst(nn.Module):
    """Token ids -> ``nn.TransformerEncoder`` as it comes by default (``batch_first=False``: layers exchange
    ``(seq, batch, dim)``) -> per-token logits, batch-first again."""

    def __init__(self, d: int = 8, layers: int = 3):
        super().__init__()
        self.tok = nn.Embedding(20, d)
        layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 20)

    def forward(self, ids):
        return self.head(self.enc(self.tok(ids).transpose(0, 1)).transpose(0, 1))


def seq_first():
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return SeqFirst(), (ids,), lambda out: out.pow(2).mean()
