"""Build the embedding fixtures: a tiny Qwen3-Embedding-style checkpoint, its GGUF twin, and golden vectors.

Needs torch, transformers and sentence-transformers (the tests that read the output do not). Run from the
repository root:

    python scripts/make_embedding_golden.py

Writes under tests/fixtures/models/:
  tiny-qwen3-embed/  a sentence-transformers directory laid out like Qwen/Qwen3-Embedding-8B: the Qwen3Model's
                     weights with no ``model.`` prefix and no lm_head (untied), config.json naming
                     Qwen3ForCausalLM, float16; modules.json with last-token Pooling and Normalize; a tokenizer
                     whose post-processor appends <|endoftext|>, as Qwen3-Embedding's does
  tiny-qwen3-embed.gguf  the same as llama.cpp's converter writes it: qwen3, pooling_type LAST, add_eos_token,
                     no output tensor; Q8_0 token_embd, Q4_0 layer 0, F16 the rest
  tiny-qwen3-embed/golden.npz  for each of TEXTS: ``ids_<i>`` (the tokenizer's ids, end of text included),
                     ``embeddings`` [B, D] from SentenceTransformer.encode, and ``last``, ``mean``, ``cls`` [B, D]:
                     the final hidden states of transformers' AutoModel pooled each way and L2-normalized
                     (``last`` equals ``embeddings``: the script checks it)
and adds both to MANIFEST.json.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from make_golden import OUT, SPECIALS, _gguf_finish, _gguf_put, _gguf_writer, _version, init_weights, train_tokenizer
from sentence_transformers import SentenceTransformer
from tokenizers import processors
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

NAME = "tiny-qwen3-embed"
SEED = 21
END = "<|endoftext|>"
TEXTS = [
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Quantization maps each weight to a small integer; the scale brings it back.",
    "The sea is wide and the sky is blue; the wind is cold and the waves are new. " * 6,
    "12",
]


def tokenizer_with_end() -> Any:
    """make_golden's BPE with Qwen3-Embedding's post-processor: every text ends with <|endoftext|>."""
    tok = train_tokenizer()
    end = tok.token_to_id(END)
    tok.post_processor = processors.TemplateProcessing(single=f"$A:0 {END}:0", pair=f"$A:0 {END}:0 $B:1 {END}:1",
                                                       special_tokens=[(END, end)])
    return tok


def write_sentence_transformers(d: Path, tok: Any, hidden: int) -> None:
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIALS}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "model_max_length": 256, "pad_token": END, "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (d / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}) + "\n")
    (d / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (d / "2_Normalize").mkdir()


def build(tok: Any) -> dict[str, Any]:
    d = OUT / NAME
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    config = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tok.token_to_id(END),
                         eos_token_id=tok.token_to_id("<|im_end|>"), rms_norm_eps=1e-6, num_hidden_layers=3,
                         intermediate_size=128, head_dim=16, tie_word_embeddings=False, rope_theta=1e6,
                         use_sliding_window=False)
    torch.manual_seed(SEED)
    causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(causal, SEED)
    causal.model.to(torch.float16).save_pretrained(d)  # the base model alone: no prefix, no lm_head
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]  # as the hub's Qwen3-Embedding configs say
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (d / "generation_config.json").unlink(missing_ok=True)
    write_sentence_transformers(d, tok, config.hidden_size)

    hf_tok = AutoTokenizer.from_pretrained(d)
    ids = [hf_tok(t)["input_ids"] for t in TEXTS]
    if any(x[-1] != tok.token_to_id(END) for x in ids):
        raise SystemExit("the tokenizer did not append <|endoftext|>")
    st = SentenceTransformer(str(d), device="cpu", model_kwargs={"dtype": torch.float32,
                                                                 "attn_implementation": "eager"})
    embeddings = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS]).astype(np.float32)
    model = AutoModel.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    pooled: dict[str, list[np.ndarray]] = {"last": [], "mean": [], "cls": []}
    with torch.no_grad():
        for x in ids:
            h = model(torch.tensor([x])).last_hidden_state[0]  # [T, D]
            for mode, v in (("last", h[-1]), ("mean", h.mean(0)), ("cls", h[0])):
                pooled[mode].append(torch.nn.functional.normalize(v, dim=0).numpy())
    golden = {mode: np.stack(vs).astype(np.float32) for mode, vs in pooled.items()}
    if not np.allclose(golden["last"], embeddings, atol=1e-5):
        raise SystemExit("sentence-transformers' embeddings are not the normalized last hidden states")
    np.savez(d / "golden.npz", embeddings=embeddings, **golden,
             **{f"ids_{i}": np.asarray(x) for i, x in enumerate(ids)})
    cos = golden["last"] @ golden["mean"].T
    return {"dir": NAME, "dtype": "float16", "seed": SEED, "texts": len(TEXTS), "dim": config.hidden_size,
            "tokens": [len(x) for x in ids], "files": sorted(p.name for p in d.iterdir()),
            "cos_last_mean_min": float(np.diag(cos).min())}


def write_gguf(src: Path, dst: Path, tok: Any) -> dict[str, Any]:
    """As llama.cpp's Qwen3Model converter writes Qwen3-Embedding: qwen3, no Q/K permutation, q/k norms,
    pooling LAST, end of text appended (its eos id), no output tensor."""
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    end = tok.token_to_id(END)
    rope_theta = cfg["rope_parameters"]["rope_theta"]  # transformers 5's layout
    w = _gguf_writer(dst, "qwen3", src.name, {**cfg, "eos_token_id": end, "rope_theta": rope_theta}, tok)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_pooling_type(gguf.PoolingType.LAST)
    w.add_add_eos_token(True)
    put = _gguf_put(w)
    put("token_embd.weight", tensors["embed_tokens.weight"], "q8_0")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(cfg["num_hidden_layers"]):
        kind = "q4_0" if i == 0 else "f16"
        for hf_name, gguf_name in norms.items():
            put(f"blk.{i}.{gguf_name}.weight", tensors[f"layers.{i}.{hf_name}.weight"], "f32")
        for hf_name, gguf_name in names.items():
            put(f"blk.{i}.{gguf_name}.weight", tensors[f"layers.{i}.{hf_name}.weight"], kind)
    put("output_norm.weight", tensors["norm.weight"], "f32")
    return _gguf_finish(w, src, dst)


def main() -> int:
    torch.use_deterministic_algorithms(True)
    tok = tokenizer_with_end()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
                "gguf": _version("gguf"), "tokenizers": tokenizers.__version__, "numpy": np.__version__}
    command = "python scripts/make_embedding_golden.py"
    manifest_path = OUT / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["models"][NAME] = {**build(tok), "command": command, "versions": versions}
    manifest["models"][f"{NAME}.gguf"] = {**write_gguf(OUT / NAME, OUT / f"{NAME}.gguf", tok), "command": command,
                                          "versions": versions}
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(json.dumps(manifest["models"][NAME], indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
