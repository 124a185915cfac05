#!/usr/bin/env python3
"""check_artifact.py — read a kvcalib artifact with the Python `safetensors`
package (independent of kvq's C reader) and check it against
kernels/schemes/ARTIFACT.md.

    python3 tests/scripts/check_artifact.py ARTIFACT.safetensors [...]

Checks, printing what it finds:
  * metadata: kvq.schema, kvq.schema_version 1, every key of the table in
    ARTIFACT.md present and well-formed (integers, numbers, the enumerations);
  * the method's tensors and no others of the per-layer kind: nuq levels
    ([2^b] or [n_kv_heads, 2^b], ascending, in [-1, 1]) with fit_objective and
    fit_chosen for K and V, per-channel key thresholds (nuq, int-pc: [kv_dim],
    finite, lower <= upper), fp8 scales ([1] or [n_kv_heads], finite, > 0),
    calib_counts [3] U64 with outliers and points <= elements; int and kivi:
    no per-layer tensors;
  * an IntactKV prefix when intactkv.token_ids is present: ids, positions 0..P-1,
    k / k_pre_rope / v [P, kv_dim] finite for every layer.
Exit status 0 when every file passes, 1 otherwise.
"""
import math
import sys

import numpy as np
from safetensors import safe_open

METHODS = {
    # method: (key levels, value levels, key thresholds, fp8 scales)
    "nuq": (True, True, True, False),
    "int": (False, False, False, False),
    "int-pc": (False, False, True, False),
    "kivi": (False, False, False, False),
    "fp8": (False, False, False, True),
    "nvfp4": (False, False, False, True),  # fp8_scale: NVFP4's float32 per-tensor scale, shape [1]
}


def fail(path, msg):
    raise AssertionError(f"{path}: {msg}")


def check(path):
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        get = f.get_tensor

        def m(key):
            if key not in meta:
                fail(path, f"metadata '{key}' missing")
            return meta[key]

        def mint(key):
            v = m(key)
            if not v.isdigit():
                fail(path, f"metadata '{key}': expected a non-negative integer, found {v!r}")
            return int(v)

        def mnum(key):
            v = float(m(key))
            if not math.isfinite(v):
                fail(path, f"metadata '{key}': not finite")
            return v

        if m("kvq.schema") != "kvq-calib-artifact":
            fail(path, "kvq.schema")
        if mint("kvq.schema_version") != 1:
            fail(path, "kvq.schema_version")
        method = m("kvq.method")
        if method not in METHODS:
            fail(path, f"kvq.method {method!r}")
        kl, vl, thr, f8 = METHODS[method]
        kb, vb = mint("kvq.k_bits"), mint("kvq.v_bits")
        if not (1 <= kb <= 8 and 1 <= vb <= 8):
            fail(path, "bits")
        of = mnum("kvq.outlier_fraction")
        if not (0 <= of < 0.5):
            fail(path, "outlier_fraction")
        mint("kvq.n_sink")
        if m("kvq.key_position") not in ("pre-rope", "post-rope"):
            fail(path, "key_position")
        gran = m("kvq.granularity")
        if gran not in ("per-layer", "per-head"):
            fail(path, "granularity")
        mint("kvq.group_size")
        mint("kvq.residual_length")
        for k in ("kvq.k_axis", "kvq.v_axis", "kvq.k_scaling", "kvq.v_scaling", "kvq.fit", "kvq.model_fingerprint",
                  "kvq.dump_fingerprint", "kvq.creator"):
            m(k)
        if m("kvq.fisher") not in ("true", "false"):
            fail(path, "fisher")
        L, H, D = mint("kvq.n_layers"), mint("kvq.n_kv_heads"), mint("kvq.head_dim")
        C = H * D
        for k in ("kvq.bits_per_element.k", "kvq.bits_per_element.v"):
            if mnum(k) < 0:
                fail(path, k)
        mint("kvq.bits_ctx")
        per_head = gran == "per-head"
        if f8:
            if m("kvq.fp8_format") not in ("e4m3fn", "e5m2"):
                fail(path, "fp8_format")
            p = mnum("kvq.fp8_percentile")
            if not (0 < p <= 100):
                fail(path, "fp8_percentile")
        expected = set()
        for i in range(L):
            for side, levels, bits in (("k", kl, kb), ("v", vl, vb)):
                pre = f"layers.{i}.{side}."
                has_table = levels or (side == "k" and thr) or f8
                if levels:
                    nt = H if per_head else 1
                    lv = get(pre + "levels")
                    if lv.dtype != np.float32 or lv.shape != ((nt, 1 << bits) if per_head else (1 << bits,)):
                        fail(path, f"{pre}levels: {lv.dtype} {lv.shape}")
                    lv = lv.reshape(nt, -1)
                    if not np.all(np.isfinite(lv)) or np.any(np.diff(lv, axis=1) < 0) or lv.min() < -1 or lv.max() > 1:
                        fail(path, f"{pre}levels: not ascending in [-1, 1]")
                    obj = get(pre + "fit_objective")
                    ch = get(pre + "fit_chosen")
                    if obj.dtype != np.float64 or obj.shape != (nt, 2) or ch.dtype != np.uint8 or ch.shape != (nt,):
                        fail(path, f"{pre}fit_objective / fit_chosen shape or dtype")
                    if np.any(ch > 2):
                        fail(path, f"{pre}fit_chosen: values > 2")
                    expected |= {pre + "levels", pre + "fit_objective", pre + "fit_chosen"}
                if side == "k" and thr:
                    lo, hi = get(pre + "channel_lower"), get(pre + "channel_upper")
                    if lo.dtype != np.float32 or lo.shape != (C,) or hi.shape != (C,):
                        fail(path, f"{pre}channel_lower/upper shape")
                    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(lo <= hi)):
                        fail(path, f"{pre}thresholds: not finite or lower > upper")
                    expected |= {pre + "channel_lower", pre + "channel_upper"}
                if f8:
                    sc = get(pre + "fp8_scale")
                    if sc.dtype != np.float32 or sc.shape != ((H,) if per_head else (1,)):
                        fail(path, f"{pre}fp8_scale: {sc.dtype} {sc.shape}")
                    if not (np.all(np.isfinite(sc)) and np.all(sc > 0)):
                        fail(path, f"{pre}fp8_scale: not finite and > 0")
                    expected.add(pre + "fp8_scale")
                if has_table:
                    c = get(pre + "calib_counts")
                    if c.dtype != np.uint64 or c.shape != (3,) or c[1] > c[0] or c[2] > c[0]:
                        fail(path, f"{pre}calib_counts: {c}")
                    expected.add(pre + "calib_counts")
        prefix = set()
        if "intactkv.token_ids" in names:
            ids = get("intactkv.token_ids")
            P = ids.shape[0]
            pos = get("intactkv.positions")
            if ids.dtype != np.int32 or np.any(ids < 0) or not np.array_equal(pos, np.arange(P, dtype=np.int32)):
                fail(path, "intactkv token ids / positions")
            if mint("kvq.intactkv.P") != P:
                fail(path, "kvq.intactkv.P")
            prefix |= {"intactkv.token_ids", "intactkv.positions"}
            for i in range(L):
                for w in ("k", "k_pre_rope", "v"):
                    t = get(f"layers.{i}.intactkv.{w}")
                    if t.dtype != np.float32 or t.shape != (P, C) or not np.all(np.isfinite(t)):
                        fail(path, f"layers.{i}.intactkv.{w}")
                    prefix.add(f"layers.{i}.intactkv.{w}")
            if "intactkv.loss_curve" in names:
                prefix.add("intactkv.loss_curve")
        extra = names - expected - prefix
        missing = expected - names
        if extra or missing:
            fail(path, f"tensors not as ARTIFACT.md says for method {method}: extra {sorted(extra)[:4]}, missing {sorted(missing)[:4]}")
        print(f"{path}: {method} K{kb}/V{vb}, {L} layers x {H} KV heads x {D}, {len(names)} tensors"
              f"{', IntactKV prefix' if prefix else ''} - OK")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    ok = True
    for p in sys.argv[1:]:
        try:
            check(p)
        except AssertionError as e:
            print(f"FAIL {e}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
