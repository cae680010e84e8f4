"""A branchy classifier with dropout for the failure-survival tests: its losses depend on the dropout masks and on
the data order drawn from the global generator, so a resume that loses either ends with other weights."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 16
FEATURES = 8
CLASSES = 4
DATASET = 256


class Branchy(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.stem = nn.Linear(FEATURES, width)
        self.left = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, width))
        self.right = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(2 * width, CLASSES))

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.cat([self.left(h), self.right(h)], dim=-1))


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def dataset():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET, FEATURES, generator=gen)
    return x, (x[:, :CLASSES] * 3).argmax(dim=1)


def next_batch(x, y):
    """A batch drawn from the *global* generator: the data order a checkpoint must carry over."""
    idx = torch.randint(0, len(x), (BATCH,))
    return x[idx], y[idx]


def factory():
    torch.manual_seed(0)
    x, y = dataset()
    return Branchy(), x[:BATCH], loss_fn, y[:BATCH]
