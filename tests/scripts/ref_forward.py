#!/usr/bin/env python3
"""ref_forward.py — independent float64 numpy reference of the Llama forward,
writing golden outputs for tests/test_forward.c under tests/fixtures/.

Independent of kvq's C code: weights are read here directly (llama2.c: numpy
over the raw file, karpathy/llama2.c run.c layout; GGUF: the `gguf` PyPI
package's GGUFReader + gguf.quants.dequantize). GGUF llama files store the
q/k projection rows already permuted for interleaved RoPE (llama.cpp
convert_hf_to_gguf.py `permute`), i.e. pairs (2i, 2i+1) within each head,
as do llama2.c files: no permutation is applied here.

The token sequence of each fixture is produced by the reference itself:
an optional prompt, then sampling (temperature 0.8, numpy default_rng(seed))
so that the text is in-distribution for the model.

Usage (from the repo root):
  python3 tests/scripts/ref_forward.py [--shared ../shared] [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf]

Fixture format (little-endian), read by tests/test_forward.c:
  char magic[8] = "KVQFWD1\\0"
  int32 vocab, T, pos0, n_full, n_cols
  int32 tokens[T]; int32 full_pos[n_full]; int32 cols[n_cols]
  float32 full_logits[n_full][vocab]      logits of the listed positions
  float32 col_logits[T][n_cols]           logits of the listed vocab columns, every position
  float64 nll[T]                          -log p(tokens[t+1] | tokens[..t]); NaN for t = T-1
  float64 loss                            mean of nll[0..T-2]
"""
import argparse
import os
import struct
import sys

import numpy as np


class Model:
    pass


def load_llama2c(path):
    raw = open(path, "rb").read()
    dim, hidden, L, nh, nkv, vocab, seq = struct.unpack("<7i", raw[:28])
    tied = vocab > 0
    vocab = abs(vocab)
    f = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    hd = dim // nh
    off = 0

    def take(*shape):
        nonlocal off
        n = int(np.prod(shape))
        a = f[off:off + n].reshape(shape)
        off += n
        return a

    m = Model()
    m.dim, m.hidden, m.L, m.nh, m.nkv, m.vocab, m.hd = dim, hidden, L, nh, nkv, vocab, hd
    m.rope_dim, m.theta, m.eps = hd, 10000.0, 1e-5
    m.emb = take(vocab, dim)
    att_norm = take(L, dim)
    wq = take(L, nh * hd, dim)
    wk = take(L, nkv * hd, dim)
    wv = take(L, nkv * hd, dim)
    wo = take(L, dim, nh * hd)
    ffn_norm = take(L, dim)
    w1 = take(L, hidden, dim)
    w2 = take(L, dim, hidden)
    w3 = take(L, hidden, dim)
    m.out_norm = take(dim)
    take(seq, hd // 2)
    take(seq, hd // 2)
    m.out = m.emb if tied else take(vocab, dim)
    assert off == f.size, (off, f.size)
    m.layers = [dict(att_norm=att_norm[l], wq=wq[l], wk=wk[l], wv=wv[l], wo=wo[l], ffn_norm=ffn_norm[l],
                     w1=w1[l], w2=w2[l], w3=w3[l]) for l in range(L)]
    return m


def load_gguf(path):
    import gguf
    r = gguf.GGUFReader(path)

    def kv(key):
        fld = r.fields[key]
        return fld.parts[fld.data[0]][0]

    ts = {t.name: t for t in r.tensors}

    def w(name):
        t = ts[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]  # ggml ne0 is the fastest dim
        return np.asarray(a, dtype=np.float64).reshape(shape)

    m = Model()
    m.L = int(kv("llama.block_count"))
    m.dim = int(kv("llama.embedding_length"))
    m.hidden = int(kv("llama.feed_forward_length"))
    m.nh = int(kv("llama.attention.head_count"))
    m.nkv = int(kv("llama.attention.head_count_kv"))
    m.hd = m.dim // m.nh
    m.rope_dim = int(kv("llama.rope.dimension_count")) if "llama.rope.dimension_count" in r.fields else m.hd
    m.theta = float(kv("llama.rope.freq_base"))
    m.eps = float(kv("llama.attention.layer_norm_rms_epsilon"))
    assert "llama.rope.scaling.type" not in r.fields, "RoPE scaling not handled by this reference"
    m.emb = w("token_embd.weight")
    m.vocab = m.emb.shape[0]
    m.out_norm = w("output_norm.weight")
    m.out = w("output.weight") if "output.weight" in ts else m.emb
    m.layers = []
    for l in range(m.L):
        p = f"blk.{l}."
        m.layers.append(dict(att_norm=w(p + "attn_norm.weight"), wq=w(p + "attn_q.weight"), wk=w(p + "attn_k.weight"),
                             wv=w(p + "attn_v.weight"), wo=w(p + "attn_output.weight"), ffn_norm=w(p + "ffn_norm.weight"),
                             w1=w(p + "ffn_gate.weight"), w2=w(p + "ffn_down.weight"), w3=w(p + "ffn_up.weight")))
    toks = r.fields["tokenizer.ggml.tokens"]
    m.vocab_strings = [bytes(toks.parts[i]).decode("utf-8", "replace") for i in toks.data]
    return m


def rmsnorm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x, pos, rope_dim, theta):
    """x [T][H][hd]; rotate interleaved pairs (2i, 2i+1), i < rope_dim/2."""
    half = rope_dim // 2
    freq = theta ** (-2.0 * np.arange(half) / rope_dim)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * freq[None, :]  # [T][half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.copy()
    a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
    y[..., 0:rope_dim:2] = a * c - b * s
    y[..., 1:rope_dim:2] = a * s + b * c
    return y


def forward(m, tokens, pos0=0, last_only=False):
    T = len(tokens)
    pos = np.arange(pos0, pos0 + T)
    x = m.emb[np.asarray(tokens)]
    grp = m.nh // m.nkv
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for ly in m.layers:
        h = rmsnorm(x, ly["att_norm"], m.eps)
        q = (h @ ly["wq"].T).reshape(T, m.nh, m.hd)
        k = (h @ ly["wk"].T).reshape(T, m.nkv, m.hd)
        v = (h @ ly["wv"].T).reshape(T, m.nkv, m.hd)
        q, k = rope(q, pos, m.rope_dim, m.theta), rope(k, pos, m.rope_dim, m.theta)
        out = np.empty((T, m.nh, m.hd))
        for hh in range(m.nh):
            g = hh // grp
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(m.hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            p = s / s.sum(axis=1, keepdims=True)
            out[:, hh, :] = p @ v[:, g, :]
        x = x + out.reshape(T, -1) @ ly["wo"].T
        h = rmsnorm(x, ly["ffn_norm"], m.eps)
        a, u = h @ ly["w1"].T, h @ ly["w3"].T
        x = x + (a / (1 + np.exp(-a)) * u) @ ly["w2"].T
    x = rmsnorm(x, m.out_norm, m.eps)
    if last_only:
        x = x[-1:]
    return x @ m.out.T


def nll_of(logits, tokens):
    T = len(tokens)
    nll = np.full(T, np.nan)
    for t in range(T - 1):
        z = logits[t]
        mx = z.max()
        nll[t] = mx + np.log(np.exp(z - mx).sum()) - z[tokens[t + 1]]
    return nll


def sample_sequence(m, prompt, T, seed, temp=0.8):
    rng = np.random.default_rng(seed)
    toks = list(prompt)
    while len(toks) < T:
        z = forward(m, toks, last_only=True)[0] / temp
        p = np.exp(z - z.max())
        p /= p.sum()
        toks.append(int(rng.choice(len(p), p=p)))
    return toks


def write_fixture(path, m, tokens, pos0, full_pos, cols):
    logits = forward(m, tokens, pos0)
    nll = nll_of(logits, tokens)
    loss = float(np.nanmean(nll))
    T, V = logits.shape
    with open(path, "wb") as f:
        f.write(b"KVQFWD1\0")
        f.write(struct.pack("<5i", V, T, pos0, len(full_pos), len(cols)))
        f.write(np.asarray(tokens, "<i4").tobytes())
        f.write(np.asarray(full_pos, "<i4").tobytes())
        f.write(np.asarray(cols, "<i4").tobytes())
        f.write(logits[np.asarray(full_pos, dtype=int)].astype("<f4").tobytes())
        f.write(logits[:, np.asarray(cols, dtype=int)].astype("<f4").tobytes() if len(cols) else b"")
        f.write(nll.astype("<f8").tobytes())
        f.write(struct.pack("<d", loss))
    print(f"{path}: T={T} V={V} loss={loss:.8f} ({os.path.getsize(path)} bytes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/fixtures")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name, seed in (("stories260K", 1), ("aidreams260K", 2)):
        p = os.path.join(a.shared, "models/llama2c", name + ".bin")
        if not os.path.exists(p):
            print(f"skip {name}: {p} absent", file=sys.stderr)
            continue
        m = load_llama2c(p)
        toks = sample_sequence(m, [1], 64, seed)
        write_fixture(os.path.join(a.out, f"fwd_{name}.bin"), m, toks, 0, list(range(64)), [])
    if os.path.exists(a.gguf):
        m = load_gguf(a.gguf)
        words = ["Once", "Ġupon", "Ġa", "Ġtime", ",", "Ġthere", "Ġwas", "Ġa", "Ġlittle"]
        prompt = [m.vocab_strings.index(w) for w in words]
        toks = sample_sequence(m, prompt, 64, 3)
        cols = sorted(np.random.default_rng(4).choice(m.vocab, 512, replace=False).tolist())
        write_fixture(os.path.join(a.out, "fwd_smollm2.bin"), m, toks, 0, [0, 63], cols)
    else:
        print(f"skip default model: {a.gguf} absent", file=sys.stderr)


if __name__ == "__main__":
    main()
