#!/usr/bin/env python3
"""fuzz_formats_seeds.py CORPUS_DIR [SHARED_DIR [ARTIFACT_DIR]] — seeds for scripts/fuzz_formats.sh.

Each seed is selector byte (the reader, see tests/fuzz/fuzz_formats.h) + option
byte + the file (or, for two-file readers, a 16-bit little-endian length of
the first file, then both files). Small valid files: the fixtures in
tests/fixtures, a tiny llama2.c checkpoint and tokenizer, a tiny HF checkpoint
(numpy + safetensors), text and JSONL samples, and the calibration artifacts
(*.kvq) in ARTIFACT_DIR (scripts/fuzz_formats.sh makes them with kvcalib)."""
import hashlib, json, os, struct, sys

import numpy as np

GGUF, MODEL_GGUF, TOK_GGUF, LLAMA2C, TOK_LLAMA2C, SAFETENSORS, HF_CKPT, TOK_HF, TEXT, ARTIFACT = range(10)
out = sys.argv[1]
shared = sys.argv[2] if len(sys.argv) > 2 else "../shared"
os.makedirs(out, exist_ok=True)
fx = "tests/fixtures"


def seed(sel, opt, *files):
    if len(files) == 1:
        d = bytes([sel, opt]) + files[0]
    else:
        d = bytes([sel, opt]) + struct.pack("<H", len(files[0])) + files[0] + files[1]
    open(os.path.join(out, hashlib.sha1(d).hexdigest()), "wb").write(d)


def rd(p):
    return open(p, "rb").read()


g = rd(os.path.join(fx, "tiny_llama.gguf"))
for s in (GGUF, MODEL_GGUF, TOK_GGUF):
    seed(s, 0, g)

rng = np.random.default_rng(0)
# llama2.c checkpoint: dim 8, hidden 16, 1 layer, 2 heads, 1 kv head, vocab 16, seq_len 8
dim, hid, L, H, KV, V, T = 8, 16, 1, 2, 1, 16, 8
hd = dim // H
n = V * dim + L * (dim + dim * dim + 2 * KV * hd * dim + dim * dim + dim + 3 * hid * dim) + dim + 2 * T * hd // 2
seed(LLAMA2C, 0, struct.pack("<7i", dim, hid, L, H, KV, V, T) + rng.standard_normal(n).astype("<f4").tobytes())
seed(LLAMA2C, 0, struct.pack("<7i", dim, hid, L, H, KV, -V, T) +
     rng.standard_normal(n + V * dim).astype("<f4").tobytes())

# llama2.c tokenizer: 16 records (<unk>, <s>, </s>, bytes, pieces)
texts = [b"<unk>", b"\n<s>\n", b"\n</s>\n", b"<0x0A>", b"<0x20>", b" ", b"e", b"t", b" t", b"he", b" the",
         b"o", b"l", b"lo", b"Hello", b" world"]
tok = struct.pack("<I", max(len(t) for t in texts))
for i, t in enumerate(texts):
    tok += struct.pack("<fi", -float(i), len(t)) + t
seed(TOK_LLAMA2C, (len(texts) - 3) << 1, tok)
seed(TOK_LLAMA2C, 1, tok)
p = os.path.join(shared, "models/llama2c/aidreams-tok512.bin")
if os.path.exists(p):
    seed(TOK_LLAMA2C, 1, rd(p))

seed(SAFETENSORS, 0, rd(os.path.join(fx, "st_fixture.safetensors")))

# HF checkpoint: the same tiny shapes
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": dim,
       "intermediate_size": hid, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
       "vocab_size": V, "max_position_embeddings": T, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "rope_scaling": None, "tie_word_embeddings": True, "torch_dtype": "float32"}
try:
    from safetensors.numpy import save
    t = {"model.embed_tokens.weight": (V, dim), "model.norm.weight": (dim,)}
    for l in range(L):
        pre = "model.layers.%d." % l
        t.update({pre + "input_layernorm.weight": (dim,), pre + "post_attention_layernorm.weight": (dim,),
                  pre + "self_attn.q_proj.weight": (dim, dim), pre + "self_attn.k_proj.weight": (KV * hd, dim),
                  pre + "self_attn.v_proj.weight": (KV * hd, dim), pre + "self_attn.o_proj.weight": (dim, dim),
                  pre + "mlp.gate_proj.weight": (hid, dim), pre + "mlp.up_proj.weight": (hid, dim),
                  pre + "mlp.down_proj.weight": (dim, hid)})
    for dt in ("<f4", "<f2"):
        w = save({k: rng.standard_normal(s).astype(dt) for k, s in t.items()})
        seed(HF_CKPT, 0, json.dumps(cfg).encode(), w)
    seed(SAFETENSORS, 0, w)
except ImportError:
    print("fuzz_formats_seeds: safetensors not installed; no HF checkpoint seed", file=sys.stderr)

tj = rd(os.path.join(fx, "hf_metaspace_tokenizer.json"))
seed(TOK_HF, 0, tj, b"")
seed(TOK_HF, 0, tj, json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
                                "add_eos_token": False}).encode())

txt = b" = Valkyria Chronicles III = \n \n Senjou no Valkyria 3 : <unk> Chronicles\r\n\n"
for opt in (0, 1, 4):
    seed(TEXT, opt, txt)
seed(TEXT, 2, b'{"text": "Hello \\u00e9 world"}\n\n{"text": "a\\nb", "id": 3}\n')
adir = sys.argv[3] if len(sys.argv) > 3 else None
if adir and os.path.isdir(adir):
    for f in sorted(os.listdir(adir)):
        if f.endswith(".kvq"):
            seed(ARTIFACT, 0, rd(os.path.join(adir, f)))
print("fuzz_formats_seeds: %d seeds in %s" % (len(os.listdir(out)), out))
