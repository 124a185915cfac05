#!/usr/bin/env python3
"""check_dump_h5py.py — read a kvdump HDF5 file with h5py (independent of the C
reader) and check it against formats/DUMP.md.

    python3 tests/scripts/check_dump_h5py.py DUMP.h5 [--synthetic] [--atol 1e-3] [--rtol R]

Checks, printing what it finds:
  * every root attribute of schema version 1 is present (prints the identity ones);
  * /tokens and every /layers/<i>/<dataset> of the layer range exist with the
    documented shape and dtype (float16 for k_pre_rope/k/v/q when dtype == "f16",
    else float32; Fisher and attention stats always float32; tokens int32), and
    datasets the attributes say are absent are absent;
  * k == RoPE(k_pre_rope): interleaved pairs (2i, 2i+1) within each head, rotary
    dim / theta / scaling from the root attributes, position = token index within
    the sample. Reported: max |error|, the element where it occurs, and the max
    |error| over elements with |k| < 2 (where f16 storage can resolve 1e-3).
    Passes if every element has |error| <= atol + rtol * |(k_pre_rope pair)|;
    default rtol: 2^-10 for f16 storage (two roundings of 2^-11), 2^-13 for f32;
  * --synthetic: the file was written by tests/test_dump.c (gen() there);
    recompute every stored value with numpy (including numpy's own f32 → f16
    rounding) and require exact equality.
Exit status 0 when every check passes, 1 otherwise.
"""
import argparse
import sys

import h5py
import numpy as np

SCHEMA_VERSION = 1
ROOT_ATTRS = [
    "schema_version", "kvq_version", "model_path", "model_sha256", "model_arch", "n_layers", "dim", "hidden_dim",
    "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ctx_len", "rope_theta", "rope_dim", "rope_pairing",
    "rope_scaling", "rope_scale_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_orig_ctx",
    "tokenizer", "corpus_path", "corpus_sha256", "corpus_format", "bos_policy", "n_samples", "seq_len", "seed",
    "sample_offsets", "dtype", "has_q", "has_fisher", "has_attn_stats", "layer_first", "layer_last",
    "command_line", "samples_done",
]
OPTIONAL_ATTRS = {"compute_mode": "exact", "compute_device": "", "rope_params": "",
                  "attention": ""}  # added later; older files read as these
DATASETS = ["k_pre_rope", "k", "v", "q", "fisher_k_pre_rope", "fisher_v", "attn_received", "attn_entropy"]

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def attr_str(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def rope_inv_freq(a):
    """Per-pair angular frequencies (radians per position), llama.cpp / HF conventions."""
    rd = int(a["rope_dim"])
    theta = float(a["rope_theta"])
    freq = theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    scaling = attr_str(a["rope_scaling"])
    factor = float(a["rope_scale_factor"])
    if scaling == "linear":
        freq = freq / factor
    elif scaling == "llama3":
        lo, hi, orig = float(a["rope_low_freq_factor"]), float(a["rope_high_freq_factor"]), float(a["rope_orig_ctx"])
        wavelen = 2 * np.pi / freq
        smooth = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
        scaled = np.where(wavelen > orig / lo, freq / factor, freq)
        mid = (wavelen <= orig / lo) & (wavelen >= orig / hi)
        freq = np.where(mid, (1 - smooth) * freq / factor + smooth * freq, scaled)
    elif scaling == "yarn":  # transformers _compute_yarn_parameters
        prm = dict(kv.split("=") for kv in attr_str(a["rope_params"]).split())
        bf, bs, trunc = float(prm["beta_fast"]), float(prm["beta_slow"]), prm["truncate"] == "1"
        orig = float(a["rope_orig_ctx"])
        cd = lambda rot: rd * np.log(orig / (rot * 2 * np.pi)) / (2 * np.log(theta))
        lo, hi = cd(bf), cd(bs)
        if trunc:
            lo, hi = np.floor(lo), np.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rd - 1)
        if lo == hi:
            hi += 0.001
        extra = 1 - np.clip((np.arange(rd // 2) - lo) / (hi - lo), 0, 1)
        freq = (freq / factor) * (1 - extra) + freq * extra
    elif scaling == "dynamic":  # transformers _compute_dynamic_ntk_parameters at seq_len = max(ctx_len, L)
        S = max(int(a["ctx_len"]), int(a["seq_len"]))
        base = theta * ((factor * S / int(a["ctx_len"])) - (factor - 1)) ** (rd / (rd - 2))
        freq = base ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    elif scaling == "freq_factors":
        return None  # the dump holds the factors' digest only: the RoPE check is skipped
    elif scaling != "none":
        raise ValueError(f"unknown rope_scaling {scaling!r}")
    return freq


def rope_scale(a):
    """The factor cos and sin carry (YaRN's attention factor), 1 otherwise."""
    if attr_str(a["rope_scaling"]) != "yarn":
        return 1.0
    return float(dict(kv.split("=") for kv in attr_str(a["rope_params"]).split())["attn_factor"])


def rope(kp, inv_freq):
    """kp: [N][L][H][D] float64 → RoPE'd copy (interleaved pairs within the first rope_dim channels)."""
    out = kp.copy()
    L = kp.shape[1]
    ang = np.arange(L, dtype=np.float64)[:, None] * inv_freq[None, :]  # [L][rd/2]
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    rd = 2 * inv_freq.shape[0]
    x0, x1 = kp[..., 0:rd:2], kp[..., 1:rd:2]
    out[..., 0:rd:2] = x0 * c - x1 * s
    out[..., 1:rd:2] = x0 * s + x1 * c
    return out


def gen(ds, layer, s, t, h, c):
    """tests/test_dump.c gen(): exact integer formula, broadcasting over numpy int64 arrays."""
    x = (1000003 * ds + 7919 * layer + 104729 * s + 3571 * t + 131 * h + 17 * c + 37 * t * c + 11 * c * c) % 2000001
    return ((x - 1000000) / 4096.0).astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--synthetic", action="store_true", help="values follow tests/test_dump.c gen()")
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=None)
    args = ap.parse_args()

    f = h5py.File(args.dump, "r")
    a = f.attrs
    missing = [k for k in ROOT_ATTRS if k not in a]
    if missing:
        fail(f"root attributes missing: {missing}")
        return 1
    print(f"{args.dump}: schema_version {a['schema_version']}, kvq {attr_str(a['kvq_version'])}, "
          f"dtype {attr_str(a['dtype'])}, {len(a.keys())} root attributes (all {len(ROOT_ATTRS)} expected present)")
    if int(a["schema_version"]) != SCHEMA_VERSION:
        fail(f"schema_version {a['schema_version']}, this script checks version {SCHEMA_VERSION}")
    print(f"  model {attr_str(a['model_path'])} ({attr_str(a['model_arch'])}, sha256 {attr_str(a['model_sha256'])[:16]}...): "
          f"{a['n_layers']} layers, dim {a['dim']}, hidden {a['hidden_dim']}, heads {a['n_heads']}/{a['n_kv_heads']} kv "
          f"x {a['head_dim']}, vocab {a['vocab_size']}, ctx {a['ctx_len']}")
    print(f"  rope: theta {a['rope_theta']}, dim {a['rope_dim']}, pairing {attr_str(a['rope_pairing'])}, "
          f"scaling {attr_str(a['rope_scaling'])} x{a['rope_scale_factor']}")
    print(f"  tokenizer {attr_str(a['tokenizer'])!r}; corpus {attr_str(a['corpus_path'])} "
          f"({attr_str(a['corpus_format'])}), BOS {attr_str(a['bos_policy'])}")
    N, L = int(a["n_samples"]), int(a["seq_len"])
    H, Hkv, D = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
    lf, ll = int(a["layer_first"]), int(a["layer_last"])
    f16 = attr_str(a["dtype"]) == "f16"
    print(f"  samples {a['samples_done']}/{N} x {L} tokens (seed {a['seed']}, offsets {[int(x) for x in a['sample_offsets'][:4]]}"
          f"{'...' if N > 4 else ''}), layers {lf}-{ll}, q {bool(a['has_q'])}, fisher {bool(a['has_fisher'])}, "
          f"attn stats {bool(a['has_attn_stats'])}")
    print(f"  command: {attr_str(a['command_line'])}")
    print("  compute: " + ", ".join(f"{k} {attr_str(a[k]) if k in a else repr(v) + ' (absent: default)'}" for k, v in OPTIONAL_ATTRS.items()))
    if int(a["samples_done"]) != N:
        fail(f"samples_done {a['samples_done']} != n_samples {N} (unfinished dump)")
    if attr_str(a["rope_pairing"]) != "interleaved":
        fail(f"rope_pairing {attr_str(a['rope_pairing'])!r}, expected 'interleaved'")
    if len(a["sample_offsets"]) != N:
        fail(f"sample_offsets has {len(a['sample_offsets'])} values, expected {N}")

    enabled = {"k_pre_rope": True, "k": True, "v": True, "q": bool(a["has_q"]),
               "fisher_k_pre_rope": bool(a["has_fisher"]), "fisher_v": bool(a["has_fisher"]),
               "attn_received": bool(a["has_attn_stats"]), "attn_entropy": bool(a["has_attn_stats"])}

    def expect(name):
        if name in ("attn_received", "attn_entropy"):
            return (N, H, L), np.float32
        heads = H if name == "q" else Hkv
        dt = np.float16 if (f16 and name in ("k_pre_rope", "k", "v", "q")) else np.float32
        return (N, L, heads, D), dt

    tok = f["tokens"]
    print(f"  /tokens {tok.shape} {tok.dtype}")
    if tok.shape != (N, L) or tok.dtype != np.int32:
        fail(f"/tokens: expected ({N}, {L}) int32, found {tok.shape} {tok.dtype}")
    toks = tok[...]
    if toks.min() < 0 or toks.max() >= int(a["vocab_size"]):
        fail(f"/tokens: ids outside [0, {a['vocab_size']})")

    inv_freq = rope_inv_freq(a)
    u = 2.0 ** -11 if f16 else 2.0 ** -24
    rtol = args.rtol if args.rtol is not None else (2.0 ** -10 if f16 else 2.0 ** -13)
    layer_names = sorted(f["layers"].keys(), key=int)
    if layer_names != [str(i) for i in range(lf, ll + 1)]:
        fail(f"/layers has groups {layer_names}, expected {lf}..{ll}")
    worst = (0.0, None)
    for i in range(lf, ll + 1):
        g = f["layers"].get(str(i))
        if g is None:
            continue
        parts = []
        for name in DATASETS:
            if name not in g:
                if enabled[name]:
                    fail(f"/layers/{i}/{name} missing")
                continue
            if not enabled[name]:
                fail(f"/layers/{i}/{name} present although the attributes say it is not")
            d = g[name]
            shape, dt = expect(name)
            parts.append(f"{name} {d.shape} {d.dtype}")
            if d.shape != shape or d.dtype != dt:
                fail(f"/layers/{i}/{name}: expected {shape} {np.dtype(dt).name}, found {d.shape} {d.dtype}")
        print(f"  layer {i}: " + ", ".join(parts))
        if "k" in g and "k_pre_rope" in g and inv_freq is not None:
            kp = g["k_pre_rope"][...].astype(np.float64)
            k = g["k"][...].astype(np.float64)
            ref = rope(kp, inv_freq)
            ref[..., : 2 * inv_freq.shape[0]] *= rope_scale(a)
            err = np.abs(k - ref)
            pn = np.zeros_like(kp)  # |pair| of k_pre_rope, per element
            rd = int(a["rope_dim"])
            n2 = np.sqrt(kp[..., 0:rd:2] ** 2 + kp[..., 1:rd:2] ** 2)
            pn[..., 0:rd:2] = n2
            pn[..., 1:rd:2] = n2
            pn[..., rd:] = np.abs(kp[..., rd:])
            bound = args.atol + rtol * pn
            j = np.unravel_index(np.argmax(err), err.shape)
            small = err[np.abs(k) < 2]
            print(f"    k vs RoPE(k_pre_rope): max |err| {err.max():.3g} at (sample, pos, head, ch) {tuple(int(x) for x in j)} "
                  f"where |k| = {abs(k[j]):.3g}; max |err| where |k| < 2: {small.max() if small.size else 0:.3g}; "
                  f"max err / (f16-or-f32 unit roundoff x |pair|): {np.max(err / (u * np.maximum(pn, 1e-30))):.2f}")
            if err.max() > worst[0]:
                worst = (float(err.max()), i)
            if np.any(err > bound):
                jj = np.unravel_index(np.argmax(err - bound), err.shape)
                fail(f"/layers/{i}/k != RoPE(k_pre_rope) at {tuple(int(x) for x in jj)}: |err| {err[jj]:.3g} > "
                     f"{args.atol} + {rtol:.3g} x {pn[jj]:.3g}")
    print(f"  RoPE check: worst max |err| {worst[0]:.3g} (layer {worst[1]}), tolerance atol {args.atol} + rtol {rtol:.3g} x |pair|")

    if args.synthetic:
        ids = {n: j for j, n in enumerate(DATASETS)}
        s = np.arange(N)[:, None, None, None]
        t = np.arange(L)[None, :, None, None]
        nchk = 0
        for i in range(lf, ll + 1):
            g = f["layers"][str(i)]
            for name in DATASETS:
                if name == "k" or name not in g:
                    continue
                if name.startswith("attn"):
                    want = gen(ids[name], i, np.arange(N)[:, None, None], np.arange(L)[None, None, :],
                               np.arange(H)[None, :, None], 0)
                else:
                    heads = g[name].shape[2]
                    want = gen(ids[name], i, s, t, np.arange(heads)[None, None, :, None],
                               np.arange(D)[None, None, None, :])
                want = want.astype(g[name].dtype)  # numpy's RNE float32 → float16
                got = g[name][...]
                if not np.array_equal(got, want):
                    bad = np.argwhere(got != want)[0]
                    fail(f"/layers/{i}/{name}{tuple(int(x) for x in bad)}: {got[tuple(bad)]!r} != expected {want[tuple(bad)]!r}")
                nchk += got.size
        want_tok = (np.arange(N)[:, None] * 31 + np.arange(L)[None, :] * 7 + 3) % int(a["vocab_size"])
        if not np.array_equal(toks, want_tok):
            fail("/tokens differ from the synthetic formula")
        print(f"  synthetic values: {nchk} stored values + {toks.size} tokens compared exactly "
              f"(e.g. layer {lf} v[0,1,0,:3] = {f['layers'][str(lf)]['v'][0, 1, 0, :3]})")

    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
