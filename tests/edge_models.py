"""Tiny models with the edges real models hit (issue 65): non-tensor inputs, an in-place op on a value a stage
receives, a parameter the forward never uses.

Each factory returns ``(module, example_inputs, loss_fn)`` (the ``file.py:factory`` contract).
"""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH = 8


class Flagged(nn.Module):
    """Non-tensor inputs: a ``bool`` that changes what forward returns, an int scale, a string mode, a ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, output_hidden_states=False, scale=1, mode="plain", extra=None):
        h = self.stem(x)
        hidden = (h,)
        for block in self.blocks:
            h = torch.tanh(block(h)) * scale
            if output_hidden_states:
                hidden = hidden + (h,)
        if mode == "shifted":
            h = h + 1.0
        if extra is not None:
            h = h + extra
        out = {"logits": self.head(h)}
        if output_hidden_states:
            out["hidden_states"] = hidden
        return out


def flagged():
    torch.manual_seed(0)
    inputs = {"x": torch.randn(BATCH, 4), "output_hidden_states": True, "scale": 2, "mode": "shifted", "extra": None}
    return Flagged(), inputs, lambda out: out["logits"].pow(2).mean() + out["hidden_states"][1].mean()


class AddPosition(nn.Module):
    """Adds a learned position vector to its input in place, then a linear layer (BLIP's text embeddings do
    ``embeddings += position_embeddings``): fine eagerly, where the input is an intermediate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(dim) * 0.1)
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        h += self.pos
        h[:, :2].mul_(0.5)  # through a view as well
        return self.lin(h)


class InPlace(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(AddPosition(dim) for _ in range(2))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def in_place():
    torch.manual_seed(0)
    return InPlace(), (torch.randn(BATCH, 4),), lambda out: out.pow(2).mean()


class Unused(nn.Module):
    """A vision tower's ``post_layernorm`` the model never calls, and a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.post_layernorm = nn.LayerNorm(8)  # never called
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("unused_stat", torch.arange(3.0))  # persistent, never read
        self.register_buffer("cache", torch.ones(2), persistent=False)

    def forward(self, x):
        h = self.stem(x) * self.scale
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def unused():
    torch.manual_seed(0)
    return Unused(), (torch.randn(BATCH, 4),), lambda out: out.pow(2).mean()
