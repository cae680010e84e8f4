"""--check and graphpipe run draw a factory's targets from its example target's rows, so losses stay in their domain."""

import os

import torch

from graphpipe.runtime.runnable import build_runnable

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "target_models.py")


def test_bce_labels_are_the_examples_rows_and_the_loss_is_a_real_bce():
    runnable = build_runnable(MODELS + ":recommender")
    for seed in range(3):
        dense, ids, labels = runnable.make_inputs(32, seed)
        assert labels.shape == (32,) and labels.dtype == torch.float32
        assert set(labels.tolist()) <= {0.0, 1.0} and len(set(labels.tolist())) == 2  # both classes drawn
        assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 50
        out = runnable.module(dense, ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, labels)
        assert loss.item() > 0  # a BCE is never negative when labels are labels
    a, b = runnable.make_inputs(16, 7)[-1], runnable.make_inputs(16, 7)[-1]
    assert torch.equal(a, b)  # same seed, same targets
    assert not torch.equal(runnable.make_inputs(64, 1)[-1], runnable.make_inputs(64, 2)[-1])


def test_class_targets_stay_valid_classes_with_their_dtype():
    runnable = build_runnable(MODELS + ":classifier")
    x, y = runnable.make_inputs(40, 3)
    assert y.dtype == torch.int64 and y.shape == (40,)
    assert set(y.tolist()) <= {0, 1, 2, 3, 4}
    assert x.shape == (40, 12) and abs(x.mean().item()) < 1  # inputs are drawn afresh, not resampled


def test_uncaptured_reference_draws_the_same_targets():
    """The single-process --check reference (capture=False) sees the same targets as the pipelined run."""
    captured = build_runnable(MODELS + ":recommender")
    reference = build_runnable(MODELS + ":recommender", capture=False)
    for a, b in zip(captured.make_inputs(12, 5), reference.make_inputs(12, 5)):
        assert torch.equal(a, b)
