// kvcache_cuda_nuq.cuh — nuq_kernel, the choice of the NUQ split-K decode kernel (v4::nuq_decode of
// kvcache_cuda_dec.cuh, every key and value width 2, 3, 4 and up to 4 query heads per block). Included by
// kvcache_cuda.cu after kvcache_cuda_dec.cuh. See formats/KVCACHE.md "Decode attention (GPU)".
//
// The kernels of each key width are compiled in a translation unit of their own, written by the Makefile (KVC_INST:
// build/gen/kvcache_cuda_inst_nuq_<bk>.cu instantiates nuq_kernel<bk> after the extern template declarations at the
// end of this file), so that make -jN compiles them in parallel; no other unit instantiates them.
#ifndef KVQ_KVCACHE_CUDA_NUQ_CUH
#define KVQ_KVCACHE_CUDA_NUQ_CUH

typedef void (*DecFn)(DecP);

// query heads per block GQ <= 4 (v4's registers hold 8 scores per query head)
template <int BK, int BV, int GQ> DecFn nuq_pick3()
{
    if constexpr (GQ <= 4) return v4::nuq_decode<BK, BV, GQ>;
    else return nullptr;
}
template <int BK, int BV> DecFn nuq_pick2(int gq)
{
    switch (gq) {
    case 1: return nuq_pick3<BK, BV, 1>();
    case 2: return nuq_pick3<BK, BV, 2>();
    case 3: return nuq_pick3<BK, BV, 3>();
    case 4: return nuq_pick3<BK, BV, 4>();
    case 8: return nuq_pick3<BK, BV, 8>();
    default: return nullptr;
    }
}
// the decode kernel for BK-bit keys, bv-bit values (2, 3, 4) and gq query heads per block (1, 2, 3, 4, 8); nullptr where
// none
template <int BK> DecFn nuq_kernel(int bv, int gq)
{
    return bv == 2 ? nuq_pick2<BK, 2>(gq) : bv == 3 ? nuq_pick2<BK, 3>(gq) : nuq_pick2<BK, 4>(gq);
}
extern template DecFn nuq_kernel<2>(int, int);
extern template DecFn nuq_kernel<3>(int, int);
extern template DecFn nuq_kernel<4>(int, int);

#endif
