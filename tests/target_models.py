"""Factories whose losses take a target from a restricted domain (used by test_check_targets.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Recommender(nn.Module):
    """Dense features and an id embedding, a click probability per row."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.dense = nn.Linear(6, 8)
        self.top = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids):
        return self.top(torch.cat([self.dense(dense), self.emb(ids)], dim=1)).squeeze(1)


def recommender():
    """BCE on logits: labels must lie in [0, 1] (a label of 2.3 or -1.1 makes the loss meaningless, even negative)."""
    torch.manual_seed(0)
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    inputs = (torch.randn(8, 6), torch.randint(0, 50, (8,)))
    return Recommender(), inputs, lambda out, y: F.binary_cross_entropy_with_logits(out, y), labels


def classifier():
    """Cross-entropy over 5 classes: a target outside 0..4 is an error, not a loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    return model, (torch.randn(6, 12),), lambda out, y: F.cross_entropy(out, y), torch.tensor([0, 4, 2, 2, 1, 3])
