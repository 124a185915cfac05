/* test_generate.c — tokenizer + forward end to end: aidreams260K with its
 * tokenizer, prompt "Once upon a time" with BOS, greedy decoding. The
 * published continuation (../shared/README.md, from the model's authors) is
 * ", pixels unfolding like petals." — an exact check of encode, the forward
 * pass and decode together. */
#include "forward.h"
#include "kvq_test.h"
#include "model.h"
#include "tokenizer.h"

START_TEST(test_aidreams_greedy)
{
    char mp[4096], tp[4096];
    const char *model = kvq_test_shared(mp, sizeof mp, "models/llama2c/aidreams260K.bin");
    const char *tokp = kvq_test_shared(tp, sizeof tp, "models/llama2c/aidreams-tok512.bin");
    KVQ_SKIP_IF(!model || !tokp, "../shared/models/llama2c absent");
    kvq_err e = {0};
    kvq_model m;
    ck_assert_msg(kvq_model_load(model, &m, &e) == KVQ_OK, "%s", e.msg);
    kvq_tokenizer *tok;
    ck_assert_msg(kvq_tokenizer_load(tokp, &tok, &e) == KVQ_OK, "%s", e.msg);
    const char *prompt = "Once upon a time";
    int32_t *ids = NULL;
    size_t n = 0;
    ck_assert_msg(kvq_tokenizer_encode(tok, prompt, strlen(prompt), KVQ_TOK_ADD_BOS, &ids, &n, &e) == KVQ_OK, "%s", e.msg);
    enum { GEN = 16 };
    int seq[64];
    size_t T = n;
    for (size_t i = 0; i < n; i++) seq[i] = ids[i];
    free(ids);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, 64, 0, 0, &e) == KVQ_OK);
    float *logits = malloc(sizeof(float) * 64 * m.hp.vocab_size);
    for (int g = 0; g < GEN; g++) {
        kvq_fwd_io io = {.tokens = seq, .T = (int)T, .logits = logits};
        kvq_fwd_result r;
        ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
        const float *last = logits + (T - 1) * m.hp.vocab_size;
        int best = 0;
        for (int v = 1; v < m.hp.vocab_size; v++)
            if (last[v] > last[best]) best = v;
        seq[T++] = best;
    }
    int32_t gen[GEN];
    for (int g = 0; g < GEN; g++) gen[g] = seq[n + g];
    char *text = NULL;
    size_t len = 0;
    ck_assert_msg(kvq_tokenizer_decode(tok, gen, GEN, KVQ_TOK_KEEP_LEADING_SPACE, &text, &len, &e) == KVQ_OK, "%s", e.msg);
    const char *want = ", pixels unfolding like petals.";
    ck_assert_msg(strncmp(text, want, strlen(want)) == 0, "generated '%s', expected it to begin '%s'", text, want);
    free(text);
    free(logits);
    kvq_forward_free(&fw);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("generate");
    TCase *tc = tcase_create("greedy");
    tcase_add_test(tc, test_aidreams_greedy);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
