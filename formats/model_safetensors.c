/* model_safetensors.c — Hugging Face (transformers) checkpoint loader for the
 * Llama, Qwen2, Qwen3 and Mistral families.
 *
 * Input (kvq_hf_checkpoint_paths): a checkpoint directory, its config.json, a
 * *.safetensors file or a *.safetensors.index.json. In a directory,
 * model.safetensors is used if present, else model.safetensors.index.json
 * (the order of transformers' from_pretrained). config.json is read from the
 * same directory. A sharded index is {"metadata": {...}, "weight_map":
 * {tensor name: shard file name}}; every shard it names is opened (a missing
 * or corrupt shard is an error naming the index entry and the shard), and each
 * required tensor must be in the shard the weight_map names.
 *
 * config.json (transformers LlamaConfig / Qwen2Config / Qwen3Config /
 * MistralConfig): model_type "llama", "qwen2", "qwen3" or "mistral"; when
 * present, architectures must list the matching *ForCausalLM class.
 *   required  hidden_size, intermediate_size, num_hidden_layers,
 *             num_attention_heads, vocab_size, max_position_embeddings,
 *             rms_norm_eps
 *   optional  num_key_value_heads (default num_attention_heads),
 *             head_dim (default hidden_size / num_attention_heads; may differ:
 *               q_dim = num_attention_heads * head_dim, as Qwen3 and Mistral-Nemo),
 *             rope_theta (default 10000),
 *             rope_scaling: null | {"rope_type" or "type": "default" | "linear"
 *               (factor) | "dynamic" (factor) | "llama3" (factor,
 *               low_freq_factor, high_freq_factor, original_max_position_embeddings)
 *               | "yarn" (factor, original_max_position_embeddings, attention_factor,
 *               mscale, mscale_all_dim, beta_fast, beta_slow, truncate)}; the
 *               original context defaults, as transformers' standardize_rope_params,
 *               to a top-level original_max_position_embeddings, else
 *               max_position_embeddings; other types (longrope, ...) are rejected
 *               naming the key and the value;
 *             rope_parameters (transformers v5 spelling: rope_theta and the
 *               rope_scaling fields in one object; per-layer-type forms rejected),
 *             partial_rotary_factor (rotary dim = int(head_dim * factor), the
 *               first channels of each head, as in transformers'
 *               _compute_default_rope_parameters),
 *             tie_word_embeddings (default false),
 *             hidden_act (must be "silu"), mlp_bias (must be false),
 *             attention_bias (llama, qwen3: q/k/v/o biases; qwen2 always has
 *               q/k/v biases and no o bias, and reads no attention_bias),
 *             sliding window: mistral sliding_window (every layer; null = none);
 *               qwen2/qwen3 use_sliding_window + sliding_window +
 *               max_window_layers, or layer_types (full_attention layers, then
 *               sliding_attention layers; other patterns rejected).
 *   A missing required key or a value of the wrong type is an error naming
 *   config.json and the key. A null value counts as absent.
 *
 * Tensors (PyTorch nn.Linear layout [out_features][in_features], i.e. kvq's
 * [out][in] row-major; dtypes F32, F16, BF16; held as the kvq_weights mode
 * says: converted to fp32 exactly, kept as stored, or rounded to bf16/f16):
 *   model.embed_tokens.weight [vocab_size][hidden], model.norm.weight [hidden],
 *   lm_head.weight [vocab_size][hidden] (untied only), and per layer N
 *   model.layers.N.{input_layernorm [hidden], self_attn.q_proj [q_dim][hidden],
 *   self_attn.k_proj / v_proj [kv_dim][hidden], self_attn.o_proj [hidden][q_dim],
 *   post_attention_layernorm [hidden], mlp.gate_proj / up_proj
 *   [intermediate][hidden], mlp.down_proj [hidden][intermediate]}.weight, with
 *   biases self_attn.{q,k,v,o}_proj.bias and the Qwen3 per-head norms
 *   self_attn.{q,k}_norm.weight [head_dim] where the config implies them.
 * Shapes are checked against config.json before anything is allocated; an
 * error names the shard file, the tensor, the expected and the found shape.
 * Ignored tensors: *.rotary_emb.inv_freq (buffers saved by old transformers),
 * and lm_head.weight when tie_word_embeddings is true (transformers'
 * tie_weights() replaces it by the embedding after loading, so kvq does the
 * same). Any other tensor is rejected, so nothing the forward would need is
 * silently dropped.
 *
 * Tied embeddings. tie_word_embeddings true → the LM head is the embedding.
 * tie_word_embeddings false (or absent: LlamaConfig's default) and no
 * lm_head.weight → error: transformers would warn and initialise the head
 * randomly, which is never what an analysis wants.
 *
 * RoPE pairing. HF's LlamaAttention rotates channel pairs (i, i + r/2) of each
 * head ("rotate_half", r = rotary dim), Meta/llama2.c/GGUF and kvq rotate
 * interleaved pairs (2i, 2i+1). transformers' convert_llama_weights_to_hf.py
 * therefore permutes the rows of q_proj and k_proj within each head,
 *   w.view(n_heads, head_dim/2, 2, in).transpose(1, 2).reshape(out, in),
 * i.e. HF row j*(r/2) + i holds Meta row 2i + j (j in {0, 1}). kvq applies the
 * inverse (llama.cpp convert_hf_to_gguf.py `permute`: reshape(n_head, 2,
 * head_dim/2, in).swapaxes(1, 2)): kvq row 2i + j of each head ← HF row
 * j*(r/2) + i, for i < r/2; rows r..head_dim-1 of a head (partial rotary) are
 * not rotated and stay in place. k_proj uses num_key_value_heads heads. The
 * q/k biases (rows of one element) and the q/k norm weights (one "head")
 * follow the same permutation.
 * Verified by tests/test_model_hf.c against the llama2.c original that
 * tests/scripts/llama2c_to_hf.py converts with HF's permutation.
 */
#include <cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "loaders.h"
#include "ggml_dequant.h"
#include "half.h"
#include "safetensors.h"

enum { KVQ_HF_NAME_MAX = 96 };

static bool ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static bool is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static kvq_status join(char *out, size_t n, const char *dir, const char *name, kvq_err *err)
{
    int k = snprintf(out, n, "%s/%s", dir, name);
    if (k < 0 || (size_t)k >= n) return kvq_fail(err, KVQ_EINVAL, "%s/%s: path too long (limit %zu bytes)", dir, name, n - 1);
    return KVQ_OK;
}

kvq_status kvq_hf_checkpoint_paths(const char *path, char *dir, size_t dir_size, char *weights, size_t weights_size,
                                   kvq_err *err)
{
    struct stat st;
    if (stat(path, &st) != 0) return kvq_fail(err, KVQ_EIO, "%s: cannot open: %s", path, strerror(errno));
    size_t n = strlen(path);
    if (n + 1 > dir_size) return kvq_fail(err, KVQ_EINVAL, "%s: path too long (limit %zu bytes)", path, dir_size - 1);
    bool look_in_dir = true;
    if (S_ISDIR(st.st_mode)) {
        memcpy(dir, path, n + 1);
        while (n > 1 && dir[n - 1] == '/') dir[--n] = 0;
    } else {
        const char *slash = strrchr(path, '/');
        if (!slash) snprintf(dir, dir_size, ".");
        else if (slash == path) snprintf(dir, dir_size, "/");
        else {
            memcpy(dir, path, (size_t)(slash - path));
            dir[slash - path] = 0;
        }
        const char *base = slash ? slash + 1 : path;
        if (strcmp(base, "config.json") != 0) {
            look_in_dir = false;
            if ((size_t)snprintf(weights, weights_size, "%s", path) >= weights_size)
                return kvq_fail(err, KVQ_EINVAL, "%s: path too long (limit %zu bytes)", path, weights_size - 1);
        }
    }
    if (look_in_dir) {
        KVQ_TRY(join(weights, weights_size, dir, "model.safetensors", err));
        if (is_file(weights)) return KVQ_OK;
        KVQ_TRY(join(weights, weights_size, dir, "model.safetensors.index.json", err));
        if (is_file(weights)) return KVQ_OK;
        return kvq_fail(err, KVQ_EIO, "%s: HF checkpoint has neither model.safetensors nor model.safetensors.index.json", dir);
    }
    return KVQ_OK;
}

/* ---- JSON helpers ---------------------------------------------------------- */

/* Parse the whole file as JSON; *root owned by the caller (cJSON_Delete). */
static kvq_status read_json(const char *path, cJSON **root, kvq_err *err)
{
    *root = NULL;
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a JSON file", &f, err));
    size_t cap = 1 << 14, n = 0;
    char *buf = malloc(cap);
    kvq_status s = KVQ_OK;
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        if (cap >= ((size_t)1 << 30)) { s = kvq_fail(err, KVQ_EFORMAT, "%s: larger than 1 GiB, not a config/index file", path); break; }
        char *nb = realloc(buf, cap * 2);
        if (!nb) { free(buf); buf = NULL; break; }
        buf = nb;
        cap *= 2;
    }
    if (!s && !buf) s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory reading", path);
    if (!s && ferror(f)) s = kvq_fail(err, KVQ_EIO, "%s: read error", path);
    fclose(f);
    if (!s) {
        const char *end = NULL;
        *root = cJSON_ParseWithLengthOpts(buf, n, &end, 0);
        size_t at = end ? (size_t)(end - buf) : 0;
        while (*root && at < n && (buf[at] == ' ' || buf[at] == '\t' || buf[at] == '\n' || buf[at] == '\r')) at++;
        if (!*root) s = kvq_fail(err, KVQ_EFORMAT, "%s: invalid JSON at byte offset %zu", path, at);
        else if (at < n) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: invalid JSON: unexpected content after the top-level value at byte offset %zu", path, at);
            cJSON_Delete(*root);
            *root = NULL;
        } else if (!cJSON_IsObject(*root)) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: expected a JSON object at the top level", path);
            cJSON_Delete(*root);
            *root = NULL;
        }
    }
    free(buf);
    return s;
}

/* Member k of object o; NULL when absent or JSON null. */
static const cJSON *jget(const cJSON *o, const char *k)
{
    const cJSON *v = o ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* Short description of a JSON value for "found ..." in messages. */
static const char *jdesc(const cJSON *v, char *buf, size_t n)
{
    if (cJSON_IsNumber(v)) snprintf(buf, n, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v)) snprintf(buf, n, "\"%.48s\"", v->valuestring);
    else if (cJSON_IsBool(v)) snprintf(buf, n, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsArray(v)) snprintf(buf, n, "an array");
    else if (cJSON_IsObject(v)) snprintf(buf, n, "an object");
    else snprintf(buf, n, "null");
    return buf;
}

typedef struct {
    const char *path; /* config.json */
    const char *pre;  /* key prefix for messages ("", "rope_scaling.") */
} cfgctx;

static kvq_status missing(const cfgctx *c, const char *key, kvq_err *err)
{
    return kvq_fail(err, KVQ_EFORMAT, "%s: required key '%s%s' is missing", c->path, c->pre, key);
}

static kvq_status cfg_int(const cfgctx *c, const cJSON *o, const char *key, bool required, int *out, kvq_err *err)
{
    const cJSON *v = jget(o, key);
    if (!v) return required ? missing(c, key, err) : KVQ_OK;
    char b[80];
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble <= 0 || v->valuedouble > INT_MAX)
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s%s': expected a positive integer that fits in 32 bits, found %s", c->path,
                        c->pre, key, jdesc(v, b, sizeof b));
    *out = (int)v->valuedouble;
    return KVQ_OK;
}

static kvq_status cfg_float(const cfgctx *c, const cJSON *o, const char *key, bool required, float *out, kvq_err *err)
{
    const cJSON *v = jget(o, key);
    if (!v) return required ? missing(c, key, err) : KVQ_OK;
    char b[80];
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !(v->valuedouble < 3.0e38))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s%s': expected a finite positive number, found %s", c->path, c->pre, key,
                        jdesc(v, b, sizeof b));
    *out = (float)v->valuedouble;
    return KVQ_OK;
}

static kvq_status cfg_bool(const cfgctx *c, const cJSON *o, const char *key, bool *out, kvq_err *err)
{
    const cJSON *v = jget(o, key);
    if (!v) return KVQ_OK;
    char b[80];
    if (!cJSON_IsBool(v))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s%s': expected true or false, found %s", c->path, c->pre, key, jdesc(v, b, sizeof b));
    *out = cJSON_IsTrue(v);
    return KVQ_OK;
}

/* Optional string; *out NULL when absent. */
static kvq_status cfg_str(const cfgctx *c, const cJSON *o, const char *key, const char **out, kvq_err *err)
{
    const cJSON *v = jget(o, key);
    *out = NULL;
    if (!v) return KVQ_OK;
    char b[80];
    if (!cJSON_IsString(v))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s%s': expected a string, found %s", c->path, c->pre, key, jdesc(v, b, sizeof b));
    *out = v->valuestring;
    return KVQ_OK;
}

/* Optional number in (0, inf) (any sign-checked float that must be > 0); absent leaves *out. */
static kvq_status cfg_pos_double(const cfgctx *c, const cJSON *o, const char *key, double *out, bool *given, kvq_err *err)
{
    const cJSON *v = jget(o, key);
    if (given) *given = v != NULL;
    if (!v) return KVQ_OK;
    char b[80];
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !(v->valuedouble < 3.0e38))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s%s': expected a finite positive number, found %s", c->path, c->pre, key,
                        jdesc(v, b, sizeof b));
    *out = v->valuedouble;
    return KVQ_OK;
}

/* original_max_position_embeddings of a scaled RoPE, as transformers'
 * standardize_rope_params: the rope object's, else the top-level key, else
 * max_position_embeddings. */
static kvq_status orig_ctx(const cfgctx *c, const cJSON *o, const cJSON *cfg, const kvq_hparams *hp, int *out, kvq_err *err)
{
    *out = hp->ctx_len;
    cfgctx top = {c->path, ""};
    KVQ_TRY(cfg_int(&top, cfg, "original_max_position_embeddings", false, out, err));
    return cfg_int(c, o, "original_max_position_embeddings", false, out, err);
}

/* yarn_get_mscale of transformers: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1). */
static double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0; }

/* rope_scaling / rope_parameters object → hp (transformers modeling_rope_utils).
 * hp->ctx_len is set. */
static kvq_status parse_rope(const char *path, const cJSON *cfg, const cJSON *o, const char *name, bool type_optional, kvq_hparams *hp,
                             kvq_err *err)
{
    char pre[40];
    snprintf(pre, sizeof pre, "%s.", name);
    cfgctx c = {path, pre};
    char b[80];
    if (!cJSON_IsObject(o))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s': expected null or an object, found %s", path, name, jdesc(o, b, sizeof b));
    const char *ty = NULL, *key = "rope_type";
    KVQ_TRY(cfg_str(&c, o, "rope_type", &ty, err));
    if (!ty) {
        key = "type";
        KVQ_TRY(cfg_str(&c, o, "type", &ty, err));
    }
    if (!ty) {
        if (!type_optional) return kvq_fail(err, KVQ_EFORMAT, "%s: required key '%srope_type' (or '%stype') is missing", path, pre, pre);
        ty = "default";
    }
    if (!strcmp(ty, "default")) return KVQ_OK;
    if (!strcmp(ty, "linear")) {
        hp->rope_scaling = KVQ_ROPE_SCALING_LINEAR;
        return cfg_float(&c, o, "factor", true, &hp->rope_scale_factor, err);
    }
    if (!strcmp(ty, "dynamic")) {
        hp->rope_scaling = KVQ_ROPE_SCALING_DYNAMIC;
        return cfg_float(&c, o, "factor", true, &hp->rope_scale_factor, err);
    }
    if (!strcmp(ty, "llama3")) {
        hp->rope_scaling = KVQ_ROPE_SCALING_LLAMA3;
        KVQ_TRY(cfg_float(&c, o, "factor", true, &hp->rope_scale_factor, err));
        KVQ_TRY(cfg_float(&c, o, "low_freq_factor", true, &hp->rope_low_freq_factor, err));
        KVQ_TRY(cfg_float(&c, o, "high_freq_factor", true, &hp->rope_high_freq_factor, err));
        KVQ_TRY(orig_ctx(&c, o, cfg, hp, &hp->rope_orig_ctx, err));
        if (!(hp->rope_high_freq_factor > hp->rope_low_freq_factor))
            return kvq_fail(err, KVQ_EFORMAT, "%s: key '%shigh_freq_factor': expected > low_freq_factor (%g), found %g", path, pre,
                            hp->rope_low_freq_factor, hp->rope_high_freq_factor);
        return KVQ_OK;
    }
    if (!strcmp(ty, "yarn")) {
        /* transformers _compute_yarn_parameters */
        hp->rope_scaling = KVQ_ROPE_SCALING_YARN;
        KVQ_TRY(orig_ctx(&c, o, cfg, hp, &hp->rope_orig_ctx, err));
        double factor = (double)hp->ctx_len / hp->rope_orig_ctx, af = 0, ms = 0, msa = 0, bf = 32, bs = 1;
        bool has_af, has_ms, has_msa;
        KVQ_TRY(cfg_pos_double(&c, o, "factor", &factor, NULL, err));
        KVQ_TRY(cfg_pos_double(&c, o, "attention_factor", &af, &has_af, err));
        KVQ_TRY(cfg_pos_double(&c, o, "mscale", &ms, &has_ms, err));
        KVQ_TRY(cfg_pos_double(&c, o, "mscale_all_dim", &msa, &has_msa, err));
        KVQ_TRY(cfg_pos_double(&c, o, "beta_fast", &bf, NULL, err));
        KVQ_TRY(cfg_pos_double(&c, o, "beta_slow", &bs, NULL, err));
        hp->rope_yarn_truncate = true;
        KVQ_TRY(cfg_bool(&c, o, "truncate", &hp->rope_yarn_truncate, err));
        if (!has_af) af = has_ms && has_msa ? yarn_mscale(factor, ms) / yarn_mscale(factor, msa) : yarn_mscale(factor, 1.0);
        hp->rope_scale_factor = (float)factor;
        hp->rope_attn_factor = (float)af;
        hp->rope_beta_fast = (float)bf;
        hp->rope_beta_slow = (float)bs;
        return KVQ_OK;
    }
    return kvq_fail(err, KVQ_EUNSUPPORTED,
                    "%s: key '%s%s': RoPE scaling \"%.48s\" is not supported (supported: default, linear, dynamic, llama3, yarn)",
                    path, pre, key, ty);
}

/* model_type → architecture, and the architectures entry that must match it. */
static const struct {
    const char *model_type, *cls;
    kvq_arch arch;
} ARCHS[] = {
    {"llama", "LlamaForCausalLM", KVQ_ARCH_LLAMA},
    {"qwen2", "Qwen2ForCausalLM", KVQ_ARCH_QWEN2},
    {"qwen3", "Qwen3ForCausalLM", KVQ_ARCH_QWEN3},
    {"mistral", "MistralForCausalLM", KVQ_ARCH_MISTRAL},
};

/* Sliding-window attention: Mistral (every layer when sliding_window is set),
 * Qwen2/Qwen3 (use_sliding_window, layers >= max_window_layers, or an explicit
 * layer_types list of the form full..., sliding...). */
static kvq_status read_sliding(const char *path, const cJSON *cfg, kvq_hparams *hp, kvq_err *err)
{
    cfgctx c = {path, ""};
    char b[80];
    hp->sliding_window = 0;
    hp->swa_first_layer = 0;
    const cJSON *lt = jget(cfg, "layer_types");
    if (hp->arch == KVQ_ARCH_LLAMA) {
        if (lt) {
            for (const cJSON *e = cJSON_IsArray(lt) ? lt->child : NULL; e; e = e->next)
                if (!cJSON_IsString(e) || strcmp(e->valuestring, "full_attention"))
                    return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'layer_types': a llama model with layers other than \"full_attention\" "
                                    "is not supported (found %s)", path, jdesc(e, b, sizeof b));
        }
        return KVQ_OK; /* LlamaModel has no sliding window (a sliding_window key is ignored by transformers too) */
    }
    int W = 0;
    if (hp->arch == KVQ_ARCH_MISTRAL) {
        if (lt)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'layer_types': per-layer attention types are not supported for model_type "
                            "\"mistral\" (transformers' MistralModel ignores them; a Ministral checkpoint?)", path);
        KVQ_TRY(cfg_int(&c, cfg, "sliding_window", false, &W, err));
        hp->sliding_window = W;
        return KVQ_OK;
    }
    /* qwen2 / qwen3 */
    bool use = false;
    KVQ_TRY(cfg_bool(&c, cfg, "use_sliding_window", &use, err));
    if (use) KVQ_TRY(cfg_int(&c, cfg, "sliding_window", false, &W, err));
    if (!use || W == 0) W = 0;
    int first = hp->n_layers;
    if (lt) {
        if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != hp->n_layers)
            return kvq_fail(err, KVQ_EFORMAT, "%s: key 'layer_types': expected an array of %d strings, found %s", path, hp->n_layers,
                            jdesc(lt, b, sizeof b));
        int i = 0, seen_sliding = 0;
        first = -1;
        for (const cJSON *e = lt->child; e; e = e->next, i++) {
            bool full = cJSON_IsString(e) && !strcmp(e->valuestring, "full_attention");
            bool slid = cJSON_IsString(e) && !strcmp(e->valuestring, "sliding_attention");
            if (!full && !slid)
                return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'layer_types[%d]': expected \"full_attention\" or \"sliding_attention\", found %s",
                                path, i, jdesc(e, b, sizeof b));
            if (slid && !seen_sliding) first = i, seen_sliding = 1;
            if (full && seen_sliding)
                return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'layer_types[%d]': a full-attention layer after sliding-window layer %d "
                                "(supported: full-attention layers, then sliding-window layers)", path, i, first);
        }
        if (first < 0) first = hp->n_layers;
        if (first < hp->n_layers && W == 0)
            return kvq_fail(err, KVQ_EFORMAT, "%s: key 'layer_types' has sliding-window layers but 'sliding_window' is not in use "
                            "(use_sliding_window false or sliding_window null)", path);
    } else if (W > 0) {
        int mw = hp->n_layers;
        KVQ_TRY(cfg_int(&c, cfg, "max_window_layers", false, &mw, err));
        first = mw;
    }
    if (W > 0 && first < hp->n_layers) {
        hp->sliding_window = W;
        hp->swa_first_layer = first;
    }
    return KVQ_OK;
}

static kvq_status read_config(const char *path, const cJSON *cfg, kvq_hparams *hp, kvq_err *err)
{
    cfgctx c = {path, ""};
    char b[80];
    const char *mt = NULL;
    KVQ_TRY(cfg_str(&c, cfg, "model_type", &mt, err));
    if (!mt) return missing(&c, "model_type", err);
    int ai = -1;
    for (int i = 0; i < (int)(sizeof ARCHS / sizeof *ARCHS); i++)
        if (!strcmp(mt, ARCHS[i].model_type)) ai = i;
    if (ai < 0)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'model_type': expected \"llama\", \"qwen2\", \"qwen3\" or \"mistral\", found \"%.48s\"",
                        path, mt);
    const cJSON *arch = jget(cfg, "architectures");
    if (arch) {
        bool ok = false;
        if (!cJSON_IsArray(arch)) return kvq_fail(err, KVQ_EFORMAT, "%s: key 'architectures': expected an array, found %s", path, jdesc(arch, b, sizeof b));
        for (const cJSON *a = arch->child; a; a = a->next) ok |= cJSON_IsString(a) && !strcmp(a->valuestring, ARCHS[ai].cls);
        if (!ok)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'architectures': expected it to list \"%s\" (model_type \"%s\")", path,
                            ARCHS[ai].cls, mt);
    }
    const char *act = NULL;
    KVQ_TRY(cfg_str(&c, cfg, "hidden_act", &act, err));
    if (act && strcmp(act, "silu") != 0)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'hidden_act': expected \"silu\" (SwiGLU), found \"%.48s\"", path, act);
    bool mlp_bias = false, attn_bias = false;
    KVQ_TRY(cfg_bool(&c, cfg, "mlp_bias", &mlp_bias, err));
    if (mlp_bias) return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'mlp_bias': expected false, found true (MLP biases are not supported)", path);
    KVQ_TRY(cfg_bool(&c, cfg, "attention_bias", &attn_bias, err));

    memset(hp, 0, sizeof *hp);
    hp->arch = ARCHS[ai].arch;
    if (hp->arch == KVQ_ARCH_QWEN2) {
        hp->attn_qkv_bias = true; /* Qwen2Attention: q/k/v biases always, no o_proj bias (it reads no attention_bias key) */
    } else if (hp->arch != KVQ_ARCH_MISTRAL) {
        hp->attn_qkv_bias = hp->attn_out_bias = attn_bias; /* LlamaAttention / Qwen3Attention: all four projections */
    } else if (attn_bias) {
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'attention_bias': expected false for model_type \"mistral\", found true", path);
    }
    hp->qk_norm = hp->arch == KVQ_ARCH_QWEN3;
    KVQ_TRY(cfg_int(&c, cfg, "hidden_size", true, &hp->dim, err));
    KVQ_TRY(cfg_int(&c, cfg, "intermediate_size", true, &hp->hidden_dim, err));
    KVQ_TRY(cfg_int(&c, cfg, "num_hidden_layers", true, &hp->n_layers, err));
    KVQ_TRY(cfg_int(&c, cfg, "num_attention_heads", true, &hp->n_heads, err));
    hp->n_kv_heads = hp->n_heads;
    KVQ_TRY(cfg_int(&c, cfg, "num_key_value_heads", false, &hp->n_kv_heads, err));
    KVQ_TRY(cfg_int(&c, cfg, "vocab_size", true, &hp->vocab_size, err));
    KVQ_TRY(cfg_int(&c, cfg, "max_position_embeddings", true, &hp->ctx_len, err));
    KVQ_TRY(cfg_float(&c, cfg, "rms_norm_eps", true, &hp->norm_eps, err));
    KVQ_TRY(cfg_bool(&c, cfg, "tie_word_embeddings", &hp->tied_embeddings, err));

    /* head_dim: transformers' getattr(config, "head_dim", hidden_size // num_attention_heads) */
    hp->head_dim = hp->dim / hp->n_heads;
    const cJSON *hdv = jget(cfg, "head_dim");
    if (hdv) KVQ_TRY(cfg_int(&c, cfg, "head_dim", false, &hp->head_dim, err));
    else if (hp->dim % hp->n_heads)
        return kvq_fail(err, KVQ_EFORMAT, "%s: key 'hidden_size' %d is not a multiple of 'num_attention_heads' %d and 'head_dim' is not given",
                        path, hp->dim, hp->n_heads);
    hp->rope_dim = hp->head_dim;
    const cJSON *prf = jget(cfg, "partial_rotary_factor");
    if (prf) {
        if (!cJSON_IsNumber(prf) || !(prf->valuedouble > 0) || !(prf->valuedouble <= 1))
            return kvq_fail(err, KVQ_EFORMAT, "%s: key 'partial_rotary_factor': expected a number in (0, 1], found %s", path, jdesc(prf, b, sizeof b));
        hp->rope_dim = (int)(hp->head_dim * prf->valuedouble); /* transformers: int(head_dim * partial_rotary_factor) */
        if (hp->rope_dim < 2 || hp->rope_dim % 2)
            return kvq_fail(err, KVQ_EFORMAT, "%s: key 'partial_rotary_factor': head_dim %d x %g = %d rotary channels, expected an even number >= 2",
                            path, hp->head_dim, prf->valuedouble, hp->rope_dim);
    }
    hp->rope_theta = 10000.0f;
    hp->rope_scaling = KVQ_ROPE_SCALING_NONE;
    hp->rope_scale_factor = 1.0f;
    hp->rope_attn_factor = 1.0f;
    KVQ_TRY(cfg_float(&c, cfg, "rope_theta", false, &hp->rope_theta, err));
    const cJSON *rs = jget(cfg, "rope_scaling"), *rp = jget(cfg, "rope_parameters");
    if (rs && rp)
        return kvq_fail(err, KVQ_EFORMAT, "%s: keys 'rope_scaling' and 'rope_parameters' are both set; expected one", path);
    if (rs) KVQ_TRY(parse_rope(path, cfg, rs, "rope_scaling", false, hp, err));
    if (rp) {
        if (cJSON_IsObject(rp) && (jget(rp, "full_attention") || jget(rp, "sliding_attention")))
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'rope_parameters': per-layer-type RoPE parameters are not supported", path);
        KVQ_TRY(parse_rope(path, cfg, rp, "rope_parameters", true, hp, err));
        cfgctx c2 = {path, "rope_parameters."};
        KVQ_TRY(cfg_float(&c2, rp, "rope_theta", false, &hp->rope_theta, err));
        const cJSON *p2 = jget(rp, "partial_rotary_factor");
        if (p2 && !(prf && cJSON_IsNumber(p2) && p2->valuedouble == prf->valuedouble))
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: key 'rope_parameters.partial_rotary_factor': give it as the top-level 'partial_rotary_factor'", path);
    }
    KVQ_TRY(read_sliding(path, cfg, hp, err));
    return kvq_hparams_validate(hp, path, err);
}

/* ---- tensors ------------------------------------------------------------- */

typedef struct {
    char name[KVQ_HF_NAME_MAX];
    uint64_t rows, cols;   /* expected shape [rows][cols]; cols == 0: 1-D [rows] */
    float *dst;            /* a vector (fp32), or NULL for a matrix */
    kvq_mat *mat;          /* a matrix (its storage type set by the allocation), or NULL */
    int role, layer;       /* matrices: kvq_mat_role and layer (-1: embedding / LM head); vectors: -1 */
    int perm_heads;        /* > 0: un-permute rows (q/k projections, biases, norms) over this many heads */
    int shard;             /* index into shards, -1 until found */
    const kvq_st_tensor *t;
} job;

typedef struct {
    kvq_safetensors *st;   /* [n] */
    char **name;           /* [n] file names as in the index (or the single file's path) */
    bool **claimed;        /* [n][st[i].n_tensors] */
    size_t n;
} shardset;

static void shards_free(shardset *s)
{
    for (size_t i = 0; i < s->n; i++) {
        kvq_safetensors_close(&s->st[i]);
        free(s->name[i]);
        free(s->claimed[i]);
    }
    free(s->st);
    free(s->name);
    free(s->claimed);
    memset(s, 0, sizeof *s);
}

static int shard_index(const shardset *s, const char *name)
{
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->name[i], name)) return (int)i;
    return -1;
}

/* Open `file` (dir/name) as shard `name`; ctx (may be NULL) prefixes errors. */
static kvq_status shard_add(shardset *s, const char *dir, const char *name, const char *ctx, kvq_err *err)
{
    size_t i = s->n;
    kvq_safetensors *st = realloc(s->st, (i + 1) * sizeof *st);
    if (st) s->st = st;
    char **nm = realloc(s->name, (i + 1) * sizeof *nm);
    if (nm) s->name = nm;
    bool **cl = realloc(s->claimed, (i + 1) * sizeof *cl);
    if (cl) s->claimed = cl;
    if (!st || !nm || !cl) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", name);
    char path[4096];
    if (dir) KVQ_TRY(join(path, sizeof path, dir, name, err));
    else snprintf(path, sizeof path, "%s", name);
    kvq_status r = kvq_safetensors_open(path, &s->st[i], err);
    if (r) return ctx ? kvq_err_prefix(err, "%s", ctx) : r;
    s->name[i] = strdup(name);
    s->claimed[i] = calloc(s->st[i].n_tensors + 1, sizeof(bool));
    s->n = i + 1; /* owned from here on */
    if (!s->name[i] || !s->claimed[i]) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
    return KVQ_OK;
}

static void add_job(job *jobs, size_t *n, const char *name, uint64_t rows, uint64_t cols, float *dst, kvq_mat *mat, int role,
                    int layer, int perm_heads)
{
    job *j = &jobs[(*n)++];
    snprintf(j->name, sizeof j->name, "%s", name);
    j->rows = rows;
    j->cols = cols;
    j->dst = dst;
    j->mat = mat;
    j->role = role;
    j->layer = layer;
    j->perm_heads = perm_heads;
    j->shard = -1;
    j->t = NULL;
}

/* Tensors per layer at most (9 Llama + 4 biases + 2 norms). */
enum { MAX_JOBS_PER_LAYER = 15 };

/* Expected tensors with shapes; dst/mat pointers into m when m != NULL. */
static size_t build_jobs(const kvq_hparams *hp, kvq_model *m, job *jobs)
{
    size_t n = 0;
    const uint64_t D = hp->dim, H = hp->hidden_dim, Q = kvq_q_dim(hp), KV = kvq_kv_dim(hp), V = hp->vocab_size, HD = hp->head_dim;
    add_job(jobs, &n, "model.embed_tokens.weight", V, D, NULL, m ? &m->tok_embd : NULL, KVQ_MAT_TOK_EMBD, -1, 0);
    if (!hp->tied_embeddings) add_job(jobs, &n, "lm_head.weight", V, D, NULL, m ? &m->output : NULL, KVQ_MAT_OUTPUT, -1, 0);
    add_job(jobs, &n, "model.norm.weight", D, 0, m ? m->out_norm : NULL, NULL, -1, -1, 0);
    for (int l = 0; l < hp->n_layers; l++) {
        kvq_layer_weights *w = m ? &m->layers[l] : NULL;
        char nm[KVQ_HF_NAME_MAX];
#define VEC(suffix, r, field, ph) do { \
            snprintf(nm, sizeof nm, "model.layers.%d." suffix, l); \
            add_job(jobs, &n, nm, r, 0, w ? w->field : NULL, NULL, -1, -1, ph); } while (0)
#define MAT(suffix, r, c, field, role, ph) do { \
            snprintf(nm, sizeof nm, "model.layers.%d." suffix ".weight", l); \
            add_job(jobs, &n, nm, r, c, NULL, w ? &w->field : NULL, role, l, ph); } while (0)
        VEC("input_layernorm.weight", D, attn_norm, 0);
        MAT("self_attn.q_proj", Q, D, wq, KVQ_MAT_WQ, hp->n_heads);
        MAT("self_attn.k_proj", KV, D, wk, KVQ_MAT_WK, hp->n_kv_heads);
        MAT("self_attn.v_proj", KV, D, wv, KVQ_MAT_WV, 0);
        MAT("self_attn.o_proj", D, Q, wo, KVQ_MAT_WO, 0);
        if (hp->attn_qkv_bias) {
            VEC("self_attn.q_proj.bias", Q, bq, hp->n_heads);
            VEC("self_attn.k_proj.bias", KV, bk, hp->n_kv_heads);
            VEC("self_attn.v_proj.bias", KV, bv, 0);
        }
        if (hp->attn_out_bias) VEC("self_attn.o_proj.bias", D, bo, 0);
        if (hp->qk_norm) {
            VEC("self_attn.q_norm.weight", HD, q_norm, 1);
            VEC("self_attn.k_norm.weight", HD, k_norm, 1);
        }
        VEC("post_attention_layernorm.weight", D, ffn_norm, 0);
        MAT("mlp.gate_proj", H, D, w_gate, KVQ_MAT_GATE, 0);
        MAT("mlp.up_proj", H, D, w_up, KVQ_MAT_UP, 0);
        MAT("mlp.down_proj", D, H, w_down, KVQ_MAT_DOWN, 0);
#undef VEC
#undef MAT
    }
    return n;
}

static void shape_str(char *buf, size_t n, uint32_t nd, const uint64_t *sh)
{
    int k = snprintf(buf, n, "[");
    for (uint32_t d = 0; d < nd && d < KVQ_ST_MAX_DIMS && (size_t)k < n; d++)
        k += snprintf(buf + k, n - (size_t)k, "%s%llu", d ? ", " : "", (unsigned long long)sh[d]);
    if ((size_t)k < n) snprintf(buf + k, n - (size_t)k, "]");
}

/* Find j's tensor (via the index when given), check dtype and shape. */
static kvq_status locate(const shardset *s, const cJSON *wmap, const char *index_path, const kvq_hparams *hp, job *j, kvq_err *err)
{
    int k = 0;
    if (wmap) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(wmap, j->name);
        if (!e)
            return kvq_fail(err, KVQ_EFORMAT, "%s: weight_map has no entry for required tensor '%s'", index_path, j->name);
        k = shard_index(s, e->valuestring); /* every value was validated and opened */
    }
    const kvq_safetensors *st = &s->st[k];
    const kvq_st_tensor *t = kvq_safetensors_find(st, j->name);
    if (!t) {
        if (wmap)
            return kvq_fail(err, KVQ_EFORMAT, "%s: required tensor '%s' is missing (%s's weight_map places it in this shard)",
                            st->path, j->name, index_path);
        if (!strcmp(j->name, "lm_head.weight"))
            return kvq_fail(err, KVQ_EFORMAT, "%s: required tensor 'lm_head.weight' is missing and config.json does not set "
                            "tie_word_embeddings (transformers would initialise the LM head randomly)", st->path);
        return kvq_fail(err, KVQ_EFORMAT, "%s: required tensor '%s' is missing", st->path, j->name);
    }
    if (t->dtype != KVQ_ST_F32 && t->dtype != KVQ_ST_F16 && t->dtype != KVQ_ST_BF16)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor '%s': dtype %s, expected F32, F16 or BF16", st->path, j->name,
                        kvq_st_dtype_name(t->dtype));
    uint32_t nd = j->cols ? 2 : 1;
    if (t->n_dims != nd || t->shape[0] != j->rows || (j->cols && t->shape[1] != j->cols)) {
        char want[64], found[160];
        const uint64_t ws[2] = {j->rows, j->cols};
        shape_str(want, sizeof want, nd, ws);
        shape_str(found, sizeof found, t->n_dims, t->shape);
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': expected shape %s (from config.json: hidden_size %d, intermediate_size %d, "
                        "heads %d, kv heads %d, head_dim %d, vocab_size %d), found %s", st->path, j->name, want, hp->dim, hp->hidden_dim,
                        hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->vocab_size, found);
    }
    j->shard = k;
    j->t = t;
    return KVQ_OK;
}

/* HF rotate-half row order → interleaved, in place, per head (see header):
 * rows of rb bytes (a matrix row, or one element of a bias / norm vector). */
static void unpermute_rows(void *w, int n_heads, int head_dim, int rope_dim, size_t rb, char *tmp)
{
    const int half = rope_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        char *base = (char *)w + (size_t)h * head_dim * rb;
        memcpy(tmp, base, (size_t)rope_dim * rb);
        for (int i = 0; i < half; i++)
            for (int jj = 0; jj < 2; jj++) memcpy(base + (size_t)(2 * i + jj) * rb, tmp + (size_t)(jj * half + i) * rb, rb);
    }
}

/* Open the shards: the single file, or every file the index names. */
static kvq_status open_shards(const char *dir, const char *weights, shardset *s, cJSON **index, const cJSON **wmap, kvq_err *err)
{
    *index = NULL;
    *wmap = NULL;
    if (!ends_with(weights, ".json")) return shard_add(s, NULL, weights, NULL, err);
    KVQ_TRY(read_json(weights, index, err));
    const cJSON *wm = jget(*index, "weight_map");
    if (!cJSON_IsObject(wm))
        return wm ? kvq_fail(err, KVQ_EFORMAT, "%s: key 'weight_map': expected an object {tensor: shard file}", weights)
                  : kvq_fail(err, KVQ_EFORMAT, "%s: required key 'weight_map' is missing", weights);
    for (const cJSON *e = wm->child; e; e = e->next) {
        char b[80];
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, '/') || !strcmp(e->valuestring, ".") ||
            !strcmp(e->valuestring, ".."))
            return kvq_fail(err, KVQ_EFORMAT, "%s: weight_map[\"%.96s\"]: expected a shard file name in the same directory, found %s",
                            weights, e->string, jdesc(e, b, sizeof b));
        if (shard_index(s, e->valuestring) >= 0) continue;
        char ctx[4096 + 128];
        snprintf(ctx, sizeof ctx, "%s: weight_map[\"%.96s\"]", weights, e->string);
        KVQ_TRY(shard_add(s, dir, e->valuestring, ctx, err));
    }
    if (!s->n) return kvq_fail(err, KVQ_EFORMAT, "%s: weight_map is empty", weights);
    *wmap = wm;
    return KVQ_OK;
}

/* Storage types of the matrices: the weights mode applied to each tensor's dtype. */
typedef struct {
    const kvq_hparams *hp;
    kvq_weights mode;
    uint32_t *stored; /* [(n_layers + 1) * 9]: index (layer + 1) * 9 + role */
} type_ctx;

static uint32_t ggml_of(kvq_st_dtype d) { return d == KVQ_ST_BF16 ? KVQ_GGML_BF16 : d == KVQ_ST_F16 ? KVQ_GGML_F16 : KVQ_GGML_F32; }

static uint32_t mat_type(void *user, kvq_mat_role role, int layer)
{
    const type_ctx *c = user;
    return kvq_weights_type(c->mode, c->hp, c->stored[(size_t)(layer + 1) * 9 + role]);
}

/* Copy tensor t (F32/F16/BF16) into matrix storage of type dst_type: bytes as
 * they are when the types agree, else widened to fp32 and rounded (to nearest
 * even) to the target, in chunks. */
static void read_mat(const kvq_st_tensor *t, kvq_mat *m)
{
    const uint32_t st = ggml_of(t->dtype), dt = m->type;
    const size_t n = t->n_elements;
    if (st == dt) {
        memcpy(m->data, t->data, t->n_bytes);
        return;
    }
    float buf[4096];
    for (size_t i0 = 0; i0 < n; i0 += 4096) {
        size_t k = n - i0 < 4096 ? n - i0 : 4096;
        for (size_t i = 0; i < k; i++) {
            uint16_t h;
            if (st == KVQ_GGML_F32) memcpy(&buf[i], t->data + 4 * (i0 + i), 4);
            else {
                memcpy(&h, t->data + 2 * (i0 + i), 2);
                buf[i] = st == KVQ_GGML_F16 ? kvq_f16_to_f32(h) : kvq_bf16_to_f32(h);
            }
        }
        if (dt == KVQ_GGML_F32) memcpy((float *)m->data + i0, buf, k * sizeof(float));
        else
            for (size_t i = 0; i < k; i++) {
                uint16_t h = dt == KVQ_GGML_F16 ? kvq_f32_to_f16(buf[i]) : kvq_f32_to_bf16(buf[i]);
                memcpy((char *)m->data + 2 * (i0 + i), &h, 2);
            }
    }
}

kvq_status kvq_model_load_safetensors(const char *path, kvq_weights weights, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    char dir[4096], weights_path[4096], cfg_path[4096];
    KVQ_TRY(kvq_hf_checkpoint_paths(path, dir, sizeof dir, weights_path, sizeof weights_path, err));
    KVQ_TRY(join(cfg_path, sizeof cfg_path, dir, "config.json", err));
    cJSON *cfg = NULL, *index = NULL;
    const cJSON *wmap = NULL;
    shardset sh = {0};
    job *jobs = NULL;
    char *tmp = NULL;
    uint32_t *stored = NULL;
    kvq_hparams hp;
    size_t n = 0;
    kvq_status s = read_json(cfg_path, &cfg, err);
    if (!s) s = read_config(cfg_path, cfg, &hp, err);
    if (!s) s = open_shards(dir, weights_path, &sh, &index, &wmap, err);
    if (s) goto done;
    jobs = calloc(3 + MAX_JOBS_PER_LAYER * (size_t)hp.n_layers, sizeof *jobs);
    stored = calloc(((size_t)hp.n_layers + 1) * 9, sizeof *stored);
    if (!jobs || !stored) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    /* 1. every expected tensor present with dtype and shape (before allocating) */
    n = build_jobs(&hp, NULL, jobs);
    size_t max_row_bytes = 4;
    for (size_t i = 0; i < n; i++) {
        if ((s = locate(&sh, wmap, weights_path, &hp, &jobs[i], err))) goto done;
        sh.claimed[jobs[i].shard][jobs[i].t - sh.st[jobs[i].shard].tensors] = true;
        if (jobs[i].role >= 0) stored[(size_t)(jobs[i].layer + 1) * 9 + jobs[i].role] = ggml_of(jobs[i].t->dtype);
        if (jobs[i].cols && jobs[i].cols * 4 > max_row_bytes) max_row_bytes = jobs[i].cols * 4;
    }
    /* 2. every tensor in every shard claimed once, or one that transformers ignores too */
    for (size_t k = 0; k < sh.n; k++)
        for (size_t i = 0; i < sh.st[k].n_tensors; i++) {
            if (sh.claimed[k][i]) continue;
            const char *nm = sh.st[k].tensors[i].name;
            for (size_t q = 0; q < n; q++)
                if (!strcmp(nm, jobs[q].name)) {
                    s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' also appears in %s", sh.st[k].path, nm, sh.st[jobs[q].shard].path);
                    goto done;
                }
            if (ends_with(nm, ".rotary_emb.inv_freq") || (hp.tied_embeddings && !strcmp(nm, "lm_head.weight"))) continue;
            s = kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor '%.96s' is not part of a %d-layer %s model that kvq can run%s",
                         sh.st[k].path, nm, hp.n_layers, kvq_arch_name(hp.arch),
                         strstr(nm, "bias") ? " (config.json declares no such bias)" : "");
            goto done;
        }
    /* 3. allocate, convert, normalise the RoPE pairing */
    type_ctx tc = {&hp, weights, stored};
    if ((s = kvq_model_alloc_typed(out, &hp, mat_type, &tc, weights == KVQ_WEIGHTS_AUTO ? KVQ_WEIGHTS_NATIVE : weights, err))) {
        kvq_err_prefix(err, "%s", path);
        goto done;
    }
    out->source = KVQ_SRC_SAFETENSORS;
    snprintf(out->path, sizeof out->path, "%s", path);
    tmp = malloc((size_t)hp.head_dim * max_row_bytes);
    if (!tmp) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    n = build_jobs(&hp, out, jobs);
    for (size_t i = 0; i < n && !s; i++) s = locate(&sh, wmap, weights_path, &hp, &jobs[i], err);
    if (s) goto done;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
    for (size_t i = 0; i < n; i++) {
        const job *j = &jobs[i];
        if (j->mat) read_mat(j->t, j->mat);
        else if (kvq_safetensors_read_f32(&sh.st[j->shard], j->t, j->dst, j->t->n_elements, NULL) != KVQ_OK) failed = 1;
        kvq_safetensors_release(&sh.st[j->shard], j->t); /* the file's pages leave this process's memory */
    }
    if (failed) /* unreachable after locate(); report the first failure serially */
        for (size_t i = 0; i < n && !s; i++)
            if (!jobs[i].mat) s = kvq_safetensors_read_f32(&sh.st[jobs[i].shard], jobs[i].t, jobs[i].dst, jobs[i].t->n_elements, err);
    for (size_t i = 0; i < n && !s; i++) {
        const job *j = &jobs[i];
        if (j->perm_heads <= 0) continue;
        if (j->mat) unpermute_rows(j->mat->data, j->perm_heads, hp.head_dim, hp.rope_dim, j->mat->row_bytes, tmp);
        else unpermute_rows(j->dst, j->perm_heads, hp.head_dim, hp.rope_dim, sizeof(float), tmp);
    }
done:
    free(tmp);
    free(jobs);
    free(stored);
    shards_free(&sh);
    cJSON_Delete(index);
    cJSON_Delete(cfg);
    if (s) kvq_model_free(out);
    return s;
}
