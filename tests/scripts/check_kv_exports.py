#!/usr/bin/env python3
"""Read a `kvcalib export-vllm` file back with the Python `safetensors` package
(the reader HF transformers, vLLM and llm-compressor use) and compare it with
the artifact it was exported from (tests/test_kvcalib.c runs it).

    python3 tests/scripts/check_kv_exports.py ARTIFACT EXPORT FORM [CONFIG_JSON]

FORM: vllm | compressed-tensors | modelopt (formats/vllm_scales.h). Checks:
exactly the form's tensor names for every layer
  vllm, compressed-tensors: model.layers.<i>.self_attn.k_scale / v_scale
  modelopt:                 model.layers.<i>.self_attn.k_proj.k_scale / v_proj.v_scale
dtype float32; the form's shapes (vllm [] or [H]; compressed-tensors [1] or
[H, 1, 1] as compressed-tensors' initialize_qparams creates them for strategy
tensor / attn_head; modelopt [1]); values bit for bit equal to the artifact's
layers.<i>.{k,v}.fp8_scale; metadata format "pt" and kvq.form. With
CONFIG_JSON (compressed-tensors): quantization_config.quant_method
"compressed-tensors" and kv_cache_scheme {num_bits 8, type float, strategy
tensor | attn_head matching the artifact's granularity, dynamic false,
symmetric true}. Exit status 0 when all hold.
"""
import json
import sys

import numpy as np
from safetensors import safe_open


def main():
    art, exp, form = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = sys.argv[4] if len(sys.argv) > 4 else None
    with safe_open(art, framework="np") as a:
        meta = a.metadata()
        L, H = int(meta["kvq.n_layers"]), int(meta["kvq.n_kv_heads"])
        per_head = meta["kvq.granularity"] == "per-head"
        want = {}
        for i in range(L):
            for w in "kv":
                sc = a.get_tensor(f"layers.{i}.{w}.fp8_scale").astype(np.float32)
                if form == "modelopt":
                    name = f"model.layers.{i}.self_attn.{w}_proj.{w}_scale"
                else:
                    name = f"model.layers.{i}.self_attn.{w}_scale"
                want[name] = sc
    if form == "vllm":
        shape = (H,) if per_head else ()
    elif form == "compressed-tensors":
        shape = (H, 1, 1) if per_head else (1,)
    elif form == "modelopt":
        assert not per_head, "modelopt form of a per-head artifact"
        shape = (1,)
    else:
        raise SystemExit(f"unknown form {form}")
    with safe_open(exp, framework="np") as f:
        names = sorted(f.keys())
        assert names == sorted(want), (names, sorted(want))
        m = f.metadata()
        assert m.get("format") == "pt" and m.get("kvq.form") == form, m
        for name, sc in want.items():
            t = f.get_tensor(name)
            assert t.dtype == np.float32, (name, t.dtype)
            assert t.shape == shape, (name, t.shape, shape)
            assert np.array_equal(t.reshape(-1).view(np.uint32), sc.reshape(-1).view(np.uint32)), (name, t, sc)
    if cfg:
        assert form == "compressed-tensors"
        with open(cfg) as fh:
            c = json.load(fh)
        q = c["quantization_config"]
        assert q["quant_method"] == "compressed-tensors", q
        s = q["kv_cache_scheme"]
        assert s == {"num_bits": 8, "type": "float", "strategy": "attn_head" if per_head else "tensor",
                     "dynamic": False, "symmetric": True}, s
    print(f"{exp}: {form}, {len(want)} tensors of shape {shape}, equal to {art}" + (f"; {cfg} ok" if cfg else ""))


if __name__ == "__main__":
    main()
