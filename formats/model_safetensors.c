/* model_safetensors.c — placeholder until the HF safetensors loader lands. */
#include "loaders.h"

kvq_status kvq_model_load_safetensors(const char *path, kvq_model *out, kvq_err *err)
{
    (void)out;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: safetensors model loading is not implemented yet", path);
}
