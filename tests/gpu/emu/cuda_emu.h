// cuda_emu.h — just enough of CUDA to run kernels/kvcache/kvcache_cuda_dec.cuh and kvcache_cuda_kivi.cuh on the host: one std::thread per
// CUDA thread, blocks one after another, __syncthreads / warp shuffles with std::barrier, shared memory
// in one arena (so 32-bit shared addresses and their alignment behave as on the device). For checking
// the kernels' index arithmetic against the CPU reference on a machine without a GPU; not a simulator
// of timing or of the memory model.
#pragma once
#include <atomic>
#include <barrier>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

extern "C" {
#include "half.h"
}

#define KVQ_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

// CUDA's alignment (8 / 16 bytes), so UBSan flags a misaligned vector access as the device would fault on it
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(8) uint2 { uint32_t x, y; };
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
struct dim3e { unsigned x = 0, y = 0, z = 0; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }

inline thread_local dim3e threadIdx;
inline dim3e blockIdx, blockDim, gridDim;

struct EmuState {
    std::barrier<> *block_bar = nullptr;
    std::vector<std::barrier<> *> warp_bar;
    std::vector<float> shfl; // [warps][32]
    std::vector<uint32_t> mma; // [warps][32][6]: a0..a3, b0, b1 of every lane
    std::mutex atom;
    alignas(4096) char arena[2048 * 1024];
    size_t static_top = 0;              // static shared arrays: [0, 1.5 MB) (each kernel instance keeps its own)
    static constexpr size_t DYN = 1536 * 1024; // dynamic shared memory: [1.5 MB, 2 MB)
};
inline EmuState emu;

inline void *emu_static_alloc(size_t bytes, size_t al)
{
    emu.static_top = (emu.static_top + al - 1) / al * al;
    void *p = emu.arena + emu.static_top;
    emu.static_top += bytes;
    if (emu.static_top > EmuState::DYN) abort();
    return p;
}
#define KVQ_DYN_SMEM(T, name) T *name = (T *)(emu.arena + EmuState::DYN)
#define KVQ_STATIC_SMEM(T, name, n, al) static T *name = (T *)emu_static_alloc(sizeof(T) * (n), al)
inline uint32_t kvq_saddr(const void *p) { return (uint32_t)((const char *)p - emu.arena); }
inline void kvq_prefetch_l2(const void *, size_t) {} // an L2 hint: nothing to do on the host
inline float kvq_lds(uint32_t a) { float v; memcpy(&v, emu.arena + a, 4); return v; }
inline float2 kvq_lds2(uint32_t a)
{
    if (a & 7) abort(); // misaligned v2 load
    float2 v; memcpy(&v, emu.arena + a, 8); return v;
}
inline float h2f(uint32_t bits) { return kvq_f16_to_f32((uint16_t)(bits & 0xffff)); }

inline void __syncthreads() { emu.block_bar->arrive_and_wait(); }
inline void __syncwarp() { emu.warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    emu.shfl[w * 32 + l] = v;
    emu.warp_bar[w]->arrive_and_wait();
    float r = emu.shfl[w * 32 + (l ^ off)];
    emu.warp_bar[w]->arrive_and_wait();
    return r;
}
inline uint32_t kvq_h2pack(float lo, float hi) { return (uint32_t)kvq_f32_to_f16(lo) | (uint32_t)kvq_f32_to_f16(hi) << 16; }
// one warp-wide mma: every lane publishes its fragments (a0..a3, b0, b1), then lane 4g + t computes its accumulators
// c = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]} as dot(c_i, row, col, m) over the warp's fragments m ([32][6])
template <class T, class Dot> inline void emu_mma(T (&c)[4], const uint32_t (&in)[6], Dot dot)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    uint32_t *m = &emu.mma[(size_t)w * 32 * 6];
    for (int i = 0; i < 6; i++) m[l * 6 + i] = in[i];
    emu.warp_bar[w]->arrive_and_wait();
    const int g = l >> 2, t = l & 3;
    T d[4];
    for (int i = 0; i < 4; i++) d[i] = dot(c[i], g + 8 * (i >> 1), 2 * t + (i & 1), m);
    emu.warp_bar[w]->arrive_and_wait();
    for (int i = 0; i < 4; i++) c[i] = d[i];
}
// mma.m16n8k16 f32 += f16·f16 (fragment layout as kernels/kvcache/kvcache_cuda_dec.cuh documents): products exact in
// fp32, sums in fp32 in k order (the device's order and internal precision may differ in the last bits)
inline void kvq_mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
    emu_mma(c, {a0, a1, a2, a3, b0, b1}, [](float s, int row, int col, const uint32_t *m) {
        auto half = [](uint32_t r, int k) { return kvq_f16_to_f32((uint16_t)(k & 1 ? r >> 16 : r & 0xffff)); };
        for (int k = 0; k < 16; k++)
            s += half(m[((row & 7) * 4 + (k & 7) / 2) * 6 + (row >> 3) + 2 * (k >> 3)], k) * half(m[(col * 4 + (k & 7) / 2) * 6 + 4 + (k >> 3)], k);
        return s;
    });
}
// mma.m16n8k32 s32 += u8·s8 (BS) or u8·u8 on the integer tensor cores (exact; fragment layout as kernels/kvcache/kvcache_cuda_kivi.cuh
// documents): A register i of lane 4g + t holds row g + 8 (i & 1), columns 16 (i >> 1) + 4t + byte; B register i holds
// rows 16 i + 4t + byte of column g; accumulators as kvq_mma16816
template <bool BS> inline void kvq_imma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
    emu_mma(c, {a0, a1, a2, a3, b0, b1}, [](int c0, int row, int col, const uint32_t *m) {
        int64_t s = c0;
        for (int k = 0; k < 32; k++) {
            const int64_t a = (uint8_t)(m[((row & 7) * 4 + (k & 15) / 4) * 6 + (row >> 3) + 2 * (k >> 4)] >> (8 * (k & 3)));
            const uint32_t x = m[(col * 4 + (k & 15) / 4) * 6 + 4 + (k >> 4)] >> (8 * (k & 3));
            s += a * (BS ? (int64_t)(int8_t)(uint8_t)x : (int64_t)(uint8_t)x);
        }
        if (s > INT32_MAX || s < INT32_MIN) abort(); // the kernel's bounds keep the sums within s32
        return (int)s;
    });
}
inline void kvq_imma_us(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) { kvq_imma<true>(c, a0, a1, a2, a3, b0, b1); }
inline void kvq_imma_uu(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) { kvq_imma<false>(c, a0, a1, a2, a3, b0, b1); }
// mma.m16n8k16 s32 += u8·u8 (exact): A register i of lane 4g + t holds row g + 8 i, columns 4t + byte; B register 0 rows
// 4t + byte of column g
inline void kvq_imma16_uu(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0)
{
    emu_mma(c, {a0, a1, 0u, 0u, b0, 0u}, [](int c0, int row, int col, const uint32_t *m) {
        int64_t s = c0;
        for (int k = 0; k < 16; k++) {
            const int64_t a = (uint8_t)(m[((row & 7) * 4 + k / 4) * 6 + (row >> 3)] >> (8 * (k & 3)));
            s += a * (int64_t)(uint8_t)(m[(col * 4 + k / 4) * 6 + 4] >> (8 * (k & 3)));
        }
        if (s > INT32_MAX || s < INT32_MIN) abort();
        return (int)s;
    });
}
inline int __shfl_xor_sync(unsigned, int v, int off)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    memcpy(&emu.shfl[w * 32 + l], &v, 4); // the bits, whatever float they would be
    emu.warp_bar[w]->arrive_and_wait();
    int r;
    memcpy(&r, &emu.shfl[w * 32 + (l ^ off)], 4);
    emu.warp_bar[w]->arrive_and_wait();
    return r;
}
// cvt.rni / cvt.rzi.s32.f32: round to nearest even / toward zero, saturating, NaN -> 0
inline int emu_f2i(float x, bool rn)
{
    if (x != x) return 0;
    const double r = rn ? std::nearbyint((double)x) : std::trunc((double)x);
    return r >= 2147483647.0 ? INT32_MAX : r <= -2147483648.0 ? INT32_MIN : (int)r;
}
inline int __float2int_rn(float x) { return emu_f2i(x, true); }
inline int __float2int_rz(float x) { return emu_f2i(x, false); }
// cvt.rni.u32.f32: round to nearest even, saturating to [0, 2^32 - 1], NaN -> 0
inline unsigned __float2uint_rn(float x)
{
    if (x != x) return 0u;
    const double r = std::nearbyint((double)x);
    return r >= 4294967295.0 ? 0xffffffffu : r <= 0.0 ? 0u : (unsigned)r;
}
inline uint32_t kvq_andor(uint32_t x, uint32_t m, uint32_t c) { return (x & m) | c; }
inline float __frcp_rn(float x) { return 1.f / x; }
// ex2.approx.ftz.f32: 2^x (the hardware's ~2^-22 relative error not modelled), results below 2^-126 flushed to 0
inline float kvq_ex2(float x)
{
    const float y = std::exp2(x);
    return y < 0x1p-126f ? 0.f : y;
}
// fma.rn.f16x2: per half, a·b + c rounded once to fp16 (exact in double for fp16 inputs)
inline uint32_t kvq_hfma2(uint32_t a, uint32_t b, uint32_t c)
{
    uint32_t r = 0;
    for (int i = 0; i < 2; i++) {
        auto h = [i](uint32_t x) { return (double)kvq_f16_to_f32((uint16_t)(x >> (16 * i))); };
        r |= (uint32_t)kvq_f32_to_f16((float)(h(a) * h(b) + h(c))) << (16 * i);
    }
    return r;
}
// a double through the shuffle (tests/gpu/emu/emu_sched.cc): the two halves of its bits
inline double __shfl_xor_sync(unsigned m, double v, int off)
{
    int32_t h[2];
    memcpy(h, &v, 8);
    h[0] = __shfl_xor_sync(m, (int)h[0], off);
    h[1] = __shfl_xor_sync(m, (int)h[1], off);
    double r;
    memcpy(&r, h, 8);
    return r;
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    std::lock_guard<std::mutex> g(emu.atom);
    unsigned long long o = *p;
    *p = o + v;
    return o;
}
// IEEE round-to-nearest fp32 operations, never contracted (the host build has no FMA contraction in ISO C++ either)
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline int atomicMax(int *p, int v) { std::lock_guard<std::mutex> g(emu.atom); int o = *p; if (v > o) *p = v; return o; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float atomicAdd(float *p, float v) { std::lock_guard<std::mutex> g(emu.atom); float o = *p; *p = o + v; return o; }
inline int atomicAdd(int *p, int v) { std::lock_guard<std::mutex> g(emu.atom); int o = *p; *p = o + v; return o; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T __ldcg(const T *p) { return *p; }
template <class T> inline T __ldcs(const T *p)
{
    if ((sizeof(T) == 16 || sizeof(T) == 8) && ((uintptr_t)p & (sizeof(T) - 1))) abort(); // misaligned 8- / 16-byte load
    return *p;
}
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s)
{
    uint8_t b[8];
    for (int i = 0; i < 4; i++) { b[i] = (uint8_t)(x >> (8 * i)); b[4 + i] = (uint8_t)(y >> (8 * i)); }
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)b[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}

// run fn() as grid x block threads (blocks in sequence); dynamic shared memory is poisoned with NaN
inline void emu_launch(dim3e grid, unsigned nthreads, size_t dyn_bytes, const std::function<void()> &fn)
{
    if (dyn_bytes > sizeof emu.arena - EmuState::DYN) abort();
    gridDim = grid;
    blockDim = {nthreads, 1, 1};
    const unsigned nw = (nthreads + 31) / 32;
    std::barrier<> bb(nthreads);
    std::vector<std::barrier<> *> wb;
    for (unsigned w = 0; w < nw; w++) wb.push_back(new std::barrier<>(std::min(32u, nthreads - 32 * w)));
    emu.block_bar = &bb;
    emu.warp_bar = wb;
    emu.shfl.assign(nw * 32, 0.f);
    emu.mma.assign((size_t)nw * 32 * 6, 0u);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                memset(emu.arena + EmuState::DYN, 0xff, dyn_bytes);
                std::vector<std::thread> th;
                for (unsigned t = 0; t < nthreads; t++)
                    th.emplace_back([t, &fn] { threadIdx = {t, 0, 0}; fn(); });
                for (auto &x2 : th) x2.join();
            }
    for (auto *b : wb) delete b;
}
