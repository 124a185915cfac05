#!/usr/bin/env python3
"""Tiny random-weight checkpoints of the model families kvq runs, with
transformers' float32 reference outputs, for tests/test_families.c.

For each family below this writes, under tests/fixtures/:
    hf-<name>/config.json, hf-<name>/model.safetensors   (HF checkpoint, save_pretrained)
    hf-<name>/ref.bin                                    (reference, format below)
    hf-<name>.gguf                                       (the same weights, llama.cpp layout; not for
                                                          every family, see GGUF)
The families (2 layers, dim 32, vocab 128 (qwen2: 512, so that a llama2.c
512-token tokenizer can drive kvdump on it), GQA; weights drawn so that the
model is far from uniform and every optional part matters):
    llama31        Llama-3.1 `llama3` RoPE scaling in the old `rope_scaling`
                   config form (original context 16, so positions 0..31 reach
                   every band); GGUF: llama.cpp's rope_freqs.weight factors
    llama-yarn     YaRN (factor 4, original context 16, `rope_parameters` form);
                   GGUF: rope.scaling.type yarn + factor + original_context_length
    llama-dynamic  dynamic NTK (factor 2, max_position_embeddings 16 < 32 tokens,
                   `rope_scaling` form with the legacy "type" key); HF only
                   (llama.cpp has no dynamic NTK)
    llama-linear   linear scaling (factor 2); GGUF rope.scaling.type linear
    qwen2          Qwen2: q/k/v biases (large key biases on a few channels of the
                   first and last layer, as in Qwen2.5), bf16 weights on disk
                   (the reference uses the bf16 values in float32); GGUF arch
                   qwen2, BF16 tensors, rotate-half (NEOX) q/k order
    qwen3          Qwen3: per-head q/k RMSNorm, decoupled head_dim 16 (hidden 32 /
                   4 heads = 8), tied embeddings; GGUF arch qwen3 with key_length
    mistral        Mistral: sliding window 8 over the 32 tokens; GGUF arch llama
                   with llama.attention.sliding_window (llama.cpp's own converter
                   omits it for Mistral)
GGUF layout (llama.cpp convert_hf_to_gguf.py): token_embd, output (untied
only), output_norm, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
ffn_norm, ffn_gate, ffn_up, ffn_down}.weight, attn_{q,k,v}.bias,
attn_{q,k}_norm.weight; llama-architecture q/k rows (and biases) permuted by
LlamaModel.permute, qwen2/qwen3 kept in HF order (NEOX RoPE).

ref.bin (little-endian): "KVQREF1\\0", int32 vocab, int32 T, int32 tokens[T],
float32 logits[T][vocab] (transformers, float32, eager attention), float64
loss (mean next-token cross-entropy over positions 0..T-2, HF's labels=ids).

Needs torch (CPU) and transformers (PyPI), numpy, gguf, safetensors; run from
the repository root:  python3 tests/scripts/hf_family_fixtures.py
"""
import json
import math
import os
import struct

import numpy as np
import torch
import transformers
import gguf
from gguf import GGMLQuantizationType as GT

OUT = "tests/fixtures"
T = 32
V = 128
D = 32
L = 2
HID = 64


def common(**kw):
    c = dict(vocab_size=V, hidden_size=D, intermediate_size=HID, num_hidden_layers=L, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
             hidden_act="silu", bos_token_id=1, eos_token_id=2)
    c.update(kw)
    return c


FAMILIES = [
    dict(name="llama31", arch="llama", cfg=common(rope_theta=500000.0),
         rope=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16), rope_form="rope_scaling", gguf=True),
    dict(name="llama-yarn", arch="llama", cfg=common(rope_theta=10000.0, max_position_embeddings=64),
         rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16), rope_form="rope_parameters", gguf=True),
    dict(name="llama-dynamic", arch="llama", cfg=common(rope_theta=10000.0, max_position_embeddings=16),
         rope=dict(type="dynamic", factor=2.0), rope_form="rope_scaling", gguf=False),
    dict(name="llama-linear", arch="llama", cfg=common(rope_theta=10000.0),
         rope=dict(rope_type="linear", factor=2.0), rope_form="rope_parameters", gguf=True),
    dict(name="qwen2", arch="qwen2", cfg=common(rope_theta=1000000.0, vocab_size=512), rope=None, gguf=True, bf16=True),
    dict(name="qwen3", arch="qwen3", cfg=common(rope_theta=1000000.0, head_dim=16, tie_word_embeddings=True),
         rope=None, gguf=True),
    dict(name="mistral", arch="mistral", cfg=common(rope_theta=10000.0, sliding_window=8), rope=None, gguf=True),
]


def build(fam):
    arch = fam["arch"]
    cfg = dict(fam["cfg"])
    if fam["rope"] is not None:
        r = dict(fam["rope"])
        r["rope_theta"] = cfg["rope_theta"]
        cfg["rope_parameters"] = r
    cfg.pop("rope_theta", None) if fam["rope"] is not None else None
    if "rope_parameters" not in cfg:
        cfg["rope_parameters"] = dict(rope_type="default", rope_theta=cfg.pop("rope_theta"))
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    config = cls[0](**cfg)
    config._attn_implementation = "eager"
    model = cls[1](config).eval()
    return config, model


def randomize(model, fam, seed):
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    new = {}
    for k, t in sd.items():
        if k.endswith("norm.weight"):
            v = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        elif k.endswith("embed_tokens.weight"):
            v = torch.randn(t.shape, generator=g)
        elif k.endswith(".bias"):
            v = 0.3 * torch.randn(t.shape, generator=g)
        else:  # linear weights [out][in]
            v = torch.randn(t.shape, generator=g) * (1.5 / math.sqrt(t.shape[1]))
        new[k] = v.float()
    if fam["arch"] == "qwen2":
        # Qwen2.5-like key biases: a few channels of the first and last layer dominate
        for l in (0, L - 1):
            b = new[f"model.layers.{l}.self_attn.k_proj.bias"]
            b[3] += 12.0
            b[9] -= 9.0
            b[14] += 7.0
    if fam.get("bf16"):
        new = {k: v.bfloat16().float() for k, v in new.items()}
    model.load_state_dict(new, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def reference(model, tokens):
    with torch.no_grad():
        ids = torch.tensor([tokens], dtype=torch.long)
        out = model(input_ids=ids, labels=ids)
    return out.logits[0].float().numpy(), float(out.loss)


def write_ref(path, tokens, logits, loss):
    with open(path, "wb") as f:
        f.write(b"KVQREF1\0")
        f.write(struct.pack("<ii", logits.shape[1], T))
        f.write(np.asarray(tokens, dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(logits, dtype="<f4").tobytes())
        f.write(struct.pack("<d", loss))


def fix_config(path, fam):
    """save_pretrained writes transformers v5's `rope_parameters`; give the
    old `rope_scaling` form (rope_theta top-level) where the family asks for it."""
    with open(path) as f:
        c = json.load(f)
    if fam.get("rope_form") == "rope_scaling":
        rp = c.pop("rope_parameters")
        c["rope_theta"] = rp.pop("rope_theta")
        c["rope_scaling"] = rp
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def llama_permute(w, n_head):
    # convert_hf_to_gguf.py LlamaModel.permute (rotate-half -> interleaved rows)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(rope, base, dim):
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_freqs.weight)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lf, hf, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    lw, hw = old / lf, old / hf
    out = []
    for fr in freqs:
        wl = 2 * math.pi / float(fr)
        if wl < hw:
            out.append(1.0)
        elif wl > lw:
            out.append(factor)
        else:
            s = (old / wl - lf) / (hf - lf)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def write_gguf(path, fam, config, sd):
    arch = "llama" if fam["arch"] in ("llama", "mistral") else fam["arch"]
    w = gguf.GGUFWriter(path, arch)
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    w.add_name("kvq " + fam["name"] + " test model")
    w.add_block_count(L)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(D)
    w.add_vocab_size(config.vocab_size)
    w.add_feed_forward_length(HID)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rp = config.rope_parameters
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_rope_dimension_count(hd)
    if hd != config.hidden_size // nh:
        w.add_key_length(hd)
        w.add_value_length(hd)
    rt = rp.get("rope_type", "default")
    if rt == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif rt == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if fam["arch"] == "mistral":
        w.add_sliding_window(config.sliding_window)
    bf16 = fam.get("bf16", False)

    def add(name, t, permute_heads=0):
        a = t.float().numpy()
        if permute_heads:
            a = llama_permute(a, permute_heads)
        a = np.ascontiguousarray(a)
        if bf16 and a.ndim == 2:
            u = (a.view(np.uint32) >> 16).astype(np.uint16)  # exact: the values are bf16 already
            w.add_tensor(name, u, raw_shape=a.shape, raw_dtype=GT.BF16)
        else:
            w.add_tensor(name, a.astype(np.float32))

    perm = fam["arch"] in ("llama", "mistral")
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if rt == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(rp, float(rp["rope_theta"]), hd))
    for l in range(L):
        p = f"model.layers.{l}."
        add(f"blk.{l}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{l}.attn_q.weight", sd[p + "self_attn.q_proj.weight"], nh if perm else 0)
        add(f"blk.{l}.attn_k.weight", sd[p + "self_attn.k_proj.weight"], nkv if perm else 0)
        add(f"blk.{l}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{l}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for b, key in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            if p + f"self_attn.{key}.bias" in sd:
                heads = (nh if b == "q" else nkv) if (perm and b != "v") else 0
                add(f"blk.{l}.attn_{b}.bias", sd[p + f"self_attn.{key}.bias"], heads)
        if p + "self_attn.q_norm.weight" in sd:
            add(f"blk.{l}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            add(f"blk.{l}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        add(f"blk.{l}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{l}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{l}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{l}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    torch.manual_seed(0)
    tokens = [int(x) for x in np.random.default_rng(42).integers(3, V, size=T)]
    for i, fam in enumerate(FAMILIES):
        config, model = build(fam)
        model = randomize(model, fam, 1000 + i)
        logits, loss = reference(model, tokens)
        d = os.path.join(OUT, "hf-" + fam["name"])
        os.makedirs(d, exist_ok=True)
        if fam.get("bf16"):
            model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
            model.to(torch.float32)
        else:
            model.save_pretrained(d, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        fix_config(os.path.join(d, "config.json"), fam)
        # the checkpoint as written reproduces the reference
        re = type(model).from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        l2, _ = reference(re, tokens)
        assert np.array_equal(l2, logits), fam["name"] + ": reloaded checkpoint differs"
        write_ref(os.path.join(d, "ref.bin"), tokens, logits, loss)
        if fam["gguf"]:
            write_gguf(os.path.join(OUT, "hf-" + fam["name"] + ".gguf"), fam, config,
                       {k: v.detach() for k, v in model.state_dict().items()})
        print(f"{fam['name']}: loss {loss:.6f}, |logits| {np.linalg.norm(logits):.3f}")


if __name__ == "__main__":
    main()
