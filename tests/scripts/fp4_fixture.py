#!/usr/bin/env python3
"""Fixture for tests/test_quant_fp4.c: FP4 KV block-format reference values
computed with numpy and the `ml_dtypes` PyPI package (float4_e2m1fn,
float8_e4m3fn, float8_e8m0fnu), independently of kvq's C code.

ml_dtypes is needed only to run this script (pip install ml_dtypes); the C test
reads the committed output.

Rules transcribed (float32 throughout, as the engines compute):
  nvfp4   FlashInfer csrc/fp4_kv_quantization.cu (the KV kernel SGLang calls):
          sf = (1/g) * (vmax * (1/6)); sf8 = e4m3(min(sf, 448)) (RNE; the
          kernel's __nv_fp8_e4m3 saturates, ml_dtypes would give NaN, hence the
          clamp); os = 1 / (sf8 * g); code = e2m1(clip(x * os, -6, 6)) (RNE;
          cvt.rn.satfinite); y = e2m1 * (sf8 * g).
  mxfp4   OCP MX v1.0 / torchao to_mx FLOOR: e = floor(log2(amax)) - 2
          clamped to [-127, 127]; code = e2m1(clip(x / 2^e, -6, 6)); y = code * 2^e.
  mx16    SGLang kvfp4_tensor.py FP4MXBlock16KVQuantizeUtil (literally):
          e = ceil(log2(clamp(amax / 6, 1e-10))); magnitude = sum(|x/2^e| >= bounds).

Writes tests/fixtures/fp4_ml_dtypes.bin (little-endian):
  b"KVQFP4R1",
  f32 e2m1_decode[16]   (ml_dtypes float4_e2m1fn of every code)
  f32 e8m0_decode[256]  (ml_dtypes float8_e8m0fnu of every code; NaN for 0xFF)
  u32 n_enc, then n_enc x (f32 input, u8 code): ml_dtypes' RNE cast of every
      code value, every midpoint, their float32 neighbours, both signs
  u32 n_formats (3), per format: u32 format (0 nvfp4, 1 mxfp4, 2 mx16),
      u32 block, u32 n_blocks, f32 g (nvfp4's per-tensor scale, else 1),
      then per block: f32 x[block], u8 codes[block], u8 scale_code, f32 y[block]

Usage (repository root): python3 tests/scripts/fp4_fixture.py
"""
import struct

import ml_dtypes
import numpy as np

OUT = "tests/fixtures/fp4_ml_dtypes.bin"
F4 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
f32 = np.float32
MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=f32)


def f4_code(v):
    """code byte of float32 values via ml_dtypes (RNE); inputs within [-6, 6]"""
    return np.asarray(v, dtype=f32).astype(F4).view(np.uint8) & 0xF


def e4m3(v):
    return np.asarray(v, dtype=f32).astype(E4M3)


def nvfp4_block(x, g):
    g = f32(g)
    vmax = np.max(np.abs(x)).astype(f32)
    sf = (f32(1) / g) * (vmax * (f32(1) / f32(6)))
    sf = min(sf, f32(448))
    s8 = e4m3(sf)
    sfv = f32(s8.astype(f32))
    deq = f32(sfv * g)
    if vmax == 0 or sfv == 0:
        codes = np.where(np.signbit(x), 8, 0).astype(np.uint8)
        return codes, int(s8.view(np.uint8)), np.copysign(np.zeros_like(x), x).astype(f32)
    os_ = f32(f32(1) / deq)
    t = (x * os_).astype(f32)
    codes = f4_code(np.clip(t, -6, 6))
    y = (codes_val(codes) * deq).astype(f32)
    return codes, int(s8.view(np.uint8)), y


def codes_val(codes):
    return np.array([(-1 if c & 8 else 1) * MAGS[c & 7] for c in codes], dtype=f32)


def mxfp4_block(x):
    amax = np.max(np.abs(x)).astype(f32)
    e = int(np.floor(np.log2(np.float64(amax)))) - 2 if amax > 0 else -127
    e = max(-127, min(127, e))
    t = np.ldexp(x.astype(np.float64), -e).astype(f32)
    codes = f4_code(np.clip(t, -6, 6))
    y = np.ldexp(codes_val(codes).astype(np.float64), e).astype(f32)
    return codes, e + 127, y


def mx16_block(x):
    amax = np.max(np.abs(x)).astype(f32)
    r = max(f32(amax / f32(6)), f32(1e-10))
    e = int(np.ceil(np.log2(np.float64(r))))  # exact in float64 for float32 r
    t = np.ldexp(x.astype(np.float64), -e).astype(f32)
    mag = np.sum(np.abs(t)[:, None] >= BOUNDS[None, :], axis=1)
    codes = (((t < 0).astype(np.uint8) << 3) + mag.astype(np.uint8)).astype(np.uint8)
    y = np.ldexp(codes_val(codes).astype(np.float64), e).astype(f32)
    return codes, e + 127, y


def blocks(rng, block, n, ties):
    out = []
    for i in range(n):
        mag = 10.0 ** rng.uniform(-4, 4)
        x = (rng.standard_normal(block) * mag).astype(f32)
        if i % 5 == 1:  # a heavy outlier
            x[rng.integers(block)] *= f32(50)
        if i % 7 == 3:  # exact ties on the element grid: amax fixes the scale, others sit on midpoints
            scale = f32(2.0) ** int(rng.integers(-6, 6))
            x = (rng.choice(ties, block) * scale * rng.choice([-1, 1], block)).astype(f32)
        if i == 0:
            x[:] = 0
        out.append(x)
    return out


def main():
    rng = np.random.default_rng(2026)
    buf = bytearray(b"KVQFP4R1")
    codes16 = np.arange(16, dtype=np.uint8)
    buf += codes16.view(F4).astype(f32).tobytes()
    e8 = np.arange(256, dtype=np.uint8).view(E8M0).astype(f32)
    buf += e8.tobytes()
    ins = []
    pts = MAGS + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for v in pts:
        v = f32(v)
        for w in (v, np.nextafter(v, f32(0)), np.nextafter(v, f32(7))):
            for s in (1, -1):
                ins.append(f32(w * s))
    ins = np.array(ins, dtype=f32)
    enc = f4_code(ins)
    buf += struct.pack("<I", len(ins))
    for v, c in zip(ins, enc):
        buf += struct.pack("<fB", float(v), int(c))
    ties = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1, 3], dtype=f32)
    fmts = [(0, 16, 0.37), (1, 32, 1.0), (2, 16, 1.0)]
    buf += struct.pack("<I", len(fmts))
    for fmt, block, g in fmts:
        bl = blocks(rng, block, 200, ties)
        buf += struct.pack("<IIIf", fmt, block, len(bl), g)
        for x in bl:
            if fmt == 0:
                c, s, y = nvfp4_block(x, g)
            elif fmt == 1:
                c, s, y = mxfp4_block(x)
            else:
                c, s, y = mx16_block(x)
            buf += x.astype("<f4").tobytes() + np.asarray(c, np.uint8).tobytes() + bytes([s]) + y.astype("<f4").tobytes()
    with open(OUT, "wb") as f:
        f.write(buf)
    print(f"wrote {OUT}: {len(buf)} bytes")


if __name__ == "__main__":
    main()
