#!/usr/bin/env python3
"""Write a random-weight HF Llama checkpoint of a real model's shape, for the
memory and speed benchmarks (scripts/gpu_families_check.sh step 3, docs/BENCHMARKS.md).
Nothing here is a test fixture: the output is large (16 GB for llama3-8b in
bf16) and belongs in a scratch directory (/tmp), never in the repository.

    python3 tests/scripts/random_llama_model.py --shape llama3-8b --out /tmp/kvq-llama3-8b [--dtype bf16] [--layers N] [--jobs N]

Shapes (transformers LlamaConfig fields):
    llama3-8b   dim 4096, 32 layers, 32 query / 8 KV heads (head_dim 128), SwiGLU
                14336, vocab 128256, untied, rope_theta 500000 with Llama-3.1's
                llama3 scaling (factor 8, original context 8192), context 131072
    llama2-7b   dim 4096, 32 layers, 32 / 32 heads, SwiGLU 11008, vocab 32000,
                rope_theta 10000, context 4096
    smollm2-135m  dim 576, 30 layers, 9 / 3 heads (head_dim 64), SwiGLU 1536, vocab
                49152, rope_theta 100000, context 8192 (SmolLM2-135M's shape, its
                embeddings untied here; scripts/gpu_carry_sched.sh)
    llama2-70b  dim 8192, 80 layers, 64 / 8 heads, SwiGLU 28672, vocab 32000,
                rope_theta 10000, context 4096 (138 GB in bf16: the multi-GPU
                pipeline's measurements, scripts/gpu_multi.sh)
--layers keeps the shape but fewer layers (a quick variant).

A byte-level tokenizer.json with the model's vocabulary size is written
beside (every byte a token; filler ids; 256 reserved special tokens on top).
The weights are N(0, 0.02^2) (transformers' initializer_range), norms 1:
activations stay finite through every layer; the values mean nothing. They
are written into safetensors shards of at most 5 GB with a
model.safetensors.index.json (the layout of HF's own Llama checkpoints) by
--jobs worker processes (default: every core), each filling blocks of at most
32 Mi elements in place (os.pwrite): memory is jobs x 128 MB of float32, not
the model. Block b of the checkpoint draws from np.random.default_rng([1234, b]),
so the file is the same for any --jobs.
"""
import argparse
import json
import multiprocessing
import os
import struct

import numpy as np

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192)),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=100000.0),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      rope_theta=10000.0),
    "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       rope_theta=10000.0),
}


def tensors(c):
    D, H, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = D // c["num_attention_heads"]
    Q, KV = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (V, D)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (D,)
        yield p + "self_attn.q_proj.weight", (Q, D)
        yield p + "self_attn.k_proj.weight", (KV, D)
        yield p + "self_attn.v_proj.weight", (KV, D)
        yield p + "self_attn.o_proj.weight", (D, Q)
        yield p + "post_attention_layernorm.weight", (D,)
        yield p + "mlp.gate_proj.weight", (H, D)
        yield p + "mlp.up_proj.weight", (H, D)
        yield p + "mlp.down_proj.weight", (D, H)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


def bytes_to_unicode():
    # GPT-2's byte <-> printable-character map (HF ByteLevel)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(path, vocab_size):
    """A byte-level BPE tokenizer.json of exactly vocab_size ids: the 256 bytes
    (no merges: every byte is a token), unreachable filler entries, and 256
    reserved special tokens at the top (Llama-3's layout: 128000 regular ids,
    then 256 special ones). Enough to drive kvdump/kveval over text with a model
    of this vocabulary; the tokens mean nothing to random weights."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    n_special = min(256, vocab_size - 256)
    for i in range(256, vocab_size - n_special):
        vocab[f"fill{i}"] = i  # 'f', 'i', 'l' and digits are byte-level symbols; never produced without merges
    added = [dict(id=i, content=f"<|reserved_special_token_{i}|>", special=True, single_word=False, lstrip=False,
                  rstrip=False, normalized=False) for i in range(vocab_size - n_special, vocab_size)]
    added[0]["content"] = "<|begin_of_text|>"
    tok = dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None,
               pre_tokenizer=dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True),
               post_processor=None, decoder=dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True, use_regex=True),
               model=dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                          fuse_unk=False, byte_fallback=False, ignore_merges=False, vocab=vocab, merges=[]))
    with open(path, "w") as f:
        json.dump(tok, f)


BLOCK_ELEMS = 1 << 25  # elements per block of rows (128 MB as float32)


def write_block(job):
    """Fill one block of rows of one tensor in place: N(0, 0.02^2) weights (ones for a 1-D norm)."""
    fname, offset, rows, cols, norm, dtype, b = job
    if norm:
        x = np.ones((rows, cols), dtype=np.float32)
    else:
        x = np.random.default_rng([1234, b]).standard_normal((rows, cols), dtype=np.float32)
        x *= 0.02
    if dtype == "bf16":
        u = x.view(np.uint32)
        u += 0x7FFF + ((u >> 16) & 1)  # round to nearest even (no NaN here)
        data = (u >> 16).astype(np.uint16).tobytes()
    else:
        data = x.tobytes()
    fd = os.open(fname, os.O_WRONLY)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0: every core)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write config.json and tokenizer.json only")
    a = ap.parse_args()
    c = dict(SHAPES[a.shape])
    if a.layers:
        c["num_hidden_layers"] = a.layers
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16" if a.dtype == "bf16" else "float32", **c)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_tokenizer(os.path.join(a.out, "tokenizer.json"), c["vocab_size"])
    if a.tokenizer_only:
        return
    esize = 2 if a.dtype == "bf16" else 4
    # plan the shards
    shards, cur, cur_bytes = [], [], 0
    for name, shape in tensors(c):
        nb = int(np.prod(shape)) * esize
        if cur and cur_bytes + nb > a.shard_gb * 1e9:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, nb))
        cur_bytes += nb
    shards.append(cur)
    # headers first (each file created at its full size), then the blocks of rows in parallel
    weight_map, total, blocks = {}, 0, []
    for si, sh in enumerate(shards):
        fname = os.path.join(a.out, f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors")
        header, off = {}, 0
        for name, shape, nb in sh:
            header[name] = dict(dtype="BF16" if a.dtype == "bf16" else "F32", shape=list(shape), data_offsets=[off, off + nb])
            off += nb
            weight_map[name] = os.path.basename(fname)
        hj = json.dumps(header, separators=(",", ":")).encode()
        hj += b" " * ((8 - len(hj) % 8) % 8)
        with open(fname, "wb") as f:
            f.write(struct.pack("<Q", len(hj)))
            f.write(hj)
            f.truncate(8 + len(hj) + off)
        pos = 8 + len(hj)
        for name, shape, nb in sh:
            cols = shape[-1]
            rows = int(np.prod(shape)) // cols
            step = max(1, BLOCK_ELEMS // cols)
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                blocks.append((fname, pos + r0 * cols * esize, n, cols, len(shape) == 1, a.dtype, len(blocks)))
            pos += nb
        total += off
    with multiprocessing.Pool(a.jobs or os.cpu_count()) as pool:
        for _ in pool.imap_unordered(write_block, blocks):
            pass
    for si in range(len(shards)):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        print(f"{fname}: {os.path.getsize(os.path.join(a.out, fname)) / 1e9:.2f} GB", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=1)
    print(f"{a.out}: {a.shape}, {c['num_hidden_layers']} layers, {total / 1e9:.2f} GB of {a.dtype} weights")


if __name__ == "__main__":
    main()
