#!/usr/bin/env python3
"""ref_grad_jax.py — independent float64 autograd reference for the backward
pass (kernels/model/backward.h), writing tests/fixtures/grad_smollm2.bin for
tests/test_backward.c.

Independent of kvq's C code: the GGUF is read with the `gguf` PyPI package
(GGUFReader + gguf.quants.dequantize), the Llama forward is written here in
jax.numpy (float64, jax_enable_x64) and differentiated with jax.grad. GGUF
llama files store q/k projection rows permuted for interleaved RoPE pairs
(2i, 2i+1) (llama.cpp convert_hf_to_gguf.py `permute`), so RoPE here rotates
interleaved pairs.

Tokens: the 64 in-distribution tokens of tests/fixtures/fwd_smollm2.bin
(written by ref_forward.py), continued to 128 by sampling from this reference
(temperature 0.8, numpy default_rng(0)).

Loss: mean next-token cross-entropy over positions 0..T-2 (targets
tokens[1..T-1]). Gradients w.r.t. the pre-RoPE keys and the values of layers
0 and L-1 are taken as gradients w.r.t. zero offsets added to k_pre and v.

Usage (repo root; needs `pip install "jax[cpu]" gguf numpy`, a few minutes):
  python3 tests/scripts/ref_grad_jax.py [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf]

Fixture format (little-endian):
  char magic[8] = "KVQGRD1\\0"
  int32 T, n_layers, kv_dim, n_stored
  int32 layers[n_stored]
  int32 tokens[T]
  float64 loss
  for each stored layer: float32 dv[T][kv_dim], float32 dk_pre[T][kv_dim]
"""
import argparse
import struct

import numpy as np


def load(path):
    import gguf
    r = gguf.GGUFReader(path)

    def kv(key):
        f = r.fields[key]
        return f.parts[f.data[0]][0]

    ts = {t.name: t for t in r.tensors}

    def w(name):
        t = ts[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)])

    hp = dict(L=int(kv("llama.block_count")), dim=int(kv("llama.embedding_length")),
              nh=int(kv("llama.attention.head_count")), nkv=int(kv("llama.attention.head_count_kv")),
              theta=float(kv("llama.rope.freq_base")), eps=float(kv("llama.attention.layer_norm_rms_epsilon")))
    hp["hd"] = hp["dim"] // hp["nh"]
    hp["rope_dim"] = int(kv("llama.rope.dimension_count")) if "llama.rope.dimension_count" in r.fields else hp["hd"]
    assert "llama.rope.scaling.type" not in r.fields
    W = dict(emb=w("token_embd.weight"), out_norm=w("output_norm.weight"))
    W["out"] = w("output.weight") if "output.weight" in ts else W["emb"]
    names = dict(att_norm="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output", ffn_norm="ffn_norm",
                 w1="ffn_gate", w2="ffn_down", w3="ffn_up")
    W["layers"] = [{k: w(f"blk.{l}.{v}.weight") for k, v in names.items()} for l in range(hp["L"])]
    return hp, W


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/fixtures/grad_smollm2.bin")
    ap.add_argument("--T", type=int, default=128)
    a = ap.parse_args()

    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    hp, W = load(a.gguf)
    W = jax.tree_util.tree_map(jnp.asarray, W)
    L, nh, nkv, hd, rd = hp["L"], hp["nh"], hp["nkv"], hp["hd"], hp["rope_dim"]
    T = a.T

    def rmsnorm(x, g):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + hp["eps"]) * g

    half = rd // 2
    freq = hp["theta"] ** (-2.0 * np.arange(half) / rd)
    ang = np.arange(T, dtype=np.float64)[:, None] * freq[None, :]
    cos, sin = jnp.asarray(np.cos(ang))[:, None, :], jnp.asarray(np.sin(ang))[:, None, :]

    def rope(x):  # [T][H][hd], interleaved pairs
        a_, b_ = x[..., 0:rd:2], x[..., 1:rd:2]
        ya, yb = a_ * cos - b_ * sin, a_ * sin + b_ * cos
        y = jnp.stack([ya, yb], axis=-1).reshape(x.shape[:-1] + (rd,))
        return jnp.concatenate([y, x[..., rd:]], axis=-1)

    mask = jnp.asarray(np.triu(np.full((T, T), -np.inf), 1))
    grp = nh // nkv

    def forward(tokens, dk, dv):
        """dk, dv: dict layer -> [T][nkv*hd] offsets added to k_pre / v. Returns logits [T][V]."""
        x = W["emb"][tokens]
        for l, ly in enumerate(W["layers"]):
            h = rmsnorm(x, ly["att_norm"])
            q = (h @ ly["wq"].T).reshape(T, nh, hd)
            k = h @ ly["wk"].T
            v = h @ ly["wv"].T
            if l in dk:
                k = k + dk[l]
                v = v + dv[l]
            k, v = k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
            q, k = rope(q), rope(k)
            kk = jnp.repeat(k, grp, axis=1)  # query head h reads kv head h // grp
            vv = jnp.repeat(v, grp, axis=1)
            s = jnp.einsum("ihd,jhd->hij", q, kk) / np.sqrt(hd) + mask[None]
            p = jax.nn.softmax(s, axis=-1)
            o = jnp.einsum("hij,jhd->ihd", p, vv).reshape(T, nh * hd)
            x = x + o @ ly["wo"].T
            h = rmsnorm(x, ly["ffn_norm"])
            g, u = h @ ly["w1"].T, h @ ly["w3"].T
            x = x + (g * jax.nn.sigmoid(g) * u) @ ly["w2"].T
        return rmsnorm(x, W["out_norm"]) @ W["out"].T

    # tokens: fixture prefix, sampled continuation (causal: padding after position t does not change logits[t])
    raw = open("tests/fixtures/fwd_smollm2.bin", "rb").read()
    V, T0 = struct.unpack("<2i", raw[8:16])
    toks = list(np.frombuffer(raw, "<i4", count=T0, offset=28))
    fwd_jit = jax.jit(lambda t: forward(t, {}, {}))
    rng = np.random.default_rng(0)
    while len(toks) < T:
        n = len(toks)
        z = np.asarray(fwd_jit(jnp.asarray(toks + [0] * (T - n), dtype=jnp.int32))[n - 1]) / 0.8
        p = np.exp(z - z.max())
        p /= p.sum()
        toks.append(int(rng.choice(len(p), p=p)))
    tokens = jnp.asarray(toks, dtype=jnp.int32)

    layers = [0, L - 1]

    def loss_fn(dk, dv):
        z = forward(tokens, dk, dv)[:-1]
        lse = jax.scipy.special.logsumexp(z, axis=-1)
        return jnp.mean(lse - z[jnp.arange(T - 1), tokens[1:]])

    kvd = nkv * hd
    zeros = {l: jnp.zeros((T, kvd)) for l in layers}
    loss, (gk, gv) = jax.value_and_grad(loss_fn, argnums=(0, 1))(zeros, dict(zeros))
    print(f"loss {float(loss):.8f}; |dV| layer 0 {float(jnp.linalg.norm(gv[0])):.4e}, layer {L-1} {float(jnp.linalg.norm(gv[L-1])):.4e}")
    with open(a.out, "wb") as f:
        f.write(b"KVQGRD1\0")
        f.write(struct.pack("<4i", T, L, kvd, len(layers)))
        f.write(np.asarray(layers, "<i4").tobytes())
        f.write(np.asarray(toks, "<i4").tobytes())
        f.write(struct.pack("<d", float(loss)))
        for l in layers:
            f.write(np.asarray(gv[l], "<f4").tobytes())
            f.write(np.asarray(gk[l], "<f4").tobytes())
    print("wrote", a.out)


if __name__ == "__main__":
    main()
