#!/usr/bin/env python3
"""Fixture for tests/test_quant_ggml.c: expected block bytes of llama.cpp's
KV-cache block formats on random and adversarial float32 data.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: gguf.quants.quantize from the `gguf` PyPI
package (numpy ports of ggml's quantize_row_*_ref; Q8_0 is documented there as
bit-exact with ggml-quants.c). IQ4_NL: the gguf package has no IQ4_NL
quantizer, so iq4_nl_ref() below transcribes ggml-quants.c
quantize_row_iq4_nl_ref (quantize_row_iq4_nl_impl with super_block_size =
block_size = 32, 16 values, quant_weights = NULL, ntry = -1) with numpy
float32 scalars, one rounding per operation in ggml's order, and the
branchless binary search of ggml's best_index_int8. Expected dequantized
values come from gguf.quants.dequantize (which has IQ4_NL).

Writes tests/fixtures/ggml_kv_quant.bin (little-endian):
  b"KVQGQK01", u32 n_blocks, float32 x[n_blocks*32],
  u32 n_types, then per type: u32 ggml type id, u32 block bytes,
  bytes[n_blocks*block bytes], float32 dequantized[n_blocks*32].
Block order: the adversarial blocks listed in ADVERSARIAL, then random ones.

Usage (repository root): python3 tests/scripts/ggml_kv_fixture.py
"""
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

OUT = "tests/fixtures/ggml_kv_quant.bin"
F = np.float32
KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def best_index_int8(x):
    """ggml best_index_int8(16, kvalues, x): branchless binary search on 2x."""
    x2 = F(x + x)
    idx = 0
    step = 8
    while step > 0:
        j = idx + step
        if x2 >= F(KVALUES[j - 1] + KVALUES[j]):
            idx = j
        step >>= 1
    return idx


def iq4_nl_ref(block):
    x = [F(v) for v in block]
    amax, mx = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    L = [0] * 32
    d = F(0)
    if not amax < F(1e-15):
        d0 = F(mx / F(KVALUES[0]))
        iv = F(F(1) / d0)
        sumqx, sumq2 = F(0), F(0)
        for j, v in enumerate(x):
            l = best_index_int8(F(iv * v))
            L[j] = l
            q = F(KVALUES[l])
            w = F(v * v)
            sumqx = F(sumqx + F(F(w * q) * v))
            sumq2 = F(sumq2 + F(F(w * q) * q))
        d = F(sumqx / sumq2) if sumq2 > 0 else F(0)
    qs = bytes(L[j] | (L[j + 16] << 4) for j in range(16))
    return np.array([d], dtype=np.float16).view(np.uint8).tobytes() + qs


def blocks():
    rng = np.random.default_rng(20240613)
    adv = []
    adv.append(np.zeros(32))                                   # all zeros
    adv.append(np.full(32, -0.0))                              # negative zeros
    adv.append(np.full(32, 0.37))                              # constant
    adv.append(np.full(32, -2.5))                              # negative constant
    b = rng.standard_normal(32); b[5] = 1000.0; adv.append(b)  # single huge outlier
    b = rng.standard_normal(32); b[17] = -3000.0; adv.append(b)  # huge negative outlier
    adv.append(rng.standard_normal(32) * 1e-6)                 # tiny (fp16 scale subnormal)
    adv.append(rng.standard_normal(32) * 1e-30)                # tinier (fp16 scale rounds to 0)
    b = rng.uniform(0, 1, 32); b[3] = -5.0; adv.append(b)      # negative max
    b = rng.uniform(-1, 1, 32); b[0] = -4.0; b[9] = 4.0; adv.append(b)  # |max| tie, negative first
    b = rng.uniform(-1, 1, 32); b[0] = 4.0; b[9] = -4.0; adv.append(b)  # |max| tie, positive first
    b = np.arange(32) - 16 + 0.5; b[0] = 127.0; adv.append(b)  # Q8_0: x/d on .5 ties
    b = (np.arange(32) % 16) - 8 + 0.5; b[0] = -8.0; adv.append(b)  # Q4_0: x/d + 8.5 on integers
    b = (np.arange(32) % 32) - 16 + 0.5; b[0] = -16.0; adv.append(b)  # Q5_0 likewise
    b = np.zeros(32); b[0] = -127.0                            # IQ4_NL: x/d0 on codebook midpoints
    b[1:16] = [(KVALUES[k - 1] + KVALUES[k]) / 2 for k in range(1, 16)]
    b[16:31] = [KVALUES[k] for k in range(15)]; b[31] = 113.0; adv.append(b)
    adv.append(rng.standard_normal(32) * 3000.0)               # large
    adv.append(rng.uniform(5.0, 6.0, 32))                      # positive offset (Q4_1 min > 0)
    adv.append(rng.uniform(-6.0, -5.0, 32))                    # negative offset
    adv.append(rng.laplace(size=32) ** 3)                      # heavy tails
    b = np.zeros(32); b[7] = 1.0; adv.append(b)                # one non-zero
    b = np.zeros(32); b[7] = -1e-16; adv.append(b)             # below IQ4_NL's GROUP_MAX_EPS
    rand = []
    for i in range(40):
        scale = 10.0 ** rng.uniform(-2, 2)
        off = rng.choice([0.0, 0.0, 3.0 * scale])
        rand.append(rng.standard_normal(32) * scale + off)
    return np.array(adv + rand, dtype=np.float32), len(adv)


def main():
    x, n_adv = blocks()
    n = len(x)
    out = [b"KVQGQK01", struct.pack("<I", n), x.astype("<f4").tobytes()]
    types = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL]
    out.append(struct.pack("<I", len(types)))
    for t in types:
        if t == T.IQ4_NL:
            q = np.frombuffer(b"".join(iq4_nl_ref(b) for b in x), dtype=np.uint8).reshape(n, -1)
        else:
            q = quantize(x, t)
        deq = dequantize(q, t).astype(np.float32).reshape(n, 32)
        bb = q.shape[1]
        out += [struct.pack("<II", int(t), bb), q.tobytes(), deq.astype("<f4").tobytes()]
        print(f"{t.name}: {bb} bytes/block")
    with open(OUT, "wb") as f:
        f.write(b"".join(out))
    print(f"wrote {OUT}: {n} blocks ({n_adv} adversarial)")


if __name__ == "__main__":
    main()
