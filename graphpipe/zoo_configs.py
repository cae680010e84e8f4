"""The zoo models' size configurations: plain frozen dataclasses, free of torch.

They live apart from :mod:`graphpipe.frontend.zoo_models` (the ``nn.Module``
definitions) so that parsing a zoo spec, its canonical spelling and the
graph cache's key need no torch: planning a zoo model whose graph is cached
never imports it. :mod:`graphpipe.frontend.zoo` owns the presets and the parsing.

Example
-------
>>> MMTConfig(branches=2, layers=2, seq=16, hidden=32, heads=4, ffn=64, classes=10).branches
2
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MMTConfig", "DLRMConfig", "UnoConfig", "GPTConfig", "TwoBranchConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MMTConfig:
    branches: int
    """Modalities: one input and one transformer branch each."""
    layers: int
    """Transformer layers per branch."""
    seq: int
    hidden: int
    heads: int
    ffn: int
    classes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DLRMConfig:
    branches: int
    """Dense MLP branches; there are as many embedding-bag branches."""
    layers: int
    """FF layers per dense branch (the last one projects to ``dim``)."""
    hidden: int
    features: int
    """Dense input features per dense branch."""
    dim: int
    """Embedding dimension (also the dense branches' output width)."""
    bag: int
    """Rows summed per embedding lookup."""
    rows: int
    """Rows per embedding table."""
    top_layers: int
    """Layers of the top MLP (last one outputs a single logit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnoConfig:
    branches: int
    """Feature types: one input and one encoder MLP each."""
    layers: int
    """FF layers per encoder branch."""
    hidden: int
    features: int
    """Input features per branch."""
    head_layers: int
    """Layers of the MLP head after the concat (last one outputs one value)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    layers: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    vocab: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoBranchConfig:
    branches: int
    layers: int
    """Transformer layers per branch."""
    seq: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
