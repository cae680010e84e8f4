"""Tiny models for compiled stages (``file.py:factory`` contract): what real networks have and ``--compile`` must keep.

* :func:`noisy`: module dropout, functional dropout, one dropout module
  called from two places (as T5's ``encoder.dropout``), attention with
  dropout (``scaled_dot_product_attention``, causal, grouped-query heads),
  BatchNorm (running statistics updated per step) and a frozen layer;
* :func:`global_noise`: a forward drawing ``torch.randn_like`` from the
  global generator (graphpipe seeds it by forking the generator, which a
  compiled graph cannot do).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8
DIM = 8


class Attention(nn.Module):
    """Causal grouped-query self-attention (4 query heads, 2 key/value heads) with attention dropout."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim // 2), nn.Linear(dim, dim // 2)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, 4, d // 4).transpose(1, 2)
        k = self.k(x).view(b, t, 2, d // 4).transpose(1, 2)
        v = self.v(x).view(b, t, 2, d // 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25 if self.training else 0.0, is_causal=True,
                                           enable_gqa=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.drop = nn.Dropout(0.2)
        self.attn = Attention()
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)
        self.bn = nn.BatchNorm1d(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        h = self.drop(torch.tanh(self.embed(x)))
        h = self.attn(h)
        h = F.dropout(h, 0.1, self.training)
        h = F.relu(self.bn(self.conv(h.transpose(1, 2)))).transpose(1, 2)
        h = self.drop(self.frozen(h))  # the same dropout module, called a second time
        return self.head(h.mean(1))


def noisy():
    torch.manual_seed(0)
    x = torch.randn(BATCH, 6, 3)
    return Noisy(), (x,), lambda out, y: F.cross_entropy(out, y), torch.randint(0, 4, (BATCH,))


class GlobalNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + 0.1 * torch.randn_like(h))


def global_noise():
    torch.manual_seed(0)
    target = torch.zeros(BATCH, dtype=torch.long)
    return GlobalNoise(), (torch.randn(BATCH, 4),), lambda out, y: F.cross_entropy(out, y), target


class DropPath(nn.Module):
    """Stochastic depth (timm, Hugging Face Swin and BEiT): ``torch.rand((batch, 1))``, then ``torch.randn`` noise
    of the same batch-sized kind, each a factory whose size carries the batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        keep = (0.5 + torch.rand((h.shape[0], 1), dtype=h.dtype, device=h.device)).floor()
        h = h + self.b(h) * keep / 0.5
        return self.c(h + 0.1 * torch.randn((h.shape[0], 4), dtype=h.dtype, device=h.device))


def drop_path():
    torch.manual_seed(0)
    return DropPath(), (torch.randn(BATCH, 4),), lambda out, y: F.cross_entropy(out, y), torch.randint(0, 2, (BATCH,))
