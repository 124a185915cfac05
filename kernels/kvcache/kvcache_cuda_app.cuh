// kvcache_cuda_app.cuh — the NUQ append kernels of kvcache_cuda.cu (exact-region rows, per-token value range and
// outlier counts, codes and sparse entries) and the fp16 / RoPE helpers the KIVI append shares. Included by
// kvcache_cuda.cu after kvcache_cuda_dec.cuh (U<B>); tests/gpu/emu/emu_kvcache_dec.cc compiles the same source on the
// host (KVQ_EMU) and runs it through kvq_kvcache_cuda_append's host steps to check the bytes against the CPU cache's
// kvq_kvcache_append without a GPU. See formats/KVCACHE.md.
#ifndef KVQ_KVCACHE_CUDA_APP_CUH
#define KVQ_KVCACHE_CUDA_APP_CUH

// ---- append ---------------------------------------------------------------------------------
__device__ __forceinline__ uint16_t f2h_sat(float x)
{
    x = fminf(fmaxf(x, -65504.f), 65504.f);
#ifdef KVQ_EMU
    return kvq_f32_to_f16(x); // round to nearest even, as __float2half_rn
#else
    return __half_as_ushort(__float2half_rn(x));
#endif
}

// channel d of a head's key row kh at position pos after RoPE, computed in double and rounded once to float as
// kvq_rope_rotate (pairs past rope_pairs: unrotated)
__device__ __forceinline__ float rope_elem(const float *kh, int d, int pos, const double *inv_freq, int rope_pairs)
{
    if ((d >> 1) >= rope_pairs) return kh[d];
    const int pi = d >> 1;
    const double a = (double)pos * inv_freq[pi], cs = cos(a), sn = sin(a), u = kh[2 * pi], w = kh[2 * pi + 1];
    return (d & 1) ? (float)(u * sn + w * cs) : (float)(u * cs - w * sn);
}

// exact-region positions: RoPE in double (as kvq_rope_rotate), then fp16
KVQ_ONE_UNIT __global__ void put_exact_kernel(uint16_t *k16, uint16_t *v16, const float *k, const float *v, const double *inv_freq,
                                 int rope_pairs, int H, int D, int n_exact, int pos0, int n)
{
    const int C = H * D;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * C; i += gridDim.x * blockDim.x) {
        const int t = i / C, ch = i % C, h = ch / D, d = ch % D, pos = pos0 + t;
        const float y = rope_elem(k + (size_t)t * C + h * D, d, pos, inv_freq, rope_pairs);
        const size_t o = ((size_t)h * n_exact + pos) * D + d;
        k16[o] = f2h_sat(y);
        v16[o] = f2h_sat(v[i]);
    }
}

__device__ __forceinline__ int nuq_code_dev(float x, double zp, double r, const float *lv, int nl)
{
    if (r == 0) return 0;
    double xn = ((double)x - zp) / r;
    if (!(xn >= (double)lv[0])) xn = lv[0];
    if (xn > (double)lv[nl - 1]) xn = lv[nl - 1];
    const float xf = (float)xn;
    int best = 0;
    float bd = fabsf(xf - lv[0]);
    for (int j = 1; j < nl; j++) {
        const float dj = fabsf(xf - lv[j]);
        if (dj < bd) { bd = dj; best = j; }
    }
    return best;
}

// one token's C values sorted ascending into a[0..P2) (shared memory; padding +inf) by a bitonic sort; then the value
// range is [a[kps], a[C - 1 - kps]] (outliers: the kps smallest and the kps largest values, kvq_quant_nuq_values)
__device__ __forceinline__ void value_sort(const float *vt, int C, int P2, float *a)
{
    const int tid = threadIdx.x;
    for (int i = tid; i < P2; i += blockDim.x) a[i] = i < C ? vt[i] : INFINITY;
    __syncthreads();
    for (int size = 2; size <= P2; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < P2; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    const float x = a[i], y = a[j];
                    if ((x > y) == up) { a[i] = y; a[j] = x; }
                }
            }
            __syncthreads();
        }
}

// pass 1: per token, the value range (bitonic sort in shared memory) and outlier counts per head
KVQ_ONE_UNIT __global__ void append_count(const float *k, const float *v, const float *klo, const float *khi, int H, int D, int kps,
                             int outl, int P2, float *range, int *cnt)
{
    KVQ_DYN_SMEM(float4, sm4);
    float *a = (float *)sm4;
    KVQ_STATIC_SMEM(int, ck, 1024, 4);
    const int t = blockIdx.x, C = H * D, tid = threadIdx.x;
    const float *kt = k + (size_t)t * C, *vt = v + (size_t)t * C;
    for (int i = tid; i < 2 * H && i < 1024; i += blockDim.x) ck[i] = 0;
    value_sort(vt, C, P2, a);
    const float lo = a[kps], hi = a[C - 1 - kps];
    if (tid == 0) { range[2 * t] = lo; range[2 * t + 1] = hi; }
    if (outl) {
        for (int i = tid; i < C; i += blockDim.x) {
            const int h = i / D;
            if (kt[i] > khi[i] || kt[i] < klo[i]) atomicAdd(&ck[h], 1);
            if (kps && (vt[i] < lo || vt[i] > hi)) atomicAdd(&ck[H + h], 1);
        }
    }
    __syncthreads();
    for (int i = tid; i < 2 * H; i += blockDim.x) cnt[(size_t)t * 2 * H + i] = ck[i];
}

// one token at quantized position q of one sequence (the block's threads): value scale (zp, r) from the value range
// [lo, hi], key and value codes, and the sparse entries of each (head, store) from its row pointer row[q] on; with
// set_next the entries' end goes to row[q + 1] (the batched step's device scan; kvq_kvcache_cuda_append sets the rows
// from the host instead). Pointers: the sequence's blocks of the arrays (formats/KVCACHE.md).
template <int BK, int BV>
__device__ __forceinline__ void append_token(const float *kt, const float *vt, const float *klo, const float *khi, const float *klev,
                                             const float *vlev, const uint8_t *kz, const uint8_t *vz, float lo, float hi, int H, int D,
                                             int kps, int outl, int q, int capq, int kw, int vw, uint32_t *kcodes, uint32_t *vcodes,
                                             uint32_t *krow, uint32_t *vrow, uint32_t *kent, uint32_t *vent, float *vscale, size_t ent_cap,
                                             bool set_next)
{
    typedef U<BK> UK;
    typedef U<BV> UV;
    const int tid = threadIdx.x;
    const double vzp = ((double)hi + (double)lo) * 0.5, vr = ((double)hi - (double)lo) * 0.5;
    if (tid == 0) { vscale[2 * q] = (float)vzp; vscale[2 * q + 1] = (float)vr; }
    const int nuk = (D + UK::C - 1) / UK::C, nuv = (D + UV::C - 1) / UV::C;
    for (int i = tid; i < H * nuk; i += blockDim.x) {
        const int h = i / nuk, u = i % nuk;
        uint32_t w[3] = {0, 0, 0};
        for (int j = 0; j < UK::C; j++) {
            const int d = u * UK::C + j;
            if (d >= D) break;
            const int ch = h * D + d;
            const float x = kt[ch];
            int code;
            if (outl && (x > khi[ch] || x < klo[ch])) code = kz[h];
            else {
                const double zp = ((double)khi[ch] + (double)klo[ch]) * 0.5, r = ((double)khi[ch] - (double)klo[ch]) * 0.5;
                code = nuq_code_dev(x, zp, r, klev + h * UK::NL, UK::NL);
            }
            const int bit = j * BK;
            w[bit >> 5] |= (uint32_t)code << (bit & 31);
            if ((bit & 31) + BK > 32) w[(bit >> 5) + 1] |= (uint32_t)code >> (32 - (bit & 31));
        }
        for (int x = 0; x < UK::W; x++) kcodes[((size_t)h * kw + u * UK::W + x) * capq + q] = w[x];
    }
    for (int i = tid; i < H * nuv; i += blockDim.x) {
        const int h = i / nuv, u = i % nuv;
        uint32_t w[3] = {0, 0, 0};
        for (int j = 0; j < UV::C; j++) {
            const int d = u * UV::C + j;
            if (d >= D) break;
            const float x = vt[h * D + d];
            const int code = (kps && (x < lo || x > hi)) ? vz[h] : nuq_code_dev(x, vzp, vr, vlev + h * UV::NL, UV::NL);
            const int bit = j * BV;
            w[bit >> 5] |= (uint32_t)code << (bit & 31);
            if ((bit & 31) + BV > 32) w[(bit >> 5) + 1] |= (uint32_t)code >> (32 - (bit & 31));
        }
        for (int x = 0; x < UV::W; x++) vcodes[((size_t)h * capq + q) * vw + u * UV::W + x] = w[x];
    }
    if (outl) {
        for (int h = tid; h < 2 * H; h += blockDim.x) {
            const bool isv = h >= H;
            const int hh = isv ? h - H : h;
            uint32_t *row = (isv ? vrow : krow) + (size_t)hh * (capq + 1);
            uint32_t e = row[q];
            uint32_t *ent = (isv ? vent : kent) + (size_t)hh * ent_cap;
            for (int d = 0; d < D; d++) {
                const int ch = hh * D + d;
                if (!isv && (kt[ch] > khi[ch] || kt[ch] < klo[ch])) ent[e++] = (uint32_t)d << 16 | f2h_sat(kt[ch]);
                if (isv && kps && (vt[ch] < lo || vt[ch] > hi)) ent[e++] = (uint32_t)d << 16 | f2h_sat(vt[ch]);
            }
            if (set_next) row[q + 1] = e;
        }
    }
}

// pass 2: codes and sparse entries; one block per token (row pointers set by the host, only read here)
template <int BK, int BV>
__global__ void append_write(const float *k, const float *v, const float *klo, const float *khi, const float *klev,
                             const float *vlev, const uint8_t *kz, const uint8_t *vz, const float *range, int H, int D,
                             int kps, int outl, int q0, int capq, int kw, int vw, uint32_t *kcodes, uint32_t *vcodes,
                             const uint32_t *krow, const uint32_t *vrow, uint32_t *kent, uint32_t *vent, float *vscale,
                             size_t ent_cap)
{
    const int t = blockIdx.x, C = H * D;
    append_token<BK, BV>(k + (size_t)t * C, v + (size_t)t * C, klo, khi, klev, vlev, kz, vz, range[2 * t], range[2 * t + 1], H, D, kps, outl,
                         q0 + t, capq, kw, vw, kcodes, vcodes, (uint32_t *)krow, (uint32_t *)vrow, kent, vent, vscale, ent_cap, false);
}

// ---- the batched step (kvq_kvcache_cuda_append_step) -------------------------------------------------------
// The arrays of the whole cache and its device lengths len[4][B] (len, kq, vq, kivi_fast's qf: kvcache_cuda.cu);
// one block per sequence s (any blockDim.x, P2 floats of dynamic shared memory): the new token k, v[s] ([B][C],
// pre-RoPE keys) at the sequence's own position len[s]: an exact-region row (RoPE in double, fp16, as
// put_exact_kernel) or a quantized one (value_sort's range, append_token with the row pointers advanced here: the
// entries of (s, head) start at row[q], their end goes to row[q + 1]); then len[s] + 1 and kq = vq = the quantized
// positions. The outlier store must hold row[q] + D more entries per (sequence, head) (the host's bound).
struct StepArgs {
    const float *k, *v, *klo, *khi, *klev, *vlev;
    const uint8_t *kz, *vz;
    const double *inv_freq;
    int rope_pairs, B, H, D, kps, outl, P2, n_exact, capq, kw, vw;
    uint16_t *k16, *v16;
    uint32_t *kcodes, *vcodes, *krow, *vrow, *kent, *vent;
    float *vscale;
    size_t ent_cap;
    int *len;
};
template <int BK, int BV>
__global__ void append_step(StepArgs p)
{
    KVQ_DYN_SMEM(float4, sm4);
    float *a = (float *)sm4;
    const int s = blockIdx.x, H = p.H, D = p.D, C = H * D, tid = threadIdx.x, B = p.B;
    const int pos = p.len[s];
    const float *kt = p.k + (size_t)s * C, *vt = p.v + (size_t)s * C;
    if (pos < p.n_exact) { // uniform across the block
        uint16_t *k16 = p.k16 + (size_t)s * H * p.n_exact * D, *v16 = p.v16 + (size_t)s * H * p.n_exact * D;
        for (int i = tid; i < C; i += blockDim.x) {
            const int h = i / D, d = i % D;
            const size_t o = ((size_t)h * p.n_exact + pos) * D + d;
            k16[o] = f2h_sat(rope_elem(kt + h * D, d, pos, p.inv_freq, p.rope_pairs));
            v16[o] = f2h_sat(vt[i]);
        }
    } else {
        value_sort(vt, C, p.P2, a);
        const size_t R = (size_t)p.capq + 1, sh = (size_t)s * H;
        append_token<BK, BV>(kt, vt, p.klo, p.khi, p.klev, p.vlev, p.kz, p.vz, a[p.kps], a[C - 1 - p.kps], H, D, p.kps, p.outl,
                             pos - p.n_exact, p.capq, p.kw, p.vw, p.kcodes + sh * p.kw * p.capq, p.vcodes + sh * p.capq * p.vw,
                             p.krow + sh * R, p.vrow + sh * R, p.kent + sh * p.ent_cap, p.vent + sh * p.ent_cap,
                             p.vscale + (size_t)s * p.capq * 2, p.ent_cap, true);
    }
    __syncthreads(); // every thread has read len[s]
    if (tid == 0) {
        const int n = pos + 1, q = n > p.n_exact ? n - p.n_exact : 0;
        p.len[s] = n;
        p.len[B + s] = q;
        p.len[2 * B + s] = q;
        p.len[3 * B + s] = q / 16 * 16;
    }
}

// the entries each (sequence, head) holds: out[0][B·H] keys, out[1][B·H] values, read from the row pointer at the
// sequence's quantized length (len as append_step's)
KVQ_ONE_UNIT __global__ void gather_used(const uint32_t *krow, const uint32_t *vrow, const int *len, int B, int H, int capq, int n_exact, uint32_t *out)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < B * H; i += gridDim.x * blockDim.x) {
        const int s = i / H, q = len[s] > n_exact ? len[s] - n_exact : 0;
        out[i] = krow[(size_t)i * (capq + 1) + q];
        out[B * H + i] = vrow[(size_t)i * (capq + 1) + q];
    }
}

// The batched step's outlier-store rule (host code; kvcache_cuda.h kvq_kvcache_cuda_append_step). A new row adds at
// most D entries to each (sequence, head) of each store (keys: one per channel past its thresholds; values: at most
// one per channel). ku, vu [B][H]: the entries at the last synchronisation; since[s]: rows quantized into sequence s
// after it; len[s]: its positions now. True when, for some sequence whose new token is quantized (len >= n_exact),
// the bound max(ku, vu) + D·(since + 1) exceeds cap: then the step synchronises once to read the exact use.
#define KVQ_STEP_SLACK 16 /* steps of headroom a synchronisation leaves (else the store grows) */
static inline bool step_bound_exceeds(const size_t *ku, const size_t *vu, const size_t *since, const size_t *len, size_t B, size_t H,
                                      size_t D, size_t n_exact, size_t cap)
{
    for (size_t s = 0; s < B; s++) {
        if (len[s] < n_exact) continue;
        size_t u = 0;
        for (size_t h = 0; h < H; h++) {
            if (ku[s * H + h] > u) u = ku[s * H + h];
            if (vu[s * H + h] > u) u = vu[s * H + h];
        }
        if (u + D * (since[s] + 1) > cap) return true;
    }
    return false;
}
// After that synchronisation (ku, vu exact): the capacity to hold, or 0 when this step's worst case
// need = max u + D exceeds lim (outlier_max; then the step's exact counts decide). No growth (cap returned) while
// cap >= need and cap leaves KVQ_STEP_SLACK steps of headroom (max u + D·KVQ_STEP_SLACK) or covers every remaining
// position (max over s of u + D·(max_tokens − max(len, n_exact))); otherwise max(2·cap, max u + D·KVQ_STEP_SLACK)
// clipped to that cover and to lim, and never below need: geometric growth, so synchronisations are amortised.
static inline size_t step_capacity(const size_t *ku, const size_t *vu, const size_t *len, size_t B, size_t H, size_t D, size_t n_exact,
                                   size_t max_tokens, size_t cap, size_t lim)
{
    size_t need = 0, want = 0, cover = 0;
    for (size_t s = 0; s < B; s++) {
        size_t u = 0;
        for (size_t h = 0; h < H; h++) {
            if (ku[s * H + h] > u) u = ku[s * H + h];
            if (vu[s * H + h] > u) u = vu[s * H + h];
        }
        const size_t p = len[s] > n_exact ? len[s] : n_exact, rem = max_tokens > p ? max_tokens - p : 0;
        if (len[s] >= n_exact && u + D > need) need = u + D;
        if (u + D * KVQ_STEP_SLACK > want) want = u + D * KVQ_STEP_SLACK;
        if (u + D * rem > cover) cover = u + D * rem;
    }
    if (need > lim) return 0;
    if (cap >= need && (cap >= want || cap >= cover)) return cap;
    size_t t = cap > lim / 2 ? lim : 2 * cap;
    if (t < want) t = want;
    if (t > cover) t = cover;
    if (t > lim) t = lim;
    if (t < need) t = need;
    return t;
}

#endif
