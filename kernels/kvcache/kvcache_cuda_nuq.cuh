// kvcache_cuda_nuq.cuh — nuq_kernel, the choice of the NUQ split-K decode kernel (v4::nuq_decode of
// kvcache_cuda_dec.cuh, every key and value width 2, 3, 4 and up to 4 query heads per block; version 5 or 4: v5 differs
// from v4 only for 3-bit values, so the other widths run the v4 instance under either). Included by
// kvcache_cuda.cu after kvcache_cuda_dec.cuh. See formats/KVCACHE.md "Decode attention (GPU)".
//
// The kernels of each key width are compiled in a translation unit of their own, written by the Makefile (KVC_INST:
// build/gen/kvcache_cuda_inst_nuq_<bk>.cu instantiates nuq_kernel<bk> after the extern template declarations at the
// end of this file), so that make -jN compiles them in parallel; no other unit instantiates them.
#ifndef KVQ_KVCACHE_CUDA_NUQ_CUH
#define KVQ_KVCACHE_CUDA_NUQ_CUH

typedef void (*DecFn)(DecP);

// query heads per block GQ <= 4 (v4's registers hold 8 scores per query head)
template <int BK, int BV, int GQ> DecFn nuq_pick3(int ver)
{
    if constexpr (GQ > 4) return nullptr;
    else if constexpr (BV == 3) return ver >= 5 ? v4::nuq_decode<BK, BV, GQ, 5> : v4::nuq_decode<BK, BV, GQ, 4>;
    else return v4::nuq_decode<BK, BV, GQ, 4>;
}
template <int BK, int BV> DecFn nuq_pick2(int gq, int ver)
{
    switch (gq) {
    case 1: return nuq_pick3<BK, BV, 1>(ver);
    case 2: return nuq_pick3<BK, BV, 2>(ver);
    case 3: return nuq_pick3<BK, BV, 3>(ver);
    case 4: return nuq_pick3<BK, BV, 4>(ver);
    case 8: return nuq_pick3<BK, BV, 8>(ver);
    default: return nullptr;
    }
}
// the decode kernel for BK-bit keys, bv-bit values (2, 3, 4), gq query heads per block (1, 2, 3, 4, 8) and kernel version
// ver (4 or 5; kvq_kvcache_cuda_attend: 5 unless KVQ_NUQ_KERNEL=v4); nullptr where none
template <int BK> DecFn nuq_kernel(int bv, int gq, int ver)
{
    return bv == 2 ? nuq_pick2<BK, 2>(gq, ver) : bv == 3 ? nuq_pick2<BK, 3>(gq, ver) : nuq_pick2<BK, 4>(gq, ver);
}
extern template DecFn nuq_kernel<2>(int, int, int);
extern template DecFn nuq_kernel<3>(int, int, int);
extern template DecFn nuq_kernel<4>(int, int, int);

#endif
