#!/usr/bin/env python3
"""kld_reference.py — independent float64 reference of kveval's comparison
statistics (KL divergence, top-1 agreement, paired error bars) for
tests/test_kveval.c (test_kld_reference).

The model is ../shared's stories260K run by ref_forward.py's numpy float64
forward (weights read here, not through kvq), with the K/V of every layer
replaced before attention as the scheme says:
  fp16   every element rounded to IEEE half (np.float16, round to nearest even)
  int4 / int2  uniform asymmetric per token over the token's whole K (post-RoPE)
         or V vector: s = (max - min) / (2^b - 1), x^ = clip(rint((x - min) / s), 0,
         2^b - 1) * s + min (KVQuant App.P's intX baseline)
Protocol kvquant: 4 windows of 48 tokens, each a sequence sampled from the model
after BOS (seeds 3..6), every position but the last scored. Statistics as llama-perplexity --kl-divergence
defines them (tools/perplexity/perplexity.cpp):
  KLD per token = sum_v p_base,v (ln p_base,v - ln q_v), nats, in float64 from
  full logits (not the streamed formula kvq uses);
  mean and its se = sqrt((mean(x^2) - mean(x)^2) / (n - 1)); median (mean of the
  two middle values for even n); percentiles by linear interpolation at
  fraction * (n - 1); same top = argmax_q == argmax_base (first index).
Paired error bars over the windows' mean NLLs a_w (scheme), b_w (fp32):
  d_nll = mean(a - b), se = std(a - b, ddof=1) / sqrt(W);
  d_ppl = exp(mean a) - exp(mean b), se = sqrt(g' C g / W), g = (PPL_a, -PPL_b),
  C the sample covariance (ddof=1) of (a_w, b_w).

Writes tests/fixtures/kld_stories260K.txt ("key value" lines; tokens as one line).
Usage (repo root): python3 tests/scripts/kld_reference.py [--shared ../shared]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward as rf  # noqa: E402

CTX, NW = 48, 4


def q_fp16(x):
    return x.astype(np.float16).astype(np.float64)


def q_int_token(bits):
    qmax = float((1 << bits) - 1)

    def f(x):  # x [T][kv_dim] (all heads of a token)
        mn = x.min(axis=1, keepdims=True)
        mx = x.max(axis=1, keepdims=True)
        s = (mx - mn) / qmax
        with np.errstate(invalid="ignore", divide="ignore"):
            q = np.clip(np.rint((x - mn) / s), 0, qmax)
        return np.where(s == 0, mn, q * s + mn)

    return f


def forward_q(m, tokens, quant):
    """ref_forward.forward with post-RoPE K and V replaced by quant([T][kv_dim]) in every layer."""
    T = len(tokens)
    pos = np.arange(T)
    x = m.emb[np.asarray(tokens)]
    grp = m.nh // m.nkv
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for ly in m.layers:
        h = rf.rmsnorm(x, ly["att_norm"], m.eps)
        q = (h @ ly["wq"].T).reshape(T, m.nh, m.hd)
        k = (h @ ly["wk"].T).reshape(T, m.nkv, m.hd)
        v = (h @ ly["wv"].T).reshape(T, m.nkv, m.hd)
        q, k = rf.rope(q, pos, m.rope_dim, m.theta), rf.rope(k, pos, m.rope_dim, m.theta)
        if quant is not None:
            k = quant(k.reshape(T, -1)).reshape(T, m.nkv, m.hd)
            v = quant(v.reshape(T, -1)).reshape(T, m.nkv, m.hd)
        out = np.empty((T, m.nh, m.hd))
        for hh in range(m.nh):
            g = hh // grp
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(m.hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            p = s / s.sum(axis=1, keepdims=True)
            out[:, hh, :] = p @ v[:, g, :]
        x = x + out.reshape(T, -1) @ ly["wo"].T
        h = rf.rmsnorm(x, ly["ffn_norm"], m.eps)
        a, u = h @ ly["w1"].T, h @ ly["w3"].T
        x = x + (a / (1 + np.exp(-a)) * u) @ ly["w2"].T
    x = rf.rmsnorm(x, m.out_norm, m.eps)
    return x @ m.out.T


def log_softmax(z):
    mx = z.max(axis=1, keepdims=True)
    return z - (mx + np.log(np.exp(z - mx).sum(axis=1, keepdims=True)))


def percentile(v, f):  # v sorted; llama-perplexity's rule
    if f <= 0:
        return v[0]
    if f >= 1:
        return v[-1]
    p = f * (len(v) - 1)
    ip = int(p)
    p -= ip
    return (1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="../shared")
    a = ap.parse_args()
    m = rf.load_llama2c(os.path.join(a.shared, "models/llama2c/stories260K.bin"))
    toks = [t for w in range(NW) for t in rf.sample_sequence(m, [1], CTX, 3 + w)]
    schemes = {"fp32": None, "fp16": q_fp16, "int4": q_int_token(4), "int2": q_int_token(2)}
    lp, nll = {}, {}
    for name, qf in schemes.items():
        lps, nlls = [], []
        for w in range(NW):
            win = toks[w * CTX:(w + 1) * CTX]
            l = log_softmax(forward_q(m, win, qf))[:-1]  # rows 0..ctx-2 predict the next token
            lps.append(l)
            nlls.append(-l[np.arange(CTX - 1), np.asarray(win[1:])])
        lp[name], nll[name] = np.stack(lps), np.stack(nlls)  # [W][ctx-1][V], [W][ctx-1]
    out = {"ctx": CTX, "windows": NW, "tokens": " ".join(map(str, toks))}
    base = lp["fp32"]
    b_w = nll["fp32"].mean(axis=1)
    for name in schemes:
        a_w = nll[name].mean(axis=1)
        out[name + "_ppl"] = "%.12g" % np.exp(nll[name].mean())
        srt = np.sort(lp[name], axis=2)
        # how close the nearest top-1 decision is (a flip between fp32 and float64 is possible below ~1e-5)
        out[name + "_min_top_gap"] = "%.3g" % (srt[..., -1] - srt[..., -2]).min()
        if name == "fp32":
            continue
        q = lp[name]
        kld = (np.exp(base) * (base - q)).sum(axis=2).reshape(-1)
        same = (q.argmax(axis=2) == base.argmax(axis=2)).reshape(-1)
        n = kld.size
        mean = kld.mean()
        var = (kld * kld).mean() - mean * mean
        v = np.sort(kld)
        med = 0.5 * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2]
        d = a_w - b_w
        pa, pb = np.exp(nll[name].mean()), np.exp(nll["fp32"].mean())
        C = np.cov(np.stack([a_w, b_w]), ddof=1)
        g = np.array([pa, -pb])
        out[name + "_kld_tokens"] = n
        out[name + "_kld_mean"] = "%.12g" % mean
        out[name + "_kld_mean_se"] = "%.12g" % np.sqrt(var / (n - 1))
        out[name + "_kld_median"] = "%.12g" % med
        out[name + "_kld_p90"] = "%.12g" % percentile(v, 0.90)
        out[name + "_kld_p99"] = "%.12g" % percentile(v, 0.99)
        out[name + "_kld_max"] = "%.12g" % v[-1]
        out[name + "_same_top"] = int(same.sum())
        out[name + "_d_nll"] = "%.12g" % d.mean()
        out[name + "_d_nll_se"] = "%.12g" % (d.std(ddof=1) / np.sqrt(NW))
        out[name + "_d_ppl"] = "%.12g" % (pa - pb)
        out[name + "_d_ppl_se"] = "%.12g" % np.sqrt(g @ C @ g / NW)
    with open("tests/fixtures/kld_stories260K.txt", "w") as f:
        for k, v in out.items():
            f.write("%s %s\n" % (k, v))
    print(open("tests/fixtures/kld_stories260K.txt").read())


if __name__ == "__main__":
    main()
