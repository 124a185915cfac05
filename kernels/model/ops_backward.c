/* ops_backward.c — fp32 and float64 builds of ops_backward.inc; see ops_backward.h. */
#include "ops_backward.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

#include "ops.h"

/* the fp32 LM head reads a kvq_mat (converted block by block into wbuf when not fp32) */
#define R float
#define FN(name) name
#define GEMM cblas_sgemm
#define EXP(x) expf(x)
#define WPARAMS const kvq_mat *wm, float *wbuf
#define WSETUP const float *w = kvq_mat_f32(wm)
#define WBLOCK(v0, nv) (w ? w + (size_t)(v0) * dim : (kvq_mat_block(wm, (v0), (nv), wbuf), wbuf))
#define WROW(r) (w ? w + (size_t)(r) * dim : (kvq_mat_rows(wm, (r), 1, wbuf), wbuf))
#include "ops_backward.inc"
#undef R
#undef FN
#undef GEMM
#undef EXP
#undef WPARAMS
#undef WSETUP
#undef WBLOCK
#undef WROW

void kvq_linear_bwd_mat(float *dx, const float *dy, const kvq_mat *w, int T, float beta, float *scratch, size_t scratch_floats)
{
    const int in = w->cols, out = w->rows;
    const float *wf = kvq_mat_f32(w);
    if (wf) {
        kvq_linear_bwd(dx, dy, wf, T, in, out, beta);
        return;
    }
    int nb = (int)(scratch_floats / (size_t)in);
    if (nb < 1) nb = 1;
    for (int r0 = 0; r0 < out; r0 += nb) {
        int n = out - r0 < nb ? out - r0 : nb;
        kvq_mat_block(w, r0, n, scratch);
        /* dx[T][in] (+)= dy[:, r0:r0+n] . W[r0:r0+n, :] */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, in, n, 1.0f, dy + r0, out, scratch, in, r0 ? 1.0f : beta, dx, in);
    }
}

#define R double
#define FN(name) name##_f64
#define GEMM cblas_dgemm
#define EXP(x) exp(x)
#define WPARAMS const double *w
#define WSETUP (void)0
#define WBLOCK(v0, nv) (w + (size_t)(v0) * dim)
#define WROW(r) (w + (size_t)(r) * dim)
#include "ops_backward.inc"
#undef R
#undef FN
#undef GEMM
#undef EXP
