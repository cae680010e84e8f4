"""Tiny models with the edges real models hit: non-tensor inputs, an in-place op on a value a stage
receives, a parameter the forward never uses.

Each factory returns ``(module, example_inputs, loss_fn)`` (the ``file.py:factory`` contract).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

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


class UnusedOnMeta(nn.Module):
    """Parameters only, two of them never called (a LayerNorm and a Linear): built on the meta device as a model
    bigger than one rank is, each rank materializes its stages and rank 0 what no stage holds."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.post_layernorm = nn.LayerNorm(8)  # never called
        self.extra = nn.Linear(8, 8)  # never called
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.stem(x)))


def unused_on_meta():
    """The model the plan is made from (a test then gives the Pipeline one built under ``torch.device("meta")``)."""
    torch.manual_seed(0)
    return UnusedOnMeta(), (torch.randn(BATCH, 4),), lambda out: out.pow(2).mean()


def gpt2_labels():
    """Tiny GPT-2 as a Hugging Face user calls it: ``labels=`` (the loss computed inside forward) and
    ``output_hidden_states=True``, which transformers 5 passes through ``**kwargs``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (BATCH, 8))
    inputs = {"input_ids": ids, "labels": ids.clone(), "output_hidden_states": True}
    return GPT2LMHeadModel(cfg), inputs, lambda out: out.loss + 0.01 * out.hidden_states[1].pow(2).mean()


class VarKeywords(nn.Module):
    """Keyword inputs that reach forward only through ``**kwargs`` (transformers 5's way): a tensor and a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        h = self.lin(x)
        if kwargs.get("scale") is not None:
            h = h * kwargs["scale"]
        return (h, x) if kwargs.get("output_hidden_states") else (h,)


def var_keywords():
    torch.manual_seed(0)
    inputs = {"x": torch.randn(BATCH, 4), "scale": torch.rand(BATCH, 1), "output_hidden_states": True}
    return VarKeywords(), inputs, lambda out: out[0].pow(2).mean()


class ClampLayer(nn.Module):
    """DETR's encoder layer's tail: a clamp to the range of the hidden states' own dtype, and an attention-like
    score masked with that dtype's minimum."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h, mask):
        scores = self.lin(h)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        h = h + scores.softmax(-1)
        clamp_value = torch.finfo(h.dtype).max - 1000
        return torch.clamp(h, min=-clamp_value, max=clamp_value)


class DtypeDependent(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, dim)
        self.layers = nn.ModuleList(ClampLayer(dim) for _ in range(2))
        self.head = nn.Linear(dim, 2)

    def forward(self, x, mask):
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(h)


def dtype_dependent():
    torch.manual_seed(0)
    return (DtypeDependent(), (torch.randn(BATCH, 4), torch.rand(BATCH, 8) < 0.3),
            lambda out: out.float().pow(2).mean())


class DtypeBranch(nn.Module):
    """T5's feed-forward guard, written for bf16: the hidden states are clamped only when they are bf16 (an fp32
    trace takes the other branch, so its program under autocast is not what the eager module runs at bf16); and
    T5's attention bias, made in the hidden states' dtype: a bf16 trace holds a bf16 mask beside queries that
    only autocast makes bf16, so that program cannot run outside autocast."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.query = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h).relu()
            if h.dtype == torch.bfloat16:
                h = torch.clamp(h, max=0.25)
        q = self.query(h).view(h.shape[0], 1, 2, -1)  # (batch, heads 1, 2 tokens, dim / 2)
        bias = torch.zeros(h.shape[0], 1, 2, 2, dtype=q.dtype, device=q.device)
        h = h + F.scaled_dot_product_attention(q, q, q, attn_mask=bias).flatten(1)
        return self.head(h)


def dtype_branch():
    torch.manual_seed(0)
    return DtypeBranch(), (torch.randn(BATCH, 4),), lambda out: out.float().pow(2).mean()


class GraphConv(nn.Module):
    """A GCN layer on the nodes of every graph of the batch at once (torch_geometric's layout: ``(nodes, dim)``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h, src, dst):
        messages = self.lin(h)[src]
        return torch.relu(torch.zeros_like(h).index_add(0, dst, messages) + h)


class FoldedGNN(nn.Module):
    """Batch folded into the node dimension: ``(batch, nodes, dim)`` -> ``(batch * nodes, dim)`` through two
    graph convolutions and a linear head per node, then per-graph mean pooling: no value between the layers can
    be cut into micro-batches, so capture merges them into one op."""

    def __init__(self, nodes: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("src", torch.tensor([0, 1, 2, 3, 1]), persistent=False)
        self.register_buffer("dst", torch.tensor([1, 2, 3, 0, 3]), persistent=False)
        self.convs = nn.ModuleList(GraphConv(dim) for _ in range(2))
        self.lin = nn.Linear(dim, 2)

    def forward(self, x):
        b, n, d = x.shape
        offsets = (torch.arange(b, device=x.device) * n)[:, None]
        src, dst = (self.src[None] + offsets).reshape(-1), (self.dst[None] + offsets).reshape(-1)
        h = x.reshape(b * n, d)
        for conv in self.convs:
            h = conv(h, src, dst)
        return self.lin(h).reshape(b, n, -1).mean(1)  # the head per node, then per-graph mean pooling


def folded_gnn():
    torch.manual_seed(0)
    return FoldedGNN(), (torch.randn(BATCH, 4, 8),), lambda out: out.pow(2).mean()
