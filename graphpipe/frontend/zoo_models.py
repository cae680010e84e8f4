"""Layer classes and model definitions of the model zoo (docs/design.md, "The op graph").

Every model is a plain ``nn.Module`` built from :class:`Layer` subclasses.
A :class:`Layer` is what :mod:`graphpipe.frontend.capture` keeps as one fx leaf and
therefore one op of the :class:`~graphpipe.graph.OpGraph` (a transformer
block, an MLP layer, an embedding table, a concat, a head). Module attribute
names are chosen so that the qualified name of each layer is the op name,
e.g. ``branch0.layer3``, ``emb2``, ``concat``, ``head``.

Sizes live in frozen config dataclasses (:mod:`graphpipe.zoo_configs`, free of
torch); :mod:`graphpipe.frontend.zoo` owns the ``small`` / ``paper`` presets and the
option parsing.

Why these shapes (GraphPipe, Jeon et al., ASPLOS'25, Appendix A.2):

- MMT: one transformer-layer branch per modality, concat, classification head.
- DLRM: dense-feature MLP branches and embedding-bag branches meet in a
  pairwise dot-product interaction, then a top MLP.
- CANDLE-Uno: one feature-encoder MLP branch per feature type, concat, MLP head.
- GPT: the sequential sanity case (a chain: SPP and GPP should agree).
- TwoBranch: the paper's case study -- a shared embedding feeding two
  transformer branches joined by a concat and a token-level head.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpipe.frontend.layer import Layer
from graphpipe.zoo_configs import DLRMConfig, GPTConfig, MMTConfig, TwoBranchConfig, UnoConfig

__all__ = [
    "Layer",
    "TransformerLayer",
    "MLPLayer",
    "EmbeddingBagTable",
    "TokenEmbedding",
    "Concat",
    "DotInteraction",
    "ClassifierHead",
    "LMHead",
    "MMTConfig",
    "DLRMConfig",
    "UnoConfig",
    "GPTConfig",
    "TwoBranchConfig",
    "MMT",
    "DLRM",
    "CandleUno",
    "GPT",
    "TwoBranch",
]


# ---------------------------------------------------------------- layers


class TransformerLayer(Layer):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + ffn(ln(x))``.

    Attention uses ``F.scaled_dot_product_attention`` so FLOP counting sees
    the two attention matmuls on any device (meta included).
    """

    kind = "transformer"

    def __init__(self, hidden: int, heads: int, ffn: int, causal: bool = False):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(hidden, dim=-1)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLPLayer(Layer):
    """One feed-forward layer: Linear followed by ReLU (none on a final layer)."""

    kind = "mlp"

    def __init__(self, in_features: int, out_features: int, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return F.relu(y) if self.activation else y


class EmbeddingBagTable(Layer):
    """One DLRM embedding table: sum of ``bag`` looked-up rows per sample.

    Input: int64 indices of shape ``(batch, bag)`` (fixed-size bags, so no
    offsets are needed).
    """

    kind = "embedding"

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode="sum")

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.bag(indices)


class TokenEmbedding(Layer):
    """Token plus learned position embedding: ``(batch, seq)`` int64 -> ``(batch, seq, hidden)``."""

    kind = "embedding"

    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Concat(Layer):
    """Join of parallel branches along the last dimension (the GPP merge point)."""

    kind = "concat"

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, dim=-1)


class DotInteraction(Layer):
    """DLRM interaction: pairwise dot products of all feature vectors, concatenated
    with the dense vectors (Naumov et al. 2019, "dot" interaction)."""

    kind = "interaction"

    def __init__(self, num_features: int):
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: list[torch.Tensor], sparse: list[torch.Tensor]) -> torch.Tensor:
        features = torch.stack(list(dense) + list(sparse), dim=1)  # (batch, features, dim)
        dots = torch.bmm(features, features.transpose(1, 2))
        return torch.cat(list(dense) + [dots[:, self.rows, self.cols]], dim=1)


class ClassifierHead(Layer):
    """LayerNorm, mean over the sequence, Linear to classes (sequence classifier)."""

    kind = "head"

    def __init__(self, hidden: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x).mean(dim=1))


class LMHead(Layer):
    """LayerNorm and Linear to the vocabulary at every position (GPT head)."""

    kind = "head"

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _stack(prefix: str, layers: list[nn.Module]) -> nn.Sequential:
    """A Sequential whose children are named ``{prefix}0``, ``{prefix}1``, ..."""
    return nn.Sequential(OrderedDict((f"{prefix}{i}", layer) for i, layer in enumerate(layers)))


def _mlp(in_features: int, hidden: int, out_features: int, num_layers: int, last_activation: bool = True) -> nn.Sequential:
    """``num_layers`` MLPLayers ``in -> hidden -> ... -> out`` named ``layer0..``."""
    dims = [in_features] + [hidden] * (num_layers - 1) + [out_features]
    return _stack("layer", [MLPLayer(dims[i], dims[i + 1], activation=(i < num_layers - 1 or last_activation))
                            for i in range(num_layers)])


# ---------------------------------------------------------------- models
class MMT(nn.Module):
    """Multi-modal transformer: ``branch{i}.layer{j}`` -> ``concat`` -> ``head``.

    Inputs: one ``(batch, seq, hidden)`` float tensor per modality.
    """

    def __init__(self, cfg: MMTConfig):
        super().__init__()
        self.num_branches = cfg.branches
        for i in range(cfg.branches):
            self.add_module(f"branch{i}", _stack("layer", [TransformerLayer(cfg.hidden, cfg.heads, cfg.ffn)
                                                           for _ in range(cfg.layers)]))
        self.concat = Concat()
        self.head = ClassifierHead(cfg.branches * cfg.hidden, cfg.classes)

    def forward(self, *modalities: torch.Tensor) -> torch.Tensor:
        outs = [getattr(self, f"branch{i}")(x) for i, x in enumerate(modalities)]
        return self.head(self.concat(*outs))


class DLRM(nn.Module):
    """DLRM: ``dense{i}.layer{j}`` and ``emb{i}`` -> ``interaction`` -> ``top.layer{j}``.

    Inputs: ``branches`` dense ``(batch, features)`` float tensors, then
    ``branches`` index tensors ``(batch, bag)`` int64.
    """

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.num_branches = cfg.branches
        for i in range(cfg.branches):
            self.add_module(f"dense{i}", _mlp(cfg.features, cfg.hidden, cfg.dim, cfg.layers))
        for i in range(cfg.branches):
            self.add_module(f"emb{i}", EmbeddingBagTable(cfg.rows, cfg.dim))
        num_features = 2 * cfg.branches
        self.interaction = DotInteraction(num_features)
        width = cfg.branches * cfg.dim + num_features * (num_features - 1) // 2
        self.top = _mlp(width, cfg.hidden, 1, cfg.top_layers, last_activation=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        k = self.num_branches
        dense = [getattr(self, f"dense{i}")(x) for i, x in enumerate(inputs[:k])]
        sparse = [getattr(self, f"emb{i}")(x) for i, x in enumerate(inputs[k:])]
        return self.top(self.interaction(dense, sparse))


class CandleUno(nn.Module):
    """CANDLE-Uno: ``branch{i}.layer{j}`` -> ``concat`` -> ``head.layer{j}``.

    Inputs: one ``(batch, features)`` float tensor per feature type.
    """

    def __init__(self, cfg: UnoConfig):
        super().__init__()
        self.num_branches = cfg.branches
        for i in range(cfg.branches):
            self.add_module(f"branch{i}", _mlp(cfg.features, cfg.hidden, cfg.hidden, cfg.layers))
        self.concat = Concat()
        self.head = _mlp(cfg.branches * cfg.hidden, cfg.hidden, 1, cfg.head_layers, last_activation=False)

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        outs = [getattr(self, f"branch{i}")(x) for i, x in enumerate(features)]
        return self.head(self.concat(*outs))


class GPT(nn.Module):
    """GPT-style decoder stack: ``embed`` -> ``layer{j}`` -> ``head`` (a chain).

    Input: ``(batch, seq)`` int64 tokens.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_layers = cfg.layers
        self.embed = TokenEmbedding(cfg.vocab, cfg.seq, cfg.hidden)
        for j in range(cfg.layers):
            self.add_module(f"layer{j}", TransformerLayer(cfg.hidden, cfg.heads, cfg.ffn, causal=True))
        self.head = LMHead(cfg.hidden, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for j in range(self.num_layers):
            x = getattr(self, f"layer{j}")(x)
        return self.head(x)


class TwoBranch(nn.Module):
    """The case-study model: ``embed`` -> ``branch{i}.layer{j}`` -> ``concat`` -> ``head``.

    Input: ``(batch, seq)`` int64 tokens shared by both branches.
    """

    def __init__(self, cfg: TwoBranchConfig):
        super().__init__()
        self.num_branches = cfg.branches
        self.embed = TokenEmbedding(cfg.vocab, cfg.seq, cfg.hidden)
        for i in range(cfg.branches):
            self.add_module(f"branch{i}", _stack("layer", [TransformerLayer(cfg.hidden, cfg.heads, cfg.ffn, causal=True)
                                                           for _ in range(cfg.layers)]))
        self.concat = Concat()
        self.head = LMHead(cfg.branches * cfg.hidden, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.concat(*[getattr(self, f"branch{i}")(x) for i in range(self.num_branches)]))
