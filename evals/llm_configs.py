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
and decoder both), ``GRAPHPIPE_LLM_SEQ`` the tokens per sample (default
128); :func:`build` with ``tiny=True`` gives the same
architecture at a tiny width (the tests compare its unrolled capture with
the whole one). An architecture whose class the installed transformers
lacks raises a one-line error naming it.

DeepSeek-V3 is built with 16 routed experts instead of 256 (everything
else at its shape): with 256, one of its layers holds about 11 billion
parameters, more than an 80 GB device keeps for training, and a pipeline
stage is whole layers, so the plan would be refused (as Llama-4 Maverick's
is: 128 experts, about 16 billion parameters a layer) before the search
says anything. A model name says when a shape is reduced.

Refused in one line, and kept here to show it: Llama-4 Maverick and
MiniMax-Text-01 (a layer bigger than a device), JetMoE (its experts read
the tokens routed to each with ``.tolist()``, a value the meta device does
not have). Whisper is fed log-mel frames (two per encoder position).
Not here (docs/limits.md): DBRX, which transformers 5.24 cannot build;
Jamba, whose Python scan in 32 layers too few to cut captures for minutes.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ARCHS", "NAMES", "build", "sequence_length", "qwen2_72b", "mixtral_8x22b", "qwen3_moe_30b_a3b", "gemma2_27b", "gemma3_27b",
           "phi3_medium", "falcon_40b", "gpt_neox_20b", "opt_66b", "bloom_176b", "mistral_large_123b",
           "deepseek_v3_e16", "llama4_maverick", "llama4_scout", "t5_11b", "ul2_20b", "bart_large", "nllb_3b",
           "gpt_oss_120b", "llama31_405b", "nemotron4_340b", "command_r_plus_104b", "starcoder2_15b", "glm4_32b",
           "olmo2_32b", "granite3_8b", "smollm3_3b", "exaone4_32b", "qwen3_32b", "ministral_8b", "olmoe_1b_7b",
           "phi35_moe", "qwen3_moe_235b_a22b", "granite_moe_3b", "jetmoe_8b", "hunyuan_a13b", "ernie45_moe_21b",
           "dots1_142b", "bamba_9b", "falcon_h1_34b", "falcon_mamba_7b", "mamba_2_8b", "mamba2_2_7b",
           "minimax_text_01",
           "whisper_large_v3", "mt5_xxl", "pegasus_x_large"]

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
    # --- dense decoders
    "llama31_405b": ("LlamaForCausalLM", "LlamaConfig",
                     dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=False),
                     dict(_TINY)),
    "nemotron4_340b": ("NemotronForCausalLM", "NemotronConfig",
                       dict(hidden_size=18432, intermediate_size=73728, num_hidden_layers=96, num_attention_heads=96,
                            num_key_value_heads=8, head_dim=192, vocab_size=256000, max_position_embeddings=4096,
                            tie_word_embeddings=False),
                       dict(_TINY, head_dim=16)),
    "command_r_plus_104b": ("CohereForCausalLM", "CohereConfig",
                            dict(hidden_size=12288, intermediate_size=33792, num_hidden_layers=64,
                                 num_attention_heads=96, num_key_value_heads=8, vocab_size=256000, use_qk_norm=True,
                                 logit_scale=0.8333333, max_position_embeddings=131072),
                            dict(_TINY)),
    "starcoder2_15b": ("Starcoder2ForCausalLM", "Starcoder2Config",
                       dict(hidden_size=6144, intermediate_size=24576, num_hidden_layers=40, num_attention_heads=48,
                            num_key_value_heads=4, vocab_size=49152, sliding_window=4096,
                            max_position_embeddings=16384),
                       dict(_TINY, sliding_window=8)),
    "glm4_32b": ("Glm4ForCausalLM", "Glm4Config",
                 dict(hidden_size=6144, intermediate_size=23040, num_hidden_layers=61, num_attention_heads=48,
                      num_key_value_heads=2, head_dim=128, vocab_size=151552, max_position_embeddings=32768,
                      tie_word_embeddings=False),
                 dict(_TINY, head_dim=16, pad_token_id=0, eos_token_id=0)),
    "olmo2_32b": ("Olmo2ForCausalLM", "Olmo2Config",
                  dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=100352, max_position_embeddings=4096,
                       tie_word_embeddings=False),
                  dict(_TINY)),
    "granite3_8b": ("GraniteForCausalLM", "GraniteConfig",
                    dict(hidden_size=4096, intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=49155, embedding_multiplier=12.0, logits_scaling=16.0,
                         residual_multiplier=0.22, attention_multiplier=0.0078125, tie_word_embeddings=True),
                    dict(_TINY)),
    "smollm3_3b": ("SmolLM3ForCausalLM", "SmolLM3Config",
                   dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=4, vocab_size=128256, no_rope_layer_interval=4,
                        max_position_embeddings=65536, tie_word_embeddings=True),
                   dict(_TINY, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "exaone4_32b": ("Exaone4ForCausalLM", "Exaone4Config",
                    dict(hidden_size=5120, intermediate_size=27392, num_hidden_layers=64, num_attention_heads=40,
                         num_key_value_heads=8, vocab_size=102400, sliding_window=4096, sliding_window_pattern=4,
                         max_position_embeddings=131072, tie_word_embeddings=False),
                    dict(_TINY, sliding_window=8)),
    "qwen3_32b": ("Qwen3ForCausalLM", "Qwen3Config",
                  dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=False),
                  dict(_TINY, head_dim=16)),
    "ministral_8b": ("MinistralForCausalLM", "MinistralConfig",
                     dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=131072, sliding_window=32768,
                          max_position_embeddings=32768, tie_word_embeddings=False),
                     dict(_TINY, head_dim=16, sliding_window=8)),
    # --- mixtures of experts
    "olmoe_1b_7b": ("OlmoeForCausalLM", "OlmoeConfig",
                    dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
                         max_position_embeddings=4096, tie_word_embeddings=False),
                    dict(_TINY, num_experts=8, num_experts_per_tok=2)),
    "phi35_moe": ("PhimoeForCausalLM", "PhimoeConfig",
                  dict(hidden_size=4096, intermediate_size=6400, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, vocab_size=32064,
                       max_position_embeddings=131072, tie_word_embeddings=False),
                  dict(_TINY, num_local_experts=4)),
    "qwen3_moe_235b_a22b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                            dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                 num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                 num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                                 vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False),
                            dict(_TINY, moe_intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2)),
    "granite_moe_3b": ("GraniteMoeForCausalLM", "GraniteMoeConfig",
                       dict(hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_attention_heads=24,
                            num_key_value_heads=8, num_local_experts=40, num_experts_per_tok=8, vocab_size=49155,
                            embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
                            attention_multiplier=0.015625, tie_word_embeddings=True),
                       dict(_TINY, num_local_experts=4, num_experts_per_tok=2)),
    "jetmoe_8b": ("JetMoeForCausalLM", "JetMoeConfig",
                  dict(hidden_size=2048, num_hidden_layers=24, num_key_value_heads=16, kv_channels=128,
                       intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                       max_position_embeddings=4096, tie_word_embeddings=True),
                  dict(hidden_size=64, num_key_value_heads=4, kv_channels=16, intermediate_size=96,
                       num_local_experts=4, vocab_size=128)),
    "hunyuan_a13b": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config",
                     dict(hidden_size=4096, intermediate_size=3072, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, num_experts=64, moe_topk=8, vocab_size=128167,
                          max_position_embeddings=32768, tie_word_embeddings=True),
                     dict(_TINY, head_dim=16, num_experts=4, moe_topk=2)),
    "ernie45_moe_21b": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
                        dict(hidden_size=2560, intermediate_size=12288, moe_intermediate_size=1536,
                             num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4, moe_num_experts=64,
                             moe_k=6, moe_num_shared_experts=2, moe_layer_start_index=1, vocab_size=103424,
                             max_position_embeddings=131072, tie_word_embeddings=True),
                        dict(_TINY, moe_intermediate_size=32, moe_num_experts=8, moe_k=2)),
    "dots1_142b": ("Dots1ForCausalLM", "Dots1Config",
                   dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=32, n_routed_experts=128, n_shared_experts=2,
                        num_experts_per_tok=6, first_k_dense_replace=1, vocab_size=152064,
                        max_position_embeddings=32768, tie_word_embeddings=False),
                   dict(_TINY, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)),
    # --- hybrids (attention + state-space / recurrent / linear attention)
    "bamba_9b": ("BambaForCausalLM", "BambaConfig",
                 dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
                      mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, vocab_size=128256,
                      tie_word_embeddings=False),
                 dict(_TINY, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)),
    "falcon_h1_34b": ("FalconH1ForCausalLM", "FalconH1Config",
                      dict(hidden_size=5120, intermediate_size=21504, num_hidden_layers=72, num_attention_heads=32,
                           num_key_value_heads=8, mamba_d_ssm=10240, mamba_n_heads=128, mamba_d_head=80,
                           mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, vocab_size=261120,
                           tie_word_embeddings=False),
                      dict(_TINY, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)),
    "falcon_mamba_7b": ("FalconMambaForCausalLM", "FalconMambaConfig",
                        dict(hidden_size=4096, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4,
                             time_step_rank=256, vocab_size=65024, tie_word_embeddings=False),
                        dict(hidden_size=64, time_step_rank=8, vocab_size=128)),
    "mamba_2_8b": ("MambaForCausalLM", "MambaConfig",
                   dict(hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4,
                        time_step_rank=160, vocab_size=50280),
                   dict(hidden_size=64, time_step_rank=8, vocab_size=128)),
    "mamba2_2_7b": ("Mamba2ForCausalLM", "Mamba2Config",
                    dict(hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128,
                         n_groups=1, expand=2, vocab_size=50288),
                    dict(hidden_size=64, num_heads=8, head_dim=16, state_size=16, vocab_size=128)),
    "minimax_text_01": ("MiniMaxForCausalLM", "MiniMaxConfig",
                        dict(hidden_size=6144, intermediate_size=9216, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, head_dim=128, num_local_experts=32, num_experts_per_tok=2,
                             vocab_size=200064, tie_word_embeddings=False),
                        dict(_TINY, head_dim=16, num_local_experts=4, block_size=8)),
    # --- encoder-decoders
    "whisper_large_v3": ("WhisperForConditionalGeneration", "WhisperConfig",
                         dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                              decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                              num_mel_bins=128, vocab_size=51866, max_source_positions=1500,
                              max_target_positions=448),
                         dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                              decoder_ffn_dim=96, vocab_size=128, num_mel_bins=16, max_source_positions=32,
                              pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)),
    "mt5_xxl": ("MT5ForConditionalGeneration", "MT5Config",
                dict(d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_decoder_layers=24, num_heads=64,
                     vocab_size=250112, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
                dict(d_model=64, d_ff=96, d_kv=16, num_heads=4, vocab_size=128)),
    "pegasus_x_large": ("PegasusXForConditionalGeneration", "PegasusXConfig",
                        dict(d_model=1024, encoder_layers=16, decoder_layers=16, encoder_attention_heads=16,
                             decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                             vocab_size=96103, block_size=512, num_global_tokens=128, max_position_embeddings=16384),
                        dict(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                             decoder_ffn_dim=96, vocab_size=128, block_size=16, num_global_tokens=4)),
}
"""Every architecture :func:`build` knows."""

NAMES = tuple(ARCHS)

_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
               "decoder_layers")


def build(name: str, layers: int | None = None, tiny: bool = False, batch: int = 2, seq: int | None = None):
    """``(module, example inputs, loss, example labels)`` of architecture ``name`` on the meta device.

    ``layers`` overrides the depth (of both stacks of an encoder-decoder;
    default ``GRAPHPIPE_LLM_LAYERS`` or the published one); ``seq`` is the
    tokens per sample (default ``GRAPHPIPE_LLM_SEQ`` or 128); ``tiny``
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
    if seq is None:
        seq = sequence_length()
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    labels = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids}
    if hasattr(model.config, "num_mel_bins"):  # a speech encoder (Whisper) reads log-mel frames, two per position
        frames = 2 * model.config.max_source_positions
        inputs = {"input_features": torch.zeros(batch, model.config.num_mel_bins, frames, device="meta")}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, inputs, loss_fn, labels


def sequence_length() -> int:
    """Tokens per sample of the factories here and :func:`evals.bench_llm.factory`: ``GRAPHPIPE_LLM_SEQ`` or 128
    (a one-line error for anything but a positive integer)."""
    raw = os.environ.get("GRAPHPIPE_LLM_SEQ", "").strip()
    if not raw:
        return 128
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ValueError(f"GRAPHPIPE_LLM_SEQ must be a positive integer (tokens per sample), got {raw!r}")
    return int(raw)


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
llama31_405b = _factory("llama31_405b")
nemotron4_340b = _factory("nemotron4_340b")
command_r_plus_104b = _factory("command_r_plus_104b")
starcoder2_15b = _factory("starcoder2_15b")
glm4_32b = _factory("glm4_32b")
olmo2_32b = _factory("olmo2_32b")
granite3_8b = _factory("granite3_8b")
smollm3_3b = _factory("smollm3_3b")
exaone4_32b = _factory("exaone4_32b")
qwen3_32b = _factory("qwen3_32b")
ministral_8b = _factory("ministral_8b")
olmoe_1b_7b = _factory("olmoe_1b_7b")
phi35_moe = _factory("phi35_moe")
qwen3_moe_235b_a22b = _factory("qwen3_moe_235b_a22b")
granite_moe_3b = _factory("granite_moe_3b")
jetmoe_8b = _factory("jetmoe_8b")
hunyuan_a13b = _factory("hunyuan_a13b")
ernie45_moe_21b = _factory("ernie45_moe_21b")
dots1_142b = _factory("dots1_142b")
bamba_9b = _factory("bamba_9b")
falcon_h1_34b = _factory("falcon_h1_34b")
falcon_mamba_7b = _factory("falcon_mamba_7b")
mamba_2_8b = _factory("mamba_2_8b")
mamba2_2_7b = _factory("mamba2_2_7b")
minimax_text_01 = _factory("minimax_text_01")
whisper_large_v3 = _factory("whisper_large_v3")
mt5_xxl = _factory("mt5_xxl")
pegasus_x_large = _factory("pegasus_x_large")
