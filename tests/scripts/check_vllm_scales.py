#!/usr/bin/env python3
"""Check the vLLM FP8 scale files written by tests/test_vllm_scales.c with the
Python `safetensors` package (the reader HF transformers and vLLM use).

Run after `make tests && build/tests/test_vllm_scales` (repository root):
    python3 tests/scripts/check_vllm_scales.py [dir]
(default dir build/tmp/test_vllm_scales). Checks for tensor.safetensors
(shape []) and head.safetensors (shape [5]): exactly the names
model.layers.{0,1,2}.self_attn.{k,v}_scale, dtype float32, shapes, values
(k = (layer+1)/448 + head/1000 in float32, v = 3k, as in the C test), and
metadata "format" = "pt". Exit status 0 when all hold.
"""
import sys

import numpy as np
from safetensors import safe_open

L, H = 3, 5


def expected(layer, head, is_v):
    k = np.float32(np.float32(layer + 1) / np.float32(448)) + np.float32(np.float32(head) / np.float32(1000))
    k = np.float32(k)
    return np.float32(k * np.float32(3)) if is_v else k


def check(path, per_head):
    with safe_open(path, framework="np") as f:
        names = sorted(f.keys())
        want = sorted(f"model.layers.{i}.self_attn.{w}_scale" for i in range(L) for w in "kv")
        assert names == want, (names, want)
        assert f.metadata().get("format") == "pt", f.metadata()
        for i in range(L):
            for v, w in enumerate("kv"):
                t = f.get_tensor(f"model.layers.{i}.self_attn.{w}_scale")
                assert t.dtype == np.float32, t.dtype
                assert t.shape == ((H,) if per_head else ()), t.shape
                exp = np.array([expected(i, h, v) for h in range(H if per_head else 1)], dtype=np.float32)
                got = t.reshape(-1)
                assert np.array_equal(got.view(np.uint32), exp.view(np.uint32)), (path, w, i, got, exp)
        print(f"{path}: {len(names)} tensors, shape {t.shape}, metadata {f.metadata()} - OK")


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "build/tmp/test_vllm_scales"
    check(f"{d}/tensor.safetensors", False)
    check(f"{d}/head.safetensors", True)


if __name__ == "__main__":
    main()
