// cuda_emu.h — just enough of CUDA to run kernels/kvcache_cuda_dec.cuh on the host: one std::thread per
// CUDA thread, blocks one after another, __syncthreads / warp shuffles with std::barrier, shared memory
// in one arena (so 32-bit shared addresses and their alignment behave as on the device). For checking
// the kernels' index arithmetic against the CPU reference on a machine without a GPU; not a simulator
// of timing or of the memory model.
#pragma once
#include <barrier>
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

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { uint32_t x, y, z, w; };
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
    std::mutex atom;
    alignas(4096) char arena[1024 * 1024];
    size_t static_top = 0;             // static shared arrays: [0, 512 KB)
    static constexpr size_t DYN = 512 * 1024; // dynamic shared memory: [512 KB, 1 MB)
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
inline float atomicAdd(float *p, float v) { std::lock_guard<std::mutex> g(emu.atom); float o = *p; *p = o + v; return o; }
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T __ldcs(const T *p)
{
    if (sizeof(T) == 16 && ((uintptr_t)p & 15)) abort(); // misaligned 16-byte load
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
