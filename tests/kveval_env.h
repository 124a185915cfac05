/* kveval_env.h — the text-window fixture of kveval's library tests (test_kveval,
 * test_kveval_warn): aidreams260K, its tokenizer and the first ~24 KB of
 * wiki.valid.tokens (a temporary copy); env_open returns 0 when ../shared
 * lacks one of them (the caller skips through KVQ_SKIP_IF). */
#ifndef KVQ_KVEVAL_ENV_H
#define KVQ_KVEVAL_ENV_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvq_test.h"
#include "model.h"
#include "text.h"
#include "tokenizer.h"

typedef struct {
    kvq_model m;
    kvq_tokenizer *tok;
    kvq_text txt;
    char text_path[256];
} text_env;

/* aidreams260K + its tokenizer + the first ~24 KB of wiki.valid.tokens */
static int env_open(text_env *env)
{
    char mb[4096], tb[4096], db[4096];
    const char *mp = kvq_test_shared(mb, sizeof mb, "models/llama2c/aidreams260K.bin");
    const char *tp = kvq_test_shared(tb, sizeof tb, "models/llama2c/aidreams-tok512.bin");
    const char *dp = kvq_test_shared(db, sizeof db, "datasets/wikitext-2/wiki.valid.tokens");
    if (!mp || !tp || !dp) return 0;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(mp, &env->m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_tokenizer_load(tp, &env->tok, &e) == KVQ_OK, "%s", e.msg);
    FILE *in = fopen(dp, "rb");
    ck_assert(in);
    char *buf = malloc(24000);
    size_t n = fread(buf, 1, 24000, in);
    fclose(in);
    snprintf(env->text_path, sizeof env->text_path, "/tmp/kvq_test_kveval_env_%ld.tokens", (long)getpid());
    FILE *out = fopen(env->text_path, "wb");
    ck_assert(out && fwrite(buf, 1, n, out) == n);
    fclose(out);
    free(buf);
    ck_assert_msg(kvq_text_read(env->text_path, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_TO_LF, &env->txt, &e) == KVQ_OK, "%s", e.msg);
    return 1;
}

static void env_close(text_env *env)
{
    kvq_text_free(&env->txt);
    kvq_tokenizer_free(env->tok);
    kvq_model_free(&env->m);
    remove(env->text_path);
}

#endif
