"""A small Stable-Diffusion-shaped diffusers ``UNet2DConditionModel``, built from a config (no weights are
downloaded), for ``evals/rank_rss``'s per-rank memory of a convolutional model with cross-attention.

    graphpipe inspect evals/unet_model.py:unet
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH = 4


def _loss(out, target):
    return F.mse_loss(out.sample, target)


def unet():
    """Three resolution levels (64-128-256 channels) of cross-attention down and up blocks on 32x32 latents,
    a 16-token text context of width 128: 48 MB of weights. A denoising step's loss against a noise target."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 128, 256),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=128, attention_head_dim=8, norm_num_groups=32)
    inputs = {"sample": torch.randn(BATCH, 4, 32, 32), "timestep": torch.randint(0, 1000, (BATCH,)),
              "encoder_hidden_states": torch.randn(BATCH, 16, 128)}
    return model, inputs, _loss, torch.randn(BATCH, 4, 32, 32)
