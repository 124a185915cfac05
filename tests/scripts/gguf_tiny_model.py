#!/usr/bin/env python3
"""Write tests/fixtures/tiny_llama.gguf — a tiny random llama-architecture GGUF
(2 layers, dim 32, 4 query / 2 KV heads, head_dim 8, hidden 64, vocab 48,
untied output) whose weights use a mix of tensor types (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1), written with the `gguf` package's GGUFWriter and
quantizer — and tests/fixtures/tiny_llama.sha256: per tensor
"<name> <type> <n_elements> <sha256 of gguf.quants.dequantize(...) as
little-endian fp32, shape [ne1][ne0] row-major>" (= kvq's [out][in] layout),
after a first line "file <sha256 of tiny_llama.gguf>".
Used by tests/test_model_gguf.c (loader values, truncations, bit flips).
Run from the repository root: python3 tests/scripts/gguf_tiny_model.py
"""
import hashlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

OUT = "tests/fixtures/tiny_llama"
L, D, H, NH, NKV, V, CTX = 2, 32, 64, 4, 2, 48, 256
HD = D // NH


def main():
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(OUT + ".gguf", "llama")
    w.add_name("kvq tiny test llama")
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(H)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HD)

    def add(name, out_in, qt):
        a = (rng.standard_normal(out_in) * 0.5).astype(np.float32)
        if qt == T.F32:
            w.add_tensor(name, a)
        elif qt == T.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, qt), raw_dtype=qt)

    add("token_embd.weight", (V, D), T.Q8_0)
    add("output_norm.weight", (D,), T.F32)
    add("output.weight", (V, D), T.F16)
    types = [
        dict(attn_q=T.Q4_0, attn_k=T.Q4_1, attn_v=T.Q5_0, attn_output=T.Q5_1, ffn_gate=T.Q8_0, ffn_up=T.BF16, ffn_down=T.F16),
        dict(attn_q=T.F32, attn_k=T.Q8_0, attn_v=T.BF16, attn_output=T.F16, ffn_gate=T.Q4_1, ffn_up=T.Q5_1, ffn_down=T.Q4_0),
    ]
    shapes = dict(attn_q=(NH * HD, D), attn_k=(NKV * HD, D), attn_v=(NKV * HD, D), attn_output=(D, NH * HD),
                  ffn_gate=(H, D), ffn_up=(H, D), ffn_down=(D, H))
    for l in range(L):
        add(f"blk.{l}.attn_norm.weight", (D,), T.F32)
        add(f"blk.{l}.ffn_norm.weight", (D,), T.F32)
        for k, shp in shapes.items():
            add(f"blk.{l}.{k}.weight", shp, types[l][k])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = gguf.GGUFReader(OUT + ".gguf")
    with open(OUT + ".gguf", "rb") as f:
        lines = [f"file {hashlib.sha256(f.read()).hexdigest()}"]
    for t in r.tensors:
        qt = T(t.tensor_type)
        data = t.data.view(np.float16) if qt == T.F16 else t.data
        full = np.asarray(dequantize(data, qt), dtype=np.float32)
        assert full.size == int(np.prod([int(x) for x in t.shape])), t.name
        lines.append(f"{t.name} {qt.name} {full.size} {hashlib.sha256(full.astype('<f4').tobytes()).hexdigest()}")
    with open(OUT + ".sha256", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{OUT}.gguf: {len(r.tensors)} tensors, data offset {r.data_offset}")


if __name__ == "__main__":
    main()
