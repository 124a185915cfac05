#!/usr/bin/env python3
"""A tiny Llama-2-style HF tokenizer.json (BPE, byte_fallback, normalizer
Prepend("▁") + Replace(" ", "▁"), TemplateProcessing with <s>) and the ids the
HF `tokenizers` package gives for a few strings. Writes
tests/fixtures/hf_metaspace_tokenizer.json and tests/fixtures/hf_metaspace_tok.txt
(format as in make_smollm2_tok_fixture.py)."""
import json

import tokenizers

vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256):
    vocab["<0x%02X>" % b] = 3 + b
for t in ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁b", "▁▁", "abc", "▁abc"]:
    vocab[t] = len(vocab)
merges = ["▁ a", "a b", "▁a b", "b c", "▁ b", "▁ ▁", "ab c", "▁ab c"]
tj = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True} for c, i in [("<unk>", 0), ("<s>", 1), ("</s>", 2)]],
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": None,
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                       "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "vocab": vocab, "merges": merges},
}
with open("tests/fixtures/hf_metaspace_tokenizer.json", "w") as f:
    json.dump(tj, f, ensure_ascii=False, indent=0)
tk = tokenizers.Tokenizer.from_file("tests/fixtures/hf_metaspace_tokenizer.json")
cases = ["ab", "abc ab  b", " a", "cab é", "bca\n\tz", "aaaa bbbb", "abcabc abc"]
with open("tests/fixtures/hf_metaspace_tok.txt", "w") as f:
    for s in cases:
        ids = tk.encode(s, add_special_tokens=False).ids
        assert tk.decode(ids) == s, (s, tk.decode(ids))
        f.write("P\t%s\t%s\n" % (s.encode().hex(), " ".join(map(str, ids))))
print(open("tests/fixtures/hf_metaspace_tok.txt").read())
print(tk.encode("ab").ids)
