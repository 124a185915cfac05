/* hadamard.c — orthonormal Walsh–Hadamard rotation of cached vectors; see hadamard.h. */
#include "hadamard.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void kvq_fwht(float *x, size_t n)
{
    double b[KVQ_HADAMARD_MAX];
    for (size_t i = 0; i < n; i++) b[i] = x[i];
    for (size_t h = 1; h < n; h *= 2)
        for (size_t i = 0; i < n; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                double a = b[j], c = b[j + h];
                b[j] = a + c;
                b[j + h] = a - c;
            }
    double s = 1.0 / sqrt((double)n);
    for (size_t i = 0; i < n; i++) x[i] = (float)(b[i] * s);
}

size_t kvq_hadamard_block(size_t head_dim, char side)
{
    if (head_dim == 0 || head_dim > KVQ_HADAMARD_MAX) return 0;
    size_t p = head_dim & (~head_dim + 1); /* the largest power of two dividing head_dim */
    if (p < 2) return 0;
    return side == 'v' && p > 64 ? 64 : p;
}

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int kvq_rht_sign(uint64_t seed, size_t d) { return splitmix64(splitmix64(seed) + (uint64_t)d) >> 63 ? -1 : 1; }

kvq_status kvq_rotation_check(const kvq_rotation *r, size_t head_dim, kvq_err *err)
{
    if (!r || r->kind == KVQ_ROT_NONE) return KVQ_OK;
    if (r->kind != KVQ_ROT_HADAMARD && r->kind != KVQ_ROT_RHT)
        return kvq_fail(err, KVQ_EINVAL, "rotation: unknown kind %d", (int)r->kind);
    if (!kvq_hadamard_block(head_dim, 'k'))
        return kvq_fail(err, KVQ_EINVAL,
                        "+%s: head_dim %zu has no power-of-two block >= 2 dividing it (or exceeds %d): the Walsh-Hadamard "
                        "rotation needs one",
                        kvq_rotation_kind_name(r->kind), head_dim, KVQ_HADAMARD_MAX);
    return KVQ_OK;
}

kvq_status kvq_rotation_apply(const kvq_rotation *r, float *x, size_t n_tokens, size_t kv_dim, size_t head_dim, char side,
                              bool inverse, kvq_err *err)
{
    if (!r || r->kind == KVQ_ROT_NONE) return KVQ_OK;
    if (side != 'k' && side != 'v') return kvq_fail(err, KVQ_EINVAL, "rotation: side '%c': expected 'k' or 'v'", side);
    if (head_dim == 0 || kv_dim % head_dim)
        return kvq_fail(err, KVQ_EINVAL, "rotation: head_dim %zu does not divide kv_dim %zu", head_dim, kv_dim);
    KVQ_TRY(kvq_rotation_check(r, head_dim, err));
    size_t nb = kvq_hadamard_block(head_dim, side);
    bool rht = r->kind == KVQ_ROT_RHT;
    float sg[KVQ_HADAMARD_MAX];
    for (size_t d = 0; rht && d < head_dim; d++) sg[d] = (float)kvq_rht_sign(r->seed, d);
    size_t n_vec = n_tokens * (kv_dim / head_dim);
    /* each head vector on its own: the same bits on any thread count */
#pragma omp parallel for schedule(static) if (n_vec * head_dim > (1u << 16))
    for (size_t i = 0; i < n_vec; i++) {
        float *h = x + i * head_dim;
        if (rht && !inverse)
            for (size_t d = 0; d < head_dim; d++) h[d] *= sg[d]; /* exact: a sign flip */
        for (size_t b = 0; b < head_dim; b += nb) kvq_fwht(h + b, nb);
        if (rht && inverse)
            for (size_t d = 0; d < head_dim; d++) h[d] *= sg[d];
    }
    return KVQ_OK;
}

const char *kvq_rotation_kind_name(kvq_rot_kind k)
{
    return k == KVQ_ROT_HADAMARD ? "hadamard" : k == KVQ_ROT_RHT ? "rht" : "none";
}

bool kvq_rotation_kind_parse(const char *name, kvq_rot_kind *out)
{
    static const kvq_rot_kind all[] = {KVQ_ROT_NONE, KVQ_ROT_HADAMARD, KVQ_ROT_RHT};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (name && !strcmp(name, kvq_rotation_kind_name(all[i]))) {
            *out = all[i];
            return true;
        }
    return false;
}

void kvq_rotation_spec(const kvq_rotation *r, char *buf, size_t n)
{
    if (!n) return;
    if (!r || r->kind == KVQ_ROT_NONE) buf[0] = 0;
    else if (r->kind == KVQ_ROT_RHT && r->seed) snprintf(buf, n, "+rht%llu", (unsigned long long)r->seed);
    else snprintf(buf, n, "+%s", kvq_rotation_kind_name(r->kind));
}

bool kvq_rotation_equal(const kvq_rotation *a, const kvq_rotation *b)
{
    kvq_rot_kind ka = a ? a->kind : KVQ_ROT_NONE, kb = b ? b->kind : KVQ_ROT_NONE;
    if (ka != kb) return false;
    return ka != KVQ_ROT_RHT || a->seed == b->seed;
}

void kvq_rotation_describe(const kvq_rotation *r, char *buf, size_t n)
{
    if (!n) return;
    if (!r || r->kind == KVQ_ROT_NONE) snprintf(buf, n, "unrotated");
    else if (r->kind == KVQ_ROT_RHT) snprintf(buf, n, "rht-rotated (seed %llu)", (unsigned long long)r->seed);
    else snprintf(buf, n, "%s-rotated", kvq_rotation_kind_name(r->kind));
}
