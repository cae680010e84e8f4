"""A branchy classifier for the training API's tests: two MLP branches over one input, a head (no dropout or
BatchNorm, so pipelined training equals plain single-process PyTorch training to fp32 rounding)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 12
FEATURES = 6
CLASSES = 3


class TwoBranch(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.stem = nn.Linear(FEATURES, width)
        self.left = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.right = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(2 * width, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        return self.head(torch.cat([self.left(h), self.right(h)], dim=-1))


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def data(step: int, batch: int = BATCH):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    return x, y


def branchy():
    torch.manual_seed(0)
    x, y = data(0)
    return TwoBranch(), x, loss_fn, y
