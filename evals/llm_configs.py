"""Large Hugging Face language models at their published shapes, built on the meta device, as plan factories.

    graphpipe plan evals/llm_configs.py:qwen2_72b --devices 512 --batch-size 2048 --cluster h100

Each public function of :data:`NAMES` is a ``file.py:factory`` the commands
plan, shaped like :func:`evals.bench_llm.factory`: ``(module, example
inputs, loss, example labels)`` of one architecture at the published shape
of a well-known checkpoint, built under ``torch.device("meta")`` (no
weights are allocated, nothing is downloaded). They are the held-out check
that planning a decoder (or encoder-decoder) nobody tuned for stays fast:
``python -m graphpipe.evals.bench_llm_configs`` times them.

``GRAPHPIPE_LLM_LAYERS`` overrides the depth (every stack: a T5's encoder
and decoder both); :func:`build` with ``tiny=True`` gives the same
architecture at a tiny width (the tests compare its unrolled capture with
the whole one). An architecture whose class the installed transformers
lacks raises a one-line error naming it.

DeepSeek-V3 is built with 16 routed experts instead of 256 (everything
else at its shape): with 256, one of its layers holds about 11 billion
parameters, more than an 80 GB device keeps for training, and a pipeline
stage is whole layers, so the plan would be refused (as Llama-4 Maverick's
is: 128 experts, about 16 billion parameters a layer) before the search
says anything. A model name says when a shape is reduced.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ARCHS", "NAMES", "build", "qwen2_72b", "mixtral_8x22b", "qwen3_moe_30b_a3b", "gemma2_27b", "gemma3_27b",
           "phi3_medium", "falcon_40b", "gpt_neox_20b", "opt_66b", "bloom_176b", "mistral_large_123b",
           "deepseek_v3_e16", "llama4_maverick", "llama4_scout", "t5_11b", "ul2_20b", "bart_large",
           "nllb_3b", "gpt_oss_120b"]

_TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
"""The tiny widths most architectures take (:func:`build` with ``tiny=True``)."""
_LLAMA4_MAVERICK = dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=128,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=202048,
                        max_position_embeddings=1048576, tie_word_embeddings=False)
"""Llama-4 Maverick's text model: 128 experts on every other layer (Scout: 16 on every layer)."""
_TINY_LLAMA4 = dict(_TINY, intermediate_size=32, intermediate_size_mlp=96, head_dim=16, num_local_experts=4)

# name -> (model class, config class, published shape, tiny overrides)
ARCHS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_72b": ("Qwen2ForCausalLM", "Qwen2Config",
                  dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768,
                       tie_word_embeddings=False),
                  dict(_TINY)),
    "mixtral_8x22b": ("MixtralForCausalLM", "MixtralConfig",
                      dict(hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
                           num_key_value_heads=8, vocab_size=32768, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=65536, tie_word_embeddings=False),
                      dict(_TINY, num_local_experts=4)),
    "qwen3_moe_30b_a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                          dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                               vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False),
                          dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                               vocab_size=128)),
    "gemma2_27b": ("Gemma2ForCausalLM", "Gemma2Config",
                   dict(hidden_size=4608, intermediate_size=36864, num_hidden_layers=46, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, vocab_size=256000, sliding_window=4096,
                        query_pre_attn_scalar=144, max_position_embeddings=8192),
                   dict(_TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3_27b": ("Gemma3ForCausalLM", "Gemma3TextConfig",
                   dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
                        query_pre_attn_scalar=168, max_position_embeddings=131072),
                   dict(_TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "phi3_medium": ("Phi3ForCausalLM", "Phi3Config",
                    dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=10, vocab_size=32064, max_position_embeddings=4096,
                         tie_word_embeddings=False),
                    dict(_TINY, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "falcon_40b": ("FalconForCausalLM", "FalconConfig",
                   dict(hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                        new_decoder_architecture=True, parallel_attn=True, alibi=False, bias=False,
                        vocab_size=65024),
                   dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2, vocab_size=128)),
    "gpt_neox_20b": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                     dict(hidden_size=6144, intermediate_size=24576, num_hidden_layers=44, num_attention_heads=64,
                          rotary_pct=0.25, use_parallel_residual=True, vocab_size=50432,
                          max_position_embeddings=2048, tie_word_embeddings=False),
                     dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=128)),
    "opt_66b": ("OPTForCausalLM", "OPTConfig",
                dict(hidden_size=9216, ffn_dim=36864, num_hidden_layers=64, num_attention_heads=72,
                     word_embed_proj_dim=9216, vocab_size=50272, max_position_embeddings=2048,
                     do_layer_norm_before=True, enable_bias=True),
                dict(hidden_size=64, ffn_dim=96, num_attention_heads=4, word_embed_proj_dim=64, vocab_size=128)),
    "bloom_176b": ("BloomForCausalLM", "BloomConfig",
                   dict(hidden_size=14336, n_layer=70, n_head=112, vocab_size=250880),
                   dict(hidden_size=64, n_head=4, vocab_size=128)),
    "mistral_large_123b": ("MistralForCausalLM", "MistralConfig",
                           dict(hidden_size=12288, intermediate_size=28672, num_hidden_layers=88,
                                num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                                max_position_embeddings=131072, sliding_window=None, tie_word_embeddings=False),
                           dict(_TINY, head_dim=16)),
    "deepseek_v3_e16": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                        dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                             num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=16, n_shared_experts=1,
                             num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128,
                             num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                             max_position_embeddings=163840, tie_word_embeddings=False),
                        dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, vocab_size=128)),
    "llama4_maverick": ("Llama4ForCausalLM", "Llama4TextConfig",
                        _LLAMA4_MAVERICK, _TINY_LLAMA4),
    "llama4_scout": ("Llama4ForCausalLM", "Llama4TextConfig",
                     dict(_LLAMA4_MAVERICK, num_local_experts=16, interleave_moe_layer_step=1,
                          max_position_embeddings=262144), _TINY_LLAMA4),
    "t5_11b": ("T5ForConditionalGeneration", "T5Config",
               dict(d_model=1024, d_ff=65536, d_kv=128, num_layers=24, num_decoder_layers=24, num_heads=128,
                    vocab_size=32128, feed_forward_proj="relu", tie_word_embeddings=False),
               dict(d_model=64, d_ff=96, d_kv=16, num_heads=4, vocab_size=128)),
    "ul2_20b": ("T5ForConditionalGeneration", "T5Config",
                dict(d_model=4096, d_ff=16384, d_kv=256, num_layers=32, num_decoder_layers=32, num_heads=16,
                     vocab_size=32128, feed_forward_proj="gated-silu", tie_word_embeddings=False),
                dict(d_model=64, d_ff=96, d_kv=16, num_heads=4, vocab_size=128)),
    "bart_large": ("BartForConditionalGeneration", "BartConfig",
                   dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265),
                   dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                        decoder_ffn_dim=96, vocab_size=128)),
    # NLLB-200 3.3B (dense): M2M100's architecture, with training-time LayerDrop off (a branch on a random draw
    # cannot be exported); its sinusoidal positions are made in a torch.no_grad() region
    "nllb_3b": ("M2M100ForConditionalGeneration", "M2M100Config",
                dict(d_model=2048, encoder_layers=24, decoder_layers=24, encoder_attention_heads=16,
                     decoder_attention_heads=16, encoder_ffn_dim=8192, decoder_ffn_dim=8192, vocab_size=256206,
                     encoder_layerdrop=0.0, decoder_layerdrop=0.0, scale_embedding=True),
                dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                     decoder_ffn_dim=96, vocab_size=128)),
    "gpt_oss_120b": ("GptOssForCausalLM", "GptOssConfig",
                     dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
                          sliding_window=128, vocab_size=201088, tie_word_embeddings=False),
                     dict(_TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
}
"""Every architecture :func:`build` knows."""

NAMES = tuple(ARCHS)

_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


def build(name: str, layers: int | None = None, tiny: bool = False, batch: int = 2, seq: int = 128):
    """``(module, example inputs, loss, example labels)`` of architecture ``name`` on the meta device.

    ``layers`` overrides the depth (of both stacks of an encoder-decoder;
    default ``GRAPHPIPE_LLM_LAYERS`` or the published one); ``tiny``
    shrinks the widths (the tests' small configs of the same architecture).
    """
    import torch
    import torch.nn.functional as F
    import transformers

    if name not in ARCHS:
        raise ValueError(f"unknown LLM config {name!r}; known: {', '.join(NAMES)}")
    model_cls, config_cls, shape, small = ARCHS[name]
    if not hasattr(transformers, model_cls) or not hasattr(transformers, config_cls):
        raise RuntimeError(f"{name}: transformers {transformers.__version__} has no {model_cls}; "
                           f"install a version that has it")
    config = dict(shape, **(small if tiny else {}))
    if layers is None and os.environ.get("GRAPHPIPE_LLM_LAYERS"):
        layers = int(os.environ["GRAPHPIPE_LLM_LAYERS"])
    if layers is not None:
        config.update({k: layers for k in _DEPTH_KEYS if k in config})
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    labels = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, inputs, loss_fn, labels


def _factory(name: str):
    def made():
        return build(name)

    made.__name__ = name
    made.__qualname__ = name
    made.__doc__ = f"``(module, inputs, loss, labels)`` of a meta-device {name} at its published shape."
    return made


qwen2_72b = _factory("qwen2_72b")
mixtral_8x22b = _factory("mixtral_8x22b")
qwen3_moe_30b_a3b = _factory("qwen3_moe_30b_a3b")
gemma2_27b = _factory("gemma2_27b")
gemma3_27b = _factory("gemma3_27b")
phi3_medium = _factory("phi3_medium")
falcon_40b = _factory("falcon_40b")
gpt_neox_20b = _factory("gpt_neox_20b")
opt_66b = _factory("opt_66b")
bloom_176b = _factory("bloom_176b")
mistral_large_123b = _factory("mistral_large_123b")
deepseek_v3_e16 = _factory("deepseek_v3_e16")
llama4_maverick = _factory("llama4_maverick")
llama4_scout = _factory("llama4_scout")
t5_11b = _factory("t5_11b")
ul2_20b = _factory("ul2_20b")
bart_large = _factory("bart_large")
nllb_3b = _factory("nllb_3b")
gpt_oss_120b = _factory("gpt_oss_120b")
