/* runtime.c — the runtime packed cache (kernels/kvcache) configured from an
 * artifact through its family (family.h `kvcache_config`). */
#include "family.h"

kvq_status kvq_kvcache_config_from_artifact(kvq_kvcache_config *cfg, const kvq_artifact *a, size_t layer, kvq_err *err)
{
    if (!cfg || !a) return kvq_fail(err, KVQ_EINVAL, "kvcache config from artifact: NULL argument");
    const kvq_artifact_params *p = &a->p;
    if (layer >= p->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "artifact: layer %zu: expected < n_layers %zu", layer, p->n_layers);
    if (!p->method || !p->method->kvcache_config) {
        char who[160] = "";
        size_t n, len = 0;
        const kvq_family *const *f = kvq_families(&n);
        for (size_t i = 0; i < n; i++)
            if (f[i]->kvcache_config && len < sizeof who)
                len += (size_t)snprintf(who + len, sizeof who - len, "%s%s", len ? " and " : "", f[i]->name);
        return kvq_fail(err, KVQ_EUNSUPPORTED, "artifact: method %s: the packed cache supports %s",
                        p->method ? p->method->name : "?", who);
    }
    if (p->rotation.kind != KVQ_ROT_NONE) {
        char rd[64];
        kvq_rotation_describe(&p->rotation, rd, sizeof rd);
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "artifact: fitted on %s K / V (kvq.rotation): the packed cache has no rotation; calibrate without "
                        "--rotate for it", rd);
    }
    cfg->n_kv_heads = p->n_kv_heads;
    cfg->head_dim = p->head_dim;
    cfg->k_bits = p->k_bits;
    cfg->v_bits = p->v_bits;
    cfg->n_sink = p->n_sink;
    cfg->post_rope = p->post_rope;
    return p->method->kvcache_config(cfg, a, layer, err);
}
