"""Golden data for the GGUF tokenizers: transformers' own reading of the same files.

    python tests/kestrel_core/model/make_tokenizer_golden.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf
    python tests/kestrel_core/model/make_tokenizer_golden.py --sentencepiece

The first writes data/smollm2_tokenizer_golden.json from the default model's byte-level BPE. The second writes
three tokenizer-only GGUFs of one SentencePiece BPE vocabulary (trained here with `tokenizers`: byte
fallback pieces, "▁" for spaces, a piece of two real spaces as Gemma files have, scores in merge order), as
llama.cpp's converter lays them out, under tests/fixtures/tokenizers/ (spm-llama.gguf, spm-phi3.gguf,
spm-gemma3.gguf: the same vocabulary, each architecture's variant), and data/spm_tokenizer_golden.json with
transformers' token ids of TEXTS for phi3 and gemma3.

transformers builds its fast tokenizer from the GGUF's vocabulary independently of kestrel; the test compares
kestrel's GGUF-built tokenizer with it. transformers does not know llama.cpp's "smollm" pre-tokenizer (every
digit on its own), so the texts avoid runs of digits; test_tokenizer.py checks the digit split separately.
Needs transformers (and torch); the tests do not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

TEXTS = [
    "What is the capital of France?",
    "Hello, world! How are you today?",
    "  leading spaces and trailing   ",
    "line one\nline two\n\n\ttabbed\r\nwindows line",
    "Unicode: café naïve Straße Ελληνικά русский 日本語 한국어 emoji 🤖🚀✨",
    "code: def f(x):\n    return x ** 2  # square",
    "She'll say they've done it; we'd agree. I'm sure you're right.",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "I have 3 cats and 1 dog.",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}],
]


SPM_ARCHITECTURES = ("llama", "phi3", "gemma3")


def write_sentencepiece_fixtures() -> None:
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = Path(__file__).resolve().parents[2]
    out_dir = root / "fixtures" / "tokenizers"
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = (root.parent / "scripts" / "make_golden.py").read_text(encoding="utf-8") + "\n".join(TEXTS)
    bpe = Tokenizer(models.BPE(byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(corpus.splitlines(), trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                                     show_progress=False))
    learned = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]) if t not in specials]
    pieces = learned + ["  "]  # Gemma files store pieces of spaces as spaces
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]  # the merge order, best first
    golden = {"source": "transformers AutoTokenizer.from_pretrained(..., gguf_file=spm-<architecture>.gguf)"}
    for arch in SPM_ARCHITECTURES:
        path = out_dir / f"spm-{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(1)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if arch == "llama":  # transformers' GGUF reader folds its prefix space into a leading one (the model's own
            continue  # tokenizer and llama.cpp do not): the test checks it against llama.cpp's vectors instead
        tok = AutoTokenizer.from_pretrained(str(out_dir), gguf_file=path.name)
        golden[arch] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False),
                         "decoded": tok.decode(tok.encode(t, add_special_tokens=False))} for t in TEXTS]
    dest = Path(__file__).parent / "data" / "spm_tokenizer_golden.json"
    dest.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(dest)


def main() -> None:
    if sys.argv[1:] == ["--sentencepiece"]:
        write_sentencepiece_fixtures()
        return
    gguf_path = Path(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    out = {
        "source": f"transformers AutoTokenizer.from_pretrained(..., gguf_file={gguf_path.name!r})",
        "texts": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TEXTS],
        "chats": [{"messages": m, "prompt": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)}
                  for m in CONVERSATIONS],
    }
    dest = Path(__file__).parent / "data" / "smollm2_tokenizer_golden.json"
    # one entry per line: readable diffs without one line per token id
    lines = [f' "source": {json.dumps(out["source"])},', ' "texts": [']
    lines += [f"  {json.dumps(e, ensure_ascii=False)}," for e in out["texts"]]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ],", ' "chats": [']
    lines += [f"  {json.dumps(e, ensure_ascii=False)}," for e in out["chats"]]
    lines[-1] = lines[-1].rstrip(",")
    dest.write_text("{\n" + "\n".join(lines) + "\n ]\n}\n", encoding="utf-8")
    print(dest)


if __name__ == "__main__":
    main()
