"""Real-world models built from small configs in code (random weights, nothing downloaded).

Each factory follows the ``file.py:factory`` contract; the ones whose loss
takes a target return it as a fourth element:

* :func:`clip`: ``transformers.CLIPModel`` (vision and text towers: two
  branches). Keyword inputs ``input_ids``, ``attention_mask``,
  ``pixel_values``; the target says for each row whether its image and text
  match (1) or not (0), and the loss is binary cross-entropy on the
  diagonal of ``logits_per_image`` (each row's own image-text score).
  The in-batch contrastive loss couples the rows of a micro-batch, so it
  is not the same training under micro-batching; the diagonal is.
* :func:`llama`: ``LlamaForCausalLM`` with ``tie_word_embeddings=True``;
  next-token cross-entropy against a target of token ids.
* :func:`bert`: ``BertForSequenceClassification``, class labels as target.
* :func:`gpt2_meta`, :func:`mixtral_meta`: meta-device GPT-2 and Mixtral (capture only).
* :func:`m2m100`, :func:`mixtral`: an encoder-decoder with a ``no_grad`` region, a mixture of experts (runs).
* :func:`efficientnet`: timm's ``test_efficientnet`` (the EfficientNet
  family's small test size: depthwise-separable blocks, squeeze-excite,
  BatchNorm, dropout); class labels as target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH = 4


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def clip():
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8),
        projection_dim=16)
    model = T.CLIPModel(cfg)
    inputs = dict(input_ids=torch.randint(2, 64, (BATCH, 8)), attention_mask=torch.ones(BATCH, 8, dtype=torch.long),
                  pixel_values=torch.randn(BATCH, 3, 16, 16))
    inputs["input_ids"][0, 0] = 63  # the extreme ids in the rows the runtime resamples its data from
    inputs["input_ids"][1, 0] = 2
    target = torch.tensor([1.0, 0.0, 1.0, 1.0])

    def loss_fn(out, match):
        return F.binary_cross_entropy_with_logits(out.logits_per_image.diagonal() / 10.0, match.float())

    return model, inputs, loss_fn, target


def llama(layers: int = 2, hidden: int = 32, meta: bool = False, batch: int = BATCH, seq: int = 8):
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    if meta:
        with torch.device("meta"):
            model = T.LlamaForCausalLM(cfg)
    else:
        model = T.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (batch, seq), device="meta" if meta else "cpu")
    if not meta:
        ids[0, 0] = 63

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    return model, dict(input_ids=ids), loss_fn, ids.clone()


def llama_config(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int = 32000, tie: bool = False):
    """A Llama config of a given size (for meta-device capture of 7B/70B shapes)."""
    T = _transformers()
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                        tie_word_embeddings=tie)
    cfg._attn_implementation = "sdpa"
    return cfg


def _meta_lm(model_class, cfg, batch: int, seq: int):
    """``(model, inputs, loss_fn, target)`` of a causal LM built on the meta device (no weights allocated):
    next-token cross-entropy against the input ids."""
    with torch.device("meta"):
        model = model_class(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    return model, dict(input_ids=ids), loss_fn, ids


def llama_meta(cfg, batch: int = 2, seq: int = 128):
    """``(model, inputs, loss_fn, target)`` of a meta-device Llama: no weights are allocated."""
    return _meta_lm(_transformers().LlamaForCausalLM, cfg, batch, seq)


def bert():
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=32, num_labels=3)
    model = T.BertForSequenceClassification(cfg)
    inputs = dict(input_ids=torch.randint(0, 64, (BATCH, 8)), attention_mask=torch.ones(BATCH, 8, dtype=torch.long))
    inputs["input_ids"][0, 0] = 63
    labels = torch.tensor([0, 2, 1, 0])
    return model, inputs, lambda out, y: F.cross_entropy(out.logits, y), labels


def m2m100():
    """An M2M100 translation model (NLLB's architecture) with LayerDrop off: its sinusoidal positions are computed
    under ``torch.no_grad()``, which export records as a higher-order op with a graph of its own."""
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.M2M100Config(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32,
                         encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    model = T.M2M100ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids, decoder_ids, labels = (torch.randint(3, 64, (BATCH, 8), generator=g) for _ in range(3))
    return (model, dict(input_ids=ids, decoder_input_ids=decoder_ids),
            lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), labels)


def mixtral():
    """A small Mixtral with real weights (8 experts, 2 per token, transformers' grouped experts): a run's ranks
    capture it on the meta device, where transformers counts tokens per expert with an integer ``histc``."""
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=32)
    model = T.MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 64, (BATCH, 8), generator=g) for _ in range(2))
    return model, dict(input_ids=ids), lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), labels


def efficientnet():
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=5, drop_rate=0.1)
    images = torch.randn(BATCH, 3, 64, 64)  # 2x2 maps at the end: BatchNorm over 2 rows x 4 values
    labels = torch.tensor([0, 4, 2, 1])
    return model, images, lambda out, y: F.cross_entropy(out, y), labels


def gpt2_meta(batch: int = 2, seq: int = 16):
    """A meta-device GPT-2: a learned position table read by dtype and device casts in the exported graph."""
    T = _transformers()
    cfg = T.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return _meta_lm(T.GPT2LMHeadModel, cfg, batch, seq)


def mixtral_meta(experts: str | None = None, batch: int = 2, seq: int = 16):
    """A meta-device Mixtral with 8 experts, 2 per token; ``experts`` names transformers' experts implementation
    (None: its default, grouped matmuls)."""
    T = _transformers()
    cfg = T.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=64)
    if experts is not None:
        cfg._experts_implementation = experts
    return _meta_lm(T.MixtralForCausalLM, cfg, batch, seq)
