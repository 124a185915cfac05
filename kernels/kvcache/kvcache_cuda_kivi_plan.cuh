// kvcache_cuda_kivi_plan.cuh — the KIVI decode's launch schedule (host code): kivi_fast's chunk and splits (plan,
// fast_plan), kivi_generic's and kivi_tail's (generic_plan, tail_plan), all of it in kivi_schedule. Part of
// kvcache_cuda_kivi.cuh, which includes it after kvcache_cuda_kivi_fast.cuh (fast_smem, fast_blocks).
#ifndef KVQ_KVCACHE_CUDA_KIVI_PLAN_CUH
#define KVQ_KVCACHE_CUDA_KIVI_PLAN_CUH

namespace kv {
// launch plan for kivi_fast: chunk (a multiple of 128 positions) by v4's wave model (v4::plan) within smem_max bytes
// of dynamic shared memory; nq = the longest range [0, qf), per = blocks per split; chunks of at most 2048 positions
// unless max_splits is set
inline void plan(size_t nq, size_t per, size_t n_sm, size_t max_splits, int gq, int D, int G, int bk, int bv, size_t smem_max,
                 size_t *chunk_out, size_t *splits_out, size_t *slots_out = nullptr)
{
    const size_t U = 128, nu = nq ? (nq + U - 1) / U : 1, smax = max_splits && max_splits < nu ? max_splits : nu;
    size_t best = 0, bc = 0, bb = 1, bw = 0, lc = 0, lb = 0, lw = 0; // best: chunk, cost, blocks / SM, blocks; the longest chunk's
    for (size_t sp = max_splits ? 1 : (nu + 15) / 16; sp <= smax; sp++) { // without max_splits: chunks of <= 16 tiles
        const size_t cu = (nu + sp - 1) / sp, chunk = cu * U, se = (nu + cu - 1) / cu;
        if (chunk > 65536 - U || (chunk > 2048 && !max_splits)) continue;
        const size_t sm = (size_t)fast_smem(gq, D, G, bk, bv, (int)chunk).total * 4;
        if (sm > smem_max) continue;
        // resident blocks per SM: kivi_fast's launch bounds at G >= 32 (fast_blocks: 3 of 256 threads, 6 or 7 of 128 at
        // G = 128) when a split has at least 8 blocks, else 512 threads' worth (2, or 4 of 128): with few blocks per
        // split, planning for 3 picked chunks so short that their set-up outweighed the better balance
        size_t b = 228 * 1024 / (sm + 1024);
        const size_t bmax = G >= 32 && per >= 8 ? (size_t)fast_blocks(G, bk, bv) : (size_t)(512 / fast_threads(G));
        if (b > bmax) b = bmax;
        const size_t waves = (per * se + n_sm * b - 1) / (n_sm * b), cost = waves * (cu + 1);
        if (!lc) { lc = chunk; lb = b; lw = per * se; }
        if (!best || cost < bc) { best = chunk; bc = cost; bb = b; bw = per * se; }
    }
    // the cost above counts whole waves of blocks in lockstep. With at least 4 waves they are not (blocks start as others
    // finish), and each block's fixed cost (set-up, the softmax between its passes, its partial) outweighs the last
    // wave's fill: then the longest chunk, when it also makes >= 4 waves at as many blocks per SM. One query head per
    // block only (gq = 1; where it was measured on the H200: shorter chunks, and longer ones at fewer blocks per SM, were
    // slower there; the longest chunk at fewer than 4 waves, or with three query heads per block, was slower too)
    if (!max_splits && gq == 1 && lc && lc != best && lb == bb && bw >= 4 * n_sm * bb && lw >= 4 * n_sm * bb) best = lc;
    if (!best) { // nothing within max_splits fits: the largest chunk that does
        best = nu * U;
        while (best > U && (size_t)fast_smem(gq, D, G, bk, bv, (int)best).total * 4 > smem_max) best = (best / 2 + U - 1) / U * U;
    }
    *chunk_out = best;
    *splits_out = nq ? (nq + best - 1) / best : 1;
    if (slots_out) *slots_out = n_sm * bb; // resident blocks of the GPU the plan counted on
}
// kivi_fast's splits of [0, nq): nlong splits of chunk positions, then splits - nlong of chunk2 <= chunk (multiples of
// 128; shared memory for chunk). The grid starts the splits in order, so the short ones start last
struct FastPlan {
    size_t chunk, nlong, chunk2, splits;
};
// the uniform splits of `chunk` positions with the range's last part cut into nshort splits of chunk2 positions (as far
// as the range goes)
inline FastPlan fast_split(size_t nq, size_t chunk, size_t chunk2, size_t nshort)
{
    FastPlan f = {chunk, 0, chunk, 0};
    if (!nq || !chunk2 || chunk2 >= chunk || !nshort) {
        f.nlong = f.splits = nq ? (nq + chunk - 1) / chunk : 1;
        return f;
    }
    const size_t tail = nshort * chunk2 < nq ? nshort * chunk2 : nq;
    f.nlong = (nq - tail + chunk - 1) / chunk;
    f.chunk2 = chunk2;
    const size_t rest = nq > f.nlong * chunk ? nq - f.nlong * chunk : 0;
    f.splits = f.nlong + (rest + chunk2 - 1) / chunk2;
    return f;
}
// kivi_fast's plan: kv::plan's chunk, and, unless max_splits is set (then uniform splits, as many as plan chose), with
// more than one wave of blocks (per·splits > slots, plan's resident blocks) the range's last chunk cut in two of half
// the length (rounded up to 128), started last so that the last wave's blocks finish closer together (with one wave
// the extra block per row makes a second wave: not there)
inline FastPlan fast_plan(size_t nq, size_t per, size_t chunk, size_t splits, size_t slots, size_t max_splits)
{
    if (max_splits || per * splits <= slots || chunk < 256) return fast_split(nq, chunk, 0, 0);
    return fast_split(nq, chunk, (chunk / 128 + 1) / 2 * 128, 2);
}

// launch plan for kivi_generic over ranges of at most nq positions, `per` blocks per split: about 8 blocks per SM,
// chunks of at most 8192 positions (multiples of 32). With kivi_fast the range is the residual
// tail (R..2R positions), whose time is mostly the latency of a block, so more, shorter blocks: Llama heads B = 32
// take it in 2 splits of 128 positions, B = 1 in splits of 32
// [0, nq) in about sp >= 1 splits: chunks of a multiple of 32 positions, at most 8192 (more splits where that caps them)
inline void generic_cut(size_t nq, size_t sp, size_t *chunk_out, size_t *splits_out)
{
    size_t chunk = nq ? (nq + sp - 1) / sp : 32;
    chunk = (chunk + 31) / 32 * 32;
    if (chunk > 8192) chunk = 8192;
    *chunk_out = chunk;
    *splits_out = nq ? (nq + chunk - 1) / chunk : 1;
}
inline void generic_plan(size_t nq, size_t per, size_t n_sm, size_t max_splits, size_t *chunk_out, size_t *splits_out)
{
    size_t sp = (8 * n_sm + per - 1) / per;
    if (max_splits && sp > max_splits) sp = max_splits;
    if (sp < 1) sp = 1;
    generic_cut(nq, sp, chunk_out, splits_out);
}

// kivi_tail's plan beside kivi_fast (fblocks blocks, fslots resident at a time): its blocks take SM slots that kivi_fast's
// would use, so with at least 2 waves of kivi_fast blocks (which hide the tail's latency) and head_dim >= 128 the tail
// (nq positions per row) in one split per row, else generic_plan's (left in *chunk, *splits): where kivi_fast is one
// wave, or at head_dim 64, the one split was slower on the H200
inline void tail_plan(size_t nq, size_t fblocks, size_t fslots, int D, size_t *chunk, size_t *splits)
{
    if (!nq || fblocks < 2 * fslots || D < 128) return;
    generic_cut(nq, 1, chunk, splits);
}

// the KIVI decode's whole split schedule (kivi_attend's, and the emulator's replay of it): kivi_fast's plan over
// [0, maxqf) for fast_rows = B·H·qgroups blocks per split (plan, then fast_plan; none when maxqf is 0), and the
// tail's / kivi_generic's over the rest (at most maxrest positions, rows = B·n_heads: generic_plan, then tail_plan
// beside kivi_fast); smem_max as plan's
struct KiviSchedule {
    FastPlan fast;        // kivi_fast's splits (fast.splits = 0: kivi_fast does not run)
    size_t fchunk, fslots; // plan's chunk and the resident blocks it counted on
    size_t gchunk, gsplits;
    bool vpref; // kivi_fast prefetches its value codes (KivP::vpref): at least two waves of its blocks, as tail_plan's test
};
inline KiviSchedule kivi_schedule(size_t maxqf, size_t maxrest, size_t fast_rows, size_t rows, size_t n_sm, size_t max_splits, int gq, int D,
                                  int G, int bk, int bv, size_t smem_max)
{
    KiviSchedule k = {{0, 0, 0, 0}, 0, 0, 0, 0, false};
    if (maxqf) {
        size_t fsplits;
        plan(maxqf, fast_rows, n_sm, max_splits, gq, D, G, bk, bv, smem_max, &k.fchunk, &fsplits, &k.fslots);
        k.fast = fast_plan(maxqf, fast_rows, k.fchunk, fsplits, k.fslots, max_splits);
    }
    generic_plan(maxrest, rows, n_sm, max_splits, &k.gchunk, &k.gsplits);
    if (k.fast.splits) tail_plan(maxrest, fast_rows * k.fast.splits, k.fslots, D, &k.gchunk, &k.gsplits);
    k.vpref = k.fast.splits && fast_rows * k.fast.splits >= 2 * k.fslots;
    return k;
}
} // namespace kv

#endif
