#!/usr/bin/env python3
"""Fixtures for tests/test_dequant.c, computed with the `gguf` PyPI package's
own dequantizer (gguf.quants.dequantize, a numpy port of ggml's
dequantize_row_*).

Writes, under tests/fixtures/:
  dequant_synthetic.bin  every supported type on synthetic blocks (random bytes,
                         finite random fp16 scales): raw blocks + expected fp32.
                         Record: u32 ggml type, u32 n_elements, u32 n_bytes,
                         raw bytes, n_elements float32 (all little-endian);
                         the file starts with b"KVQDQ1\\0\\0" and a u32 record count.
  dequant_model.sha256   for the default model: one line per tensor,
                         "<name> <type> <n_elements> <sha256 of the dequantized
                         fp32 array, little-endian, row-major>"; the first line is
                         "file <sha256 of the model file>".
  dequant_model_rows.bin for the default model: per tensor (file order) the first,
                         middle and last row (1-D: the only row), each cut to its
                         first 32 and last 32 elements. Record: u32 name length,
                         name, u32 n_rows, then per row u64 row index + 64 float32.
                         Starts with b"KVQROWS1" and a u32 tensor count.

Usage: python3 tests/scripts/gguf_dequant_fixture.py [model.gguf]
(default models/SmolLM2-135M-Instruct.Q4_1.gguf; run from the repository root).
"""
import hashlib
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = "tests/fixtures/"
HEAD = TAIL = 32

# fp16 scale fields (byte offsets inside one block) per type
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def finite_fp16(rng, n):
    """Random finite binary16 bit patterns (any sign, subnormals, zeros, normals)."""
    h = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    exp = (h >> 10) & 0x1F
    h = np.where(exp == 0x1F, h & np.uint16(0x83FF), h)  # inf/nan -> subnormal/zero
    h[:4] = [0x0000, 0x8000, 0x0001, 0x7BFF]            # +0, -0, smallest subnormal, max
    return h.astype("<u2")


def synthetic(rng):
    recs = []
    # F32: random finite floats
    f32 = rng.standard_normal(256).astype("<f4") * np.float32(1e3)
    recs.append((T.F32, f32.tobytes()))
    # F16: every class; signalling NaNs excluded (the quiet bit is set on conversion)
    h = rng.integers(0, 1 << 16, size=2048, dtype=np.uint32).astype(np.uint16)
    snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0) & ((h & 0x200) == 0)
    h = np.where(snan, h | np.uint16(0x200), h)
    h[:8] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7C00, 0xFC00, 0x7E00]
    recs.append((T.F16, h.astype("<u2").tobytes()))
    # BF16: any bit pattern
    b = rng.integers(0, 1 << 16, size=1024, dtype=np.uint32).astype("<u2")
    recs.append((T.BF16, b.tobytes()))
    for qt, offs in SCALES.items():
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        nblk = 64 if block_elems == 32 else 8
        raw = rng.integers(0, 256, size=(nblk, block_bytes), dtype=np.uint32).astype(np.uint8)
        for o in offs:
            raw[:, o:o + 2] = finite_fp16(rng, nblk).view(np.uint8).reshape(nblk, 2)
        recs.append((qt, raw.tobytes()))
    out = [b"KVQDQ1\0\0", struct.pack("<I", len(recs))]
    for qt, raw in recs:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        arr = np.frombuffer(raw, dtype=np.uint8)
        if qt == T.F32:
            vals = arr.view("<f4").astype(np.float32)
        elif qt == T.F16:
            vals = dequantize(arr.view(np.float16), qt)
        else:
            vals = dequantize(arr.reshape(1, -1), qt).reshape(-1)
        vals = np.asarray(vals, dtype=np.float32)
        n = len(raw) // block_bytes * block_elems
        assert vals.size == n, (qt, vals.size, n)
        out += [struct.pack("<III", int(qt), n, len(raw)), raw, vals.astype("<f4").tobytes()]
        print(f"  {qt.name:5s} {n:5d} elements, {len(raw):5d} bytes")
    return b"".join(out)


def model_fixtures(path):
    fh = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            fh.update(chunk)
    r = gguf.GGUFReader(path)
    lines = [f"file {fh.hexdigest()}"]
    rows_out = [b"KVQROWS1", struct.pack("<I", len(r.tensors))]
    for t in r.tensors:
        qt = T(t.tensor_type)
        ne = [int(x) for x in t.shape]  # GGUF order: ne[0] first
        full = np.asarray(dequantize(t.data, qt), dtype=np.float32)
        ne0 = ne[0]
        full = full.reshape(-1, ne0)
        assert full.size == int(np.prod(ne)), t.name
        lines.append(f"{t.name} {qt.name} {full.size} {hashlib.sha256(full.astype('<f4').tobytes()).hexdigest()}")
        nrows = full.shape[0]
        sel = sorted({0, nrows // 2, nrows - 1})
        name = t.name.encode()
        rows_out += [struct.pack("<I", len(name)), name, struct.pack("<I", len(sel))]
        for ri in sel:
            row = np.concatenate([full[ri, :HEAD], full[ri, ne0 - TAIL:]]).astype("<f4")
            rows_out += [struct.pack("<Q", ri), row.tobytes()]
    return "\n".join(lines) + "\n", b"".join(rows_out)


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    rng = np.random.default_rng(20240601)
    print("synthetic blocks:")
    with open(OUT + "dequant_synthetic.bin", "wb") as f:
        f.write(synthetic(rng))
    print(f"model {model}:")
    sha, rows = model_fixtures(model)
    with open(OUT + "dequant_model.sha256", "w") as f:
        f.write(sha)
    with open(OUT + "dequant_model_rows.bin", "wb") as f:
        f.write(rows)
    print(f"  {sha.count(chr(10)) - 1} tensors; rows fixture {len(rows)} bytes")


if __name__ == "__main__":
    main()
