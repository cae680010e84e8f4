"""CLIP (Hugging Face ``transformers.CLIPModel``) built from configs in code, no weights downloaded.

Two ``file.py:factory`` entries for :mod:`graphpipe.evals.clip_pipelines`:

* :func:`small`: a CPU-trainable CLIP (two 4-layer towers of width 64,
  32x32 images in 8x8 patches, 16 text tokens), random weights;
* :func:`paper`: CLIP ViT-B/16's shape (a 12-layer 768-wide vision tower
  over 224x224 images, a 12-layer 512-wide text tower over 77 tokens, a
  512-wide projection) on the meta device, for planning only.

The loss is binary cross-entropy on the diagonal of ``logits_per_image``
(each row's own image-text score against a match label): CLIP's in-batch
contrastive loss couples the rows of a batch, so micro-batching would change
it (docs/limits.md); this one is a mean over rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["small", "paper", "BATCH"]

BATCH = 16


def _model(text: dict, vision: dict, projection: int, meta: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection)
    if meta:
        with torch.device("meta"):
            return transformers.CLIPModel(cfg)
    return transformers.CLIPModel(cfg)


def _loss(out, match):
    return F.binary_cross_entropy_with_logits(out.logits_per_image.diagonal() / 10.0, match.float())


def small():
    torch.manual_seed(0)
    model = _model(dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                        pad_token_id=1),
                   dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        image_size=32, patch_size=8), 32, meta=False)
    ids = torch.randint(2, 256, (BATCH, 16))
    ids[0, 0], ids[1, 0] = 255, 2  # the runtime draws ids in [min, max] of the example
    inputs = dict(input_ids=ids, attention_mask=torch.ones(BATCH, 16, dtype=torch.long),
                  pixel_values=torch.randn(BATCH, 3, 32, 32))
    return model, inputs, _loss, (torch.arange(BATCH) % 2).float()


def paper():
    model = _model(dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=8, max_position_embeddings=77),
                   dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        image_size=224, patch_size=16), 512, meta=True)
    inputs = dict(input_ids=torch.zeros(2, 77, dtype=torch.long, device="meta"),
                  attention_mask=torch.ones(2, 77, dtype=torch.long, device="meta"),
                  pixel_values=torch.zeros(2, 3, 224, 224, device="meta"))
    return model, inputs, _loss, torch.zeros(2, device="meta")
