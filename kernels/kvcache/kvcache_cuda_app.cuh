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
__global__ void put_exact_kernel(uint16_t *k16, uint16_t *v16, const float *k, const float *v, const double *inv_freq,
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

// pass 1: per token, the value range (bitonic sort in shared memory) and outlier counts per head
__global__ void append_count(const float *k, const float *v, const float *klo, const float *khi, int H, int D, int kps,
                             int outl, int P2, float *range, int *cnt)
{
    KVQ_DYN_SMEM(float4, sm4);
    float *a = (float *)sm4;
    KVQ_STATIC_SMEM(int, ck, 1024, 4);
    const int t = blockIdx.x, C = H * D, tid = threadIdx.x;
    const float *kt = k + (size_t)t * C, *vt = v + (size_t)t * C;
    for (int i = tid; i < P2; i += blockDim.x) a[i] = i < C ? vt[i] : INFINITY;
    for (int i = tid; i < 2 * H && i < 1024; i += blockDim.x) ck[i] = 0;
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

// pass 2: codes and sparse entries; one block per token
template <int BK, int BV>
__global__ void append_write(const float *k, const float *v, const float *klo, const float *khi, const float *klev,
                             const float *vlev, const uint8_t *kz, const uint8_t *vz, const float *range, int H, int D,
                             int kps, int outl, int q0, int capq, int kw, int vw, uint32_t *kcodes, uint32_t *vcodes,
                             const uint32_t *krow, const uint32_t *vrow, uint32_t *kent, uint32_t *vent, float *vscale,
                             size_t ent_cap)
{
    typedef U<BK> UK;
    typedef U<BV> UV;
    const int t = blockIdx.x, q = q0 + t, C = H * D, tid = threadIdx.x;
    const float *kt = k + (size_t)t * C, *vt = v + (size_t)t * C;
    const float lo = range[2 * t], hi = range[2 * t + 1];
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
            uint32_t e = isv ? vrow[(size_t)hh * (capq + 1) + q] : krow[(size_t)hh * (capq + 1) + q];
            uint32_t *ent = (isv ? vent : kent) + (size_t)hh * ent_cap;
            for (int d = 0; d < D; d++) {
                const int ch = hh * D + d;
                if (!isv && (kt[ch] > khi[ch] || kt[ch] < klo[ch])) ent[e++] = (uint32_t)d << 16 | f2h_sat(kt[ch]);
                if (isv && kps && (vt[ch] < lo || vt[ch] > hi)) ent[e++] = (uint32_t)d << 16 | f2h_sat(vt[ch]);
            }
        }
    }
}

#endif
