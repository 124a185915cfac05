// emu_kvcache_dec.cc — runs the NUQ decode kernels (kernels/kvcache/kvcache_cuda_dec.cuh; v5 as
// kvq_kvcache_cuda_attend runs it, and for 3-bit values v4 too, whose partials v5's must equal bit for bit) on the host
// through cuda_emu.h and compares with kvq_kvcache_attend (the CPU reference), as tests/gpu/test_kvcache_cuda.c
// does on a GPU. Built by `make tests` as build*/tests/test_kvcache_emu and run by `make test` (CI has no
// GPU: this is the CPU check of the v4 / v5 kernels' index arithmetic, packing and RoPE stepping); it prints a
// Check-style summary line for scripts/run_tests.sh. KVQ_TEST_QUICK=1 (or any argument) runs fewer cases.
#include "cuda_emu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" {
#include "decode.h"
#include "identity.h"
#include "scheme.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers" // C designated initializers, compiled as C++ here
#include "tests/kveval_util.h"
#pragma GCC diagnostic pop
#include "kvcache.h"
#include "quant.h"
}
// The kernels' host copy lives in a namespace of its own: the test links libkvq.a, whose CUDA build's kvcache_cuda.cu.o
// (pulled in through the decoder's GPU path) holds the device versions of the same templates (weak symbols the linker
// would merge). The headers' own includes were all included above, so their guards keep them out of the namespace.
namespace kvq_emu {
#include "kvcache_cuda_dec.cuh"
#include "kvcache_cuda_app.cuh"
#include "kvcache_cuda_kivi.cuh"
} // namespace kvq_emu
using namespace kvq_emu;

#define KVCACHE_SYNTH_SEED 0x1234567887654321ull
#include "../../kvcache_synth.h"

typedef void (*KFn)(DecP);
// the kernel as kvcache_cuda_nuq.cuh's nuq_kernel picks it: version 5 differs from 4 only for 3-bit values
template <int BK, int BV, int GQ> static KFn pick3(int ver)
{
    if constexpr (BV == 3) return ver >= 5 ? v4::nuq_decode<BK, BV, GQ, 5> : v4::nuq_decode<BK, BV, GQ, 4>;
    else return v4::nuq_decode<BK, BV, GQ, 4>;
}
template <int BK, int BV> static KFn pick2(int gq, int ver)
{
    switch (gq) {
    case 1: return pick3<BK, BV, 1>(ver);
    case 2: return pick3<BK, BV, 2>(ver);
    case 3: return pick3<BK, BV, 3>(ver);
    default: return pick3<BK, BV, 4>(ver);
    }
}
template <int BK> static KFn pick1(int bv, int gq, int ver)
{
    return bv == 2 ? pick2<BK, 2>(gq, ver) : bv == 3 ? pick2<BK, 3>(gq, ver) : pick2<BK, 4>(gq, ver);
}
static KFn pick(int bk, int bv, int gq, int ver) { return bk == 2 ? pick1<2>(bv, gq, ver) : bk == 3 ? pick1<3>(bv, gq, ver) : pick1<4>(bv, gq, ver); }

static int n_fail, n_pass;

static void check_out(kvq_kvcache *cpu, const std::vector<float> &out, const std::vector<float> &q, size_t nh, double tol, const char *name,
                      const char *what);

// the exact region's partial and the combine (as kvcache_cuda.cu), then out vs the CPU reference: relative L2
// within tol and no non-finite values; one line per check
static void finish_and_check(const DecP &pe, kvq_kvcache *cpu, std::vector<float> &part, std::vector<float> &out, const std::vector<float> &q,
                             size_t nslots, double tol, const char *name, const char *what)
{
    const size_t nh = (size_t)pe.n_heads, D = (size_t)pe.D, B = out.size() / (nh * D);
    // as kvcache_cuda.cu's exact_and_combine: no exact region, no exact_decode, and the combine leaves its slot out (the
    // part buffer is NaN-poisoned, so reading that slot would show)
    if (pe.n_exact) emu_launch({(unsigned)nh, (unsigned)B, 1}, 128, (D + pe.n_exact + 1) * 4, [&] { exact_decode(pe); });
    emu_launch({(unsigned)nh, (unsigned)B, 1}, 64, 0,
               [&] { combine(part.data(), out.data(), (int)nh, (int)D, (int)nslots, combine_slots(nslots, (size_t)pe.n_exact)); });
    check_out(cpu, out, q, nh, tol, name, what);
}

// out vs the CPU reference: relative L2 within tol and no non-finite values; one line per check
static void check_out(kvq_kvcache *cpu, const std::vector<float> &out, const std::vector<float> &q, size_t nh, double tol, const char *name,
                      const char *what)
{
    std::vector<float> ref(out.size());
    kvq_err err;
    if (kvq_kvcache_attend(cpu, q.data(), nh, 0, ref.data(), &err)) { printf("attend: %s\n", err.msg); exit(2); }
    double num = 0, den = 0;
    int nf = 0;
    for (size_t i = 0; i < out.size(); i++) {
        if (!std::isfinite(out[i])) nf++;
        double d = (double)out[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    const double e = sqrt(num / (den > 0 ? den : 1));
    const bool ok = nf == 0 && e <= tol;
    if (ok) n_pass++; else n_fail++;
    printf("%s %-24s %s: rel L2 %.3g, %d non-finite\n", ok ? "ok  " : "FAIL", name, what, e, nf);
    fflush(stdout);
}

// RoPE tables as kvcache_cuda.cu builds them
static void rope_tables(const kvq_kvcache_view &v, size_t D, size_t rope_dim, size_t NT, std::vector<float2> &rlo, std::vector<float2> &rhi)
{
    const size_t np = (D + 1) / 2, nr = rope_dim / 2, nhi = NT / 64 + 4;
    rlo.assign(np * 64, make_float2(1, 0));
    rhi.assign(nhi * np, make_float2(1, 0));
    for (size_t i = 0; i < nr; i++) {
        double fr = v.inv_freq[i];
        for (int l = 0; l < 64; l++) rlo[i * 64 + l] = make_float2((float)cos(l * fr), (float)sin(l * fr));
        for (size_t b = 0; b < nhi; b++) rhi[b * np + i] = make_float2((float)cos((double)(64 * b) * fr), (float)sin((double)(64 * b) * fr));
    }
}

// the CPU cache of cfg and its tokens' keys / values K, V ([n_seqs][max_tokens][kv_dim], pseudo-random)
static kvq_kvcache *cpu_cache(const kvq_kvcache_config &cfg, std::vector<float> &K, std::vector<float> &V)
{
    const size_t rows = cfg.n_seqs * cfg.max_tokens, C = cfg.n_kv_heads * cfg.head_dim;
    kvq_kvcache *cpu;
    kvq_err err;
    if (kvq_kvcache_create(&cpu, &cfg, &err)) { printf("create: %s\n", err.msg); exit(2); }
    K.assign(rows * C, 0.f);
    V.assign(rows * C, 0.f);
    fill(K.data(), rows, C, 1);
    fill(V.data(), rows, C, 0);
    return cpu;
}

// a NUQ configuration on synthetic tables: per table sorted key and value levels, per channel c thresholds
// (c % 3 - 1) +- 1.8 (1 + c % 4); the vectors hold the tables cfg points into (so no copies)
struct NuqSynth {
    std::vector<float> klev, vlev, lo, hi;
    kvq_kvcache_config cfg;
    NuqSynth(size_t B, size_t H, size_t D, int kb, int vb, size_t tables, size_t n_sink, size_t NT, double f)
    {
        const size_t C = H * D, nlk = (size_t)1 << kb, nlv = (size_t)1 << vb;
        klev.resize(tables * nlk);
        vlev.resize(tables * nlv);
        lo.resize(C);
        hi.resize(C);
        for (size_t i = 0; i < tables; i++) { sorted_levels(&klev[i * nlk], nlk); sorted_levels(&vlev[i * nlv], nlv); }
        for (size_t c = 0; c < C; c++) {
            double off = (double)(c % 3) - 1, sc = 1 + (double)(c % 4);
            lo[c] = (float)(off - 1.8 * sc);
            hi[c] = (float)(off + 1.8 * sc);
        }
        memset(&cfg, 0, sizeof cfg);
        cfg.format = KVQ_KVCACHE_NUQ; cfg.n_seqs = B; cfg.n_kv_heads = H; cfg.head_dim = D; cfg.max_tokens = NT;
        cfg.k_bits = kb; cfg.v_bits = vb; cfg.n_sink = n_sink; cfg.outlier_frac = f;
        cfg.rope.rope_dim = D / 2 * 2; cfg.rope.rope_theta = 10000;
        cfg.k_tables = cfg.v_tables = tables; cfg.k_levels = klev.data(); cfg.v_levels = vlev.data(); cfg.k_lower = lo.data();
        cfg.k_upper = hi.data();
    }
    NuqSynth(const NuqSynth &) = delete;
    NuqSynth &operator=(const NuqSynth &) = delete;
};

// the device-side tables kvq_kvcache_cuda_create builds from a NUQ configuration: levels per KV head (hk, hv), the
// zero codes (kz, vz) and the RoPE inverse frequencies (inv, [(D + 1) / 2], 0 past rope_dim / 2)
struct NuqDevTables {
    std::vector<float> hk, hv;
    std::vector<uint8_t> kz, vz;
    std::vector<double> inv;
    explicit NuqDevTables(const kvq_kvcache_config &cfg)
    {
        const size_t H = cfg.n_kv_heads, D = cfg.head_dim, nlk = (size_t)1 << cfg.k_bits, nlv = (size_t)1 << cfg.v_bits;
        hk.resize(H * nlk);
        hv.resize(H * nlv);
        kz.resize(H);
        vz.resize(H);
        for (size_t h = 0; h < H; h++) {
            const float *kl = cfg.k_levels + (cfg.k_tables > 1 ? h : 0) * nlk, *vl = cfg.v_levels + (cfg.v_tables > 1 ? h : 0) * nlv;
            memcpy(&hk[h * nlk], kl, nlk * sizeof(float));
            memcpy(&hv[h * nlv], vl, nlv * sizeof(float));
            kz[h] = (uint8_t)kvq_nuq_nearest(kl, nlk, 0.0f);
            vz[h] = (uint8_t)kvq_nuq_nearest(vl, nlv, 0.0f);
        }
        inv.assign((D + 1) / 2, 0.0);
        for (size_t i = 0; i < cfg.rope.rope_dim / 2; i++) inv[i] = pow(cfg.rope.rope_theta, -2.0 * (double)i / (double)cfg.rope.rope_dim);
    }
};

static void run(size_t B, size_t H, size_t D, size_t g, int kb, int vb, size_t tables, size_t n_sink, size_t NT, double f,
                const size_t *lens, size_t nlens, size_t n_sm, const char *name)
{
    const size_t C = H * D, nh = H * g;
    NuqSynth ns(B, H, D, kb, vb, tables, n_sink, NT, f);
    kvq_kvcache_config &cfg = ns.cfg;
    std::vector<float> K, V;
    kvq_kvcache *cpu = cpu_cache(cfg, K, V);
    kvq_err err;
    size_t len = 0;
    for (size_t li = 0; li < nlens; li++) {
        size_t to = lens[li] < NT ? lens[li] : NT;
        for (size_t s = 0; s < B; s++)
            if (kvq_kvcache_append(cpu, s, &K[(s * NT + len) * C], &V[(s * NT + len) * C], to - len, &err)) { printf("append: %s\n", err.msg); exit(2); }
        len = to;
        kvq_kvcache_view v;
        kvq_kvcache_view_get(cpu, &v);
        const size_t np = (D + 1) / 2;
        std::vector<float2> rlo, rhi;
        rope_tables(v, D, cfg.rope.rope_dim, NT, rlo, rhi);
        std::vector<int> ilen(B);
        for (size_t s = 0; s < B; s++) ilen[s] = (int)v.len[s];
        const int gq = g <= 4 ? (int)g : (g % 4 == 0 ? 4 : g % 3 == 0 ? 3 : 1), qgroups = (int)((g + gq - 1) / gq);
        const size_t nq = len > v.n_exact ? len - v.n_exact : 0;
        const size_t ck = kb == 2 ? 16 : kb == 3 ? 32 : 8, npk = v.k_head_words / (kb == 3 ? 3 : 1) * (ck / 2);
        for (size_t ms : {(size_t)0, (size_t)1, (size_t)3}) {
            size_t chunk, splits;
            v4::plan(nq, B * H * qgroups, n_sm, ms, gq, (int)npk, 160 * 1024, &chunk, &splits);
            const size_t nslots = splits + 1;
            std::vector<float> part(B * nh * nslots * (D + 2), NAN), out(B * nh * D, NAN), q(B * nh * D);
            for (auto &x : q) x = (float)gauss();
            DecP p;
            memset(&p, 0, sizeof p);
            p.kcodes = v.kcodes; p.vcodes = v.vcodes; p.krow = v.krow; p.vrow = v.vrow; p.kent = v.kent; p.vent = v.vent;
            p.vscale = v.vscale; p.klut = v.klut; p.vlevels = v.vlevels; p.kz = v.k_zcode; p.vz = v.v_zcode;
            p.rlo = rlo.data(); p.rhi = rhi.data(); p.k16 = v.k16; p.v16 = v.v16; p.q = q.data(); p.part = part.data(); p.len = ilen.data();
            p.H = (int)H; p.D = (int)D; p.dpad = (int)(2 * np); p.np = (int)np; p.n_heads = (int)nh; p.g = (int)g; p.qgroups = qgroups;
            p.kw = (int)v.k_head_words; p.vw = (int)v.v_head_words; p.capq = (int)v.capq; p.n_exact = (int)v.n_exact;
            p.n_splits = (int)splits; p.chunk = (int)chunk; p.ent_cap = (int)v.ent_cap; p.nslots = (int)nslots;
            p.scale = 1.0f / sqrtf((float)D);
            KFn fn = pick(kb, vb, gq, 5);
            const dim3e grid = {(unsigned)splits, (unsigned)(H * qgroups), (unsigned)B};
            emu_launch(grid, v4::NT4, v4::smem_bytes(gq, (int)npk, (int)chunk), [&] { fn(p); });
            char what[96];
            snprintf(what, sizeof what, "len %5zu chunk %5zu splits %3zu gq %d", len, chunk, splits, gq);
            if (vb == 3) {
                // v5's 3-bit P·V (pv_mma3_v5) builds pv_mma3's fragments another way: the v4 kernel's partials, bit for bit
                // without sparse outliers; with them within 1e-5 relative L2 (their corrections are added by atomics, in
                // any order: the last bits differ from run to run; an index error in the dense P·V is > 1e-2)
                std::vector<float> part4(part.size(), NAN);
                DecP p4 = p;
                p4.part = part4.data();
                KFn f4 = pick(kb, vb, gq, 4);
                emu_launch(grid, v4::NT4, v4::smem_bytes(gq, (int)npk, (int)chunk), [&] { f4(p4); });
                double num = 0, den = 0;
                bool odd = false; // a value finite in one and not the other
                for (size_t i = 0; i < part.size(); i++) {
                    const float a = part[i], b = part4[i];
                    if (std::isfinite(a) != std::isfinite(b) || (!std::isfinite(a) && a != b && !(std::isnan(a) && std::isnan(b)))) odd = true;
                    if (std::isfinite(a) && std::isfinite(b)) { num += ((double)a - b) * ((double)a - b); den += (double)b * b; }
                }
                const double e = sqrt(num / (den > 0 ? den : 1));
                const bool bits = !memcmp(part.data(), part4.data(), part.size() * sizeof(float)), ok = !odd && (f == 0 ? bits : e <= 1e-5);
                if (ok) n_pass++; else n_fail++;
                printf("%s %-24s %s: v5 partials vs v4's: %s, rel L2 %.3g%s\n", ok ? "ok  " : "FAIL", name, what, bits ? "bit-equal" : "differ",
                       e, odd ? ", non-finite in one only" : "");
            }
            // P·V on the tensor cores with fp16 levels (the caches round them so) and p·r in two fp16 parts: 1e-5 (seen
            // up to 1.6e-6; a single fp16 p·r gave 1e-4..5e-4, which greedy decoding amplified into logits 1-2 apart)
            finish_and_check(p, cpu, part, out, q, nslots, 1e-5, name, what);
        }
    }
    kvq_kvcache_free(cpu);
}

// the NUQ append (kvcache_cuda_app.cuh: put_exact_kernel, append_count, append_write) through the host steps of
// kvq_kvcache_cuda_append (exact rows first, then per chunk of new tokens the counts, the row pointers advanced on
// the host, the codes and entries), one sequence appended in the given chunks, against the bytes kvq_kvcache_append
// wrote: exact rows, key and value codes, value scales, row pointers and entries, bit for bit. Inputs not fp16-exact
// (the fp16 rounding of outliers and exact rows is exercised), per-head or shared tables.
static void run_append(size_t H, size_t D, int kb, int vb, size_t tables, size_t n_sink, double f, const size_t *chunks, size_t nch,
                       const char *name)
{
    size_t NT = 0;
    for (size_t i = 0; i < nch; i++) NT += chunks[i];
    const size_t C = H * D;
    NuqSynth ns(1, H, D, kb, vb, tables, n_sink, NT, f);
    kvq_kvcache_config &cfg = ns.cfg;
    const std::vector<float> &lo = ns.lo, &hi = ns.hi;
    std::vector<float> K, V;
    kvq_kvcache *cpu = cpu_cache(cfg, K, V);
    for (size_t i = 0; i < NT * C; i++) { K[i] *= (float)(1 + 1e-3 * unif()); V[i] *= (float)(1 + 1e-3 * unif()); }
    kvq_err err;
    size_t len = 0;
    for (size_t i = 0; i < nch; i++) {
        if (kvq_kvcache_append(cpu, 0, &K[len * C], &V[len * C], chunks[i], &err)) { printf("append: %s\n", err.msg); exit(2); }
        len += chunks[i];
    }
    kvq_kvcache_view v;
    kvq_kvcache_view_get(cpu, &v);
    // the device's tables and buffers as kvq_kvcache_cuda_create builds them (layout of the view)
    const size_t ne = v.n_exact, capq = v.capq, kw = v.k_head_words, vw = v.v_head_words, R = capq + 1, ecap = v.ent_cap;
    const NuqDevTables dt(cfg);
    const std::vector<float> &hk = dt.hk, &hv = dt.hv;
    const std::vector<uint8_t> &kz = dt.kz, &vz = dt.vz;
    const std::vector<double> &inv = dt.inv;
    std::vector<uint16_t> k16(H * (ne ? ne : 1) * D, 0), v16(H * (ne ? ne : 1) * D, 0);
    std::vector<uint32_t> kc(H * kw * capq, 0), vc(H * capq * vw, 0), krow(H * R, 0), vrow(H * R, 0), kent(H * ecap, 0), vent(H * ecap, 0);
    std::vector<float> vscale(capq * 2, 0.f);
    std::vector<size_t> ku(H, 0), vu(H, 0);
    const int kps = (int)kvq_outliers_per_side(C, f), outl = f > 0;
    int P2 = 1;
    while ((size_t)P2 < C) P2 <<= 1;
    size_t pos = 0;
    for (size_t i = 0; i < nch; i++) {
        const float *k = &K[pos * C], *vv = &V[pos * C];
        size_t t = 0, n = chunks[i];
        if (pos < ne) {
            const size_t m = ne - pos < n ? ne - pos : n;
            emu_launch({(unsigned)((m * C + 255) / 256), 1, 1}, 256, 0, [&] {
                put_exact_kernel(k16.data(), v16.data(), k, vv, inv.data(), (int)(cfg.rope.rope_dim / 2), (int)H, (int)D, (int)ne, (int)pos, (int)m);
            });
            t = m;
        }
        const size_t m = n - t, q0 = pos + t - ne;
        if (m) {
            const float *kq = k + t * C, *vq = vv + t * C;
            std::vector<float> range(2 * m);
            std::vector<int> cnt(m * 2 * H);
            emu_launch({(unsigned)m, 1, 1}, 256, P2 * sizeof(float), [&] {
                append_count(kq, vq, lo.data(), hi.data(), (int)H, (int)D, kps, outl, P2, range.data(), cnt.data());
            });
            for (size_t mm = 0; mm < m; mm++)
                for (size_t h = 0; h < H; h++) {
                    ku[h] += cnt[mm * 2 * H + h];
                    vu[h] += cnt[mm * 2 * H + H + h];
                    if (ku[h] > ecap || vu[h] > ecap) { printf("FAIL %s: entries beyond the CPU cache's capacity\n", name); n_fail++; return; }
                    krow[h * R + q0 + 1 + mm] = (uint32_t)ku[h];
                    vrow[h * R + q0 + 1 + mm] = (uint32_t)vu[h];
                }
            typedef void (*AF)(const float *, const float *, const float *, const float *, const float *, const float *, const uint8_t *,
                               const uint8_t *, const float *, int, int, int, int, int, int, int, int, uint32_t *, uint32_t *,
                               const uint32_t *, const uint32_t *, uint32_t *, uint32_t *, float *, size_t);
            const AF fs[3][3] = {{append_write<2, 2>, append_write<2, 3>, append_write<2, 4>},
                                 {append_write<3, 2>, append_write<3, 3>, append_write<3, 4>},
                                 {append_write<4, 2>, append_write<4, 3>, append_write<4, 4>}};
            emu_launch({(unsigned)m, 1, 1}, 128, 0, [&] {
                fs[kb - 2][vb - 2](kq, vq, lo.data(), hi.data(), hk.data(), hv.data(), kz.data(), vz.data(), range.data(), (int)H, (int)D,
                                   kps, outl, (int)q0, (int)capq, (int)kw, (int)vw, kc.data(), vc.data(), krow.data(), vrow.data(),
                                   kent.data(), vent.data(), vscale.data(), ecap);
            });
        }
        pos += n;
    }
    const size_t nq = NT > ne ? NT - ne : 0;
    size_t bad = 0, first = (size_t)-1;
    const char *what = "";
    auto cmp = [&](const void *a, const void *b, size_t bytes, const char *w) {
        if (memcmp(a, b, bytes)) { bad++; if (first == (size_t)-1) { first = 0; what = w; } }
    };
    for (size_t h = 0; h < H; h++) {
        if (ne) {
            cmp(&k16[h * ne * D], v.k16 + h * ne * D, ne * D * 2, "exact keys");
            cmp(&v16[h * ne * D], v.v16 + h * ne * D, ne * D * 2, "exact values");
        }
        for (size_t w = 0; w < kw; w++) cmp(&kc[(h * kw + w) * capq], v.kcodes + (h * kw + w) * capq, nq * 4, "key codes");
        cmp(&vc[h * capq * vw], v.vcodes + h * capq * vw, nq * vw * 4, "value codes");
        cmp(&krow[h * R], v.krow + h * R, (nq + 1) * 4, "key row pointers");
        cmp(&vrow[h * R], v.vrow + h * R, (nq + 1) * 4, "value row pointers");
        cmp(&kent[h * ecap], v.kent + h * ecap, krow[h * R + nq] * 4, "key entries");
        cmp(&vent[h * ecap], v.vent + h * ecap, vrow[h * R + nq] * 4, "value entries");
    }
    cmp(vscale.data(), v.vscale, nq * 2 * 4, "value scales");
    size_t ents = 0;
    for (size_t h = 0; h < H; h++) ents += krow[h * R + nq] + vrow[h * R + nq];
    const bool ok = bad == 0 && (f == 0 || ents > 0);
    if (ok) n_pass++; else n_fail++;
    printf("%s %-24s append of %zu tokens in %zu chunks (%zu exact, %zu sparse entries): %s%s\n", ok ? "ok  " : "FAIL", name, NT, nch, ne, ents,
           bad ? "differs from the CPU cache in " : "bytes equal to the CPU cache's", bad ? what : "");
    fflush(stdout);
    kvq_kvcache_free(cpu);
}

// the batched step (kvcache_cuda_app.cuh: append_step, gather_used and the host rule step_bound_exceeds /
// step_capacity) through the host steps of kvq_kvcache_cuda_append_step: B sequences prefilled to unequal lengths
// pre[s] (the device state taken from the CPU cache's, whose layout it shares; lengths below n_sink leave a sequence
// in the exact region for its first steps), then `steps` steps of one token per sequence at its own position, the
// outlier store starting at cap0 entries per (sequence, head). After every step the bytes equal those of
// kvq_kvcache_append of the same tokens, one per sequence: device lengths, exact rows, key and value codes, value
// scales, row pointers and entries, bit for bit; no (sequence, head) ever holds more entries than the store (the
// host's bound). The store must grow (geometrically) at least once after the first step and before the last, and
// the synchronisations (gathers of the exact counts) must be fewer than the steps. burst: every key of every step's
// token an outlier (40, past every threshold), so the key store grows by exactly D per quantized row, the host's bound
// is met with equality, and a bound one row short lets a step write past a store (tried: this case then differs from
// the CPU cache in key entries).
static void run_step(size_t B, size_t H, size_t D, int kb, int vb, size_t tables, size_t n_sink, double f, const size_t *pre, size_t steps,
                     size_t cap0, bool burst, const char *name)
{
    size_t NT = 0;
    for (size_t s = 0; s < B; s++) NT = pre[s] > NT ? pre[s] : NT;
    NT += steps;
    const size_t C = H * D;
    NuqSynth ns(B, H, D, kb, vb, tables, n_sink, NT, f);
    kvq_kvcache_config &cfg = ns.cfg;
    std::vector<float> K, V;
    kvq_kvcache *cpu = cpu_cache(cfg, K, V);
    for (size_t i = 0; i < K.size(); i++) { K[i] *= (float)(1 + 1e-3 * unif()); V[i] *= (float)(1 + 1e-3 * unif()); }
    for (size_t s = 0; burst && s < B; s++)
        for (size_t i = (s * NT + pre[s]) * C; i < (s * NT + pre[s] + steps) * C; i++) K[i] = 40.f;
    kvq_err err;
    for (size_t s = 0; s < B; s++)
        if (pre[s] && kvq_kvcache_append(cpu, s, &K[s * NT * C], &V[s * NT * C], pre[s], &err)) { printf("append: %s\n", err.msg); exit(2); }
    kvq_kvcache_view v;
    kvq_kvcache_view_get(cpu, &v);
    // the device's tables and buffers as kvq_kvcache_cuda_create builds them, the state copied from the CPU cache's
    const size_t ne = v.n_exact, ne1 = ne ? ne : 1, capq = v.capq, kw = v.k_head_words, vw = v.v_head_words, R = capq + 1;
    const NuqDevTables dt(cfg);
    const std::vector<float> &hk = dt.hk, &hv = dt.hv;
    const std::vector<uint8_t> &kz = dt.kz, &vz = dt.vz;
    const std::vector<double> &inv = dt.inv;
    std::vector<uint16_t> k16(v.k16, v.k16 + B * H * ne1 * D), v16(v.v16, v.v16 + B * H * ne1 * D);
    std::vector<uint32_t> kc(v.kcodes, v.kcodes + B * H * kw * capq), vc(v.vcodes, v.vcodes + B * H * capq * vw);
    std::vector<uint32_t> krow(v.krow, v.krow + B * H * R), vrow(v.vrow, v.vrow + B * H * R), used(2 * B * H);
    std::vector<float> vscale(v.vscale, v.vscale + B * capq * 2);
    // the stores, and past them a guard of D entries per step: a step that wrote past a store (the host's bound broken)
    // lands in the next store or the guard, where the comparison below sees it, instead of past the allocation
    size_t cap = cap0;
    const size_t guard = D * (steps + 1);
    std::vector<uint32_t> kent(B * H * cap + guard, 0), vent(B * H * cap + guard, 0);
    std::vector<size_t> len(B), since(B, 0), ku(B * H), vu(B * H);
    std::vector<int> dlen(4 * B);
    for (size_t s = 0; s < B; s++) {
        len[s] = v.len[s];
        const size_t q = len[s] > ne ? len[s] - ne : 0;
        dlen[s] = (int)len[s];
        dlen[B + s] = dlen[2 * B + s] = (int)q;
        dlen[3 * B + s] = (int)(q / 16 * 16);
        for (size_t h = 0; h < H; h++) {
            const size_t i = s * H + h;
            ku[i] = krow[i * R + q];
            vu[i] = vrow[i * R + q];
            if (ku[i] > cap || vu[i] > cap) { printf("FAIL %s: the prefill's entries exceed cap0 %zu\n", name, cap); n_fail++; return; }
            memcpy(&kent[i * cap], v.kent + i * v.ent_cap, ku[i] * 4);
            memcpy(&vent[i * cap], v.vent + i * v.ent_cap, vu[i] * 4);
        }
    }
    const int kps = (int)kvq_outliers_per_side(C, f), outl = f > 0;
    int P2 = 1;
    while ((size_t)P2 < C) P2 <<= 1;
    typedef void (*SF)(StepArgs);
    const SF fs[3][3] = {{append_step<2, 2>, append_step<2, 3>, append_step<2, 4>},
                         {append_step<3, 2>, append_step<3, 3>, append_step<3, 4>},
                         {append_step<4, 2>, append_step<4, 3>, append_step<4, 4>}};
    std::vector<float> ks(B * C), vs(B * C);
    size_t bad = 0, syncs = 0, grows = 0, first_grow = 0, over = 0;
    const char *what = "";
    auto cmp = [&](const void *a, const void *b, size_t bytes, const char *w) {
        if (memcmp(a, b, bytes)) { if (!bad) what = w; bad++; }
    };
    for (size_t st = 0; st < steps; st++) {
        for (size_t s = 0; s < B; s++) {
            const size_t r = s * NT + len[s];
            memcpy(&ks[s * C], &K[r * C], C * 4);
            memcpy(&vs[s * C], &V[r * C], C * 4);
            if (kvq_kvcache_append(cpu, s, &K[r * C], &V[r * C], 1, &err)) { printf("append: %s\n", err.msg); exit(2); }
        }
        if (outl && step_bound_exceeds(ku.data(), vu.data(), since.data(), len.data(), B, H, D, ne, cap)) {
            emu_launch({1, 1, 1}, 256, 0, [&] { gather_used(krow.data(), vrow.data(), dlen.data(), (int)B, (int)H, (int)capq, (int)ne, used.data()); });
            for (size_t i = 0; i < B * H; i++) { ku[i] = used[i]; vu[i] = used[B * H + i]; }
            std::fill(since.begin(), since.end(), 0);
            syncs++;
            const size_t t = step_capacity(ku.data(), vu.data(), len.data(), B, H, D, ne, NT, cap, 0xffffffffu);
            if (t > cap) { // as resize_entries: every (sequence, head) store re-laid at the new stride
                std::vector<uint32_t> k2(B * H * t + guard, 0), v2(B * H * t + guard, 0);
                for (size_t i = 0; i < B * H; i++) {
                    memcpy(&k2[i * t], &kent[i * cap], cap * 4);
                    memcpy(&v2[i * t], &vent[i * cap], cap * 4);
                }
                kent.swap(k2);
                vent.swap(v2);
                cap = t;
                if (!grows++) first_grow = st;
            }
        }
        StepArgs p;
        memset(&p, 0, sizeof p);
        p.k = ks.data(); p.v = vs.data(); p.klo = ns.lo.data(); p.khi = ns.hi.data(); p.klev = hk.data(); p.vlev = hv.data();
        p.kz = kz.data(); p.vz = vz.data(); p.inv_freq = inv.data(); p.rope_pairs = (int)(cfg.rope.rope_dim / 2); p.B = (int)B; p.H = (int)H;
        p.D = (int)D; p.kps = kps; p.outl = outl; p.P2 = P2; p.n_exact = (int)ne; p.capq = (int)capq; p.kw = (int)kw; p.vw = (int)vw;
        p.k16 = k16.data(); p.v16 = v16.data(); p.kcodes = kc.data(); p.vcodes = vc.data(); p.krow = krow.data(); p.vrow = vrow.data();
        p.kent = kent.data(); p.vent = vent.data(); p.vscale = vscale.data(); p.ent_cap = cap; p.len = dlen.data();
        emu_launch({(unsigned)B, 1, 1}, 128, P2 * sizeof(float), [&] { fs[kb - 2][vb - 2](p); });
        for (size_t s = 0; s < B; s++) {
            if (outl && len[s] >= ne) since[s]++;
            len[s]++;
        }
        kvq_kvcache_view_get(cpu, &v);
        for (size_t s = 0; s < B; s++) {
            const size_t q = len[s] > ne ? len[s] - ne : 0;
            const int want[4] = {(int)v.len[s], (int)v.kq[s], (int)v.vq[s], (int)(q / 16 * 16)};
            const int got[4] = {dlen[s], dlen[B + s], dlen[2 * B + s], dlen[3 * B + s]};
            cmp(got, want, sizeof want, "device lengths");
            cmp(&vscale[s * capq * 2], v.vscale + s * capq * 2, q * 8, "value scales");
            for (size_t h = 0; h < H; h++) {
                const size_t i = s * H + h;
                if (ne) {
                    const size_t m = len[s] < ne ? len[s] : ne;
                    cmp(&k16[i * ne * D], v.k16 + i * ne * D, m * D * 2, "exact keys");
                    cmp(&v16[i * ne * D], v.v16 + i * ne * D, m * D * 2, "exact values");
                }
                for (size_t w = 0; w < kw; w++) cmp(&kc[(i * kw + w) * capq], v.kcodes + (i * kw + w) * capq, q * 4, "key codes");
                cmp(&vc[i * capq * vw], v.vcodes + i * capq * vw, q * vw * 4, "value codes");
                cmp(&krow[i * R], v.krow + i * R, (q + 1) * 4, "key row pointers");
                cmp(&vrow[i * R], v.vrow + i * R, (q + 1) * 4, "value row pointers");
                if (krow[i * R + q] > cap || vrow[i * R + q] > cap) { over++; continue; }
                cmp(&kent[i * cap], v.kent + i * v.ent_cap, v.krow[i * R + q] * 4, "key entries");
                cmp(&vent[i * cap], v.vent + i * v.ent_cap, v.vrow[i * R + q] * 4, "value entries");
            }
        }
    }
    size_t ents = 0;
    for (size_t s = 0; s < B; s++)
        for (size_t h = 0; h < H; h++) ents += v.krow[(s * H + h) * R + v.kq[s]] + v.vrow[(s * H + h) * R + v.kq[s]];
    const bool ok = bad == 0 && over == 0 && grows >= 1 && first_grow > 0 && first_grow + 1 < steps && syncs < steps && ents > 0;
    if (ok) n_pass++; else n_fail++;
    printf("%s %-24s %zu steps of %zu sequences (%zu sparse entries; %zu synchronisations, store grown %zu times, first at step %zu, to %zu): "
           "%s%s%s\n", ok ? "ok  " : "FAIL", name, steps, B, ents, syncs, grows, first_grow, cap,
           bad ? "differs from the CPU cache in " : over ? "entries beyond the store" : "bytes equal to the CPU cache's after every step",
           bad ? what : "", !bad && !over && !ok ? " (but the growth / synchronisation counts are not as required)" : "");
    fflush(stdout);
    kvq_kvcache_free(cpu);
}

// query heads per block as kvcache_cuda.cu's choose_gq for the tensor-core kernels: the fewest masked slots, ties to the larger
static int gq_of(size_t g)
{
    int best = 1;
    long bw = -1;
    for (int c : {4, 3, 2, 1}) {
        long w = (long)((g + c - 1) / c) * c - (long)g;
        if (bw < 0 || w < bw) { bw = w; best = c; }
    }
    return best;
}


// KIVI: kivi_fast (where it applies) + kivi_generic + exact_decode + combine, as kvcache_cuda.cu's kivi_attend, vs the CPU
// skew: sequence s is s·skew positions longer than sequence 0 (capped at NT), so the per-sequence ranges differ
static void run_kivi(size_t B, size_t H, size_t D, size_t g, int kb, int vb, size_t G, size_t R, bool post, size_t n_sink, size_t NT,
                     const size_t *lens, size_t nlens, size_t n_sm, const char *name, size_t skew = 0, float qscale = 1.f)
{
    const size_t C = H * D, nh = H * g;
    kvq_kvcache_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.format = KVQ_KVCACHE_KIVI; cfg.n_seqs = B; cfg.n_kv_heads = H; cfg.head_dim = D; cfg.max_tokens = NT;
    cfg.k_bits = kb; cfg.v_bits = vb; cfg.n_sink = n_sink; cfg.group = G; cfg.residual = R; cfg.post_rope = post;
    cfg.rope.rope_dim = D / 2 * 2; cfg.rope.rope_theta = 10000;
    std::vector<float> K, V;
    kvq_kvcache *cpu = cpu_cache(cfg, K, V);
    kvq_err err;
    const int lg = G == 16 ? 0 : G == 32 ? 1 : G == 64 ? 2 : G == 128 ? 3 : -1;
    const bool fast = post && (kb == 2 || kb == 4) && (vb == 2 || vb == 4) && lg >= 0;
    size_t len = 0;
    std::vector<size_t> slen(B, 0);
    for (size_t li = 0; li < nlens; li++) {
        size_t to = lens[li] < NT ? lens[li] : NT;
        for (size_t s = 0; s < B; s++) {
            const size_t ts = std::min(NT, to + s * skew);
            if (kvq_kvcache_append(cpu, s, &K[(s * NT + slen[s]) * C], &V[(s * NT + slen[s]) * C], ts - slen[s], &err)) { printf("append: %s\n", err.msg); exit(2); }
            slen[s] = ts;
        }
        len = to;
        kvq_kvcache_view v;
        kvq_kvcache_view_get(cpu, &v);
        std::vector<float2> rlo, rhi;
        rope_tables(v, D, cfg.rope.rope_dim, NT, rlo, rhi);
        std::vector<int> ilen(B), ikq(B), ivq(B), iqf(B);
        size_t maxqf = 0, maxrest = 0;
        for (size_t s = 0; s < B; s++) {
            ilen[s] = (int)v.len[s];
            ikq[s] = (int)v.kq[s];
            ivq[s] = (int)v.vq[s];
            iqf[s] = fast ? (int)(std::min(v.kq[s], v.vq[s]) / 16 * 16) : 0;
            const size_t nq = v.len[s] > v.n_exact ? v.len[s] - v.n_exact : 0;
            maxqf = std::max(maxqf, (size_t)iqf[s]);
            maxrest = std::max(maxrest, nq - iqf[s]);
        }
        for (size_t ms : {(size_t)0, (size_t)1, (size_t)3}) {
            int gq = 1, qgroups = (int)g;
            if (fast && maxqf) {
                gq = gq_of(g);
                qgroups = (int)((g + gq - 1) / gq);
            }
            const kv::KiviSchedule ks = kv::kivi_schedule(maxqf, maxrest, B * H * qgroups, B * nh, n_sm, ms, gq, (int)D, (int)G, kb, vb,
                                                          160 * 1024);
            const kv::FastPlan &fp = ks.fast;
            const size_t fchunk = ks.fchunk, fsplits = fp.splits, gchunk = ks.gchunk, gsplits = ks.gsplits;
            const size_t nslots = fsplits + gsplits + 1;
            std::vector<float> part(B * nh * nslots * (D + 2), NAN), out(B * nh * D, NAN), q(B * nh * D);
            for (auto &x : q) x = (float)gauss() * qscale;
            KivP p;
            memset(&p, 0, sizeof p);
            p.kcodes = v.kcodes; p.vcodes = v.vcodes; p.kscale = (const float2 *)v.kscale; p.vscale = (const float2 *)v.vscale;
            p.kring = v.kring; p.vring = v.vring; p.rlo = rlo.data(); p.rhi = rhi.data(); p.q = q.data(); p.part = part.data();
            p.len = ilen.data(); p.kq = ikq.data(); p.vq = ivq.data(); p.qf = iqf.data();
            p.H = (int)H; p.D = (int)D; p.G = (int)G; p.kb = kb; p.vb = vb; p.np = (int)((D + 1) / 2); p.n_heads = (int)nh; p.g = (int)g;
            p.qgroups = qgroups; p.kw = (int)v.k_head_words; p.vw = (int)v.v_head_words; p.capq = (int)v.capq; p.ngk = (int)(v.capq / G + 1);
            p.n_exact = (int)v.n_exact; p.ring = (int)v.ring; p.nslots = (int)nslots; p.post_rope = post; p.scale = 1.0f / sqrtf((float)D);
            p.gchunk = (int)gchunk;
            p.use_qf = fsplits ? 1 : 0;
            if (fsplits) {
                p.chunk = (int)fp.chunk; p.nlong = (int)fp.nlong; p.chunk2 = (int)fp.chunk2; p.vpref = ks.vpref;
                kv::FastFn fn = kv::fast_pick(kb, vb, gq, lg, kv::fast_nw((int)D));
                emu_launch({(unsigned)(H * qgroups), (unsigned)B, (unsigned)fsplits}, kv::fast_threads((int)G), (size_t)kv::fast_smem(gq, (int)D, (int)G, kb, vb, (int)fp.chunk).total * 4,
                           [&] { fn(p); });
            }
            // as kvcache_cuda.cu's kivi_attend: the exact region (when there is one), then kivi_generic; after kivi_fast
            // (on the GPU beside it, on a second stream) the combine kernel merges, else kivi_generic's last split per
            // query head (ticks start at 0 and must be back at 0)
            DecP pe;
            memset(&pe, 0, sizeof pe);
            pe.k16 = v.k16; pe.v16 = v.v16; pe.q = q.data(); pe.part = part.data(); pe.len = ilen.data();
            pe.H = (int)H; pe.D = (int)D; pe.n_heads = (int)nh; pe.g = (int)g; pe.n_exact = (int)v.n_exact; pe.nslots = (int)nslots;
            pe.scale = p.scale;
            if (pe.n_exact) emu_launch({(unsigned)nh, (unsigned)B, 1}, 128, (D + pe.n_exact + 1) * 4, [&] { exact_decode(pe); });
            std::vector<int> tick(B * nh, 0);
            p.slot0 = (int)fsplits;
            p.out = out.data();
            p.tick = fsplits ? nullptr : tick.data();
            p.nuse = combine_slots(nslots, v.n_exact);
            if (fsplits)
                emu_launch({(unsigned)gsplits, (unsigned)nh, (unsigned)B}, kv::NTG, kv::generic_smem((int)D, (int)gchunk) * 4, [&] { kv::kivi_tail(p); });
            else
                emu_launch({(unsigned)gsplits, (unsigned)nh, (unsigned)B}, kv::NTG, kv::generic_smem((int)D, (int)gchunk) * 4, [&] { kv::kivi_generic(p); });
            // the combine kernel of kv::combine_pick's choice into out; below, every other one that takes these slots
            auto run_combine = [&](kv::CombineKind kind, float *o) {
                KivP pc = p;
                pc.out = o;
                switch (kind) {
                case kv::COMBINE_ROW512: emu_launch({(unsigned)nh, (unsigned)B, 1}, 512, kv::combine1_smem(512, (int)D) * 4, [&] { kv::combine_row<512, 16>(pc); }); break;
                case kv::COMBINE_ROW128: emu_launch({(unsigned)nh, (unsigned)B, 1}, 128, kv::combine1_smem(128, (int)D) * 4, [&] { kv::combine_row<128, 24>(pc); }); break;
                case kv::COMBINE_WIDE: emu_launch({(unsigned)nh, (unsigned)B, 1}, kv::CW_NT, kv::combine_wide_smem((int)D) * 4, [&] { kv::combine_par_wide(pc); }); break;
                case kv::COMBINE_PAR: emu_launch({(unsigned)nh, (unsigned)B, 1}, 128, COMBINE_SMEM * 4, [&] { kv::combine_par(pc); }); break;
                }
            };
            const kv::CombineKind picked = kv::combine_pick(B * nh, n_sm, p.nuse, (int)D);
            if (fsplits) run_combine(picked, out.data());
            char what[128];
            snprintf(what, sizeof what, "len %5zu fast %4zu x %2zu (%zu of %zu last), generic %4zu x %2zu, gq %d", len, fchunk, fsplits,
                     fp.splits - fp.nlong, fp.chunk2, gchunk, gsplits, gq);
            for (int x : tick)
                if (x) { printf("FAIL %s %s: a tick counter left at %d\n", name, what, x); n_fail++; break; }
            // fp32 throughout (the tensor-core path splits its fp16 operands into high and low parts): 2e-5
            check_out(cpu, out, q, nh, 2e-5, name, what);
            // the other combine kernels on the same partials (poisoned outputs), each against the CPU reference
            for (int k = 0; fsplits && k < 4; k++) {
                const kv::CombineKind kind = (kv::CombineKind)k;
                if (kind == picked || (k == kv::COMBINE_ROW512 && !kv::combine_row_takes(512, 16, p.nuse, (int)D)) ||
                    (k == kv::COMBINE_ROW128 && !kv::combine_row_takes(128, 24, p.nuse, (int)D)))
                    continue;
                std::vector<float> o2(out.size(), NAN);
                run_combine(kind, o2.data());
                char w2[160];
                snprintf(w2, sizeof w2, "%s, combine %d (picked %d)", what, k, (int)picked);
                check_out(cpu, o2, q, nh, 2e-5, name, w2);
            }
        }
    }
    kvq_kvcache_free(cpu);
}

// kv::fast_split / fast_plan: the splits tile [0, nq) in order, none empty, each at most its chunk long, the short ones
// (chunk2 < chunk, at most nshort) last; plan-level: fast_plan cuts only with more blocks than resident slots
static void check_fast_split()
{
    int bad = 0, n = 0;
    for (size_t nq = 128; nq <= 40 * 128; nq += 128)
        for (size_t cu = 1; cu <= 16; cu++)
            for (size_t cu2 = 0; cu2 <= cu; cu2++)
                for (size_t ns = 0; ns <= 3; ns++) {
                    const kv::FastPlan f = kv::fast_split(nq, 128 * cu, 128 * cu2, ns);
                    size_t q = 0;
                    bool ok = f.chunk == 128 * cu && f.nlong <= f.splits && f.chunk2 <= f.chunk;
                    for (size_t sp = 0; sp < f.splits && ok; sp++) {
                        const size_t q0 = sp < f.nlong ? sp * f.chunk : f.nlong * f.chunk + (sp - f.nlong) * f.chunk2;
                        const size_t len = sp < f.nlong ? f.chunk : f.chunk2;
                        ok = q0 == q && q0 < nq; // in order, contiguous, not empty
                        q = std::min(nq, q0 + len);
                    }
                    ok = ok && q == nq && (f.splits == f.nlong || (f.chunk2 < f.chunk && f.splits - f.nlong <= ns));
                    if (!ok && bad++ < 3)
                        printf("FAIL fast_split nq %zu chunk %zu chunk2 %zu nshort %zu: %zu long, %zu splits, chunk2 %zu\n", nq, 128 * cu, 128 * cu2, ns,
                               f.nlong, f.splits, f.chunk2);
                    n++;
                }
    // 40 units in chunks of 16: 3 splits; 10 blocks each against 32 slots: uniform; against 16: the last 8 units apart
    // (and uniform with max_splits set)
    const kv::FastPlan u = kv::fast_plan(40 * 128, 10, 2048, 3, 32, 0), c = kv::fast_plan(40 * 128, 10, 2048, 3, 16, 0),
                       m = kv::fast_plan(40 * 128, 10, 2048, 3, 16, 3);
    if (u.splits != 3 || u.nlong != 3 || c.nlong != 2 || c.chunk2 != 1024 || c.splits != 3 || m.splits != 3 || m.nlong != 3) {
        printf("FAIL fast_plan: %zu/%zu/%zu splits, %zu/%zu/%zu long, chunk2 %zu\n", u.splits, c.splits, m.splits, u.nlong, c.nlong, m.nlong,
               c.chunk2);
        bad++;
    }
    printf("%s fast_split: %d plans\n", bad ? "FAIL" : "ok  ", n);
    if (bad) n_fail++; else n_pass++;
}

// ---- the kernel inside real decoding: the CPU decoder (kernels/decode/decode.h) with its attention computed by v4 in
// the emulator over the same CPU cache, against the plain CPU decoder, step by step. A kernel error that passes the
// per-call checks above can still part greedy decoding from the CPU reference: quantization-code flips in later layers
// amplify it (v4 with a single fp16 p·r, ~3e-4 relative, parted step-0 logits by 0.24 here and by 1-2 on SmolLM2-135M
// on an H200; now ~1e-5).
struct EmuDec {
    kvq_decoder *d;
    int bits;
    size_t rope_dim;
    std::vector<float> kb, vb;
};

static kvq_status emu_dec_attend(void *user, const kvq_layer_ctx *c, const float *q, const float *k_pre, const float *k_post,
                                 const float *v, float *out, kvq_err *err)
{
    (void)k_post;
    EmuDec *E = (EmuDec *)user;
    kvq_decoder *d = E->d;
    const size_t kvd = (size_t)c->n_kv_heads * c->head_dim, B = d->n_seqs;
    E->kb.assign(k_pre, k_pre + B * kvd); // as the decoder's KVQ_DECODE_KV_FP16
    E->vb.assign(v, v + B * kvd);
    for (auto &x : E->kb) x = kvq_round_fp16(x);
    for (auto &x : E->vb) x = kvq_round_fp16(x);
    kvq_kvcache *cpu = d->cache[c->layer];
    for (size_t b = 0; b < B; b++) KVQ_TRY(kvq_kvcache_append(cpu, b, &E->kb[b * kvd], &E->vb[b * kvd], 1, err));
    kvq_kvcache_view v4v;
    kvq_kvcache_view_get(cpu, &v4v);
    const size_t H = c->n_kv_heads, D = c->head_dim, g = c->n_heads / H, nh = c->n_heads, np = (D + 1) / 2, len = v4v.len[0];
    const int kb = E->bits, vb = E->bits;
    std::vector<float2> rlo, rhi;
    rope_tables(v4v, D, E->rope_dim, d->max_tokens, rlo, rhi);
    std::vector<int> ilen(B);
    for (size_t b = 0; b < B; b++) ilen[b] = (int)v4v.len[b];
    const int gq = g <= 4 ? (int)g : (g % 4 == 0 ? 4 : g % 3 == 0 ? 3 : 1), qgroups = (int)((g + gq - 1) / gq);
    const size_t nq = len > v4v.n_exact ? len - v4v.n_exact : 0;
    const size_t ck = kb == 2 ? 16 : kb == 3 ? 32 : 8, npk = v4v.k_head_words / (kb == 3 ? 3 : 1) * (ck / 2);
    size_t chunk, splits;
    v4::plan(nq, B * H * qgroups, 132, 0, gq, (int)npk, 160 * 1024, &chunk, &splits);
    const size_t nslots = splits + 1;
    std::vector<float> part(B * nh * nslots * (D + 2), NAN), o(B * nh * D, NAN);
    DecP p;
    memset(&p, 0, sizeof p);
    p.kcodes = v4v.kcodes; p.vcodes = v4v.vcodes; p.krow = v4v.krow; p.vrow = v4v.vrow; p.kent = v4v.kent; p.vent = v4v.vent;
    p.vscale = v4v.vscale; p.klut = v4v.klut; p.vlevels = v4v.vlevels; p.kz = v4v.k_zcode; p.vz = v4v.v_zcode;
    p.rlo = rlo.data(); p.rhi = rhi.data(); p.k16 = v4v.k16; p.v16 = v4v.v16; p.q = q; p.part = part.data(); p.len = ilen.data();
    p.H = (int)H; p.D = (int)D; p.dpad = (int)(2 * np); p.np = (int)np; p.n_heads = (int)nh; p.g = (int)g; p.qgroups = qgroups;
    p.kw = (int)v4v.k_head_words; p.vw = (int)v4v.v_head_words; p.capq = (int)v4v.capq; p.n_exact = (int)v4v.n_exact;
    p.n_splits = (int)splits; p.chunk = (int)chunk; p.ent_cap = (int)v4v.ent_cap; p.nslots = (int)nslots;
    p.scale = 1.0f / sqrtf((float)D);
    KFn fn = pick(kb, vb, gq, 5);
    emu_launch({(unsigned)splits, (unsigned)(H * qgroups), (unsigned)B}, v4::NT4, v4::smem_bytes(gq, (int)npk, (int)chunk), [&] { fn(p); });
    if (p.n_exact) emu_launch({(unsigned)nh, (unsigned)B, 1}, 128, (D + p.n_exact + 1) * 4, [&] { exact_decode(p); });
    emu_launch({(unsigned)nh, (unsigned)B, 1}, 64, 0,
               [&] { combine(part.data(), o.data(), (int)nh, (int)D, (int)nslots, combine_slots(nslots, (size_t)p.n_exact)); });
    memcpy(out, o.data(), B * nh * D * 4);
    return KVQ_OK;
}

// one decode step of d through the forward with emu_dec_attend (kvq_decoder_step with another attend hook)
static kvq_status emu_dec_step(kvq_decoder *d, EmuDec *E, const int *tokens, kvq_err *err)
{
    const size_t len = kvq_decoder_len(d);
    for (size_t b = 0; b < d->n_seqs; b++) d->pos[b] = (int)len;
    kvq_hooks hk;
    memset(&hk, 0, sizeof hk);
    hk.user = E;
    hk.attend = emu_dec_attend;
    kvq_fwd_io io;
    memset(&io, 0, sizeof io);
    io.tokens = tokens; io.T = (int)d->n_seqs; io.pos0 = (int)len; io.pos = d->pos; io.targets = d->targets; io.hooks = &hk;
    io.logits = d->logits;
    kvq_fwd_result r;
    KVQ_TRY(kvq_forward_run(&d->fw, &io, &r, err));
    d->len++;
    return KVQ_OK;
}

// stories260K (../shared, or KVQ_SHARED), nuq3-1% from an in-process artifact, an 8-token prompt then `steps` greedy
// steps: every step's logits within tol (max |diff|) of the CPU decoder's, the tokens equal
static void run_decode(int steps, double tol)
{
    const char *sh = getenv("KVQ_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/models/llama2c/stories260K.bin", sh && *sh ? sh : "../shared");
    kvq_err err;
    memset(&err, 0, sizeof err);
    kvq_model m;
    char fp[65], ap[256];
    if (kvq_model_load(path, &m, &err) || kvq_identity_model(&m, fp, &err)) {
        printf("FAIL decode: %s\n", err.msg);
        n_fail++;
        return;
    }
    const int V = m.hp.vocab_size, P = 8;
    int cal[4 * 64], prompt[P];
    uint32_t x = 777;
    for (int i = 0; i < 4 * 64 + P; i++) {
        x = x * 1664525u + 1013904223u;
        (i < 4 * 64 ? cal[i] : prompt[i - 4 * 64]) = (int)((x >> 8) % (uint32_t)V);
    }
    snprintf(ap, sizeof ap, "/tmp/kvq_test_emu_decode_%ld.safetensors", (long)getpid());
    kvq_artifact_set set;
    const char *pp[1] = {ap};
    kvq_eval_scheme s;
    kvq_decoder a, b;
    EmuDec E;
    bool ok = !kvq_util_make_nuq_artifact(&m, cal, 4, 64, 3, 0.01, 0, false, fp, ap, &err) &&
              !kvq_artifact_set_load(&set, pp, 1, &m, fp, false, NULL, &err);
    remove(ap);
    if (!ok || kvq_eval_scheme_make("nuq3-1%", &set, &m.hp, &s, &err) ||
        kvq_decoder_init(&a, &m, &s, 1, P + steps, KVQ_DECODE_KV_FP16, &err) ||
        kvq_decoder_init(&b, &m, &s, 1, P + steps, KVQ_DECODE_KV_FP16, &err)) {
        printf("FAIL decode: %s\n", err.msg);
        n_fail++;
        return;
    }
    E.d = &b;
    E.bits = 3;
    E.rope_dim = (size_t)m.hp.rope_dim;
    int ta = -1, tb = -1;
    double worst = 0;
    bool same = true;
    for (int t = 0; t < P + steps - 1; t++) {
        const int tok_a = t < P ? prompt[t] : ta, tok_b = t < P ? prompt[t] : tb;
        if (kvq_decoder_step(&a, &tok_a, &err) || emu_dec_step(&b, &E, &tok_b, &err)) {
            printf("FAIL decode: step %d: %s\n", t, err.msg);
            n_fail++;
            return;
        }
        if (t + 1 < P) continue;
        for (int i = 0; i < V; i++) worst = fmax(worst, fabs((double)a.logits[i] - b.logits[i]));
        ta = kvq_decoder_argmax(a.logits, (size_t)V);
        tb = kvq_decoder_argmax(b.logits, (size_t)V);
        same = same && ta == tb;
    }
    const bool pass = same && worst <= tol;
    if (pass) n_pass++; else n_fail++;
    printf("%s decode nuq3-1%% stories260K    8-token prompt, %d steps, the v5 kernel in the CPU decoder vs the CPU decoder: tokens %s, "
           "logits max |diff| %.3g (tolerance %g)\n", pass ? "ok  " : "FAIL", steps, same ? "equal" : "DIFFER", worst, tol);
    fflush(stdout);
    kvq_decoder_free(&a);
    kvq_decoder_free(&b);
    kvq_artifact_set_free(&set);
    kvq_model_free(&m);
}

int main(int argc, char **argv)
{
    (void)argv;
    const char *qe = getenv("KVQ_TEST_QUICK");
    const int quick = argc > 1 || (qe && *qe && strcmp(qe, "0") != 0);
    /* the kernel inside real greedy decoding first (the model from ../shared: absent is a failure) */
    run_decode(2, 1e-2);
    const size_t l1[] = {1, 2, 40, 300, 1100};
    const size_t l2[] = {5, 700, 2600};
    check_fast_split();
    /* the append (kvcache_cuda_app.cuh) against the CPU cache's bytes: the tiny models' heads (head_dim 8 with GQA,
     * 16), SmolLM2's, a Llama head, odd head_dim; sinks, chunks that straddle the exact region, no outliers */
    {
        const size_t c1[] = {1, 1, 5, 1, 17, 1, 40}, c2[] = {3, 64, 1, 1}, c3[] = {1, 1, 1, 30};
        run_append(4, 8, 3, 3, 4, 1, 0.01, c1, 7, "app d8 3/3 per-head");
        run_append(4, 8, 2, 4, 1, 2, 0.01, c1, 7, "app d8 2/4 sink2");
        run_append(4, 16, 4, 2, 4, 1, 0.01, c1, 7, "app d16 4/2");
        run_append(3, 64, 3, 2, 3, 1, 0.01, c2, 4, "app smollm 3/2");
        run_append(2, 128, 4, 4, 1, 1, 0.05, c2, 4, "app llama 4/4 f5%");
        run_append(2, 9, 2, 3, 1, 0, 0.1, c3, 4, "app d9 2/3 no sink");
        run_append(2, 40, 3, 4, 1, 3, 0.0, c3, 4, "app d40 3/4 no outliers");
    }
    /* the batched step (kvq_kvcache_cuda_append_step): sequences at unequal lengths, one still in the exact region (2
     * sink tokens), the outlier store growing in the middle */
    {
        const size_t p1[] = {0, 3, 11}, p2[] = {5, 1, 9, 2};
        run_step(3, 2, 16, 4, 2, 2, 2, 0.05, p1, 12, 128, true, "step d16 4/2 sink2 burst");
        run_step(4, 3, 64, 3, 3, 3, 1, 0.01, p2, 8, 160, false, "step smollm 3/3");
    }
    run(2, 2, 128, 1, 4, 4, 1, 1, 1100, 0.01, l1, quick ? 3 : 5, 132, "llama-like 4/4");
    run(2, 3, 64, 3, 2, 2, 3, 1, 1100, 0.01, l1, quick ? 3 : 5, 132, "smollm-like 2/2 gqa3");
    run(1, 2, 9, 12, 2, 4, 1, 1, 300, 0.0, l1, 4, 4, "d9 2/4 gqa12");
    run(1, 1, 40, 2, 4, 2, 1, 0, 700, 0.1, l2, 2, 4, "d40 4/2 f0.1");
    run(1, 1, 256, 5, 4, 4, 1, 2, 700, 0.05, l2, 2, 4, "d256 4/4 gqa5");
    if (!quick) run(1, 1, 64, 1, 4, 2, 1, 1, 2600, 0.01, l2, 3, 2, "long 4/2");
    /* 3-bit codes (nuq3): keys in 3-word units with channels 10 and 21 straddling words, values through pv_mma3's
     * 16-dim half-unit slots; head_dim 40 (a unit and a quarter: padding channels and slots past head_dim), 3/4 and 2/3
     * mixes, grouped query heads */
    run(2, 2, 128, 1, 3, 3, 1, 1, 1100, 0.01, l1, quick ? 3 : 5, 132, "llama-like 3/3");
    run(2, 3, 64, 3, 3, 3, 3, 1, 1100, 0.01, l1, quick ? 3 : 4, 132, "smollm-like 3/3 gqa3");
    run(1, 1, 40, 2, 3, 4, 1, 0, 700, 0.1, l2, 2, 4, "d40 3/4 f0.1");
    run(1, 2, 96, 4, 2, 3, 1, 2, 700, 0.05, l2, 2, 4, "d96 2/3 gqa4");
    run(1, 1, 256, 5, 3, 2, 1, 2, 700, 0.05, l2, 2, 4, "d256 3/2 gqa5");
    /* 3-bit values at head_dim 40 (slots past head_dim: dims 40-63 padding; no outliers, so v5's partials must equal
     * v4's bit for bit) and 8 (stories260K's heads: one unit, two slots, 4 tables) */
    run(1, 2, 40, 2, 4, 3, 1, 0, 500, 0.0, l2, 2, 4, "d40 4/3 no sink, no outl.");
    run(3, 4, 8, 2, 3, 3, 4, 1, 300, 0.01, l1, 4, 4, "d8 3/3 gqa2 per-head");
    const size_t l3[] = {3, 100, 333, 900};
    //       B  H  D   g  kb vb  G   R   post  sink NT
    run_kivi(2, 2, 128, 1, 2, 2, 32, 128, true, 0, 900, l3, quick ? 3 : 4, 132, "kivi llama-like 2/2 g32");
    run_kivi(1, 3, 64, 3, 4, 4, 32, 64, true, 1, 900, l3, quick ? 3 : 4, 132, "kivi smollm 4/4 gqa3");
    /* the benchmark's k2gD / k4gD kernels: equal key and value bits at G = 128, one query head per block: the integer
     * path (2/2: 2-bit fields, 7 blocks per SM; 4/4: nibbles, P·V in mma.m16n8k16 per tile, 6 blocks per SM) */
    run_kivi(1, 2, 128, 1, 2, 2, 128, 128, true, 0, 900, l3 + 2, 2, 132, "kivi llama-like 2/2 g128"); // lengths 333, 900:
    run_kivi(1, 2, 128, 1, 4, 4, 128, 128, true, 0, 900, l3 + 2, 2, 4, "kivi llama-like 4/4 g128");   // kivi_fast runs
    /* 2/2 at G = 128 on the fp16 path (4 query heads per block: past imma_path), where the 2-bit values' nibble lies 4
     * bits up in every odd m-tile and is masked in place */
    run_kivi(1, 1, 128, 4, 2, 2, 128, 128, true, 0, 900, l3 + 2, 2, 8, "kivi 2/2 g128 gqa4 fp16 path");
    /* the integer tensor-core path (kv::imma_path: 2/2, G = head_dim = 128) with 2 query heads per block (8 key and 8
     * value B columns), a sink token and sequences 45 positions apart */
    run_kivi(3, 1, 128, 2, 2, 2, 128, 128, true, 1, 900, l3 + 2, 2, 8, "kivi 2/2 g128 gqa2 uneven", 45);
    run_kivi(3, 1, 128, 2, 4, 4, 128, 128, true, 1, 900, l3 + 2, 2, 8, "kivi 4/4 g128 gqa2 uneven", 45);
    /* the integer path at head_dim = G = 64 (SmolLM2's heads: 3 query heads per block, two n-tiles of B columns; 2-bit
     * keys take two fields of one word per k-step, 2-bit values' m-tiles two fields per lane group), and with 1, 2, 4 */
    run_kivi(2, 3, 64, 3, 2, 2, 64, 64, true, 1, 900, l3 + 2, 2, 132, "kivi smollm-like 2/2 g64 gqa3 integer path", 45);
    run_kivi(2, 3, 64, 3, 4, 4, 64, 64, true, 1, 900, l3 + 2, 2, 132, "kivi smollm-like 4/4 g64 gqa3 integer path", 45);
    run_kivi(1, 2, 64, 4, 2, 2, 64, 64, true, 0, 900, l3 + 2, 2, 8, "kivi 2/2 g64 gqa4 integer path");
    run_kivi(1, 2, 64, 4, 4, 4, 64, 64, true, 0, 900, l3 + 2, 2, 8, "kivi 4/4 g64 gqa4 integer path");
    run_kivi(1, 2, 64, 2, 2, 2, 64, 64, true, 0, 900, l3 + 2, 2, 8, "kivi 2/2 g64 gqa2 integer path");
    run_kivi(1, 2, 64, 1, 4, 4, 64, 64, true, 0, 900, l3 + 2, 2, 8, "kivi 4/4 g64 gqa1 integer path");
    /* 4/4 at G = 128 with 4 query heads per block: the fp16 path */
    run_kivi(1, 1, 128, 4, 4, 4, 128, 128, true, 0, 900, l3 + 2, 2, 8, "kivi 4/4 g128 gqa4 fp16 path");
    run_kivi(1, 1, 128, 5, 2, 4, 128, 128, true, 0, 900, l3, quick ? 3 : 4, 4, "kivi g128 2/4 gqa5");
    run_kivi(1, 2, 48, 2, 4, 2, 16, 32, true, 2, 900, l3, quick ? 2 : 4, 4, "kivi d48 g16 4/2");
    run_kivi(1, 1, 256, 4, 4, 4, 64, 0, true, 0, 700, l3, quick ? 2 : 4, 4, "kivi d256 g64 r0 4/4");
    run_kivi(1, 2, 40, 2, 3, 2, 8, 16, false, 1, 700, l3, quick ? 2 : 4, 4, "kivi pre-rope 3/2 g8");
    /* kivi_generic's dim layouts: head_dim 2 mod 4 (two dims per P·V thread, 4-byte ring loads) and odd (the last pair
     * half empty, 2-byte ring loads), pre- and post-RoPE */
    run_kivi(1, 2, 18, 2, 2, 4, 6, 18, false, 1, 500, l3, quick ? 2 : 4, 4, "kivi d18 pre-rope 2/4 g6");
    run_kivi(2, 1, 9, 3, 4, 3, 3, 9, true, 0, 500, l3, quick ? 2 : 4, 4, "kivi d9 4/3 g3");
    /* value groups that do not fill the last P·V pass (passes of 2 groups at G = 32, 4 at G = 16) */
    run_kivi(1, 1, 96, 2, 2, 4, 32, 32, true, 0, 700, l3, quick ? 2 : 4, 4, "kivi d96 g32 2/4");
    run_kivi(1, 2, 32, 1, 4, 2, 16, 16, true, 0, 700, l3, quick ? 2 : 4, 4, "kivi d32 g16 4/2");
    /* long chunks (max_splits 1: one block takes ~2500 positions): small p·s and q·s must keep their fp16 low parts
     * (the operands' power-of-two scaling; without it this case drifted to 2e-5..6e-5) */
    const size_t l4[] = {2625};
    run_kivi(1, 1, 64, 1, 4, 4, 32, 128, true, 0, 2700, l4, 1, 132, "kivi long chunk 4/4");
    /* more than 8 k-tiles per warp (the P·V flush blocks and the prefetch across them) at groups 128 (4 query heads per
     * block: the fp16 path) and 16 */
    run_kivi(1, 1, 128, 4, 4, 4, 128, 128, true, 0, 2700, l4, 1, 132, "kivi long chunk g128 4/4 gqa4");
    if (!quick) run_kivi(1, 1, 32, 1, 2, 2, 16, 16, true, 0, 2700, l4, 1, 132, "kivi long chunk g16 2/2");
    /* ... and on the integer path: ~650 positions per warp, the s32 sums exact over all of them */
    run_kivi(1, 1, 128, 1, 2, 2, 128, 128, true, 0, 2700, l4, 1, 132, "kivi long chunk g128 2/2");
    run_kivi(1, 1, 128, 1, 4, 4, 128, 128, true, 0, 2700, l4, 1, 132, "kivi long chunk g128 4/4");
    run_kivi(1, 1, 64, 3, 2, 2, 64, 64, true, 0, 2700, l4, 1, 132, "kivi long chunk g64 2/2 gqa3");
    run_kivi(1, 1, 64, 3, 4, 4, 64, 64, true, 0, 2700, l4, 1, 132, "kivi long chunk g64 4/4 gqa3");
    /* sequences of different lengths (45 positions apart): per-sequence fast / generic ranges and boundaries */
    run_kivi(3, 2, 64, 2, 2, 4, 32, 64, true, 1, 900, l3, quick ? 3 : 4, 8, "kivi uneven 2/4", 45);
    // one SM: 12 rows >= 4 per SM, so combine_par (the 128-thread merge) instead of combine_par_wide
    run_kivi(3, 2, 64, 2, 2, 4, 32, 64, true, 1, 900, l3, 2, 1, "kivi uneven 2/4 narrow combine", 45);
    /* more than one wave of kivi_fast blocks on one SM: the last chunk cut in two shorter splits (kv::fast_plan; the
     * shorter sequences end before them), and the tail in one split per row at head_dim 128 (kv::tail_plan) */
    const size_t l6[] = {1100, 1800};
    run_kivi(3, 2, 128, 1, 2, 2, 128, 128, true, 0, 1800, l6, quick ? 1 : 2, 1, "kivi g128 2/2 waves", 200);
    run_kivi(3, 2, 128, 2, 4, 4, 128, 128, true, 1, 1800, l6, 1, 1, "kivi g128 4/4 gqa2 waves", 300);
    /* tiny queries (1e-36, so max |q|·max s < 2^-114): the operands' power-of-two scale must stay finite (it overflowed to inf: NaN scores) */
    const size_t l5[] = {333};
    run_kivi(1, 1, 64, 1, 2, 2, 32, 64, true, 0, 400, l5, 1, 8, "kivi tiny queries", 0, 1e-36f);
    run_kivi(1, 1, 128, 1, 2, 2, 128, 128, true, 0, 400, l5, 1, 8, "kivi tiny queries g128 2/2", 0, 1e-36f); // imma_scale clamps
    run_kivi(1, 1, 128, 1, 4, 4, 128, 128, true, 0, 400, l5, 1, 8, "kivi tiny queries g128 4/4", 0, 1e-36f);
    run_kivi(1, 1, 64, 3, 2, 2, 64, 64, true, 0, 400, l5, 1, 8, "kivi tiny queries g64 2/2 gqa3", 0, 1e-36f);
    printf("emu: %d passed, %d failed\n", n_pass, n_fail);
    /* the summary line scripts/run_tests.sh reads (the format of Check's) */
    printf("%d%%: Checks: %d, Failures: %d, Errors: 0\n", n_pass + n_fail ? 100 * n_pass / (n_pass + n_fail) : 0, n_pass + n_fail,
           n_fail);
    return n_fail || !n_pass ? 1 : 0;
}
