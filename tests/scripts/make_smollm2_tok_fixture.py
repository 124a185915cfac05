#!/usr/bin/env python3
"""Expected token ids for the default model's tokenizer, from an independent
implementation: the HF `tokenizers` package (Rust) reading a tokenizer.json
rebuilt from the GGUF's own vocabulary and merges.

Writes
  tests/fixtures/smollm2_tok.txt       one case per line: MODE<TAB>hex(utf-8 input)<TAB>ids
                                       MODE "P" = special tokens parsed (kvq KVQ_TOK_PARSE_SPECIAL),
                                       "T" = special-token text treated as text.
  tests/fixtures/hf_mini_tokenizer.json  a small tokenizer.json (SmolLM2 ids < 3000 and the merges
                                       among them; same pre-tokenizer) for kvq's HF-json loader
  tests/fixtures/hf_mini_tok.txt       expected ids for that mini tokenizer (same format)

Usage: python3 tests/scripts/make_smollm2_tok_fixture.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]
The full rebuilt tokenizer.json is written to /tmp only (it is ~2 MB).
"""
import json
import sys

import gguf
import tokenizers

MODEL = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"

CASES = [
    "Hello world",
    " Hello world",
    "   leading spaces and trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\n\nthree",
    "windows\r\nline\r\nends\r\n",
    "digits 1234567890 and 3.14159, 1,000,000",
    "x=42;y=0x1F;z=-7e10",
    "unicode: Führer naïve café Ωμέγα Привет мир 日本語のテキスト",
    "emoji 🦙🚀😶‍🌫️ ✅ 👍🏽",
    "code: def f(x):\n    return x**2  # square\n",
    "int main(void) { printf(\"%d\\n\", a[i] >> 2); }",
    "it's they're we've I'm you'll he'd IT'S",
    "  \n\t \r\n  mixed   whitespace\u00a0nbsp\u2003emsp",
    " = Robert Boulter = \n\n\n Robert Boulter is an English film , television and theatre actor .",
    "@-@ 2 @,@ 000 <unk> tokens",
    "!!!!!!??? ... --- ***",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> inside and <|endoftext|>",
    "ÀÁÂÃÄÅ ĀāĂăĄą ḀḁḂḃ",
    "",
    "a",
]


def field(r, k):
    f = r.fields[k]
    if len(f.types) > 1 or f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()


def build(tokens, types, merges):
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


def write_cases(tk, path):
    with open(path, "w") as f:
        for s in CASES:
            for mode in ("P", "T"):
                tk.encode_special_tokens = mode == "T"
                ids = tk.encode(s, add_special_tokens=False).ids
                if mode == "T" and "<|" not in s:
                    continue
                f.write("%s\t%s\t%s\n" % (mode, s.encode("utf-8").hex(), " ".join(map(str, ids))))
                assert tk.decode(ids, skip_special_tokens=False) == s, s
    print("wrote", path)


def main():
    r = gguf.GGUFReader(MODEL)
    assert field(r, "tokenizer.ggml.pre") == "smollm"
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    full = build(tokens, types, merges)
    with open("/tmp/smollm2_rebuilt_tokenizer.json", "w") as f:
        json.dump(full, f, ensure_ascii=False)
    write_cases(tokenizers.Tokenizer.from_file("/tmp/smollm2_rebuilt_tokenizer.json"), "tests/fixtures/smollm2_tok.txt")

    M = 3000
    vocab = set(tokens[:M])
    mini_merges = [m for m in merges if (lambda a, b: a in vocab and b in vocab and a + b in vocab)(*m.split(" "))]
    mini = build(tokens[:M], types[:M], mini_merges)
    with open("tests/fixtures/hf_mini_tokenizer.json", "w") as f:
        json.dump(mini, f, ensure_ascii=False, indent=0)
    write_cases(tokenizers.Tokenizer.from_file("tests/fixtures/hf_mini_tokenizer.json"), "tests/fixtures/hf_mini_tok.txt")
    print("mini merges", len(mini_merges))


if __name__ == "__main__":
    main()
