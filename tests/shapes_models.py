"""Models whose batches vary in shape from step to step, for tests/test_shapes.py (no dropout or BatchNorm, so
pipelined training equals one process to fp32 rounding).

* ``chain``: token ids through an embedding, a learned position table of :data:`MAX_LEN` rows, two blocks and a
  per-token head; the loss is a mean over every token, so its value depends on the length.
* ``branchy``: two token inputs of unrelated lengths (a text and a list of tags), a branch each, pooled and joined.
* ``hf_bert``: a two-layer BERT from a config, with an attention mask, classifying each sequence.
* ``patches``: float patch features whose count varies per step, declared by the factory's ``dynamic_shapes``.
* ``pinned``: reshapes its tokens into a constant number of positions: the length is fixed by its code.
* ``trimmed``: drops the positions that are padding in every row of its batch (a count that depends on the
  data: export's unbacked ``u0``) before the value crosses the cut, then sums per row; the sum does not depend on
  how many all-padding positions a micro-batch dropped, so pipelined training still equals one process.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 40
MAX_LEN = 32
WIDTH = 16
BATCH = 8


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(MAX_LEN, WIDTH)
        self.block1 = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids) + self.pos(positions)
        return self.head(self.block2(self.block1(h)))


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tokens(step: int, rows: int, length: int, salt: int = 0):
    gen = torch.Generator().manual_seed(1000 * salt + 17 * step + length)
    return torch.randint(0, VOCAB, (rows, length), generator=gen)


def chain():
    torch.manual_seed(0)
    ids = tokens(0, BATCH, 12)
    return Chain(), ids, token_loss, tokens(0, BATCH, 12, salt=1)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = nn.Embedding(VOCAB, WIDTH)
        self.text_block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.tags = nn.Embedding(VOCAB, WIDTH)
        self.tags_block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
        self.head = nn.Linear(2 * WIDTH, 3)

    def forward(self, text, tags):
        a = self.text_block(self.text(text))  # (rows, text length, width)
        b = self.tags_block(self.tags(tags))  # (rows, tags length, width)
        return self.head(torch.cat([a.mean(dim=1), b.mean(dim=1)], dim=-1))


def classes(step: int, rows: int):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 3, (rows,), generator=gen)


def class_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def branchy():
    torch.manual_seed(0)
    return Branchy(), (tokens(0, BATCH, 10), tokens(0, BATCH, 5, salt=2)), class_loss, classes(0, BATCH)


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * WIDTH, max_position_embeddings=MAX_LEN, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertForSequenceClassification(config)


def mask(step: int, rows: int, length: int):
    """Padding at the end of each row: row ``i`` keeps a length of its own, at least 1."""
    gen = torch.Generator().manual_seed(300 + step + length)
    keep = torch.randint(1, length + 1, (rows,), generator=gen)
    return (torch.arange(length)[None, :] < keep[:, None]).long()


def hf_loss(out, labels):
    return F.cross_entropy(out.logits, labels)


def hf_bert():
    torch.manual_seed(0)
    return _bert(), {"input_ids": tokens(0, BATCH, 12), "attention_mask": mask(0, BATCH, 12)}, hf_loss, \
        classes(0, BATCH)


class Pinned(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(12 * WIDTH, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).reshape(ids.shape[0], 12 * WIDTH))


def pinned():
    torch.manual_seed(0)
    return Pinned(), tokens(0, BATCH, 12), class_loss, classes(0, BATCH)


class Patches(nn.Module):
    """Image patches as float features, ``(rows, patches, features)``: the number of patches varies per image
    size, declared by the factory (a float input's dims are fixed unless declared)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, patches):
        return self.head(self.block(self.embed(patches)).mean(dim=1))


def patch_batch(step: int, rows: int, count: int):
    gen = torch.Generator().manual_seed(700 + step + count)
    return torch.randn(rows, count, 6, generator=gen)


def patches():
    torch.manual_seed(0)
    return (Patches(), patch_batch(0, BATCH, 9), class_loss, classes(0, BATCH),
            {"patches": {1: torch.export.Dim.AUTO}})


class SumHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, 3, bias=False)  # no bias: a padding position adds nothing to the sum

    def forward(self, h):
        return self.proj(h).sum(dim=1)


class Trimmed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.mix = nn.Linear(WIDTH, WIDTH, bias=False)  # zero at a padding position, as the sum needs
        self.head = SumHead()

    def forward(self, ids):
        present = ids != 0
        h = self.block(self.embed(ids)) * present.unsqueeze(-1)
        kept = present.any(dim=0).nonzero().squeeze(1)  # positions some row of this batch uses
        return self.head(self.mix(h.index_select(1, kept)))


def padded_tokens(step: int, rows: int, length: int):
    """Token ids (never 0) with each row padded by zeros past a length of its own, at least 1."""
    return tokens(step, rows, length).clamp(min=1) * mask(step, rows, length)


def trimmed():
    torch.manual_seed(0)
    return Trimmed(), padded_tokens(0, BATCH, 12), class_loss, classes(0, BATCH)
