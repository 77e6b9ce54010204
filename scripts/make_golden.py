"""Build the parity fixtures: tiny seeded checkpoints and their transformers golden logits.

Needs torch and transformers (the tests that read the output do not). Run from the repository root:

    python scripts/make_golden.py                       # tiny models + SmolLM2 golden
    python scripts/make_golden.py --only tiny           # tiny models only
    python scripts/make_golden.py --smollm PATH.gguf    # SmolLM2 GGUF somewhere other than the default
    python scripts/make_golden.py --model tiny-mistral  # one tiny model (its own versions in the manifest)
    python scripts/make_golden.py --model tiny-qwen3-awq  # one twin, from its base as committed

The integer twins need gptqmodel (GPTQ, AWQ: transformers reads them through it), compressed-tensors and
bitsandbytes.

Writes under tests/fixtures/models/:
  tiny-llama/   LlamaForCausalLM, llama3 rope scaling, untied, float32, sharded safetensors + index
  tiny-llama.gguf  the same weights as llama.cpp's converter writes them (Q/K rows permuted, rope_freqs);
                   Q8_0 token_embd/output, Q4_0 layer 0, F16 layer 1; golden = tiny-llama's
  tiny-qwen2/   Qwen2ForCausalLM, nonzero q/k/v biases, untied, bfloat16
  tiny-qwen3/   Qwen3ForCausalLM, q/k RMSNorm, head_dim 64 != 64/4, tied, float16, config in the
                transformers-5 layout (rope_parameters); the other two use the classic hub layout
  tiny-mistral/ MistralForCausalLM, sliding_window 16 over the 40 positions, untied, bfloat16
  tiny-phi3/    Phi3ForCausalLM, fused qkv_proj and gate_up_proj, sliding_window 24, float16
  tiny-phi3.gguf   the same weights as llama.cpp writes phi3 (fused attn_qkv, ffn_up = gate|up); golden = tiny-phi3's
  tiny-gemma3/  Gemma3ForCausalLM: 6 layers, 5 sliding (window 8) and 1 global with linear RoPE scaling, tied,
                bfloat16, config in the transformers-5 layout (rope_parameters per layer type)
  tiny-gemma3.gguf  as llama.cpp's Gemma3Model writes it (norms + 1); golden = tiny-gemma3's
  tiny-qwen3-moe/  Qwen3MoeForCausalLM: 8 experts, top-2, norm_topk_prob, float16
  tiny-qwen3-moe.gguf  llama.cpp's qwen3moe layout (stacked ffn_*_exps); golden = tiny-qwen3-moe's
  tiny-mixtral/ MixtralForCausalLM: 4 experts (w1/w2/w3), top-2, bfloat16
  tiny-gemma2/  Gemma2ForCausalLM: 4 layers alternating sliding (window 8) and global, soft-capped attention
                and logits, tied, bfloat16
  tiny-gemma2.gguf  as llama.cpp writes gemma2 (norms + 1, the soft-caps as metadata); golden = tiny-gemma2's
  tiny-qwen2-moe/  Qwen2MoeForCausalLM: 4 experts and a gated shared expert, q/k/v biases, bfloat16
  tiny-qwen2-moe.gguf  llama.cpp's qwen2moe layout (stacked experts, *_shexp tensors); golden = tiny-qwen2-moe's
  tiny-mixtral.gguf  llama.cpp's llama layout with stacked experts (Q/K rows permuted); golden = tiny-mixtral's
  tiny-phi3-longrope/  Phi3ForCausalLM as Phi-4-mini: RoPE on 12 of 16 dims a head, longrope (pretraining context
                32, context 256: the golden takes the long factors, short_ids/short_logits the short ones), tied,
                bfloat16
  tiny-phi3-longrope.gguf  llama.cpp's phi3 with rope.dimension_count and rope_factors_long/short tensors
  tiny-qwen3-yarn/  Qwen3ForCausalLM with YaRN (factor 4, pretraining context 64), float16
  tiny-qwen3-yarn.gguf  llama.cpp's qwen3 with YaRN as rope.scaling metadata
  tiny-gpt-oss/ GptOssForCausalLM: sliding (window 8) and full layers, attention sinks, biases, 4 experts top-2 with
                the clamped SwiGLU, YaRN without truncation, bfloat16, expert weights on the MXFP4 grid
  tiny-gpt-oss-mxfp4/  the same weights with the experts as MXFP4 blocks and scales; golden = tiny-gpt-oss's
  tiny-qwen3-gptq/  tiny-qwen3's linear weights as 4-bit GPTQ (symmetric, act-order, zero points stored less 1);
                golden = transformers reading it (gptqmodel), checked against the float model with those weights
  tiny-llama-gptq-int8/  tiny-llama's as 8-bit GPTQ with zero points, one group a row; golden likewise
  tiny-qwen3-awq/  tiny-qwen3's as AWQ (gemm layout, 4 bits, zero points); golden likewise
  tiny-qwen3-moe-w4a16/  tiny-qwen3-moe's as compressed-tensors pack-quantized (W4A16), the router float; golden =
                transformers with compressed-tensors
  tiny-qwen2-w8a8/  tiny-qwen2's as compressed-tensors int-quantized (W8A8); golden likewise
  tiny-qwen3-bnb-4bit/  tiny-qwen3 loaded with bitsandbytes' load_in_4bit (NF4, double quantization) and saved;
                golden = transformers reading it, checked against bitsandbytes' own decoding of its weights
  tiny-qwen2-bnb-8bit/  tiny-qwen2 with load_in_8bit (LLM.int8), likewise
  int-references.npz  compressed-tensors' compressors on seeded weights, asymmetric zero points (no twin carries them)
  tiny-gpt-oss.gguf  llama.cpp's gpt-oss layout (MXFP4 experts, gate and up split); golden = tiny-gpt-oss's
  tiny-smollm3/ SmolLM3ForCausalLM: 4 layers, the 4th without RoPE, tied, bfloat16
  tiny-smollm3.gguf  llama.cpp's smollm3 (llama's layout, Q/K permuted); golden = tiny-smollm3's
  tiny-granite/ GraniteForCausalLM: Llama's layers with its embedding, attention, residual and logits multipliers
  tiny-granite.gguf  llama.cpp's granite (Q/K permuted, the multipliers as metadata); golden = tiny-granite's
  tiny-olmo2/   Olmo2ForCausalLM: norms after each block only, q/k norms over the whole projection, bfloat16
  tiny-olmo2.gguf  llama.cpp's olmo2 (post_attention_norm, post_ffw_norm, no pre-norms); golden = tiny-olmo2's
  tiny-ministral3/ Ministral3's language model saved as the hub's Mistral3ForConditionalGeneration (text_config,
                model.language_model.*, a vision tower's tensors beside): YaRN, and Llama 4's attention temperature past
                position 16, bfloat16
  tiny-ministral3.gguf  llama.cpp's mistral3 (Q/K permuted, yarn_log_multiplier, attention.temperature_scale)
  tiny-olmo3/   Olmo3ForCausalLM: OLMo 2's layers, three sliding (window 8) to one full, YaRN on the full ones only,
                bfloat16, config in the transformers-5 layout (rope_parameters per layer type)
  tiny-olmo3.gguf  llama.cpp's olmo2 with sliding_window, its pattern and YaRN; golden = tiny-olmo3's
  tiny-exaone4/ Exaone4ForCausalLM: norms after each block, per-head q/k norms, 3 sliding layers (window 8) then
                a global one without RoPE, bfloat16
  tiny-exaone4.gguf  llama.cpp's exaone4; golden = tiny-exaone4's
  tiny-seed-oss/ SeedOssForCausalLM: Llama's layers with q/k/v biases, bfloat16
  tiny-seed-oss.gguf  llama.cpp's seed_oss (post_attention_norm as the MLP norm); golden = tiny-seed-oss's
  tiny-glm4/    Glm4ForCausalLM: RoPE on 8 of 16 dims a head in interleaved pairs, four norms, q/k/v biases, gate|up
                fused, bfloat16
  tiny-glm4.gguf  llama.cpp's glm4; golden = tiny-glm4's
  tiny-ernie4_5/ Ernie4_5ForCausalLM: Llama's layers with RoPE in interleaved pairs, tied, bfloat16
  tiny-ernie4_5.gguf  llama.cpp's ernie4_5; golden = tiny-ernie4_5's
  tiny-glm4-moe/ Glm4MoeForCausalLM (GLM-4.5): a dense first layer, then 8 experts in 2 groups chosen by a sigmoid
                router with a choice bias (one group, top-2) and scaled weights, beside a shared expert; RoPE on half
                of each head, q/k/v biases, bfloat16; a multi-token-prediction layer after the last, which
                transformers skips
  tiny-glm4-moe.gguf  llama.cpp's glm4moe (exp_probs_b, *_shexp, the MTP layer as blk.3); golden = tiny-glm4-moe's
  tiny-ernie4_5-moe/ Ernie4_5_MoeForCausalLM: 4 layers, every 2nd from the 2nd with 8 experts (softmax router whose
                choice adds a bias, top-2) beside two shared experts, the others dense; RoPE in interleaved pairs,
                bfloat16
  tiny-ernie4_5-moe.gguf  llama.cpp's ernie4_5-moe (exp_probs_b, *_shexp); golden = tiny-ernie4_5-moe's
  tiny-lfm2-moe/ Lfm2MoeForCausalLM: LFM2's layers, the first dense, the others 4 experts chosen by a sigmoid router
                with a choice bias; bfloat16
  tiny-lfm2-moe.gguf  llama.cpp's lfm2moe (stacked ffn_*_exps, exp_probs_b); golden = tiny-lfm2-moe's
  tiny-minimax-m2/ MiniMaxM2ForCausalLM: Qwen3-MoE's layers with q/k norms over the whole projection, RoPE on half of
                each head, 8 experts (w1/w2/w3) chosen by a sigmoid router with a choice bias, top-2 renormalised,
                bfloat16
  tiny-minimax-m2.gguf  llama.cpp's minimax-m2 (stacked ffn_*_exps, exp_probs_b); golden = tiny-minimax-m2's
  tiny-dots1/   Dots1ForCausalLM (dots.llm1): a dense first layer, then 8 experts chosen by a sigmoid router with a
                choice bias (top-2), renormalised and scaled, beside a shared expert; per-head q/k norms, bfloat16
  tiny-dots1.gguf  llama.cpp's dots1 (exp_probs_b, *_shexp, no groups); golden = tiny-dots1's
  tiny-qwen3-vl/ Qwen3VLForConditionalGeneration: Qwen3's layers under model.language_model with interleaved
                multimodal RoPE (text positions: plain RoPE), a one-block vision tower kestrel does not read, bfloat16
  tiny-qwen3-vl.gguf  llama.cpp's qwen3vl (rope.dimension_sections); golden = tiny-qwen3-vl's
  tiny-qwen3-vl-moe/ Qwen3VLMoeForConditionalGeneration: 4 experts top-2, stacked as the Hub ships them (x @ W:
                gate|up [E, D, 2F], down [E, F, D]), bfloat16
  tiny-qwen3-vl-moe.gguf  llama.cpp's qwen3vlmoe (ffn_*_exps); golden = tiny-qwen3-vl-moe's
  tiny-cohere/  CohereForCausalLM (Command R): LayerNorms without a bias, the attention and the MLP in parallel from one
                norm, RoPE in interleaved pairs, per-head q/k norms (a weight a head), the logits times 0.8, tied,
                bfloat16
  tiny-cohere.gguf  llama.cpp's command-r (unpermuted, attn_q_norm [hd, heads], logit_scale); golden = tiny-cohere's
  tiny-cohere2/ Cohere2ForCausalLM (Command R7B): Cohere's layers without q/k norms, 3 sliding layers (window 8) with
                RoPE then a global one without, the logits times 0.75, tied, bfloat16
  tiny-cohere2.gguf  llama.cpp's cohere2 (its fixed 3-to-1 pattern); golden = tiny-cohere2's
  tiny-llama-lora/  a PEFT LoRA adapter of tiny-llama (rank 4 on q, v, o, down); its golden.npz: transformers + PEFT
  tiny-glm4-moe-lite-lora/  the same on tiny-glm4-moe-lite's latent attention (q_a, q_b, kv_a, kv_b, o)
  smollm2/golden.npz  SmolLM2-135M-Instruct.Q4_1.gguf as transformers dequantizes it (partial logits)
  MANIFEST.json  versions, shapes, logit ranges, the command
Every model directory holds golden.npz: ``ids`` int64 [T] and ``logits`` float32 [T, vocab], computed in
float32 with eager attention from the checkpoint as reloaded from disk (so bf16/f16 rounding is included).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Cohere2Config,
    CohereConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    LlamaConfig,
    MiniMaxM2Config,
    Ministral3Config,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    SeedOssConfig,
    SmolLM3Config,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "models"
SMOLLM_DEFAULT = Path("/tmp/smolgguf/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

VOCAB = 512
SEQ_LEN = 40
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

# Random init gives near-uniform logits, where top-1 agreement means nothing. These scales give logits a
# spread of ~15 units and attention sharp enough that a RoPE or Q/K layout error moves logits by ~30% of
# their range, while q8 stays within ~3% (measured; see docs/parity.md). Larger projection scales make the
# random network chaotic (quantization noise then grows as fast as layout errors do).
STD_PROJ = 0.12
STD_EMBED = 0.5
STD_LM_HEAD = 0.3
STD_BIAS = 0.3
NORM_JITTER = 0.2
QK_NORM_MEAN = 1.2  # Qwen3 normalizes q and k per head: their norm weights alone set attention sharpness
# Router logits of std ~4 over normalized hidden states: decisive routing, so that few positions sit on a near-tie
# between the k-th and the next expert (a tie quantization noise can flip; docs/parity.md)
STD_ROUTER = 0.5
ROUTER_CHOICE_BIAS_STD = 0.15  # a sigmoid router's choice bias: it changes some choices, not most
# Projection weights lie on the Q4_0 grid: codes in [-8, 7] times one scale per row (per 256 columns where
# K allows), with a -8 in every 32-block. q4 and q4-g256 then reproduce them exactly, so the q4 tests check
# the int4 path itself at q8-like tolerances instead of int4 rounding noise on a chaotic random network.
# The scales have two mantissa bits, so every weight is exact in bfloat16 and float16 too.
SCALE_MANTISSAS = np.array([1.0, 1.25, 1.5, 1.75])
CODE_STD = float(np.sqrt(np.mean(np.arange(-8, 8) ** 2)))
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # E2M1 by code
KEY_FROM_QUERY = 0.75  # the share of a linear-attention key's weights taken from its query's (_keys_near_queries)
LINEAR_CONV_STD = 0.6  # a linear-attention layer's convolution taps: its q, k and v mix a token with the 3 before
GPT_OSS_MLP_NORM = 8.0  # gpt-oss's MLP input norm: gate and up then reach its SwiGLU's clamp of 7
# longrope's per-pair divisors of the inverse frequencies (6 pairs turned), short and long context
LONGROPE_SHORT = [1.0, 1.05, 1.2, 1.5, 2.0, 2.5]
LONGROPE_LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A strip cache holds int8 codes and one float scale per
block of thirty-two columns. Every backend reads the same artifact: the CPU, the GPU and the simulated
NPU. What is the capital of France? The capital of France is Paris. What is the capital of Italy? The
capital of Italy is Rome. Berlin is the capital of Germany, and Madrid is the capital of Spain.
Quantization maps each weight to a small integer; the scale brings it back. Attention compares queries
with keys, rotated by their positions, and mixes the values. The model reads tokens, one after another,
and predicts the next one. Numbers like 12, 256, 4096 and 3.14159 appear in text too.
Hello! How are you today? I am fine, thank you. Please write a short poem about the sea.
The sea is wide and the sky is blue; the wind is cold and the waves are new.
"""


def zen_of_python() -> str:
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return codecs.decode(this.s, "rot13")


# ----------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly VOCAB tokens (GPT-2 pre-tokenizer), specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = CORPUS + zen_of_python()
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()] * 4, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"tokenizer trained to {tok.get_vocab_size()} tokens, wanted {VOCAB}")
    return tok


def write_tokenizer(tok: Tokenizer, d: Path) -> None:
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIALS}
    cfg = {
        "add_bos_token": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 256,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------- models

def _saved(dtype: Any, classic: bool = True, shard: str | None = None, **extra: Any) -> dict[str, Any]:
    """How build_tiny saves a tiny model: its dtype, the classic (transformers 4) config layout or not, its shard
    size (None: one file), and any extra (``short``: golden logits of the first N positions too; ``seed``: its own
    seed, else its place in tiny_configs)."""
    return {"dtype": dtype, "max_shard_size": shard, "classic_config": classic, **extra}


def tiny_configs(tok: Tokenizer) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (config, save options)."""
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos, rms_norm_eps=1e-6)
    llama = LlamaConfig(
        **common, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False,
        # original_max_position_embeddings=32 puts the llama3 wavelength cut-offs (8 and 32 positions)
        # inside head_dim 16's frequency range, so scaling changes short-sequence logits.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=10000.0,
    )
    qwen2 = Qwen2Config(**common, num_hidden_layers=3, intermediate_size=128, tie_word_embeddings=False,
                        rope_theta=10000.0, use_sliding_window=False)
    # head_dim 64 with 4 heads: q_proj is [256, 64] and o_proj's K is 256, like down_proj's (F=256), so
    # q8-g256 really uses G=256 on those tensors.
    qwen3 = Qwen3Config(**common, num_hidden_layers=3, intermediate_size=256, head_dim=64,
                        tie_word_embeddings=True, rope_theta=10000.0, use_sliding_window=False)
    # a window of 16 over 40 positions: the later rows see only their last 16 keys
    mistral = MistralConfig(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                            tie_word_embeddings=False, rope_theta=1e6, sliding_window=16)
    # fused qkv_proj / gate_up_proj tensors, and a window of 24
    phi3 = Phi3Config(**common, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False,
                      rope_theta=10000.0, sliding_window=24, pad_token_id=None)
    # llama.cpp's Gemma 3 pattern (every 6th layer global) and its query scale (1/sqrt(head_dim)), so the GGUF
    # twin reads the same; the global layer's RoPE is linearly scaled, the sliding layers' is not
    gemma3 = Gemma3TextConfig(**common, num_hidden_layers=6, intermediate_size=128, head_dim=16,
                              query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True, pad_token_id=0,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    qwen3_moe = Qwen3MoeConfig(**common, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                               tie_word_embeddings=False, rope_theta=1e6, use_sliding_window=False)
    # alternating sliding (window 8) and global layers, soft-capped attention scores and logits (caps small
    # enough to bend these logits), llama.cpp's query scale
    gemma2 = Gemma2Config(**common, num_hidden_layers=4, intermediate_size=128, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=8, tie_word_embeddings=True, pad_token_id=0, rope_theta=1e4,
                          attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    # a shared expert beside 4 routed ones, q/k/v biases, the top-2 weights not renormalised
    qwen2_moe = Qwen2MoeConfig(**common, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                               norm_topk_prob=False, tie_word_embeddings=False, rope_theta=1e6,
                               use_sliding_window=False)
    # Phi-4-mini's RoPE: 12 of each head's 16 dims turned (partial_rotary_factor 0.75), longrope with a pretraining
    # context of 32 in a context of 256: the 40 golden positions take the long factors, the first 24 (short_ids) the
    # short ones; tied embeddings as Phi-4-mini's
    phi3_longrope = Phi3Config(**common, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=True,
                               rope_theta=10000.0, sliding_window=None, pad_token_id=None, partial_rotary_factor=0.75,
                               original_max_position_embeddings=32,
                               rope_scaling={"rope_type": "longrope", "short_factor": LONGROPE_SHORT,
                                             "long_factor": LONGROPE_LONG})
    # YaRN as Qwen3's model cards turn it on (factor 4), the base and pretraining context chosen so the ramp between
    # kept and interpolated frequencies spans head_dim 16's pairs 0 to 5
    qwen3_yarn = Qwen3Config(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                             tie_word_embeddings=False, rope_theta=100.0, use_sliding_window=False,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    # gpt-oss: sliding (window 8) and full layers alternating, attention sinks, biases on q/k/v/o, the router and
    # the experts, the clamped SwiGLU (its mlp norm near 4, so gate and up cross the clamp of 7), YaRN without
    # truncation, gate|up interleaved in one stacked tensor; expert weights on the MXFP4 grid
    gpt_oss = GptOssConfig(**common, num_hidden_layers=2, intermediate_size=64, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 64,
                                            "rope_theta": 150000.0})
    # SmolLM3: llama's layers, every 4th without RoPE (layer 3 of 4), as its config and llama.cpp both count them
    smollm3 = SmolLM3Config(**common, num_hidden_layers=4, intermediate_size=128, tie_word_embeddings=True,
                            rope_theta=10000.0, use_sliding_window=False, no_rope_layer_interval=4, pad_token_id=None)
    # Granite: Llama's layers with its four multipliers, each far enough from 1 to matter
    granite = GraniteConfig(**common, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False,
                            rope_theta=10000.0, embedding_multiplier=3.0, attention_multiplier=0.1,
                            residual_multiplier=0.5, logits_scaling=1.5)
    # OLMo 2: norms after each block instead of before, q/k norms over the whole projection
    olmo2 = Olmo2Config(**common, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False,
                        rope_theta=10000.0, pad_token_id=None)
    # Ministral 3: Mistral's layers with YaRN and Llama 4's attention temperature past a pretraining context of 16 (so
    # positions 16 and 32 on take 1 + 0.5 ln 2 and 1 + 0.5 ln 3), saved as the hub's Mistral3ForConditionalGeneration
    ministral3 = Ministral3Config(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                                  tie_word_embeddings=False, sliding_window=None, rope_parameters={
                                      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "llama_4_scaling_beta": 0.5, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 1e6})
    # OLMo 3: OLMo 2's layers, three sliding (window 8) to one full, the full ones with YaRN (factor 4 over a context
    # of 64, so it changes every position's frequencies), the sliding ones plain RoPE at the same base
    olmo3 = Olmo3Config(**common, num_hidden_layers=4, intermediate_size=128, tie_word_embeddings=False,
                        sliding_window=8, pad_token_id=None, rope_parameters={
                            "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                               "attention_factor": 0.1 * math.log(4.0) + 1, "beta_slow": 1.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    # EXAONE 4: OLMo 2's norms after each block with per-head q/k norms, three sliding layers (window 8) to one
    # global, the global ones without RoPE
    exaone4 = Exaone4Config(**common, num_hidden_layers=4, intermediate_size=128, tie_word_embeddings=False,
                            rope_theta=10000.0, sliding_window=8, sliding_window_pattern=4, pad_token_id=None)
    # Seed-OSS: Llama's layers with q/k/v biases (no o bias, as Seed-OSS-36B)
    seed_oss = SeedOssConfig(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                             tie_word_embeddings=False, rope_theta=10000.0, attention_bias=True,
                             attention_out_bias=False, pad_token_id=None)
    # GLM-4: RoPE on half of each head in interleaved pairs, Gemma's four norms, q/k/v biases, gate|up fused
    glm4 = Glm4Config(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16, partial_rotary_factor=0.5,
                      tie_word_embeddings=False, rope_theta=10000.0, attention_bias=True, pad_token_id=None)
    # GLM-4.5: a dense layer, then experts chosen by a sigmoid router in 2 groups of 4 (1 kept, top-2 of it) with a
    # choice bias (ROUTER_CHOICE_BIAS_STD) and weights scaled by 1.8, a shared expert; RoPE on half of each head
    glm4_moe = Glm4MoeConfig(**common, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                             head_dim=16, partial_rotary_factor=0.5, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                             routed_scaling_factor=1.8, norm_topk_prob=True, attention_bias=True, use_qk_norm=False,
                             tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=None)
    # ERNIE 4.5: Llama's layers with RoPE in interleaved pairs, tied as the 0.3B
    ernie = Ernie4_5Config(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16, tie_word_embeddings=True,
                           rope_theta=10000.0, use_bias=False, pad_token_id=None)
    # ERNIE 4.5's MoE: layers 1 and 3 with experts (start 1, interval 2), a softmax router whose choice adds a bias
    # (2 * ROUTER_CHOICE_BIAS_STD: the tiny router's softmax is peaked, top probabilities near 0.5), two shared experts
    ernie_moe = Ernie4_5_MoeConfig(**common, num_hidden_layers=4, intermediate_size=128, head_dim=16,
                                   moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_num_shared_experts=2,
                                   moe_layer_start_index=1, moe_layer_interval=2, moe_layer_end_index=-1,
                                   tie_word_embeddings=False, rope_theta=10000.0, use_bias=False, pad_token_id=None)
    # Cohere: LayerNorms, parallel blocks, interleaved RoPE, per-head q/k norms, scaled logits (0.8, not Command R's
    # 0.0625: the tiny logits would lose their spread); Cohere2: 3 sliding layers with RoPE to 1 global without
    layer_normed = {k: v for k, v in common.items() if k != "rms_norm_eps"}
    cohere = CohereConfig(**layer_normed, num_hidden_layers=2, intermediate_size=128, layer_norm_eps=1e-5,
                          logit_scale=0.8, use_qk_norm=True, tie_word_embeddings=True, rope_theta=10000.0,
                          pad_token_id=None)
    cohere2 = Cohere2Config(**layer_normed, num_hidden_layers=4, intermediate_size=128, layer_norm_eps=1e-5,
                            logit_scale=0.75, sliding_window=8, tie_word_embeddings=True, rope_theta=10000.0,
                            pad_token_id=None)
    # Qwen3-VL: Qwen3's language model (interleaved multimodal RoPE) beside a one-block vision tower; its MoE's experts
    # 96 wide (gate|up 192, neither the hidden 64: the two layouts of stacked experts are told apart by shape)
    vl_text = dict(**common, num_hidden_layers=2, intermediate_size=128, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    vl_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                     deepstack_visual_indexes=[0], patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    qwen3_vl = Qwen3VLConfig(text_config=vl_text, vision_config=vl_vision, tie_word_embeddings=False)
    qwen3_vl_moe = Qwen3VLMoeConfig(text_config={**vl_text, "num_experts": 4, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 96, "decoder_sparse_step": 1},
                                    vision_config=vl_vision, tie_word_embeddings=False)
    # Qwen3.5: three Gated DeltaNet layers to one gated attention layer, 2 key heads to 4 value heads (llama.cpp's
    # converter reorders the value heads), RoPE on a quarter of each head, every RMSNorm but the gated one 1 + w;
    # saved as the hub's multimodal checkpoints nest it (``nest``)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                  linear_conv_kernel_dim=4, head_dim=32, num_hidden_layers=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    qwen3_5 = Qwen3_5TextConfig(**common, **linear, intermediate_size=128, tie_word_embeddings=False)
    # Qwen3.5-MoE: the same layers with 4 experts (top 2, renormalised) and a gated shared expert, tied embeddings
    qwen3_5_moe = Qwen3_5MoeTextConfig(**common, **linear, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                       num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    # Qwen3-Next: Qwen3.5-MoE's layers with the linear attention's inputs fused per key head (in_proj_qkvz, in_proj_ba)
    qwen3_next = Qwen3NextConfig(**common, **linear, intermediate_size=128, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=True, tie_word_embeddings=False)
    # LFM2: gated short convolutions (3 wide) beside attention with q/k norms; the MLP's width adjusted from
    # block_ff_dim 192 to 128 as LFM2's config computes it; tied embeddings, its final norm named embedding_norm
    lfm2 = Lfm2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos, pad_token_id=None, norm_eps=1e-5,
                      intermediate_size=192, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                      block_auto_adjust_ff_dim=True, conv_L_cache=3, num_hidden_layers=4,
                      layer_types=["conv", "conv", "full_attention", "conv"], tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    # LFM2-MoE: LFM2's layers, the first dense (128 wide), the others 4 experts (32 wide) chosen by a sigmoid router
    # with a choice bias, top-2 renormalised
    lfm2_moe = Lfm2MoeConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
                             norm_eps=1e-5, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True,
                             conv_L_cache=3, num_hidden_layers=4, tie_word_embeddings=True,
                             layer_types=["conv", "conv", "full_attention", "conv"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    # Granite 4.0-H: Mamba-2 layers (4 heads of 32 in 2 groups, state 16) beside attention without RoPE, Granite's
    # multipliers (the attention's 1, so its scores are sharp enough for positions to matter); its shared MLP alone
    # (dense), or beside 4 routed experts as an ungated shared expert
    granite4 = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
                    rms_norm_eps=1e-6, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
                    mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=32, mamba_d_conv=4,
                    mamba_expand=2, position_embedding_type="nope", embedding_multiplier=3.0,
                    attention_multiplier=1.0, residual_multiplier=0.5, logits_scaling=1.5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    granite4_h = GraniteMoeHybridConfig(**granite4, intermediate_size=128, shared_intermediate_size=128,
                                        num_local_experts=0)
    granite4_h_moe = GraniteMoeHybridConfig(**granite4, intermediate_size=32, shared_intermediate_size=64,
                                            num_local_experts=4, num_experts_per_tok=2)
    # multi-head latent attention: each head's key and value from a latent of 32 (RMSNormed), RoPE on its last 8 dims
    # in interleaved pairs with one RoPE key all 4 heads share; experts after a dense first layer
    mla = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
               num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8, tie_word_embeddings=False)
    # DeepSeek-V3: a low-rank query (32), values of 16 dims against keys of 24, YaRN (factor 4 over a context of 64)
    # whose mscale_all_dim scales the softmax, GLM-4.5's router in one group (tiny-glm4-moe has the groups: with two
    # groups of four and one kept, every seed tried had positions whose group scores float16 keys or int8
    # activations reorder)
    deepseek_v3 = DeepseekV3Config(**mla, rms_norm_eps=1e-6, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    # DeepSeek-V2-Lite: the query in one projection, a softmax router's top 2 of 8 (not renormalised), two shared
    # experts, plain RoPE
    deepseek_v2 = DeepseekV2Config(**mla, rms_norm_eps=1e-6, q_lora_rank=None, qk_nope_head_dim=16, v_head_dim=16,
                                   n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                                   routed_scaling_factor=1.0, norm_topk_prob=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # GLM-4.7-Flash: DeepSeek-V3's layers, values as wide as keys (32), its norms' eps 1e-5 (the latent's 1e-6)
    glm4_moe_lite = Glm4MoeLiteConfig(**mla, rms_norm_eps=1e-5, q_lora_rank=32, qk_nope_head_dim=24, v_head_dim=32,
                                      n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.8,
                                      norm_topk_prob=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    # MiniMax-M2: q/k norms over the whole projection, RoPE on 8 of 16 dims a head, a sigmoid router's top 2 of 8
    minimax_m2 = MiniMaxM2Config(**common, num_hidden_layers=2, intermediate_size=64, head_dim=16, num_local_experts=8,
                                 num_experts_per_tok=2, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.5})
    # dots.llm1: GLM-4.5's router (in one group, as released and as llama.cpp runs it) and shared expert with
    # Qwen3's attention
    dots1 = Dots1Config(**common, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=None,
                        tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=None)
    mixtral = MixtralConfig(**common, num_hidden_layers=2, intermediate_size=64, num_local_experts=4,
                            num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6, sliding_window=None)
    return {
        "tiny-llama": (llama, _saved(torch.float32, shard="200KB")),
        "tiny-qwen2": (qwen2, _saved(torch.bfloat16)),
        "tiny-qwen3": (qwen3, _saved(torch.float16, classic=False)),
        "tiny-mistral": (mistral, _saved(torch.bfloat16)),
        "tiny-phi3": (phi3, _saved(torch.float16)),
        "tiny-gemma3": (gemma3, _saved(torch.bfloat16, classic=False)),
        "tiny-qwen3-moe": (qwen3_moe, _saved(torch.float16)),
        "tiny-mixtral": (mixtral, _saved(torch.bfloat16)),
        "tiny-qwen2-moe": (qwen2_moe, _saved(torch.bfloat16)),
        "tiny-gemma2": (gemma2, _saved(torch.bfloat16)),
        "tiny-phi3-longrope": (phi3_longrope, _saved(torch.bfloat16, short=24)),
        "tiny-qwen3-yarn": (qwen3_yarn, _saved(torch.float16)),
        "tiny-gpt-oss": (gpt_oss, _saved(torch.bfloat16)),
        "tiny-smollm3": (smollm3, _saved(torch.bfloat16)),
        "tiny-granite": (granite, _saved(torch.bfloat16)),
        "tiny-olmo2": (olmo2, _saved(torch.bfloat16)),
        "tiny-exaone4": (exaone4, _saved(torch.bfloat16)),
        "tiny-seed-oss": (seed_oss, _saved(torch.bfloat16)),
        "tiny-glm4": (glm4, _saved(torch.bfloat16)),
        "tiny-ernie4_5": (ernie, _saved(torch.bfloat16)),
        "tiny-qwen3_5": (qwen3_5, _saved(torch.bfloat16, classic=False, nest="qwen3_5")),
        "tiny-qwen3_5-moe": (qwen3_5_moe, _saved(torch.bfloat16, classic=False)),
        "tiny-qwen3-next": (qwen3_next, _saved(torch.bfloat16, classic=False)),
        "tiny-lfm2": (lfm2, _saved(torch.bfloat16, classic=False)),
        "tiny-granite4-h": (granite4_h, _saved(torch.bfloat16, classic=False)),
        "tiny-granite4-h-moe": (granite4_h_moe, _saved(torch.bfloat16, classic=False)),
        # later additions, each with the seed it was built with (a model's seed is otherwise its place in this list)
        "tiny-glm4-moe": (glm4_moe, _saved(torch.bfloat16, mtp=True, seed=21)),
        "tiny-ernie4_5-moe": (ernie_moe, _saved(torch.bfloat16, seed=22)),
        "tiny-lfm2-moe": (lfm2_moe, _saved(torch.bfloat16, classic=False, seed=23)),
        "tiny-qwen3-vl": (qwen3_vl, _saved(torch.bfloat16, classic=False, vision=True, seed=23)),
        "tiny-qwen3-vl-moe": (qwen3_vl_moe, _saved(torch.bfloat16, classic=False, vision=True, hub_experts=True,
                                                   seed=24)),
        "tiny-olmo3": (olmo3, _saved(torch.bfloat16, classic=False, seed=17)),
        "tiny-ministral3": (ministral3, _saved(torch.bfloat16, classic=False, nest="mistral3", seed=35)),
        "tiny-deepseek-v3": (deepseek_v3, _saved(torch.bfloat16, seed=36)),
        "tiny-deepseek-v2": (deepseek_v2, _saved(torch.bfloat16, seed=37)),
        "tiny-glm4-moe-lite": (glm4_moe_lite, _saved(torch.bfloat16, classic=False, seed=38)),
        "tiny-minimax-m2": (minimax_m2, _saved(torch.bfloat16, seed=39)),
        "tiny-dots1": (dots1, _saved(torch.bfloat16, seed=43)),
        "tiny-cohere": (cohere, _saved(torch.bfloat16, seed=44)),
        "tiny-cohere2": (cohere2, _saved(torch.bfloat16, seed=45)),
    }


def q4_grid(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Weights [N, K] exactly representable by Q4_0 at G=32 and, when K % 256 == 0, at G=256."""
    n, k = shape
    codes = rng.integers(-8, 8, size=(n, k // 32, 32))
    codes[:, :, 0] = -8  # the block maximum: quantizing recovers exactly this scale
    codes = rng.permuted(codes, axis=2).reshape(n, k)
    span = 256 if k % 256 == 0 else k
    mant = rng.choice(SCALE_MANTISSAS, size=(n, k // span))
    scale = np.exp2(np.round(np.log2(std / CODE_STD / mant))) * mant  # [N, K/span]
    return codes * np.repeat(scale, span, axis=1)


def mxfp4_grid(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Weights [N, K] exactly representable by MXFP4: FP4 E2M1 values times a power of two per 32-block."""
    n, k = shape
    codes = rng.choice(np.array(FP4_VALUES), size=(n, k // 32, 32))
    exps = np.round(np.log2(std / np.sqrt(np.mean(np.square(FP4_VALUES))))) + rng.integers(-1, 1, size=(n, k // 32, 1))
    return (codes * np.exp2(exps)).reshape(n, k)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tied = model.config.tie_word_embeddings
    # Gemma's and Qwen3.5's norms multiply by 1 + w (Qwen3.5's gated linear_attn.norm by w)
    norm_shift = 1.0 if model.config.model_type.startswith(("gemma", "qwen3_5")) else 0.0
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = name.replace("model.language_model.", "model.")  # a multimodal model's language model
            shape = tuple(p.shape)
            if gpt_oss and name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, K, N]: x @ W
                val = np.stack([mxfp4_grid(rng, (shape[2], shape[1]), STD_PROJ).T for _ in range(shape[0])])
            elif gpt_oss and name.endswith("post_attention_layernorm.weight"):  # the MLP's input: past the clamp
                val = GPT_OSS_MLP_NORM + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith(("self_attn.sinks", "_proj_bias")):
                val = STD_BIAS * rng.standard_normal(shape) * (3.0 if name.endswith("sinks") else 1.0)
            elif name.endswith(("linear_attn.A_log", "mamba.A_log")):  # A from 0.02 to 4: decays near 1 to near 0
                val = rng.uniform(np.log(0.02), np.log(4.0), size=shape)
            elif name.endswith("mamba.D"):  # Mamba-2's skip
                val = rng.uniform(0.5, 1.5, size=shape)
            elif name.endswith(("linear_attn.dt_bias", "mamba.dt_bias")):
                val = rng.uniform(-1.0, 1.0, size=shape)
            elif name.endswith(("linear_attn.conv1d.weight", "conv.conv.weight", "mamba.conv1d.weight")):
                val = LINEAR_CONV_STD * rng.standard_normal(shape)
            elif name.endswith("linear_attn.norm.weight"):
                val = 1.0 + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                                "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight",
                                "linear_attn.out_proj.weight")):
                val = q4_grid(rng, shape, STD_PROJ)
            elif name.endswith(("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                                "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")):
                val = q4_grid(rng, shape, STD_PROJ)  # LFM2's MLP, Granite 4.0-H's shared one
            elif name.endswith(("q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight")):
                val = QK_NORM_MEAN - norm_shift + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith("norm.weight"):
                val = 1.0 - norm_shift + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight",
                                "mlp.router.weight", "block_sparse_moe.router.weight", "feed_forward.gate.weight")):
                # a router, or a shared expert's sigmoid gate
                val = STD_ROUTER * rng.standard_normal(shape)
            elif ".visual." in name:  # Qwen3-VL's vision tower: text logits never read it
                val = 0.02 * rng.standard_normal(shape)
            elif name.endswith("moe_statics.e_score_correction_bias"):  # ERNIE 4.5's, on softmax probabilities
                val = 2 * ROUTER_CHOICE_BIAS_STD * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                val = STD_BIAS * rng.standard_normal(shape)
            elif name == "model.embed_tokens.weight":
                val = (STD_LM_HEAD if tied else STD_EMBED) * rng.standard_normal(shape)
            elif name == "lm_head.weight":
                val = STD_LM_HEAD * rng.standard_normal(shape)
            elif name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")):
                val = q4_grid(rng, shape, STD_PROJ)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, N, K], saved per expert
                val = np.stack([q4_grid(rng, shape[1:], STD_PROJ) for _ in range(shape[0])])
            else:
                raise SystemExit(f"no init rule for {name}")
            p.copy_(torch.from_numpy(np.asarray(val, dtype=np.float32)))
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # zero at init: the choice would ignore it
                b.copy_(torch.from_numpy(ROUTER_CHOICE_BIAS_STD * rng.standard_normal(tuple(b.shape))))
        for layer in getattr(getattr(model, "model", None), "layers", []):
            if hasattr(layer, "linear_attn"):
                _keys_near_queries(layer.linear_attn, rng)


def _keys_near_queries(attn: Any, rng: np.random.Generator) -> None:
    """Give a linear-attention layer's keys most of their queries' weights (whole 32-blocks of in_proj_qkv rows,
    and convolution taps), as a trained model's are far from orthogonal. Random q and k are nearly orthogonal, and
    the gated RMSNorm after the delta rule then scales each head's output up by 1 / (q . k): the logits would hang
    on the rounding of every input, whoever computes them."""
    kd, dk = attn.num_k_heads * attn.head_k_dim, attn.head_k_dim
    fused = hasattr(attn, "in_proj_qkvz")  # Qwen3-Next: per key head, q, k, v, z
    w = attn.in_proj_qkvz.weight if fused else attn.in_proj_qkv.weight  # [rows, D]
    group = w.shape[0] // attn.num_k_heads if fused else 0
    q_rows = torch.cat([torch.arange(h * group, h * group + dk) for h in range(attn.num_k_heads)]) if fused \
        else torch.arange(kd)
    k_rows = q_rows + dk if fused else q_rows + kd
    blocks = torch.from_numpy(rng.random((kd, w.shape[1] // 32)) < KEY_FROM_QUERY)
    take = blocks.repeat_interleave(32, dim=1)
    w[k_rows] = torch.where(take, w[q_rows], w[k_rows])
    conv = attn.conv1d.weight  # [C, 1, kernel]
    taps = torch.from_numpy(rng.random(kd) < KEY_FROM_QUERY)[:, None, None]
    conv[kd:2 * kd] = torch.where(taps, conv[:kd], conv[kd:2 * kd])


def classic_config(d: Path) -> None:
    """Rewrite config.json the way hub checkpoints (transformers 4.x) spell RoPE: rope_theta + rope_scaling."""
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:  # the hub keeps it beside the scaling (Phi-4-mini)
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:  # the hub's name
        cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def hf_logits(model_dir: Path, ids: np.ndarray, auto: Any = AutoModelForCausalLM, **kw: Any) -> np.ndarray:
    model = auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager", **kw)
    model.eval()
    out = model(torch.from_numpy(ids[None].astype(np.int64)))
    return out.logits[0].float().numpy()  # [T, V]


def build_tiny(name: str, config: Any, opts: dict[str, Any], tok: Tokenizer, seed: int) -> dict[str, Any]:
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if opts.get("vision") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    init_weights(model, seed)
    model = model.to(opts["dtype"])
    save_kw = {"max_shard_size": opts["max_shard_size"]} if opts["max_shard_size"] else {}
    model.save_pretrained(d, **save_kw)
    (d / "generation_config.json").unlink(missing_ok=True)
    if opts["classic_config"]:
        classic_config(d)
    write_tokenizer(tok, d)

    # Seeded ids, avoiding the specials so nothing downstream treats them as control tokens.
    if opts.get("hub_experts"):
        hub_stacked_experts(d)
    ids = np.random.default_rng(seed).integers(len(SPECIALS), VOCAB, size=SEQ_LEN).astype(np.int64)
    logits = hf_logits(d, ids, auto)
    extra = {}
    if opts.get("short"):  # the first positions alone: a sequence within a longrope model's pretraining context
        extra = {"short_ids": ids[:opts["short"]], "short_logits": hf_logits(d, ids[:opts["short"]])}
    np.savez(d / "golden.npz", ids=ids, logits=logits.astype(np.float32), **extra)
    if opts.get("nest"):
        nest_multimodal(d, opts["nest"])
    if opts.get("mtp"):
        add_mtp_layer(d)
    return {"dir": name, "dtype": str(opts["dtype"]).removeprefix("torch."), "seed": seed,
            "files": sorted(p.name for p in d.iterdir()), **logit_stats(logits)}


def hub_stacked_experts(d: Path) -> None:
    """Rewrite transformers 5's stacked experts (nn.Linear's [E, 2F, D] gate|up, [E, D, F] down) as the Hub ships
    Qwen3-VL-MoE (x @ W: [E, D, 2F], [E, F, D]); transformers transposes them back as it loads."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def add_mtp_layer(d: Path) -> None:
    """Append the multi-token-prediction layer GLM-4.5's hub checkpoints hold after the last
    (``num_nextn_predict_layers`` of them), which transformers does not load: the last layer's tensors again, and its
    eh_proj, enorm, hnorm and shared_head norm."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((d / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(d / "model.safetensors")
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    tensors.update({mtp + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)})
    dtype = tensors["model.norm.weight"].dtype
    tensors[mtp + "eh_proj.weight"] = torch.full((hidden, 2 * hidden), 0.01, dtype=dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[mtp + norm + ".weight"] = torch.ones(hidden, dtype=dtype)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


# how the hub's multimodal checkpoints hold a text model: (architecture, model_type, vision_config, the tensors beside
# the language model's as name -> shape, which a text-only reader skips)
MULTIMODAL = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5", {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32},
                {"model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16), "mtp.fc.weight": (64, 128)}),
    "mistral3": ("Mistral3ForConditionalGeneration", "mistral3", {"model_type": "pixtral", "hidden_size": 32},
                 {"model.vision_tower.patch_conv.weight": (32, 3, 14, 14),
                  "model.multi_modal_projector.linear_1.weight": (64, 32)}),
}


def nest_multimodal(d: Path, kind: str) -> None:
    """Rewrite a saved text model as the hub's multimodal checkpoints of ``kind`` (MULTIMODAL) hold it: the settings
    under text_config (tie_word_embeddings outside), the language model's tensors under model.language_model., and
    the vision tower's (and Qwen3.5's MTP head's) beside them."""
    from safetensors.torch import load_file, save_file

    architecture, model_type, vision, extra = MULTIMODAL[kind]
    cfg = json.loads((d / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "tie_word_embeddings")}
    hub = {"architectures": [architecture], "model_type": model_type, "text_config": text, "vision_config": vision,
           "tie_word_embeddings": cfg["tie_word_embeddings"], "transformers_version": cfg["transformers_version"]}
    (d / "config.json").write_text(json.dumps(hub, indent=2, sort_keys=True) + "\n")
    tensors = load_file(d / "model.safetensors")
    nested = {(k if k.startswith("lm_head.") else k.replace("model.", "model.language_model.", 1)): v
              for k, v in tensors.items()}
    dtype = next(iter(tensors.values())).dtype
    nested.update({name: torch.zeros(shape, dtype=dtype) for name, shape in extra.items()})
    save_file(nested, d / "model.safetensors", metadata={"format": "pt"})


def logit_stats(logits: np.ndarray) -> dict[str, Any]:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    rng = logits.max(axis=-1) - logits.min(axis=-1)
    return {"T": int(logits.shape[0]), "vocab": int(logits.shape[1]),
            "logit_min": float(logits.min()), "logit_max": float(logits.max()),
            "per_position_range_mean": float(rng.mean()),
            "top1_top2_gap_min": float((top2[:, 1] - top2[:, 0]).min()),
            "top1_top2_gap_median": float(np.median(top2[:, 1] - top2[:, 0]))}


# ---------------------------------------------------------------------------------------------------- GGUF

def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotate_half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs tensor (LlamaModel.generate_extra_tensors) for a llama3 rope_scaling."""
    rs = cfg["rope_scaling"]
    dim = cfg["head_dim"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _gguf_writer(dst: Path, arch: str, name: str, cfg: dict[str, Any], tok: Tokenizer) -> Any:
    """A GGUFWriter with the config and tokenizer metadata llama.cpp's converter writes for ``arch``."""
    w = gguf.GGUFWriter(str(dst), arch)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    else:  # a LayerNorm's (Cohere's)
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(cfg.get("partial_rotary_factor", 1.0) * head_dim))  # the dims RoPE turns
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model_json = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return w


def _gguf_put(w: Any) -> Any:
    """put(name, array, kind): add a tensor as q8_0, q4_0 (checked to be exact), f16 or f32."""
    qtypes = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

    def put(name: str, arr: np.ndarray, kind: str) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if kind in qtypes:
            data = gguf.quants.quantize(arr, qtypes[kind])
            if kind == "q4_0" and not np.array_equal(gguf.quants.dequantize(data, qtypes[kind]), arr):
                raise SystemExit(f"{name}: weights are not on the Q4_0 grid")
            w.add_tensor(name, data, raw_dtype=qtypes[kind])
        elif kind == "f16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr)
    return put


def _gguf_finish(w: Any, src: Path, dst: Path) -> dict[str, Any]:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": dst.name, "twin": src.name, "bytes": dst.stat().st_size}


def write_llama_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(src / shard))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = _gguf_writer(dst, "llama", "tiny-llama", cfg, tok)
    put = _gguf_put(w)

    # Q8_0 embedding/output: kestrel keeps both 8-bit with G=32, so re-quantizing them is lossless up to
    # the float16 scale. Layer 0 as Q4_0 and layer 1 as F16 hold the grid weights exactly.
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    put("rope_freqs.weight", llama3_rope_factors(cfg), "f32")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.attn_q.weight", llamacpp_permute(tensors[p + "self_attn.q_proj.weight"], n_head, n_head),
            kind)
        put(f"blk.{i}.attn_k.weight", llamacpp_permute(tensors[p + "self_attn.k_proj.weight"], n_head, n_kv),
            kind)
        put(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"], kind)
        put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"], kind)
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"], kind)
        put(f"blk.{i}.ffn_up.weight", tensors[p + "mlp.up_proj.weight"], kind)
        put(f"blk.{i}.ffn_down.weight", tensors[p + "mlp.down_proj.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_smollm3_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-smollm3 as llama.cpp's SmolLM3Model (LlamaModel's converter) writes it: Q/K rows permuted, no output
    tensor (tied); which layers have no RoPE is llama.cpp's fixed rule, not in the file."""
    return _write_dense(src, dst, tok, "smollm3", PRE_NORMS, permute=True)


def write_ernie4_5_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-ernie4_5 as llama.cpp's Ernie4_5Model writes it: llama's tensor names, unpermuted (llama.cpp turns
    interleaved pairs as HF does), no output tensor (tied)."""
    return _write_dense(src, dst, tok, "ernie4_5", PRE_NORMS)


def write_granite_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-granite as llama.cpp's GraniteModel (LlamaModel's converter) writes it: Q/K rows permuted, the
    multipliers as granite.embedding_scale, .residual_scale, .attention.scale and .logit_scale."""
    def scales(w: Any, cfg: dict[str, Any]) -> None:
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    return _write_dense(src, dst, tok, "granite", PRE_NORMS, permute=True, configure=scales)


def write_olmo2_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-olmo2 as llama.cpp's Olmo2Model writes it: no Q/K permutation, attn_q_norm / attn_k_norm over the
    whole projection, post_attention_norm and post_ffw_norm, no pre-norms."""
    return _write_dense(src, dst, tok, "olmo2", POST_NORMS)


def write_olmo3_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-olmo3 as llama.cpp's Olmo2Model writes OLMo 3: olmo2's tensors, the sliding window and each layer's
    pattern (true: sliding), the full layers' YaRN with its attention factor as rope.scaling.attn_factor."""
    def configure(w: Any, cfg: dict[str, Any]) -> None:
        scaling = cfg["rope_scaling"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_attn_factors(scaling["attention_factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    return _write_dense(src, dst, tok, "olmo2", POST_NORMS, configure=configure)


def write_ministral3_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-ministral3's language model as llama.cpp's Ministral3Model writes it: llama's layout (Q/K permuted),
    YaRN with yarn_log_multiplier = mscale_all_dim, and the attention temperature's scale (its length is the YaRN
    original context)."""
    def configure(w: Any, cfg: dict[str, Any]) -> None:
        rope = cfg["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    return _write_dense(src, dst, tok, "mistral3", PRE_NORMS, permute=True, configure=configure)


def write_exaone4_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-exaone4 as llama.cpp's Exaone4Model writes it: olmo2's tensors (per-head q/k norms) and the window as
    exaone4.attention.sliding_window; the 3-to-1 pattern and the global layers' lack of RoPE are llama.cpp's rule."""
    return _write_dense(src, dst, tok, "exaone4", POST_NORMS,
                        configure=lambda w, cfg: w.add_sliding_window(cfg["sliding_window"]))


def write_seed_oss_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-seed-oss as llama.cpp's SeedOssModel writes it: unpermuted, q/k/v biases, post_attention_norm as the MLP's
    input norm."""
    return _write_dense(src, dst, tok, "seed_oss", {"input_layernorm": "attn_norm",
                                                      "post_attention_layernorm": "post_attention_norm"})


def write_glm4_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-glm4 as llama.cpp's Glm4Model writes it: q/k/v (unpermuted: its RoPE pairs dims 2i, 2i + 1 as HF's) with
    biases, ffn_up = gate|up, post_attention_norm after the attention, ffn_norm before the MLP, post_ffw_norm after
    it, rope.dimension_count half the head."""
    norms = {"input_layernorm": "attn_norm", "post_self_attn_layernorm": "post_attention_norm",
             "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm"}
    return _write_dense(src, dst, tok, "glm4", norms, fused_gate_up=True)


def write_qwen3_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """A dense qwen3 as llama.cpp's Qwen3Model writes it: unpermuted Q/K, q/k norms, YaRN as rope.scaling metadata;
    Q4_0 layer 0, F16 layer 1."""
    def yarn(w: Any, cfg: dict[str, Any]) -> None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        scaling = cfg.get("rope_scaling")
        if scaling:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    return _write_dense(src, dst, tok, "qwen3", PRE_NORMS, configure=yarn)


def write_cohere_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-cohere or tiny-cohere2 as llama.cpp's CommandR2Model / Cohere2Model writes it: unpermuted Q/K (llama.cpp
    turns interleaved pairs as HF does), attn_norm the one norm, command-r's attn_q_norm / attn_k_norm as [heads, hd],
    logit_scale and attention.layer_norm_epsilon; cohere2's window (its 3-to-1 pattern is llama.cpp's rule)."""
    cohere2 = src.name == "tiny-cohere2"

    def configure(w: Any, cfg: dict[str, Any]) -> None:
        w.add_logit_scale(cfg["logit_scale"])
        if cohere2:
            w.add_sliding_window(cfg["sliding_window"])
    return _write_dense(src, dst, tok, "cohere2" if cohere2 else "command-r", {"input_layernorm": "attn_norm"},
                        configure=configure)


# HF norm -> llama.cpp tensor, by where an architecture puts its norms
PRE_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
POST_NORMS = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _write_dense(src: Path, dst: Path, tok: Tokenizer, arch: str, norms: dict[str, str], *, permute: bool = False,
                 fused_gate_up: bool = False, configure: Any = None) -> dict[str, Any]:
    """A dense model's GGUF as llama.cpp's converter writes ``arch``: ``norms`` (HF name -> tensor name), Q/K rows
    permuted as llama's where ``permute``, biases and q/k norms where the checkpoint has them, gate|up as one ffn_up
    where ``fused_gate_up``, no output tensor where the embeddings are tied; ``configure(writer, config)`` adds the
    architecture's metadata. Q4_0 even layers, F16 odd ones."""
    cfg, tensors = _checkpoint(src)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = _gguf_writer(dst, arch, src.name, cfg, tok)
    if configure is not None:
        configure(w, cfg)
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i % 2 == 0 else "f16"
        for hf_norm, name in norms.items():
            put(f"blk.{i}.{name}.weight", tensors[p + hf_norm + ".weight"], "f32")
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            t = tensors[p + f"self_attn.{proj}_proj.weight"]
            if permute and proj in ("q", "k"):
                t = llamacpp_permute(t, n_head, n_head if proj == "q" else n_kv)
            put(f"blk.{i}.{name}.weight", t, kind)
            if p + f"self_attn.{proj}_proj.bias" in tensors:
                put(f"blk.{i}.{name}.bias", tensors[p + f"self_attn.{proj}_proj.bias"], "f32")
        for norm in ("q_norm", "k_norm"):
            if p + f"self_attn.{norm}.weight" in tensors:
                put(f"blk.{i}.attn_{norm}.weight", tensors[p + f"self_attn.{norm}.weight"], "f32")
        mlp = ("up",) if fused_gate_up else ("gate", "up")
        for proj in (*mlp, "down"):
            hf = "gate_up" if fused_gate_up and proj == "up" else proj
            put(f"blk.{i}.ffn_{proj}.weight", tensors[p + f"mlp.{hf}_proj.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    if not cfg.get("tie_word_embeddings"):
        put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_phi3_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-phi3 as llama.cpp's Phi3MiniModel writes it: fused attn_qkv and ffn_up (gate rows, then up),
    no Q/K permutation, the window as phi3.attention.sliding_window; Q4_0 layer 0, F16 layer 1."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    w = _gguf_writer(dst, "phi3", src.name, cfg, tok)
    w.add_sliding_window(cfg["sliding_window"] or 0)
    put = _gguf_put(w)
    scaling = cfg.get("rope_scaling")
    if scaling:  # as Phi3MiniModel: the pretraining context, the attention factor, the factors as tensors
        context, original = cfg["max_position_embeddings"], cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(context / original) / math.log(original)))
        put("rope_factors_long.weight", np.asarray(scaling["long_factor"]), "f32")
        put("rope_factors_short.weight", np.asarray(scaling["short_factor"]), "f32")
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.attn_qkv.weight", tensors[p + "self_attn.qkv_proj.weight"], kind)
        put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"], kind)
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_up.weight", tensors[p + "mlp.gate_up_proj.weight"], kind)
        put(f"blk.{i}.ffn_down.weight", tensors[p + "mlp.down_proj.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    if not cfg.get("tie_word_embeddings"):
        put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_glm4_moe_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-glm4-moe as llama.cpp's Glm4MoeModel writes it: post_attention_norm as the MLP's norm, the router's
    metadata (sigmoid, groups, scale), and the MTP layer as one more block (nextn_predict_layers)."""
    cfg = json.loads((src / "config.json").read_text())

    def configure(w: Any) -> None:
        _sigmoid_router_metadata(w, cfg, groups=True)
        w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    dense = range(cfg["first_k_dense_replace"])
    return _write_choice_router_gguf(src, dst, tok, "glm4moe", configure, "post_attention_norm", dense,
                                     mtp=cfg["num_nextn_predict_layers"])


def write_dots1_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-dots1 as llama.cpp's Dots1Model writes it: ffn_norm, the leading dense layers, the router's metadata
    (sigmoid, scale, renormalised; no groups) and the shared expert."""
    cfg = json.loads((src / "config.json").read_text())

    def configure(w: Any) -> None:
        _sigmoid_router_metadata(w, cfg)
    return _write_choice_router_gguf(src, dst, tok, "dots1", configure, "ffn_norm", range(cfg["first_k_dense_replace"]))


def _sigmoid_router_metadata(w: Any, cfg: dict[str, Any], groups: bool = False) -> None:
    """What llama.cpp's converters write of a DeepSeek-V3-style router (GLM-4.5's, dots.llm1's): the experts (in
    groups, where ``groups``), their width, the shared experts' count, the leading dense layers, the sigmoid gating,
    the scale and the renormalisation."""
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if groups:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])


def write_ernie4_5_moe_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-ernie4_5-moe as llama.cpp's Ernie4_5MoeModel writes it: ffn_norm, the leading dense layers and the step
    between expert layers, the shared experts' count (and the width llama.cpp's converter derives)."""
    cfg = json.loads((src / "config.json").read_text())

    def configure(w: Any) -> None:
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        w.add_expert_shared_feed_forward_length(cfg["intermediate_size"] // cfg["num_key_value_heads"])
    start, step = cfg["moe_layer_start_index"], cfg["moe_layer_interval"]
    dense = [i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step or i < start]
    return _write_choice_router_gguf(src, dst, tok, "ernie4_5-moe", configure, "ffn_norm", dense)


def _write_choice_router_gguf(src: Path, dst: Path, tok: Tokenizer, arch: str, configure: Any, mlp_norm: str,
                              dense: Any, mtp: int = 0) -> dict[str, Any]:
    """A mixture of experts whose router has a choice bias, as llama.cpp's converters write it: unpermuted q/k/v
    with biases and q/k norms where the checkpoint has them, ``mlp_norm`` the MLP's norm, the ``dense`` layers'
    ffn_*, the others' experts stacked with ffn_gate_inp and exp_probs_b and their shared experts as ffn_*_shexp;
    ``mtp`` more blocks (the checkpoint's multi-token-prediction layers) after the last."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    layers = cfg["num_hidden_layers"] + mtp
    experts = cfg.get("n_routed_experts") or cfg["moe_num_experts"]
    w = _gguf_writer(dst, arch, src.name, {**cfg, "num_hidden_layers": layers}, tok)
    configure(w)
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(layers):
        p, kind = f"model.layers.{i}.", "q4_0" if i % 2 == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.{mlp_norm}.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            put(f"blk.{i}.{name}.weight", tensors[p + f"self_attn.{proj}_proj.weight"], kind)
            if p + f"self_attn.{proj}_proj.bias" in tensors:
                put(f"blk.{i}.{name}.bias", tensors[p + f"self_attn.{proj}_proj.bias"], "f32")
        for norm in ("q_norm", "k_norm"):  # dots.llm1's per-head q/k norms
            if p + f"self_attn.{norm}.weight" in tensors:
                put(f"blk.{i}.attn_{norm}.weight", tensors[p + f"self_attn.{norm}.weight"], "f32")
        _put_shared_expert_mlp(put, tensors, i, kind, i in dense, experts, choice_bias=True)
        if i not in dense and i >= cfg["num_hidden_layers"]:  # an MTP layer's own tensors
            put(f"blk.{i}.nextn.eh_proj.weight", tensors[p + "eh_proj.weight"], "f16")
            for norm in ("enorm", "hnorm"):
                put(f"blk.{i}.nextn.{norm}.weight", tensors[p + f"{norm}.weight"], "f32")
            put(f"blk.{i}.nextn.shared_head_norm.weight", tensors[p + "shared_head.norm.weight"], "f32")
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    if not cfg.get("tie_word_embeddings"):
        put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_deepseek2_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """A multi-head latent attention model as llama.cpp's DeepseekV2Model writes it (arch deepseek2): the latent as
    one KV head (key_length r + rope, value_length r) and each head's dims in key_length_mla and value_length_mla,
    kv_b split per head into attn_k_b (transposed) and attn_v_b; DeepSeek-V2's twin as files from before that split
    hold it (head_count_kv the heads, key_length and value_length a head's, attn_kv_b whole). YaRN's mscale_all_dim
    as yarn_log_multiplier (times 0.1); the router as GLM-4.5's twin writes it, sigmoid or softmax."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    tensors = _float32_tensors(src / "model.safetensors")
    heads, r, q_rank = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    nope, turned, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    legacy = cfg["model_type"] == "deepseek_v2"
    layers = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types") or ["dense"] * cfg["first_k_dense_replace"] + ["sparse"] * layers
    dense = [i for i in range(layers) if types[i] == "dense"]
    sigmoid = cfg["model_type"] != "deepseek_v2"
    w = _gguf_writer(dst, "deepseek2", src.name, {**cfg, "num_key_value_heads": heads if legacy else 1,
                                                   "head_dim": turned}, tok)
    w.add_key_length(nope + turned if legacy else r + turned)
    w.add_value_length(dv if legacy else r)
    if not legacy:
        w.add_key_length_mla(nope + turned)
        w.add_value_length_mla(dv)
    w.add_kv_lora_rank(r)
    if q_rank:
        w.add_q_lora_rank(q_rank)
    w.add_leading_dense_block_count(len(dense))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if sigmoid:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(layers):
        p, kind = f"model.layers.{i}.", "q4_0" if i % 2 == 0 else "f16"
        a = p + "self_attn."
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        if q_rank:
            put(f"blk.{i}.attn_q_a.weight", tensors[a + "q_a_proj.weight"], kind)
            put(f"blk.{i}.attn_q_a_norm.weight", tensors[a + "q_a_layernorm.weight"], "f32")
            put(f"blk.{i}.attn_q_b.weight", tensors[a + "q_b_proj.weight"], kind)
        else:
            put(f"blk.{i}.attn_q.weight", tensors[a + "q_proj.weight"], kind)
        put(f"blk.{i}.attn_kv_a_mqa.weight", tensors[a + "kv_a_proj_with_mqa.weight"], kind)
        put(f"blk.{i}.attn_kv_a_norm.weight", tensors[a + "kv_a_layernorm.weight"], "f32")
        kv_b = tensors[a + "kv_b_proj.weight"]  # [H*(nope + dv), r]
        if legacy:
            put(f"blk.{i}.attn_kv_b.weight", kv_b, kind)
        else:
            per_head = kv_b.reshape(heads, nope + dv, r)
            put(f"blk.{i}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1), "f16")  # [H, r, nope]
            put(f"blk.{i}.attn_v_b.weight", per_head[:, nope:], "f16")  # [H, dv, r]
        put(f"blk.{i}.attn_output.weight", tensors[a + "o_proj.weight"], kind)
        _put_shared_expert_mlp(put, tensors, i, kind, i in dense, cfg["n_routed_experts"], choice_bias=sigmoid)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def _put_shared_expert_mlp(put: Any, tensors: dict[str, np.ndarray], i: int, kind: str, dense: bool, experts: int,
                           choice_bias: bool) -> None:
    """Layer ``i``'s MLP as llama.cpp's converters write a mixture of experts beside shared experts: a dense layer's
    ffn_*, else the router ffn_gate_inp, its choice bias exp_probs_b (where ``choice_bias``), the experts stacked as
    ffn_*_exps and the shared ones as ffn_*_shexp."""
    p = f"model.layers.{i}."
    if dense:
        for proj in ("gate", "up", "down"):
            put(f"blk.{i}.ffn_{proj}.weight", tensors[p + f"mlp.{proj}_proj.weight"], kind)
        return
    put(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "mlp.gate.weight"], "f32")
    if choice_bias:
        bias = next(tensors[p + n] for n in ("mlp.gate.e_score_correction_bias",
                                             "mlp.moe_statics.e_score_correction_bias") if p + n in tensors)
        put(f"blk.{i}.exp_probs_b.bias", bias, "f32")
    for kind_name, stacked in _stack_experts(tensors, p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"),
                                             experts).items():
        put(f"blk.{i}.ffn_{kind_name}_exps.weight", stacked, kind)
    for proj in ("gate", "up", "down"):
        put(f"blk.{i}.ffn_{proj}_shexp.weight", tensors[p + f"mlp.shared_experts.{proj}_proj.weight"], kind)


def _mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [..., N, K] on the MXFP4 grid as transformers' checkpoint holds them: blocks uint8 [..., N, K/32, 16]
    (two E2M1 codes a byte, the low nibble first) and scales uint8 [..., N, K/32] (exponent + 127)."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    exps = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)), 0)  # the largest code is 6
    scaled = blocks / np.exp2(exps)
    lut = np.array(FP4_VALUES)
    codes = np.abs(scaled[..., None] - lut).argmin(axis=-1) | np.where(np.signbit(scaled) & (scaled != 0), 8, 0)
    codes = np.where(np.abs(scaled[..., None] - lut).min(axis=-1) == 0, codes, -1)
    if (codes < 0).any():
        raise SystemExit("weights are not on the MXFP4 grid")
    codes = codes.astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exps[..., 0] + 127).astype(np.uint8)


def write_gpt_oss_mxfp4(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-gpt-oss as OpenAI ships gpt-oss: the experts' weights as MXFP4 blocks and scales (checked against
    transformers' own decoder, convert_moe_packed_tensors), everything else as it was; golden = tiny-gpt-oss's."""
    from safetensors.torch import save_file
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (dst / "golden.npz").unlink()
    tensors = {k: torch.from_numpy(v) for k, v in _float32_tensors(src / "model.safetensors").items()}
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, K, N]: rows are t[e].T
            blocks, scales = _mxfp4_encode(t.transpose(1, 2).numpy())
            back = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            if not torch.equal(back, t):
                raise SystemExit(f"{name}: MXFP4 encoding does not decode to the weights")
            out[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            out[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    golden = np.load(src / "golden.npz")
    logits = hf_logits(dst, golden["ids"], quantization_config=Mxfp4Config(dequantize=True))
    if not np.array_equal(logits, golden["logits"]):  # transformers reads the twin as the very same model
        raise SystemExit(f"{dst.name}: transformers' logits differ from {src.name}'s")
    return {"dir": dst.name, "twin": src.name, "files": sorted(p.name for p in dst.iterdir())}


# Integer-quantized twins (GPTQ, AWQ, compressed-tensors): every decoder layer's linear weights round-to-nearest
# quantized to 4 bits in groups of INT_GROUP input columns, everything else as it was. Each twin's golden is what
# transformers computes reading it (through gptqmodel, or compressed-tensors), checked against the float model with
# the weights the script meant to write, so the packing is the readers' and not only the script's.
INT_GROUP = 32


def _quantized_linears(tensors: dict[str, np.ndarray], skip: tuple[str, ...] = ()) -> list[str]:
    """The names (less ``.weight``) of the decoder layers' 2-D linear weights, ``skip`` suffixes left out."""
    return sorted(n.removesuffix(".weight") for n, t in tensors.items()
                  if n.startswith("model.layers.") and n.endswith("_proj.weight") and t.ndim == 2
                  and not n.removesuffix(".weight").endswith(skip))


def _rtn(w: np.ndarray, group_of: np.ndarray, symmetric: bool, bits: int = 4
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest of w [N, K] to ``bits`` by column group (group_of [K]): codes [N, K] in 0..2^bits - 1, zero
    points and float16 scales [N, G]; w's value is then scale * (code - zero)."""
    top, mid = (1 << bits) - 1, 1 << (bits - 1)
    groups = int(group_of.max()) + 1
    scales = np.empty((w.shape[0], groups), np.float16)
    zeros = np.empty((w.shape[0], groups), np.int64)
    for g in range(groups):
        cols = w[:, group_of == g]
        if symmetric:
            scales[:, g] = np.maximum(np.abs(cols).max(1), 1e-6) / (mid - 1)
            zeros[:, g] = mid
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            scales[:, g] = np.maximum(hi - lo, 1e-6) / top
            zeros[:, g] = np.clip(np.round(-lo / scales[:, g].astype(np.float32)), 0, top)
    s = scales.astype(np.float32)[:, group_of]
    codes = np.clip(np.round(w / s) + zeros[:, group_of], 0, top).astype(np.int64)
    return codes, zeros, scales


def _pack_words(codes: np.ndarray, order: np.ndarray | None = None, bits: int = 4) -> np.ndarray:
    """int32 [R, C * bits / 32]: 32 / bits codes [R, C] a word along the row, the lowest bits first, code i of a word
    holding column order[i] of its run (default: column i)."""
    per = 32 // bits
    order = np.arange(per) if order is None else order
    grouped = (codes.reshape(codes.shape[0], -1, per)[:, :, order] & ((1 << bits) - 1)).astype(np.uint32)
    words = np.zeros(grouped.shape[:2], np.uint32)
    for i in range(per):
        words |= grouped[:, :, i] << np.uint32(bits * i)
    return words.view(np.int32)


def _write_int_twin(src: Path, dst: Path, quant: dict[str, Any], tensors_of: Any, tolerance: float = 0.01,
                    **load: Any) -> dict[str, Any]:
    """``src`` with its linear weights replaced by ``tensors_of(name, w)``'s tensors ({suffix: array}, and the
    float weight the script meant), the quantization_config ``quant``; golden: transformers reading the twin, within
    ``tolerance`` of the logits' range of the float model with the weights meant (more where transformers also
    quantizes the activations)."""
    from safetensors.torch import save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (dst / "golden.npz").unlink()
    tensors = {k: v for shard in sorted(src.glob("model*.safetensors")) for k, v in _float32_tensors(shard).items()}
    meant = dict(tensors)
    out = {k: torch.from_numpy(v) for k, v in tensors.items()}
    for name in _quantized_linears(tensors, quant.pop("_skip", ())):
        del out[name + ".weight"]
        parts, meant[name + ".weight"] = tensors_of(name, tensors[name + ".weight"])
        out.update({f"{name}.{suffix}": torch.from_numpy(np.ascontiguousarray(t)) for suffix, t in parts.items()})
    for file in dst.glob("model*.safetensors*"):
        file.unlink()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return _golden_of_twin(src, dst, {k: torch.from_numpy(v) for k, v in meant.items()}, tolerance, **load)


def _golden_of_twin(src: Path, dst: Path, meant: dict[str, Any], tolerance: float, **load: Any) -> dict[str, Any]:
    """dst's golden: transformers reading the quantized twin, checked to be within ``tolerance`` of the logits'
    range of the float model with the weights ``meant`` (every tensor of src, torch), so that the twin holds the
    weights its readers decode and not only those its writer meant."""
    from safetensors.torch import save_file

    ids = np.load(src / "golden.npz")["ids"]
    logits = hf_logits(dst, ids, **load)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        for file in Path(tmp).glob("model*.safetensors*"):
            file.unlink()
        save_file({k: v.contiguous() for k, v in meant.items()}, Path(tmp) / "model.safetensors",
                  metadata={"format": "pt"})
        expected = hf_logits(Path(tmp), ids)
    spread = float((expected.max(-1) - expected.min(-1)).mean())
    if np.abs(logits - expected).max() > tolerance * spread:
        raise SystemExit(f"{dst.name}: transformers reads other weights than the twin was meant to hold "
                         f"(max |diff| {np.abs(logits - expected).max():.4f}, range {spread:.2f})")
    np.savez(dst / "golden.npz", ids=ids, logits=logits.astype(np.float32))
    return {"dir": dst.name, "twin": src.name, "files": sorted(p.name for p in dst.iterdir()), **logit_stats(logits)}


def write_gptq(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """GPTQ as AutoGPTQ and GPTQModel write it (checkpoint_format gptq: zero points stored less 1), 4 bits,
    symmetric, act-order (each column's group from a seeded permutation, g_idx)."""
    rng = np.random.default_rng(41)

    def tensors_of(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        k = w.shape[1]
        g_idx = np.argsort(rng.permutation(k)) // INT_GROUP
        codes, zeros, scales = _rtn(w, g_idx, symmetric=True)
        meant = scales.astype(np.float32)[:, g_idx] * (codes - zeros[:, g_idx])
        return {"qweight": _pack_words(codes.T.reshape(k // 8, 8, -1).transpose(2, 0, 1).reshape(-1, k)).T,
                "qzeros": _pack_words(zeros.T - 1), "scales": scales.T, "g_idx": g_idx.astype(np.int32)}, meant

    quant = {"quant_method": "gptq", "bits": 4, "group_size": INT_GROUP, "desc_act": True, "sym": True,
             "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    return _write_int_twin(src, dst, quant, tensors_of, device_map="cpu")


def write_gptq_int8(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """GPTQ at 8 bits with zero points, one group a row (group_size -1), no act-order."""
    def tensors_of(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        group_of = np.zeros(w.shape[1], np.int64)
        codes, zeros, scales = _rtn(w, group_of, symmetric=False, bits=8)
        meant = scales.astype(np.float32)[:, group_of] * (codes - zeros[:, group_of])
        return {"qweight": _pack_words(codes, bits=8).T, "qzeros": _pack_words(zeros.T - 1, bits=8),
                "scales": scales.T, "g_idx": group_of.astype(np.int32)}, meant

    quant = {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    return _write_int_twin(src, dst, quant, tensors_of, device_map="cpu")


def write_awq(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """AWQ's gemm layout as AutoAWQ writes it: 4 bits with zero points, eight codes a word along the output
    columns in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    def tensors_of(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        group_of = np.arange(w.shape[1]) // INT_GROUP
        codes, zeros, scales = _rtn(w, group_of, symmetric=False)
        meant = scales.astype(np.float32)[:, group_of] * (codes - zeros[:, group_of])
        order = np.array([0, 2, 4, 6, 1, 3, 5, 7])
        return {"qweight": _pack_words(codes.T, order), "qzeros": _pack_words(zeros.T, order),
                "scales": scales.T}, meant

    quant = {"quant_method": "awq", "bits": 4, "group_size": INT_GROUP, "zero_point": True, "version": "gemm"}
    return _write_int_twin(src, dst, quant, tensors_of, device_map="cpu")


def write_compressed_tensors(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """llm-compressor's W4A16 (compressed-tensors pack-quantized, symmetric groups), packed by compressed-tensors'
    own pack_to_int32; the MoE router stays float, as llm-compressor leaves it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    def tensors_of(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        group_of = np.arange(w.shape[1]) // INT_GROUP
        codes, zeros, scales = _rtn(w, group_of, symmetric=True)
        meant = scales.astype(np.float32)[:, group_of] * (codes - zeros[:, group_of])
        signed = torch.from_numpy((codes - 8).astype(np.int8))
        return {"weight_packed": pack_to_int32(signed, 4).numpy(), "weight_scale": scales,
                "weight_shape": np.array(w.shape, np.int64)}, meant

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT_GROUP,
               "dynamic": False, "observer": "minmax"}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                           "output_activations": None}},
             "ignore": ["lm_head", "re:.*mlp.gate$"], "_skip": ("mlp.gate",)}
    return _write_int_twin(src, dst, quant, tensors_of)


def write_compressed_tensors_w8a8(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """llm-compressor's W8A8 (compressed-tensors int-quantized): int8 weights [N, K] with a scale a row, beside int8
    activations quantized a token at a time as the model runs (transformers does; kestrel keeps its own)."""
    def tensors_of(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        scales = (np.maximum(np.abs(w).max(1, keepdims=True), 1e-6) / 127).astype(np.float16)
        codes = np.clip(np.round(w / scales.astype(np.float32)), -127, 127).astype(np.int8)
        return {"weight": codes, "weight_scale": scales}, scales.astype(np.float32) * codes

    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
               "observer": "minmax"}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}
    quant = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                           "output_activations": None}},
             "ignore": ["lm_head"]}
    return _write_int_twin(src, dst, quant, tensors_of, tolerance=0.05)


def write_bnb(src: Path, dst: Path, tok: Tokenizer, bits: int = 4) -> dict[str, Any]:
    """``src`` quantized by bitsandbytes as transformers loads it with load_in_4bit (NF4, double quantization) or
    load_in_8bit, and saved as the Hub's -bnb-4bit repositories are; golden: transformers reading the twin, checked
    against the float model with bitsandbytes' own decoding of those weights."""
    import bitsandbytes.functional as bnbf
    from transformers import BitsAndBytesConfig

    if dst.exists():
        shutil.rmtree(dst)
    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32) if bits == 4 else
             BitsAndBytesConfig(load_in_8bit=True))
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=quant, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(dst)
    (dst / "generation_config.json").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    meant = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if bits == 4 and getattr(weight, "quant_state", None) is not None:
            meant[name + ".weight"] = bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
        elif bits == 8 and getattr(weight, "SCB", None) is not None:
            meant[name + ".weight"] = weight.data.float() * (weight.SCB.float() / 127)[:, None]
    tensors = {k: v for shard in sorted(src.glob("model*.safetensors")) for k, v in _float32_tensors(shard).items()}
    meant = {k: meant.get(k, torch.from_numpy(v)) for k, v in tensors.items()}
    return _golden_of_twin(src, dst, meant, 0.01 if bits == 4 else 0.05, device_map="cpu")


def write_int_references(dst: Path) -> dict[str, Any]:
    """compressed-tensors' own compressors on seeded weights, for the layouts no twin covers (transformers'
    compressed-tensors loader refuses asymmetric zero points): pack-quantized 4-bit groups with packed zero
    points, 8-bit rows; int-quantized with zero points. Each case: the compressed tensors and the library's
    decompressed weight (``NAME.weight``)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rng = np.random.default_rng(43)
    w = torch.from_numpy(rng.standard_normal((48, 96)).astype(np.float32))
    cases = {"packed4": (PackedQuantizationCompressor, dict(num_bits=4, strategy="group", group_size=32), 3),
             "packed8": (PackedQuantizationCompressor, dict(num_bits=8, strategy="channel"), 1),
             "int8": (IntQuantizationCompressor, dict(num_bits=8, strategy="channel"), 1)}
    out: dict[str, np.ndarray] = {}
    for name, (compressor, kw, groups) in cases.items():
        bits = kw["num_bits"]
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(type="int", symmetric=False, **kw))
        scale = torch.from_numpy(rng.uniform(0.05, 0.2, (48, groups)).astype(np.float32))
        zp = torch.from_numpy(rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (48, groups)).astype(np.int8))
        packed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        out.update({f"{name}.{k}": v.numpy() for k, v in packed.items()})
        out[f"{name}.expected"] = compressor.decompress(packed, scheme)["weight"].float().numpy()
    np.savez(dst, **out)
    return {"file": dst.name, "cases": sorted(cases)}


def write_gpt_oss_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-gpt-oss as llama.cpp's GptOssModel writes it: gate and up split from the interleaved tensor, experts
    MXFP4 (gguf-py's quantizer, exact on the grid), attn_sinks, biases, YaRN metadata, post_attention_norm as
    the MLP's input norm; golden = tiny-gpt-oss's."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    w = _gguf_writer(dst, "gpt-oss", src.name, cfg, tok)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    scaling = cfg["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(scaling["factor"])
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    put = _gguf_put(w)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4

    def put_experts(name: str, arr: np.ndarray) -> None:  # [E, N, K]
        data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), mxfp4)
        if not np.array_equal(gguf.quants.dequantize(data, mxfp4), arr):
            raise SystemExit(f"{name}: weights are not on the MXFP4 grid")
        w.add_tensor(name, data, raw_dtype=mxfp4)

    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            put(f"blk.{i}.{name}.weight", tensors[p + f"self_attn.{proj}_proj.weight"], "f16")
            put(f"blk.{i}.{name}.bias", tensors[p + f"self_attn.{proj}_proj.bias"], "f32")
        put(f"blk.{i}.attn_sinks.weight", tensors[p + "self_attn.sinks"], "f32")
        put(f"blk.{i}.post_attention_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "mlp.router.weight"], "f32")
        put(f"blk.{i}.ffn_gate_inp.bias", tensors[p + "mlp.router.bias"], "f32")
        gate_up = tensors[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2F, D], gate|up interleaved
        bias = tensors[p + "mlp.experts.gate_up_proj_bias"]
        put_experts(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, 0::2])
        put_experts(f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2])
        put_experts(f"blk.{i}.ffn_down_exps.weight", tensors[p + "mlp.experts.down_proj"].transpose(0, 2, 1))
        put(f"blk.{i}.ffn_gate_exps.bias", bias[:, 0::2], "f32")
        put(f"blk.{i}.ffn_up_exps.bias", bias[:, 1::2], "f32")
        put(f"blk.{i}.ffn_down_exps.bias", tensors[p + "mlp.experts.down_proj_bias"], "f32")
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


LORA_STD = 0.1  # A and B entries: (alpha / r) * B @ A moves the weights by about a third of their own spread


@torch.no_grad()
def build_lora(base: Path, dst: Path, seed: int, targets: tuple[str, ...]) -> dict[str, Any]:
    """A PEFT LoRA adapter of the tiny model ``base`` (rank 4, alpha 8, on the ``targets`` modules) with random A and
    B, saved as PEFT saves it; golden.npz holds transformers + PEFT's logits on ``base``'s golden ids."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if dst.exists():
        shutil.rmtree(dst)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0, bias="none")
    peft = get_peft_model(model, config)
    rng = np.random.default_rng(seed)
    for name, p in peft.named_parameters():
        if "lora_" in name:
            p.copy_(torch.from_numpy(LORA_STD * rng.standard_normal(tuple(p.shape)).astype(np.float32)))
    peft.save_pretrained(dst, safe_serialization=True)
    (dst / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base.name  # not this machine's path
    (dst / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ids = np.load(base / "golden.npz")["ids"]
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager"), dst)
    reloaded.eval()
    logits = reloaded(torch.from_numpy(ids[None].astype(np.int64))).logits[0].float().numpy()
    np.savez(dst / "golden.npz", ids=ids, logits=logits.astype(np.float32))
    return {"dir": dst.name, "base": base.name, "seed": seed, "files": sorted(p.name for p in dst.iterdir()),
            **logit_stats(logits)}


def _checkpoint(src: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config, float32 tensors) of a tiny model as a text model's: a multimodal Qwen3-VL's text_config and
    model.language_model.* tensors as a plain model's, its stacked experts (the Hub's [E, D, 2F] / [E, F, D]) as
    each expert's gate, up and down; anything else as it is."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    full = (cfg.get("rope_parameters") or {}).get("full_attention")
    if full is not None:  # RoPE per layer type (OLMo 3): the full layers' base and scaling, as llama.cpp writes them
        cfg = {**cfg, "rope_theta": full["rope_theta"],
               "rope_scaling": full if full.get("rope_type", "default") != "default" else None}
    if "text_config" not in cfg:
        return cfg, tensors
    text = cfg["text_config"]
    rope = text["rope_parameters"]
    cfg = {**text, "rope_theta": rope["rope_theta"], "mrope_section": rope.get("mrope_section"),
           "tie_word_embeddings": cfg["tie_word_embeddings"], "vision": cfg["vision_config"]}
    tensors = {k.replace("model.language_model.", "model."): v for k, v in tensors.items() if ".visual." not in k}
    width = cfg.get("moe_intermediate_size")
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        stacked, prefix = tensors.pop(name), name.rsplit(".", 1)[0] + "."
        for e, w in enumerate(stacked):  # x @ W: gate|up [D, 2F], down [F, D]
            if name.endswith("gate_up_proj"):
                tensors[f"{prefix}{e}.gate_proj.weight"] = np.ascontiguousarray(w[:, :width].T)
                tensors[f"{prefix}{e}.up_proj.weight"] = np.ascontiguousarray(w[:, width:].T)
            else:
                tensors[f"{prefix}{e}.down_proj.weight"] = np.ascontiguousarray(w.T)
    return cfg, tensors


def _float32_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (bfloat16 too, which safetensors' numpy loader refuses)."""
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(path).items()}


def _stack_experts(tensors: dict[str, np.ndarray], prefix: str, names: tuple[str, str, str],
                   experts: int) -> dict[str, np.ndarray]:
    """gate, up, down of every expert stacked [E, N, K], as llama.cpp's converters write ffn_*_exps."""
    return {kind: np.stack([tensors[f"{prefix}{e}.{name}.weight"] for e in range(experts)])
            for kind, name in zip(("gate", "up", "down"), names)}


def write_gemma_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-gemma2 / tiny-gemma3 as llama.cpp's Gemma2Model / Gemma3Model write them: every norm weight + 1,
    key/value lengths, the window; Gemma 2's soft-caps, Gemma 3's global layers' linear RoPE scaling; no Q/K
    permutation; Q4_0 layer 0, F16 the rest; tied (no output)."""
    cfg = json.loads((src / "config.json").read_text())
    arch = "gemma3" if cfg["model_type"].startswith("gemma3") else "gemma2"
    full = cfg["rope_parameters"]["full_attention"] if arch == "gemma3" else {"rope_theta": cfg["rope_theta"]}
    tensors = _float32_tensors(src / "model.safetensors")
    w = _gguf_writer(dst, arch, src.name, {**cfg, "rope_theta": full["rope_theta"]}, tok)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i == 0 else "f16"
        for hf_name, gguf_name in names.items():
            if f"{p}{hf_name}.weight" in tensors:  # Gemma 2 has no q/k norms
                put(f"blk.{i}.{gguf_name}.weight", tensors[f"{p}{hf_name}.weight"] + 1, "f32")
        for proj, gguf_name in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                                ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                                ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                                ("mlp.down_proj", "ffn_down")):
            put(f"blk.{i}.{gguf_name}.weight", tensors[f"{p}{proj}.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"] + 1, "f32")
    return _gguf_finish(w, src, dst)


def _write_moe_gguf(src: Path, dst: Path, tok: Tokenizer, arch: str, permute: bool, expert_names: tuple[str, ...],
                    block: str, configure: Any = None) -> dict[str, Any]:
    cfg, tensors = _checkpoint(src)
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    cfg = {**cfg, "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]}
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = _gguf_writer(dst, arch, src.name, cfg, tok)
    if configure is not None:
        configure(w, cfg)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i == 0 else "f16"
        q, k = tensors[p + "self_attn.q_proj.weight"], tensors[p + "self_attn.k_proj.weight"]
        if permute:
            q, k = llamacpp_permute(q, n_head, n_head), llamacpp_permute(k, n_head, n_kv)
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.attn_q.weight", q, kind)
        put(f"blk.{i}.attn_k.weight", k, kind)
        put(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"], kind)
        put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"], kind)
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in tensors:
                put(f"blk.{i}.attn_{proj}.bias", tensors[p + f"self_attn.{proj}_proj.bias"], "f32")
        for norm in ("q_norm", "k_norm"):
            if p + f"self_attn.{norm}.weight" in tensors:
                put(f"blk.{i}.attn_{norm}.weight", tensors[p + f"self_attn.{norm}.weight"], "f32")
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_gate_inp.weight", tensors[f"{p}{block}.gate.weight"], "f32")
        for kind_name, stacked in _stack_experts(tensors, f"{p}{block}.experts.", expert_names, experts).items():
            put(f"blk.{i}.ffn_{kind_name}_exps.weight", stacked, kind)
        if f"{p}{block}.e_score_correction_bias" in tensors:  # the router's choice bias
            put(f"blk.{i}.exp_probs_b.bias", tensors[f"{p}{block}.e_score_correction_bias"], "f32")
        if f"{p}{block}.shared_expert_gate.weight" in tensors:  # as llama.cpp's Qwen2MoeModel: the gate as [D]
            put(f"blk.{i}.ffn_gate_inp_shexp.weight", tensors[f"{p}{block}.shared_expert_gate.weight"][0], "f32")
            for name in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{name}_shexp.weight", tensors[f"{p}{block}.shared_expert.{name}_proj.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_qwen3_moe_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-qwen3-moe as llama.cpp's Qwen3MoeModel writes it: qwen3moe, stacked experts, q/k norms, unpermuted."""
    return _write_moe_gguf(src, dst, tok, "qwen3moe", False, ("gate_proj", "up_proj", "down_proj"), "mlp")


def write_minimax_m2_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-minimax-m2 as llama.cpp's MiniMaxM2Model writes it: minimax-m2, stacked experts intermediate_size wide,
    the router's bias as exp_probs_b, a sigmoid gating function, q/k norms over the whole projection, unpermuted."""
    def configure(w: Any, cfg: dict[str, Any]) -> None:
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    return _write_moe_gguf(src, dst, tok, "minimax-m2", False, ("w1", "w3", "w2"), "block_sparse_moe",
                           configure=configure)


def write_qwen2_moe_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-qwen2-moe as llama.cpp's Qwen2MoeModel writes it: qwen2moe, q/k/v biases, stacked experts, the
    shared expert as ffn_*_shexp with its gate ffn_gate_inp_shexp; unpermuted."""
    return _write_moe_gguf(src, dst, tok, "qwen2moe", False, ("gate_proj", "up_proj", "down_proj"), "mlp")


def _qwen3_vl_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """What llama.cpp's Qwen3VLTextModel adds to qwen3's: the multimodal RoPE's sections and the deepstack layers."""
    w.add_rope_dimension_sections([*cfg["mrope_section"], 0])
    w.add_uint32(f"{w.arch}.n_deepstack_layers", len(cfg["vision"]["deepstack_visual_indexes"]))


def write_qwen3_vl_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-qwen3-vl's language model as llama.cpp's Qwen3VLTextModel writes it (the vision tower goes to its own
    mmproj file): qwen3's tensors, unpermuted, q/k norms."""
    return _write_dense(src, dst, tok, "qwen3vl", PRE_NORMS, configure=_qwen3_vl_metadata)


def write_qwen3_vl_moe_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-qwen3-vl-moe's language model as llama.cpp's Qwen3VLMoeTextModel writes it: qwen3moe's stacked ffn_*_exps
    from the Hub's fused gate|up."""
    return _write_moe_gguf(src, dst, tok, "qwen3vlmoe", False, ("gate_proj", "up_proj", "down_proj"), "mlp",
                           configure=_qwen3_vl_metadata)


def write_mixtral_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-mixtral as llama.cpp writes Mixtral: the llama architecture with experts, Q/K rows permuted."""
    return _write_moe_gguf(src, dst, tok, "llama", True, ("w1", "w3", "w2"), "block_sparse_moe")


def _tiled_value_heads(t: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head (HF) -> tiled."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(key_heads, per_key, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def write_hybrid_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-qwen3_5 / tiny-qwen3_5-moe / tiny-qwen3-next as llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel /
    Qwen3NextModel write them: every norm but linear_attn.norm + 1, A_log as -exp(A_log) (ssm_a), dt_bias as
    ssm_dt.bias, the convolution squeezed, q_proj whole (each head's query, then its gate); experts stacked, the
    shared expert as *_shexp. Qwen3.5: the value heads of every linear-attention tensor reordered from grouped to
    tiled. Qwen3-Next: in_proj_qkvz split into attn_qkv (every key head's q, then k, then v) and attn_gate (z),
    in_proj_ba whole as ssm_ba. Q4_0 even layers, F16 odd ones."""
    cfg = json.loads((src / "config.json").read_text())
    cfg = {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}
    moe, nxt = "num_experts" in cfg, cfg["model_type"] == "qwen3_next"
    rope = cfg["rope_parameters"]
    flat = {**cfg, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
            "intermediate_size": cfg.get("intermediate_size") or cfg["moe_intermediate_size"]}
    tensors = {(k.replace("model.language_model.", "model.", 1)): v
               for k, v in _float32_tensors(src / "model.safetensors").items()}
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    w = _gguf_writer(dst, "qwen3next" if nxt else "qwen35moe" if moe else "qwen35", src.name, flat, tok)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(cfg["layer_types"].index("full_attention") + 1)
    if not nxt:
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if moe:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    put = _gguf_put(w)
    # Qwen3.5's converter tiles the value heads; Qwen3-Next's keeps them
    tiled = (lambda t, axis, head_dim: t) if nxt else partial(_tiled_value_heads, key_heads=hk, per_key=hv // hk)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    for i, kind_of_layer in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i % 2 == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"] + 1, "f32")
        put(f"blk.{i}.post_attention_norm.weight", tensors[p + "post_attention_layernorm.weight"] + 1, "f32")
        if kind_of_layer == "linear_attention":
            a = p + "linear_attn."
            if nxt:
                per = hv // hk * dv
                qkvz = tensors[a + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * per, -1)
                q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + per], axis=1)
                qkv = np.concatenate([t.reshape(-1, t.shape[-1]) for t in (q, k, v)])
                z = z.reshape(-1, z.shape[-1])
            else:
                qkv, z = tensors[a + "in_proj_qkv.weight"], tensors[a + "in_proj_z.weight"]
            conv = tensors[a + "conv1d.weight"][:, 0]  # [C, kernel]
            qk = 2 * hk * dk
            put(f"blk.{i}.attn_qkv.weight", np.concatenate([qkv[:qk], tiled(qkv[qk:], 0, head_dim=dv)]), kind)
            put(f"blk.{i}.attn_gate.weight", tiled(z, 0, head_dim=dv), kind)
            if nxt:
                put(f"blk.{i}.ssm_ba.weight", tensors[a + "in_proj_ba.weight"], kind)
            else:
                put(f"blk.{i}.ssm_beta.weight", tiled(tensors[a + "in_proj_b.weight"], 0, head_dim=1), kind)
                put(f"blk.{i}.ssm_alpha.weight", tiled(tensors[a + "in_proj_a.weight"], 0, head_dim=1), kind)
            put(f"blk.{i}.ssm_a", tiled(-np.exp(tensors[a + "A_log"]), 0, head_dim=1), "f32")
            put(f"blk.{i}.ssm_dt.bias", tiled(tensors[a + "dt_bias"], 0, head_dim=1), "f32")
            put(f"blk.{i}.ssm_conv1d.weight", np.concatenate([conv[:qk], tiled(conv[qk:], 0, head_dim=dv)]), "f32")
            put(f"blk.{i}.ssm_norm.weight", tensors[a + "norm.weight"], "f32")
            put(f"blk.{i}.ssm_out.weight", tiled(tensors[a + "out_proj.weight"], 1, head_dim=dv), kind)
        else:
            for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                put(f"blk.{i}.{name}.weight", tensors[p + f"self_attn.{proj}_proj.weight"], kind)
            for norm in ("q_norm", "k_norm"):
                put(f"blk.{i}.attn_{norm}.weight", tensors[p + f"self_attn.{norm}.weight"] + 1, "f32")
        if moe:
            put(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "mlp.gate.weight"], "f32")
            names = ("gate_proj", "up_proj", "down_proj")
            for name, stacked in _stack_experts(tensors, p + "mlp.experts.", names, cfg["num_experts"]).items():
                put(f"blk.{i}.ffn_{name}_exps.weight", stacked, kind)
            put(f"blk.{i}.ffn_gate_inp_shexp.weight", tensors[p + "mlp.shared_expert_gate.weight"][0], "f32")
            for name in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{name}_shexp.weight", tensors[p + f"mlp.shared_expert.{name}_proj.weight"], kind)
        else:
            for name in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{name}.weight", tensors[p + f"mlp.{name}_proj.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"] + 1, "f32")
    if not cfg["tie_word_embeddings"]:
        put("output.weight", tensors["lm_head.weight"], "q8_0")
    return _gguf_finish(w, src, dst)


def write_lfm2_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-lfm2 as llama.cpp's LFM2Model writes it: head_count_kv per layer (0: a short-convolution layer),
    shortconv.l_cache, the MLP's adjusted width as feed_forward_length, the convolution squeezed, the final norm
    as token_embd_norm; unpermuted. Q4_0 even layers, F16 odd ones; tied (no output)."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    width = tensors["model.layers.0.feed_forward.w1.weight"].shape[0]
    flat = {**cfg, "rope_theta": cfg["rope_parameters"]["rope_theta"], "intermediate_size": width,
            "rms_norm_eps": cfg["norm_eps"]}
    experts, dense = cfg.get("num_experts", 0), cfg.get("num_dense_layers", len(cfg["layer_types"]))
    w = _gguf_writer(dst, "lfm2moe" if experts else "lfm2", src.name, flat, tok)
    w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    if experts:  # LFM2MoeModel's: the experts, the leading dense layers, a sigmoid router
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(dense)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    put("token_embd_norm.weight", tensors["model.embedding_norm.weight"], "f32")
    for i, kind_of_layer in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i % 2 == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "operator_norm.weight"], "f32")
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "ffn_norm.weight"], "f32")
        if kind_of_layer == "conv":
            put(f"blk.{i}.shortconv.in_proj.weight", tensors[p + "conv.in_proj.weight"], kind)
            put(f"blk.{i}.shortconv.conv.weight", tensors[p + "conv.conv.weight"][:, 0], "f32")
            put(f"blk.{i}.shortconv.out_proj.weight", tensors[p + "conv.out_proj.weight"], kind)
        else:
            for proj, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                               ("out_proj", "attn_output")):
                put(f"blk.{i}.{name}.weight", tensors[p + f"self_attn.{proj}.weight"], kind)
            put(f"blk.{i}.attn_q_norm.weight", tensors[p + "self_attn.q_layernorm.weight"], "f32")
            put(f"blk.{i}.attn_k_norm.weight", tensors[p + "self_attn.k_layernorm.weight"], "f32")
        if i < dense:
            for hf, name in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                put(f"blk.{i}.ffn_{name}.weight", tensors[p + f"feed_forward.{hf}.weight"], kind)
            continue
        put(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "feed_forward.gate.weight"], "f32")
        put(f"blk.{i}.exp_probs_b.bias", tensors[p + "feed_forward.expert_bias"], "f32")
        for kind_name, stacked in _stack_experts(tensors, p + "feed_forward.experts.", ("w1", "w3", "w2"),
                                                 experts).items():
            put(f"blk.{i}.ffn_{kind_name}_exps.weight", stacked, kind)
    return _gguf_finish(w, src, dst)


def write_granite_hybrid_gguf(src: Path, dst: Path, tok: Tokenizer) -> dict[str, Any]:
    """tiny-granite4-h / tiny-granite4-h-moe as llama.cpp's GraniteHybridModel writes them: head_count_kv per layer
    (0: a Mamba-2 layer), the ssm.* sizes, Granite's multipliers, a context of 2^20 (no RoPE); Q/K rows permuted as
    llama's; A_log as -exp(A_log) and D as [heads, 1], dt_bias as ssm_dt.bias, the convolution squeezed, the norm
    as [groups, inner / groups]; the shared MLP split into gate and up (ffn_* alone, *_shexp beside experts), the
    experts' input_linear into gate and up. Q4_0 even layers, F16 odd ones; tied (no output)."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _float32_tensors(src / "model.safetensors")
    experts = cfg["num_local_experts"]
    heads, groups = cfg["mamba_n_heads"], cfg["mamba_n_groups"]
    inner = cfg["mamba_expand"] * cfg["hidden_size"]
    attn = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    w = _gguf_writer(dst, "granitehybrid", src.name, {**cfg, "rope_theta": cfg["rope_parameters"]["rope_theta"]}, tok)
    w.add_context_length(2 ** 20)
    w.add_head_count_kv([cfg["num_key_value_heads"] if i in attn else 0 for i in range(cfg["num_hidden_layers"])])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_count(experts)
    if experts:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)
    w.add_rope_scaling_finetuned(False)
    put = _gguf_put(w)
    put("token_embd.weight", tensors["model.embed_tokens.weight"], "q8_0")
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kind = "q4_0" if i % 2 == 0 else "f16"
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], "f32")
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], "f32")
        if i in attn:
            q, k = tensors[p + "self_attn.q_proj.weight"], tensors[p + "self_attn.k_proj.weight"]
            put(f"blk.{i}.attn_q.weight", llamacpp_permute(q, n_head, n_head), kind)
            put(f"blk.{i}.attn_k.weight", llamacpp_permute(k, n_head, n_kv), kind)
            put(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"], kind)
            put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"], kind)
        else:
            m = p + "mamba."
            put(f"blk.{i}.ssm_in.weight", tensors[m + "in_proj.weight"], kind)
            put(f"blk.{i}.ssm_conv1d.weight", tensors[m + "conv1d.weight"][:, 0], "f32")
            put(f"blk.{i}.ssm_conv1d.bias", tensors[m + "conv1d.bias"], "f32")
            put(f"blk.{i}.ssm_dt.bias", tensors[m + "dt_bias"], "f32")
            put(f"blk.{i}.ssm_a", -np.exp(tensors[m + "A_log"])[:, None], "f32")
            put(f"blk.{i}.ssm_d", tensors[m + "D"][:, None], "f32")
            put(f"blk.{i}.ssm_norm.weight", tensors[m + "norm.weight"].reshape(groups, inner // groups), "f32")
            put(f"blk.{i}.ssm_out.weight", tensors[m + "out_proj.weight"], kind)
        gate, up = np.split(tensors[p + "shared_mlp.input_linear.weight"], 2)
        shared = "_shexp" if experts else ""
        put(f"blk.{i}.ffn_gate{shared}.weight", gate, kind)
        put(f"blk.{i}.ffn_up{shared}.weight", up, kind)
        put(f"blk.{i}.ffn_down{shared}.weight", tensors[p + "shared_mlp.output_linear.weight"], kind)
        if experts:
            put(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "block_sparse_moe.router.layer.weight"], "f32")
            gate, up = np.split(tensors[p + "block_sparse_moe.input_linear.weight"], 2, axis=1)
            put(f"blk.{i}.ffn_gate_exps.weight", gate, kind)
            put(f"blk.{i}.ffn_up_exps.weight", up, kind)
            put(f"blk.{i}.ffn_down_exps.weight", tensors[p + "block_sparse_moe.output_linear.weight"], kind)
    put("output_norm.weight", tensors["model.norm.weight"], "f32")
    return _gguf_finish(w, src, dst)


# ------------------------------------------------------------------------------------------------- SmolLM2

SMOLLM_MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris, which is also its largest city."},
]
SMOLLM_TOPK = 5
SMOLLM_FULL_POSITIONS = 4


def build_smollm(gguf_path: Path) -> dict[str, Any]:
    import hashlib

    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    if digest != SMOLLM_GGUF_SHA256:
        raise SystemExit(f"{gguf_path}: sha256 {digest} is not the pinned {SMOLLM_GGUF_SHA256}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = tokenizer.apply_chat_template(SMOLLM_MESSAGES, tokenize=False)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    logits = hf_logits(gguf_path.parent, ids, gguf_file=gguf_path.name)  # [T, V]
    t = logits.shape[0]
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :SMOLLM_TOPK]
    full_pos = np.linspace(0, t - 1, SMOLLM_FULL_POSITIONS).round().astype(np.int64)
    d = OUT / "smollm2"
    d.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        d / "golden.npz",
        ids=ids,
        top_ids=order.astype(np.int64),                                        # [T, k]
        top_logits=np.take_along_axis(logits, order, axis=-1).astype(np.float32),  # [T, k]
        logit_min=logits.min(axis=-1).astype(np.float32),                       # [T]
        logit_max=logits.max(axis=-1).astype(np.float32),                       # [T]
        full_positions=full_pos,                                                # [P]
        full_logits=logits[full_pos].astype(np.float32),                        # [P, V]
    )
    greedy = tokenizer.decode(order[:, 0])
    return {"gguf": gguf_path.name, "gguf_sha256": digest, "text": text, "teacher_forced_greedy": greedy,
            **logit_stats(logits)}


# ---------------------------------------------------------------------------------------------------- main

# the GGUF twins written from a tiny model's directory (with it, under --model)
GGUF_TWINS = {"tiny-phi3": write_phi3_gguf, "tiny-gemma3": write_gemma_gguf, "tiny-gemma2": write_gemma_gguf,
              "tiny-qwen3-moe": write_qwen3_moe_gguf, "tiny-mixtral": write_mixtral_gguf,
              "tiny-qwen2-moe": write_qwen2_moe_gguf, "tiny-phi3-longrope": write_phi3_gguf,
              "tiny-qwen3-yarn": write_qwen3_gguf, "tiny-gpt-oss": write_gpt_oss_gguf,
              "tiny-smollm3": write_smollm3_gguf, "tiny-granite": write_granite_gguf, "tiny-olmo2": write_olmo2_gguf,
              "tiny-olmo3": write_olmo3_gguf, "tiny-ministral3": write_ministral3_gguf,
              "tiny-exaone4": write_exaone4_gguf, "tiny-seed-oss": write_seed_oss_gguf, "tiny-glm4": write_glm4_gguf,
              "tiny-ernie4_5": write_ernie4_5_gguf, "tiny-qwen3_5": write_hybrid_gguf,
              "tiny-qwen3_5-moe": write_hybrid_gguf, "tiny-qwen3-next": write_hybrid_gguf,
              "tiny-lfm2": write_lfm2_gguf, "tiny-granite4-h": write_granite_hybrid_gguf,
              "tiny-granite4-h-moe": write_granite_hybrid_gguf, "tiny-glm4-moe": write_glm4_moe_gguf,
              "tiny-deepseek-v3": write_deepseek2_gguf, "tiny-deepseek-v2": write_deepseek2_gguf,
              "tiny-glm4-moe-lite": write_deepseek2_gguf,
              "tiny-ernie4_5-moe": write_ernie4_5_moe_gguf, "tiny-qwen3-vl": write_qwen3_vl_gguf,
              "tiny-qwen3-vl-moe": write_qwen3_vl_moe_gguf, "tiny-lfm2-moe": write_lfm2_gguf,
              "tiny-minimax-m2": write_minimax_m2_gguf, "tiny-dots1": write_dots1_gguf,
              "tiny-cohere": write_cohere_gguf, "tiny-cohere2": write_cohere_gguf}
# other twins written from a tiny model's directory: name -> (twin, writer)
INT_REFERENCES = "int-references.npz"  # compressed-tensors' layouts without a twin (write_int_references)
# twin -> (base, writer): directories derived from a tiny model's
DIR_TWINS = {"tiny-gpt-oss-mxfp4": ("tiny-gpt-oss", write_gpt_oss_mxfp4), "tiny-qwen3-gptq": ("tiny-qwen3", write_gptq),
             "tiny-qwen3-awq": ("tiny-qwen3", write_awq), "tiny-llama-gptq-int8": ("tiny-llama", write_gptq_int8),
             "tiny-qwen3-moe-w4a16": ("tiny-qwen3-moe", write_compressed_tensors),
             "tiny-qwen2-w8a8": ("tiny-qwen2", write_compressed_tensors_w8a8),
             "tiny-qwen3-bnb-4bit": ("tiny-qwen3", write_bnb),
             "tiny-qwen2-bnb-8bit": ("tiny-qwen2", partial(write_bnb, bits=8))}
# LoRA adapters of the tiny models: name -> (base, seed); built from the base's directory as it is
# adapter -> (base, seed, target modules): tiny-llama's on q, v, o and down; GLM-4.7-Flash's on its latent attention
ADAPTERS = {"tiny-llama-lora": ("tiny-llama", 101, ("q_proj", "v_proj", "o_proj", "down_proj")),
            "tiny-glm4-moe-lite-lora": ("tiny-glm4-moe-lite", 102, ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                    "kv_b_proj", "o_proj"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "smollm"], help="build only one part")
    ap.add_argument("--model", help="build only this tiny model (tiny-mistral, ...)")
    ap.add_argument("--smollm", type=Path, default=SMOLLM_DEFAULT, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    args = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(parents=True, exist_ok=True)

    manifest_path = OUT / "MANIFEST.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.pop("command", None)
    command = "python scripts/make_golden.py" + (f" --only {args.only}" if args.only else "")
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "gguf": _version("gguf"),
                "tokenizers": tokenizers.__version__, "numpy": np.__version__}
    manifest.setdefault("models", {})
    if args.model in ADAPTERS:
        base, seed, targets = ADAPTERS[args.model]
        manifest["models"][args.model] = {**build_lora(OUT / base, OUT / args.model, seed, targets),
                                          "command": f"python scripts/make_golden.py --model {args.model}",
                                          "versions": {**versions, "peft": _version("peft")}}
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    if args.model == INT_REFERENCES:
        ct = {"compressed-tensors": _version("compressed-tensors")}
        manifest["models"][INT_REFERENCES] = {**write_int_references(OUT / INT_REFERENCES),
                                              "command": f"python scripts/make_golden.py --model {INT_REFERENCES}",
                                              "versions": {**versions, **ct}}
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    if args.model in DIR_TWINS:  # a twin alone, from its base as it is
        base, write = DIR_TWINS[args.model]
        manifest["models"][args.model] = {**write(OUT / base, OUT / args.model, None),
                                          "command": f"python scripts/make_golden.py --model {args.model}",
                                          "versions": {**versions, **_twin_versions(args.model)}}
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    if args.model:
        tok = train_tokenizer()
        configs = tiny_configs(tok)
        if args.model not in configs:
            raise SystemExit(f"--model: one of {', '.join([*configs, *DIR_TWINS, *ADAPTERS])}")
        config, opts = configs[args.model]
        seed = opts.get("seed", list(configs).index(args.model) + 1)
        entry = build_tiny(args.model, config, opts, tok, seed)
        manifest["models"][args.model] = {**entry, "command": f"python scripts/make_golden.py --model {args.model}",
                                          "versions": versions}
        if args.model in GGUF_TWINS:
            twin = f"{args.model}.gguf"
            manifest["models"][twin] = {**GGUF_TWINS[args.model](OUT / args.model, OUT / twin, tok),
                                        "command": manifest["models"][args.model]["command"], "versions": versions}
        for twin, (base, write) in DIR_TWINS.items():
            if base == args.model:
                manifest["models"][twin] = {**write(OUT / base, OUT / twin, tok),
                                            "command": manifest["models"][base]["command"], "versions": versions}
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    manifest["versions"] = versions
    if args.only in (None, "tiny"):
        tok = train_tokenizer()
        for place, (name, (config, opts)) in enumerate(tiny_configs(tok).items(), start=1):
            manifest["models"][name] = {**build_tiny(name, config, opts, tok, opts.get("seed", place)),
                                        "command": command}
            print(f"{name}: {manifest['models'][name]}", file=sys.stderr)
        manifest["models"]["tiny-llama.gguf"] = {
            **write_llama_gguf(OUT / "tiny-llama", OUT / "tiny-llama.gguf", tok), "command": command}
        for name, write in GGUF_TWINS.items():
            manifest["models"][f"{name}.gguf"] = {**write(OUT / name, OUT / f"{name}.gguf", tok), "command": command}
        for twin, (base, write) in DIR_TWINS.items():
            manifest["models"][twin] = {**write(OUT / base, OUT / twin, tok), "command": command}
        for name, (base, seed, targets) in ADAPTERS.items():
            manifest["models"][name] = {**build_lora(OUT / base, OUT / name, seed, targets), "command": command}
        manifest["models"][INT_REFERENCES] = {**write_int_references(OUT / INT_REFERENCES), "command": command}
    if args.only in (None, "smollm"):
        manifest["models"]["smollm2"] = {**build_smollm(args.smollm), "command": command}
        print(f"smollm2: {manifest['models']['smollm2']}", file=sys.stderr)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return 0


def _twin_versions(twin: str) -> dict[str, str]:
    """The readers a twin's golden came through."""
    dists = {"tiny-qwen3-gptq": ("gptqmodel", "optimum"), "tiny-llama-gptq-int8": ("gptqmodel", "optimum"),
             "tiny-qwen3-awq": ("gptqmodel",), "tiny-qwen3-moe-w4a16": ("compressed-tensors",),
             "tiny-qwen2-w8a8": ("compressed-tensors",), "tiny-qwen3-bnb-4bit": ("bitsandbytes",),
             "tiny-qwen2-bnb-8bit": ("bitsandbytes",)}.get(twin, ())
    return {d: _version(d) for d in dists}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
