/* vllm_scales.c — FP8 k_scale / v_scale export for vLLM; see vllm_scales.h. */
#include "vllm_scales.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outfile.h"

const char *kvq_kv_scale_form_name(kvq_kv_scale_form f)
{
    return f == KVQ_SCALES_COMPRESSED_TENSORS ? "compressed-tensors" : f == KVQ_SCALES_MODELOPT ? "modelopt" : "vllm";
}

char *kvq_kv_scale_name(char *buf, size_t n, kvq_kv_scale_form form, size_t layer, int is_v)
{
    if (form == KVQ_SCALES_MODELOPT)
        snprintf(buf, n, "model.layers.%zu.self_attn.%s", layer, is_v ? "v_proj.v_scale" : "k_proj.k_scale");
    else
        snprintf(buf, n, "model.layers.%zu.self_attn.%s", layer, is_v ? "v_scale" : "k_scale");
    return buf;
}

char *kvq_vllm_scale_name(char *buf, size_t n, size_t layer, int is_v)
{
    return kvq_kv_scale_name(buf, n, KVQ_SCALES_VLLM, layer, is_v);
}

kvq_status kvq_ct_config_write(const char *path, int per_head, kvq_err *err)
{
    kvq_outfile o;
    KVQ_TRY(kvq_outfile_open(&o, path, err));
    fprintf(o.f,
            "{\n"
            "  \"quantization_config\": {\n"
            "    \"quant_method\": \"compressed-tensors\",\n"
            "    \"kv_cache_scheme\": {\n"
            "      \"num_bits\": 8,\n"
            "      \"type\": \"float\",\n"
            "      \"strategy\": \"%s\",\n"
            "      \"dynamic\": false,\n"
            "      \"symmetric\": true\n"
            "    }\n"
            "  }\n"
            "}\n",
            per_head ? "attn_head" : "tensor");
    return kvq_outfile_commit(&o, err);
}

kvq_status kvq_vllm_scales_write(const char *path, const kvq_vllm_kv_scales *s, const kvq_st_kv *meta,
                                 size_t n_meta, kvq_err *err)
{
    if (!s || !s->n_layers || !s->k_scale || !s->v_scale)
        return kvq_fail(err, KVQ_EINVAL, "%s: vLLM scales: no layers or no scale arrays", path);
    if (s->per_head && !s->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "%s: vLLM per-head scales with n_kv_heads 0", path);
    if ((unsigned)s->form > KVQ_SCALES_MODELOPT) return kvq_fail(err, KVQ_EINVAL, "%s: unknown scale form %d", path, (int)s->form);
    if (s->per_head && s->form == KVQ_SCALES_MODELOPT)
        return kvq_fail(err, KVQ_EINVAL, "%s: the modelopt form has one k_scale / v_scale per layer (k_proj.k_scale, "
                        "shape [1]); per-KV-head scales exist in the vllm and compressed-tensors forms only", path);
    const size_t per = s->per_head ? s->n_kv_heads : 1;
    size_t total, n_entries;
    if (kvq_mul_size(s->n_layers, per, &total) || kvq_mul_size(s->n_layers, 2, &n_entries))
        return kvq_fail(err, KVQ_ENOMEM, "%s: vLLM scales: %zu layers x %zu overflows", path, s->n_layers, per);
    for (size_t i = 0; i < total; i++)
        for (int v = 0; v < 2; v++) {
            const float x = (v ? s->v_scale : s->k_scale)[i];
            if (!(isfinite(x) && x > 0.0f)) {
                if (s->per_head)
                    return kvq_fail(err, KVQ_EINVAL, "%s: layer %zu %s_scale[%zu] = %g (expected finite and > 0)", path,
                                    i / per, v ? "v" : "k", i % per, (double)x);
                return kvq_fail(err, KVQ_EINVAL, "%s: layer %zu %s_scale = %g (expected finite and > 0)", path, i,
                                v ? "v" : "k", (double)x);
            }
        }
    for (size_t m = 0; m < n_meta; m++)
        if (meta[m].key && strcmp(meta[m].key, "format") == 0)
            return kvq_fail(err, KVQ_EINVAL, "%s: metadata key \"format\" is reserved (always \"pt\")", path);

    kvq_st_entry *ent = calloc(n_entries, sizeof *ent);
    char *names = calloc(n_entries, 64);
    kvq_st_kv *kv = calloc(n_meta + 1, sizeof *kv);
    kvq_status st = KVQ_OK;
    if (!ent || !names || !kv) {
        st = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %zu scale entries", path, n_entries);
        goto done;
    }
    for (size_t l = 0; l < s->n_layers; l++)
        for (int v = 0; v < 2; v++) {
            kvq_st_entry *e = &ent[2 * l + (size_t)v];
            e->name = kvq_kv_scale_name(names + 64 * (2 * l + (size_t)v), 64, s->form, l, v);
            e->dtype = KVQ_ST_F32;
            if (s->form == KVQ_SCALES_VLLM) { /* [] or [H] */
                e->n_dims = s->per_head ? 1 : 0;
                e->shape[0] = s->per_head ? s->n_kv_heads : 0;
            } else if (s->per_head) { /* compressed-tensors attn_head: [H, 1, 1] */
                e->n_dims = 3;
                e->shape[0] = s->n_kv_heads;
                e->shape[1] = e->shape[2] = 1;
            } else { /* compressed-tensors tensor, modelopt: [1] */
                e->n_dims = 1;
                e->shape[0] = 1;
            }
            e->data = (v ? s->v_scale : s->k_scale) + l * per;
        }
    kv[0] = (kvq_st_kv){"format", "pt"};
    if (n_meta) memcpy(kv + 1, meta, n_meta * sizeof *kv);
    st = kvq_safetensors_write(path, ent, n_entries, kv, n_meta + 1, err);
done:
    free(ent);
    free(names);
    free(kv);
    return st;
}
