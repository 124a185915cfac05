#!/usr/bin/env python3
"""Convert a llama2.c checkpoint into Hugging Face Llama layout (config.json +
safetensors), exactly as transformers' convert_llama_weights_to_hf.py converts
Meta checkpoints, for tests/test_model_hf.c.

Regenerate the committed fixtures (f32, ~1 MB each):
    python3 tests/scripts/llama2c_to_hf.py ../shared/models/llama2c/stories260K.bin tests/fixtures
writes
    tests/fixtures/stories260K-hf/          config.json, model.safetensors
    tests/fixtures/stories260K-hf-sharded/  config.json, model.safetensors.index.json,
                                            model-00001-of-00002.safetensors (embedding, layers 0-2),
                                            model-00002-of-00002.safetensors (layers 3-4, final norm)

llama2.c layout (karpathy/llama2.c run.c, memory_map_weights): header of 7
int32 {dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len}
(vocab_size < 0: separate classifier), then fp32 arrays stacked over layers.
llama2.c, like Meta's reference model, rotates interleaved channel pairs
(2i, 2i+1) of each head. HF's LlamaAttention rotates (i, i + head_dim/2)
("rotate_half"), so the converter permutes the rows of wq and wk per head:
    permute(w, n_heads, dim1, dim2) =
        w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)
(transformers/models/llama/convert_llama_weights_to_hf.py; wk uses
n_heads = num_key_value_heads, dim1 = kv_dim). The script checks that this is
the right permutation: attention scores q.k under HF's rotate-half RoPE on the
permuted weights equal those under interleaved RoPE on the original weights.

Values are stored as F32 so that the loaded weights are bit-identical to the
llama2.c loader's.
"""
import json
import os
import struct
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def read_llama2c(path):
    with open(path, "rb") as f:
        hdr = struct.unpack("<7i", f.read(28))
        data = np.frombuffer(f.read(), dtype="<f4")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = hdr
    shared = vocab > 0
    vocab = abs(vocab)
    hd = dim // n_heads
    qd, kvd = n_heads * hd, n_kv * hd
    off = 0

    def take(*shape):
        nonlocal off
        n = int(np.prod(shape))
        a = data[off:off + n].reshape(shape)
        off += n
        return a

    w = {}
    w["emb"] = take(vocab, dim)
    w["rms_att"] = take(n_layers, dim)
    w["wq"] = take(n_layers, qd, dim)
    w["wk"] = take(n_layers, kvd, dim)
    w["wv"] = take(n_layers, kvd, dim)
    w["wo"] = take(n_layers, dim, qd)
    w["rms_ffn"] = take(n_layers, dim)
    w["w1"] = take(n_layers, hidden, dim)
    w["w2"] = take(n_layers, dim, hidden)
    w["w3"] = take(n_layers, hidden, dim)
    w["rms_final"] = take(dim)
    take(seq_len, hd // 2)  # freq_cis_real
    take(seq_len, hd // 2)  # freq_cis_imag
    w["wcls"] = w["emb"] if shared else take(vocab, dim)
    assert off == data.size, f"{path}: {data.size - off} trailing floats"
    hp = dict(dim=dim, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv=n_kv,
              vocab=vocab, seq_len=seq_len, shared=shared)
    return hp, w


def permute(w, n_heads, dim1, dim2):
    """transformers convert_llama_weights_to_hf.py (torch .view/.transpose in numpy)."""
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def rope_interleaved(x, pos, theta=10000.0):
    hd = x.shape[-1]
    out = x.astype(np.float64).copy()
    for i in range(hd // 2):
        f = pos / theta ** (2 * i / hd)
        c, s = np.cos(f), np.sin(f)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def rope_rotate_half(x, pos, theta=10000.0):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([pos * inv, pos * inv])
    x = x.astype(np.float64)
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def check_permutation(hp, w):
    """q.k scores: HF rotate-half on permuted weights == interleaved on the originals."""
    rng = np.random.default_rng(0)
    dim, nh, nkv = hp["dim"], hp["n_heads"], hp["n_kv"]
    hd = dim // nh
    wq, wk = w["wq"][0].astype(np.float64), w["wk"][0].astype(np.float64)
    wq_hf, wk_hf = permute(wq, nh, nh * hd, dim), permute(wk, nkv, nkv * hd, dim)
    x1, x2 = rng.standard_normal(dim), rng.standard_normal(dim)
    for h in range(nh):
        g = h // (nh // nkv)
        q = rope_interleaved((wq @ x1)[h * hd:(h + 1) * hd], 7)
        k = rope_interleaved((wk @ x2)[g * hd:(g + 1) * hd], 3)
        qh = rope_rotate_half((wq_hf @ x1)[h * hd:(h + 1) * hd], 7)
        kh = rope_rotate_half((wk_hf @ x2)[g * hd:(g + 1) * hd], 3)
        assert abs(q @ k - qh @ kh) <= 1e-9 * (1 + abs(q @ k)), (h, q @ k, qh @ kh)


def hf_tensors(hp, w):
    dim, nh, nkv = hp["dim"], hp["n_heads"], hp["n_kv"]
    hd = dim // nh
    t = {"model.embed_tokens.weight": w["emb"]}
    for l in range(hp["n_layers"]):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = w["rms_att"][l]
        t[p + "self_attn.q_proj.weight"] = permute(w["wq"][l], nh, nh * hd, dim)
        t[p + "self_attn.k_proj.weight"] = permute(w["wk"][l], nkv, nkv * hd, dim)
        t[p + "self_attn.v_proj.weight"] = w["wv"][l]
        t[p + "self_attn.o_proj.weight"] = w["wo"][l]
        t[p + "post_attention_layernorm.weight"] = w["rms_ffn"][l]
        t[p + "mlp.gate_proj.weight"] = w["w1"][l]
        t[p + "mlp.down_proj.weight"] = w["w2"][l]
        t[p + "mlp.up_proj.weight"] = w["w3"][l]
    t["model.norm.weight"] = w["rms_final"]
    if not hp["shared"]:
        t["lm_head.weight"] = w["wcls"]
    return {k: np.ascontiguousarray(v, dtype="<f4") for k, v in t.items()}


def config(hp):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hp["dim"],
        "intermediate_size": hp["hidden"],
        "num_hidden_layers": hp["n_layers"],
        "num_attention_heads": hp["n_heads"],
        "num_key_value_heads": hp["n_kv"],
        "vocab_size": hp["vocab"],
        "max_position_embeddings": hp["seq_len"],
        "rms_norm_eps": 1e-05,  # llama2.c run.c
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": bool(hp["shared"]),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, outdir = sys.argv[1], sys.argv[2]
    name = os.path.splitext(os.path.basename(src))[0]
    hp, w = read_llama2c(src)
    check_permutation(hp, w)
    t = hf_tensors(hp, w)
    meta = {"format": "pt"}

    single = os.path.join(outdir, name + "-hf")
    os.makedirs(single, exist_ok=True)
    write_json(os.path.join(single, "config.json"), config(hp))
    save_file(t, os.path.join(single, "model.safetensors"), metadata=meta)

    sharded = os.path.join(outdir, name + "-hf-sharded")
    os.makedirs(sharded, exist_ok=True)
    write_json(os.path.join(sharded, "config.json"), config(hp))
    cut = (hp["n_layers"] + 1) // 2
    first = lambda k: k == "model.embed_tokens.weight" or (k.startswith("model.layers.") and int(k.split(".")[2]) < cut)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [{k: v for k, v in t.items() if first(k)}, {k: v for k, v in t.items() if not first(k)}]
    for fn, part in zip(names, parts):
        save_file(part, os.path.join(sharded, fn), metadata=meta)
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in t.values()))},
             "weight_map": {k: names[0] if first(k) else names[1] for k in sorted(t)}}
    write_json(os.path.join(sharded, "model.safetensors.index.json"), index)

    # round trip through the reference reader
    back = load_file(os.path.join(single, "model.safetensors"))
    assert set(back) == set(t) and all(np.array_equal(back[k], t[k]) for k in t)
    print(f"{single}: {len(t)} tensors; {sharded}: {len(parts[0])} + {len(parts[1])} tensors")


if __name__ == "__main__":
    main()
