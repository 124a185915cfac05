#!/usr/bin/env python3
"""Write tests/fixtures/st_fixture.safetensors with the reference `safetensors`
package (Rust serializer) for tests/test_safetensors.c.

Regenerate:  python3 tests/scripts/make_safetensors_fixture.py
Verify a kvq-written file loads in the reference reader:
             python3 tests/scripts/make_safetensors_fixture.py --check FILE

Tensors (values chosen so the C test can recompute them):
  a.f32   F32  [2, 3]  (arange(6) * 0.5 - 1)
  b.f16   F16  [4]     [0.1, -2.5, 65504, 6e-8]  (as numpy rounds them to half)
  c.bf16  BF16 [3]     bit patterns 0x3f80 (1.0), 0xc049 (-3.140625), 0x0001 (tiny)
  d.i32   I32  [2, 2]  [[1, -2], [3, 2147483647]]
  e.i64   I64  [3]     [-1, 0, 2**40]
  f.u8    U8   [5]     [0, 1, 2, 254, 255]
  g.f64   F64  [2]     [1.5, -1e300]
  h.scalar F32 []      42.0
metadata: {"format": "kvq-fixture", "note": "quote \" and unicode é"}
"""
import json
import os
import sys

import numpy as np
from safetensors import safe_open
from safetensors._safetensors_rust import TensorSpec, serialize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "st_fixture.safetensors")


def check(path):
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        for k in f.keys():
            try:
                t = f.get_tensor(k)
                print(f"{k}: {t.dtype} {list(t.shape)} {t.ravel()[:6]}")
            except TypeError as e:  # numpy has no bfloat16
                print(f"{k}: {f.get_slice(k).get_dtype()} {f.get_slice(k).get_shape()} ({e})")
    print("metadata:", json.dumps(meta, indent=1, sort_keys=True))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
        return
    tensors = {
        "a.f32": {"dtype": "float32", "shape": [2, 3],
                  "data": (np.arange(6, dtype=np.float32) * 0.5 - 1).reshape(2, 3).tobytes()},
        "b.f16": {"dtype": "float16", "shape": [4],
                  "data": np.array([0.1, -2.5, 65504, 6e-8], dtype=np.float16).tobytes()},
        "c.bf16": {"dtype": "bfloat16", "shape": [3],
                   "data": np.array([0x3F80, 0xC049, 0x0001], dtype="<u2").tobytes()},
        "d.i32": {"dtype": "int32", "shape": [2, 2],
                  "data": np.array([[1, -2], [3, 2147483647]], dtype="<i4").tobytes()},
        "e.i64": {"dtype": "int64", "shape": [3], "data": np.array([-1, 0, 2**40], dtype="<i8").tobytes()},
        "f.u8": {"dtype": "uint8", "shape": [5], "data": np.array([0, 1, 2, 254, 255], dtype=np.uint8).tobytes()},
        "g.f64": {"dtype": "float64", "shape": [2], "data": np.array([1.5, -1e300], dtype="<f8").tobytes()},
        "h.scalar": {"dtype": "float32", "shape": [], "data": np.array(42.0, dtype="<f4").tobytes()},
    }
    meta = {"format": "kvq-fixture", "note": 'quote " and unicode \u00e9'}
    keep = {k: np.frombuffer(v["data"], dtype=np.uint8).copy() for k, v in tensors.items()}
    specs = {k: TensorSpec(dtype=v["dtype"], shape=v["shape"], data_ptr=keep[k].ctypes.data, data_len=keep[k].nbytes) for k, v in tensors.items()}
    data = bytes(serialize(specs, metadata=meta))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "wb") as f:
        f.write(data)
    print(f"wrote {OUT} ({len(data)} bytes)")
    check(OUT)


if __name__ == "__main__":
    main()
