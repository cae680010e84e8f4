"""Small models with what real networks have and the zoo lacks: dropout and BatchNorm inside
branches, and an output head tied to the input embedding.

Each factory returns ``(module, example_inputs, loss_fn)`` (the ``file.py:factory`` contract), so a plan's
``model`` can be ``tests/real_models.py:branchy`` and the runtime rebuilds it on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpipe.frontend.layer import Layer

BATCH = 8


class Branchy(nn.Module):
    """A BatchNorm2d + Dropout2d stem, two branches with BatchNorm and dropout (module and functional), a head.

    Convolutions keep several values per channel in every micro-batch: BatchNorm over 2 scalars per
    channel is so ill-conditioned that fp32 rounding alone moves gradients past assert_close's tolerance.
    """

    def __init__(self, width: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(4)
        self.stem_drop = nn.Dropout2d(0.25)
        self.a1 = nn.Conv2d(4, width, 3, padding=1, bias=False)
        self.a_bn = nn.BatchNorm2d(width)
        self.a_drop = nn.Dropout(0.3)
        self.a2 = nn.Conv2d(width, 4, 1)
        self.b1 = nn.Conv2d(4, width, 1, bias=False)
        self.b_bn = nn.BatchNorm2d(width, momentum=None)  # cumulative average: another commit rule
        self.b2 = nn.Conv2d(width, 4, 1)
        self.head = nn.Linear(8 * 3 * 3, 3)

    def forward(self, x):
        h = self.stem_drop(F.relu(self.stem_bn(self.stem(x))))
        a = self.a2(self.a_drop(F.relu(self.a_bn(self.a1(h)))))
        b = self.b2(F.dropout(torch.tanh(self.b_bn(self.b1(h))), p=0.2, training=self.training))
        return self.head(torch.cat([a, b], dim=1).flatten(1))


def branchy():
    torch.manual_seed(0)  # the runtime seeds before calling; this keeps direct calls deterministic too
    model = Branchy()
    return model, (torch.randn(BATCH, 2, 3, 3),), lambda out: out.pow(2).mean() + out[:, 0].mean()


class TiedLM(nn.Module):
    """A GPT-style toy: embedding, two residual MLP blocks with dropout, output head sharing the embedding."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(0.1)
        self.block0 = nn.Linear(dim, dim)
        self.block1 = nn.Linear(dim, dim)
        self.block2 = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 does

    def forward(self, tokens):
        h = self.drop(self.embed(tokens))
        h = h + torch.tanh(self.block0(h))
        h = h + torch.tanh(self.block1(h))
        h = h + torch.tanh(self.block2(h))
        return self.head(h)


def tied_lm():
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 32, (BATCH, 5))
    tokens[0, 0] = 31  # the runtime draws tokens in [0, max + 1)
    return model, (tokens,), lambda logits: logits.logsumexp(-1).mean() - logits[..., 0].mean()


class NoisyLayer(nn.Module):
    """Noise from the global generator (``torch.randn_like``): the runtime seeds it per shard."""

    def forward(self, x):
        return x + 0.01 * torch.randn_like(x)


class TransformerBlock(nn.Module):
    """``nn.TransformerEncoderLayer`` with dropout: a capture leaf whose dropouts (and attention's) are inside."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.block = nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.2, batch_first=True)
        self.noise = NoisyLayer()
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        return self.out(self.noise(self.block(self.inp(x))))


def noisy():
    torch.manual_seed(0)
    return TransformerBlock(), (torch.randn(BATCH, 3, 6),), lambda out: out.pow(2).mean()


class DropPath(nn.Module):
    """Stochastic depth as timm and Hugging Face write it: a ``torch.rand`` of shape ``(batch, 1, 1)``, a
    factory whose size, not any tensor argument, carries the batch."""

    def __init__(self, dim: int = 6, keep: float = 0.5):
        super().__init__()
        self.fc, self.keep = nn.Linear(dim, dim), keep

    def forward(self, x):
        mask = (self.keep + torch.rand((x.shape[0], 1, 1), dtype=x.dtype, device=x.device)).floor()
        return x + self.fc(x) * mask / self.keep


def drop_path():
    torch.manual_seed(0)
    return nn.Sequential(DropPath(), DropPath()), (torch.randn(BATCH, 3, 6),), lambda out: out.pow(2).mean()


class OwnGenerator(Layer):
    """A custom op with a generator of its own: its draws depend on how often it ran, where (cannot be replayed)."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x):
        return x + 0.01 * torch.randn(x.shape[1:], generator=self.gen)  # one draw per feature, shared by the rows


def own_generator():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), OwnGenerator(), nn.Linear(6, 2))
    return model, (torch.randn(BATCH, 6),), lambda out: out.pow(2).mean()


class SharedLayer(nn.Module):
    """One ``nn.Linear`` called twice (weights shared between two ops, which a plan may put in two stages)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        h = torch.relu(self.shared(self.inp(x)))
        return self.out(torch.tanh(self.shared(h)))


def shared_layer():
    torch.manual_seed(0)
    return SharedLayer(), (torch.randn(BATCH, 6),), lambda out: out.pow(2).mean()
