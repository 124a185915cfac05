#!/usr/bin/env python3
"""The GEMM-only floor of one kveval --math bf16 window: the forward's matrix products at the
model's shapes, each timed alone on the GPU (PyTorch bf16 matmul, CUDA events, median of 20
after 3 warm-ups, fresh random operands), summed over the window, next to an 8192^3 product
timed the same way. A diagnostic for scripts/gpu_families_check.sh (run gemms:CTX); needs
python3 with torch and a GPU.

    python3 scripts/gpu_gemm_shapes.py MODEL_DIR CTX

MODEL_DIR: an HF Llama directory (config.json is read; no weights). The products, as
kernels/cuda/forward_cuda.cu runs them for a window of CTX tokens: per layer q, k, v, o, gate,
up, down ([CTX][in] x [in][out]); the LM head over the CTX - 1 scored rows in vocabulary blocks
of 2^26 / CTX columns (the bf16 mode's block). kvq's GEMMs write fp32 (cublasGemmEx, fp32
accumulation); torch's bf16 matmul writes bf16: a few percent less output traffic.
"""
import json
import os
import sys

import torch


def timed(m, k, n, reps=20):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in ev:
        e0.record()
        a @ b
        e1.record()
    torch.cuda.synchronize()
    t = sorted(e0.elapsed_time(e1) for e0, e1 in ev)
    return t[len(t) // 2] / 1e3


def main():
    cfg = json.load(open(os.path.join(sys.argv[1], "config.json")))
    T = int(sys.argv[2])
    D, H, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or D // cfg["num_attention_heads"]
    Q, KV = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    vc = (1 << 26) // T
    shapes = [("q", T, D, Q, L), ("k", T, D, KV, L), ("v", T, D, KV, L), ("o", T, Q, D, L), ("gate", T, D, H, L),
              ("up", T, D, H, L), ("down", T, H, D, L)]
    for v0 in range(0, V, vc):
        shapes.append((f"head[{v0}:]", T - 1, D, min(vc, V - v0), 1))
    n = 8192
    sq = timed(n, n, n)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {n}^3 {2 * n ** 3 / sq / 1e12:.1f} TFLOP/s")
    tot_s = tot_f = 0.0
    for name, m, k, nn, cnt in shapes:
        s = timed(m, k, nn)
        f = 2.0 * m * k * nn
        tot_s += s * cnt
        tot_f += f * cnt
        if not name.startswith("head[") or name == "head[0:]":
            print(f"  {name:10s} [{m}][{k}] x [{k}][{nn}] x {cnt}: {s * 1e6:8.1f} us, {f / s / 1e12:6.1f} TFLOP/s")
    print(f"GEMMs of one {T}-token window: {tot_f / 1e12:.2f} TFLOP in {tot_s * 1e3:.2f} ms = {tot_f / tot_s / 1e12:.1f} TFLOP/s "
          f"({tot_f / tot_s * sq / (2 * n ** 3):.2f} of the {n}^3 rate)")


if __name__ == "__main__":
    main()
