#!/usr/bin/env python3
"""Fixture for tests/test_quant_fp8.c: FP8 decode/encode reference values from
the `ml_dtypes` PyPI package (float8_e4m3fn, float8_e5m2; the same types JAX
and PyTorch-compatible tooling use).

ml_dtypes is needed only to run this script (pip install ml_dtypes); the C test
reads the committed output.

Writes tests/fixtures/fp8_ml_dtypes.bin (little-endian):
  b"KVQFP8R1", u32 n_formats, then per format:
    u32 format (0 = e4m3fn, 1 = e5m2),
    u32 decode[256]      float32 bit pattern of every code (ml_dtypes astype(float32)),
    u32 n_inputs, u32 inputs[n_inputs] (float32 bits), u8 codes[n_inputs]
  The inputs are all within the finite range (|x| <= max finite), where
  ml_dtypes' round-to-nearest-even cast and kvq's saturating encoder must agree:
  every finite code value, the midpoint between every pair of adjacent codes
  and the float32 neighbours just above and below each midpoint (both signs),
  and log-uniform random magnitudes (seed 1234).

Usage (repository root): python3 tests/scripts/fp8_fixture.py
"""
import struct

import ml_dtypes
import numpy as np

OUT = "tests/fixtures/fp8_ml_dtypes.bin"
FORMATS = [(0, ml_dtypes.float8_e4m3fn), (1, ml_dtypes.float8_e5m2)]


def main():
    rng = np.random.default_rng(1234)
    out = [b"KVQFP8R1", struct.pack("<I", len(FORMATS))]
    for fid, dt in FORMATS:
        codes = np.arange(256, dtype=np.uint8)
        dec = codes.view(dt).astype(np.float32)
        fmax = np.float32(ml_dtypes.finfo(dt).max)
        # positive finite codes in increasing order
        pos = [c for c in range(128) if np.isfinite(dec[c])]
        vals = dec[pos]
        assert np.all(np.diff(vals) > 0)
        inputs = list(vals) + list(-vals)
        for a, b in zip(vals[:-1], vals[1:]):
            m = np.float32((np.float64(a) + np.float64(b)) / 2)
            assert np.float64(m) == (np.float64(a) + np.float64(b)) / 2, "midpoint not exact in float32"
            for v in (m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf))):
                inputs += [v, -v]
        mags = np.exp(rng.uniform(np.log(1e-7), np.log(float(fmax)), 1000)).astype(np.float32)
        signs = rng.choice([-1.0, 1.0], 1000).astype(np.float32)
        inputs += list(mags * signs)
        x = np.array(inputs, dtype=np.float32)
        x = x[np.abs(x) <= fmax]
        enc = x.astype(dt).view(np.uint8)
        assert not np.any(np.isnan(enc.view(dt).astype(np.float32))), "finite input gave NaN"
        out += [struct.pack("<I", fid), dec.view(np.uint32).astype("<u4").tobytes(),
                struct.pack("<I", len(x)), x.view(np.uint32).astype("<u4").tobytes(), enc.tobytes()]
        print(f"{dt.__name__}: 256 codes, {len(x)} encode cases, max {fmax}")
    with open(OUT, "wb") as f:
        f.write(b"".join(out))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
