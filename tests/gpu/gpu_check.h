/* gpu_check.h — what the parts of tests/gpu/gpu_check share (see gpu_check.c's header for the checks): the scheme
 * lists and synthetic tables, the CPU-vs-GPU comparison (gpu_check.c), the synthetic models and the backward
 * helpers (gpu_check_synth.c), the model families and the real model (gpu_check_models.c). */
#ifndef KVQ_GPU_CHECK_H
#define KVQ_GPU_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_info.h"
#include "device.h"
#include "backward.h"
#include "forward.h"
#include "forward_cuda.h"
#include "kv_desc.h"
#include "model.h"
#include "ops.h"
#include "quant_fp4.h"
#include "select.h"
#include "text.h"
#include "tokenizer.h"

#define DIE(...) do { fprintf(stderr, "gpu_check: " __VA_ARGS__); fprintf(stderr, "\n"); exit(2); } while (0)
#define CHECK(expr) do { kvq_err e_ = {0}; if ((expr) != KVQ_OK) DIE("%s: %s", #expr, e_.msg); } while (0)
#define TRYE(expr) do { if ((expr) != KVQ_OK) DIE("%s: %s", #expr, err.msg); } while (0)

typedef struct {
    int n_layers;
    size_t kvd;
    float *lower, *upper;      /* [n_layers][kvd] */
    float *k_levels, *v_levels;/* [1 << bits] shared by all layers */
    kvq_kv_layer_tables *lt;   /* [n_layers] */
    kvq_artifact *fam_art;     /* synthetic family tables (wkvq shift/scale, cq codebooks, lowrank bases), gpu_check.c fam_tables */
} synth_tables;

typedef struct {
    synth_tables *st;
    int T;
} calib_user;

#define MAX_SCHEMES 48
typedef struct {
    kvq_kv_desc d[MAX_SCHEMES];
    char name[MAX_SCHEMES][64];
    int n;
} scheme_list;

typedef struct {
    double logit_rel, ppl_cpu, ppl_gpu, ppl_rel, sec_cpu, sec_gpu;
} cmp_row;

/* Observe hook that records k_att and v_att of one layer (for the host-path check). */
typedef struct {
    int layer;
    float *k, *v;
    size_t n;
    int calls;
} obs_rec;

typedef struct {
    int n_layers, T, P;
    size_t kvd;
    kvq_grad_store st;
    float *fk, *fv; /* Fisher: squared dk_pre / dv, [n_layers][T][kvd] */
} grad_rec;

/* gpu_check.c: schemes and comparison */
void add_scheme(scheme_list *L, const char *family, int bits, size_t group, size_t residual, double f, size_t sink,
                kvq_key_stage stage, const synth_tables *st, const char *suffix);
int bitexact_all(kvq_engine *gpu, const kvq_hparams *hp, const scheme_list *L, const int *tokens, int T,
                 const kvq_prefix *px);
kvq_status calib_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err);
cmp_row compare(kvq_engine *cpu, kvq_engine *gpu, const kvq_kv_desc *d, const int32_t *tokens, int n_windows, int T,
                const kvq_prefix *px, int mode, float *lc, float *lg);
void add_variant(scheme_list *L, const char *family, int bits, int variant, size_t sink, const char *suffix);
void default_schemes(scheme_list *L, const synth_tables *st, int hd, int sink, size_t kivi2_r);
/* give the last scheme of L a rotation (+hadamard / +rht) and rename it */
void rotate_last(scheme_list *L, kvq_rotation r);
/* does the GPU engine run d natively (fp32, or a family CUDA part without rotation)? else the host hook */
int gpu_native(const kvq_kv_desc *d);
void fix_bits(scheme_list *L, synth_tables *st3);
void header(void);
int is_exact_scheme(const kvq_kv_desc *d);
double now_s(void);
kvq_status rec_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err);
double rel_l2(const float *a, const float *b, size_t n);
int report_row(const char *name, const char *path, cmp_row r, int exact);
void synth_alloc(synth_tables *st, const kvq_hparams *hp, int bits);
void synth_free(synth_tables *st);

/* gpu_check_synth.c: synthetic models, backward CPU vs GPU */
int bwd_compare(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const kvq_kv_desc *d, int host_hook,
                const char *name, const int32_t *tokens, int T, const kvq_prefix *px, double tol);
void bwd_header(void);
void fill(float *x, size_t n, float a, uint64_t *s);
/* a random-weight model (fp32 weights, draws from seed): biases, per-head q/k norms, a sliding window
 * from layer 1 and YaRN when asked (gpu_check_synth.c) */
void synth_model_ex(kvq_model *m, int n_layers, int dim, int n_heads, int n_kv, int head_dim, int hidden, int vocab, int bias,
                    int qk_norm, int window, int yarn, uint64_t seed);
void fisher_of(grad_rec *g);
void grad_rec_alloc(grad_rec *g, const kvq_hparams *hp, int T, int P);
void grad_rec_free(grad_rec *g);
uint64_t rng_next(uint64_t *s);
float rng_u(uint64_t *s);
int run_backward_synthetic(kvq_device gdev);
int run_synthetic(kvq_device gdev);
/* gpu_check --attn: the bf16 tensor-core attention vs the fp32 kernel (gpu_check_attn.c) */
int run_attn_check(void);
int stats_check(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const kvq_kv_desc *d, const char *name,
                const int32_t *tokens, int T, const kvq_prefix *px, int layer);

/* gpu_check_pipeline.c: the CUDA pipeline stages vs the whole model (gpu_check --pipeline) */
int run_pipeline_check(void);

/* gpu_check_models.c: the model families, the real model */
int run_families(const char *dir, kvq_device gdev);
/* gpu_check_decode.c: --decode (GPU vs CPU greedy decoding on the packed KV cache); model NULL = the tiny models */
int run_decode_check(const char *model, const char *artifact, const char *scheme, const char *text, int steps, int prompt_len,
                     int prompts);
int run_fisher_model(const char *model_path, const char *text_path, int ctx, int n_win, kvq_device gdev);
int run_model(const char *model_path, const char *text_path, int ctx, int check_windows, int max_windows, int bench,
              kvq_device gdev);

#endif
