/* model_gguf.c — placeholder until the GGUF model loader lands. */
#include "loaders.h"

kvq_status kvq_model_load_gguf(const char *path, kvq_model *out, kvq_err *err)
{
    (void)out;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: GGUF model loading is not implemented yet", path);
}
