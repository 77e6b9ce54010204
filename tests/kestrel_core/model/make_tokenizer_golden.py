"""Write data/smollm2_tokenizer_golden.json: transformers' own reading of the default model's tokenizer.

    python tests/kestrel_core/model/make_tokenizer_golden.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf

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


def main() -> None:
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
