/* sha256.c — see sha256.h. */
#include "sha256.h"

#include <openssl/evp.h>

void kvq_hex(const unsigned char *d, size_t n, char *hex)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[2 * n] = 0;
}

kvq_status kvq_sha256_hex(const void *data, size_t n, char hex[65], kvq_err *err)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int ml = 0;
    if (!EVP_Digest(data, n, md, &ml, EVP_sha256(), NULL) || ml != 32)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "sha256: OpenSSL EVP_Digest failed");
    kvq_hex(md, ml, hex);
    return KVQ_OK;
}
