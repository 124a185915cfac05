/* kvcache_synth.h — the random inputs the packed-KV-cache tests share
 * (tests/test_kvcache.c, tests/gpu/test_kvcache_cuda.c, tests/gpu/emu/emu_kvcache_dec.cc):
 * xorshift64 uniform / Gaussian numbers, fp16-representable heavy-tailed K/V rows with
 * per-channel scales and offsets for keys, and sorted random NUQ levels spanning [-1, 1].
 * The includer defines KVCACHE_SYNTH_SEED first (each test keeps its own sequence) and
 * includes quant.h (kvq_round_fp16). C and C++. */
#ifndef KVCACHE_SYNTH_H
#define KVCACHE_SYNTH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifndef KVCACHE_SYNTH_SEED
#error "define KVCACHE_SYNTH_SEED before including kvcache_synth.h"
#endif

static uint64_t synth_rng = KVCACHE_SYNTH_SEED;

/* uniform in (0, 1) */
static double unif(void)
{
    synth_rng ^= synth_rng << 13; synth_rng ^= synth_rng >> 7; synth_rng ^= synth_rng << 17;
    return ((double)(synth_rng >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

/* x [n_tokens][C]: N(0,1) (keys: scale 1 + c%4, offset c%3 - 1), 3% of values ×6, rounded to fp16 */
static void fill(float *x, size_t n_tokens, size_t C, int keys)
{
    for (size_t t = 0; t < n_tokens; t++)
        for (size_t c = 0; c < C; c++) {
            double v = gauss() * (keys ? 1 + (double)(c % 4) : 1.0) + (keys ? (double)(c % 3) - 1 : 0.0);
            if (unif() < 0.03) v *= 6;
            x[t * C + c] = kvq_round_fp16((float)v);
        }
}

/* n sorted levels, uniform in (-1, 1), the ends set to -1 and 1, rounded to fp16 */
static void sorted_levels(float *lv, size_t n)
{
    for (size_t i = 0; i < n; i++) lv[i] = (float)(2 * unif() - 1);
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && lv[j] < lv[j - 1]; j--) { float t = lv[j]; lv[j] = lv[j - 1]; lv[j - 1] = t; }
    lv[0] = -1;
    lv[n - 1] = 1;
    for (size_t i = 0; i < n; i++) lv[i] = kvq_round_fp16(lv[i]); /* fp16 numbers, as artifacts' value levels are */
}

#endif
