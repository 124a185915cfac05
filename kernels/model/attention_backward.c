/* attention_backward.c — fp32 and float64 builds of attention_backward.inc,
 * and the shared workspace; see attention_backward.h. */
#include "attention_backward.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#define BK KVQ_ATTN_BWD_BK

/* Hot row/block functions are compiled for several ISAs (GCC target_clones,
 * chosen at load time). -std=c17 implies -ffp-contract=off and the vectorised
 * loops are elementwise (no reassociated reductions), so every clone gives
 * bit-identical results. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVQ_BWD_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_BWD_HOT
#endif

/* per-thread scratch elements: score row (max_P+max_T) + 4 transposed K/V
 * blocks [hd][BK] + 4 transposed gradient blocks [hd][BK] + p and dsq per head
 * of a group (4 x [n_heads][BK]) + 4 dq partial rows [hd] */
static size_t scratch_elems(int max_T, int max_P, int n_heads, int hd)
{
    return (size_t)max_P + max_T + 8 * (size_t)BK * hd + 4 * (size_t)n_heads * BK + 4 * (size_t)hd;
}

kvq_status kvq_attn_grad_ws_init(kvq_attn_grad_ws *ws, int max_T, int max_P, int n_heads, int n_kv_heads, int head_dim,
                                 int n_threads, size_t elem, kvq_err *err)
{
    memset(ws, 0, sizeof *ws);
    if (max_T <= 0 || max_P < 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || n_threads <= 0 ||
        (elem != sizeof(float) && elem != sizeof(double)))
        return kvq_fail(err, KVQ_EINVAL,
                        "attention gradient workspace: bad sizes (max_T %d, max_P %d, heads %d/%d, head_dim %d, threads %d, elem %zu)",
                        max_T, max_P, n_heads, n_kv_heads, head_dim, n_threads, elem);
    size_t ld = (size_t)max_P + max_T, nkb = (ld + BK - 1) / BK, per = scratch_elems(max_T, max_P, n_heads, head_dim);
    size_t n_kt, n_kq, n_D, n_dqp, n_s, per_g;
    const int rep = n_heads / n_kv_heads;
    if (kvq_mul_size(nkb * max_T, (size_t)rep * head_dim * elem, &per_g))
        return kvq_fail(err, KVQ_ENOMEM, "attention gradient workspace: size overflows (max_T %d, max_P %d)", max_T, max_P);
    size_t gc = per_g ? KVQ_ATTN_BWD_DQP_MAX / per_g : (size_t)n_kv_heads;
    ws->g_chunk = gc < 1 ? 1 : gc > (size_t)n_kv_heads ? n_kv_heads : (int)gc;
    if (kvq_mul_size((size_t)n_kv_heads * head_dim, ld * elem, &n_kt) || kvq_mul_size((size_t)n_kv_heads * head_dim, (size_t)max_T * elem, &n_kq) ||
        kvq_mul_size((size_t)n_heads * max_T, elem, &n_D) || kvq_mul_size(per_g, (size_t)ws->g_chunk, &n_dqp) ||
        kvq_mul_size((size_t)n_threads * per, elem, &n_s))
        return kvq_fail(err, KVQ_ENOMEM, "attention gradient workspace: size overflows (max_T %d, max_P %d)", max_T, max_P);
    ws->max_T = max_T;
    ws->max_P = max_P;
    ws->n_heads = n_heads;
    ws->n_kv_heads = n_kv_heads;
    ws->head_dim = head_dim;
    ws->n_threads = n_threads;
    ws->elem = elem;
    ws->scratch_per_thread = per;
    ws->kt = malloc(n_kt);
    ws->kqt = malloc(n_kq);
    ws->D = malloc(n_D);
    ws->dqp = malloc(n_dqp);
    ws->scratch = malloc(n_s);
    if (!ws->kt || !ws->kqt || !ws->D || !ws->dqp || !ws->scratch) {
        kvq_attn_grad_ws_free(ws);
        return kvq_fail(err, KVQ_ENOMEM, "attention gradient workspace: cannot allocate %.1f MiB",
                        (double)(n_kt + n_kq + n_D + n_dqp + n_s) / (1 << 20));
    }
    return KVQ_OK;
}

void kvq_attn_grad_ws_free(kvq_attn_grad_ws *ws)
{
    free(ws->kt);
    free(ws->kqt);
    free(ws->D);
    free(ws->dqp);
    free(ws->scratch);
    memset(ws, 0, sizeof *ws);
}

#define R float
#define FN(name) name
#define ARGS kvq_attn_grad_args
#define EXP(x) expf(x)
#include "attention_backward.inc"
#undef R
#undef FN
#undef ARGS
#undef EXP

#define R double
#define FN(name) name##_f64
#define ARGS kvq_attn_grad_args_f64
#define EXP(x) exp(x)
#include "attention_backward.inc"
#undef R
#undef FN
#undef ARGS
#undef EXP
