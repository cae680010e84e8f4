"""Vision-language models built from tiny configs in code (random weights, nothing downloaded).

Each factory follows the ``file.py:factory`` contract with a target:

* :func:`paligemma`: ``PaliGemmaForConditionalGeneration``, a SigLIP vision
  tower beside a Gemma decoder; the projected image features replace the
  image placeholder tokens of ``input_ids`` (``masked_scatter``).
* :func:`mllama`: ``MllamaForConditionalGeneration``, a tiled vision encoder
  whose features the text decoder reads through cross-attention layers.
* :func:`altclip`: ``AltCLIPModel``, a dual encoder; the loss reads both
  towers' embeddings (a per-row loss, not the in-batch contrastive one).

Next-token cross-entropy against a target of token ids for the decoders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH = 4
IMAGE_TOKEN = 63


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _ids(image_tokens: int, length: int = 8):
    """Token ids with ``image_tokens`` placeholders after the first token of every row, and a target."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (BATCH, max(length, image_tokens + 4)), generator=gen)
    ids[:, 1:1 + image_tokens] = IMAGE_TOKEN
    return ids, torch.randint(3, 60, ids.shape, generator=gen)


def _pixels(*shape: int):
    return torch.randn(BATCH, *shape, generator=torch.Generator().manual_seed(2))


def lm_loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def _vision(**extra):
    return dict(image_size=16, patch_size=8, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                num_hidden_layers=1, **extra)


def paligemma():
    T = _transformers()
    torch.manual_seed(0)
    text = T.GemmaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, vocab_size=64, num_hidden_layers=1)
    cfg = T.PaliGemmaConfig(vision_config=T.SiglipVisionConfig(**_vision(projection_dim=16)).to_dict(),
                            text_config=text.to_dict(), image_token_index=IMAGE_TOKEN, projection_dim=16,
                            hidden_size=16)
    ids, target = _ids(4)
    return T.PaliGemmaForConditionalGeneration(cfg), {"input_ids": ids, "pixel_values": _pixels(3, 16, 16)}, \
        lm_loss, target


def mllama():
    T = _transformers()
    torch.manual_seed(0)
    vision = {k: v for k, v in _vision().items() if k != "num_attention_heads"}
    vision = T.MllamaVisionConfig(**vision, attention_heads=2,
                                  num_global_layers=1, vision_output_dim=32, intermediate_layers_indices=[0],
                                  max_num_tiles=1, supported_aspect_ratios=[[1, 1]])
    text = T.MllamaTextConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                              vocab_size=64, num_hidden_layers=2, cross_attention_layers=[1], pad_token_id=0,
                              bos_token_id=1, eos_token_id=2)
    cfg = T.MllamaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE_TOKEN)
    ids, target = _ids(1)
    inputs = {"input_ids": ids, "pixel_values": _pixels(1, 1, 3, 16, 16),
              "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long),
              "aspect_ratio_mask": torch.ones(BATCH, 1, 1, dtype=torch.long),
              "cross_attention_mask": torch.ones(BATCH, ids.shape[1], 1, 1, dtype=torch.long)}
    return T.MllamaForConditionalGeneration(cfg), inputs, lm_loss, target


def altclip():
    T = _transformers()
    torch.manual_seed(0)
    text = T.AltCLIPTextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, project_dim=16, max_position_embeddings=16, pad_token_id=1)
    cfg = T.AltCLIPConfig(text_config=text.to_dict(), vision_config=_vision(), projection_dim=16)
    ids, _ = _ids(0)
    target = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(3))

    def loss_fn(out, y):  # both towers' embeddings, row by row
        return F.mse_loss(out.image_embeds, y) + F.mse_loss(out.text_embeds, y)

    return T.AltCLIPModel(cfg), {"input_ids": ids, "pixel_values": _pixels(3, 16, 16)}, loss_fn, target

