/* ops_backward.c — fp32 and float64 builds of ops_backward.inc; see ops_backward.h. */
#include "ops_backward.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

#define R float
#define FN(name) name
#define GEMM cblas_sgemm
#define EXP(x) expf(x)
#include "ops_backward.inc"
#undef R
#undef FN
#undef GEMM
#undef EXP

#define R double
#define FN(name) name##_f64
#define GEMM cblas_dgemm
#define EXP(x) exp(x)
#include "ops_backward.inc"
#undef R
#undef FN
#undef GEMM
#undef EXP
