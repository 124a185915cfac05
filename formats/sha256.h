/* sha256.h — SHA-256 digests as lowercase hex (OpenSSL EVP, FIPS 180-4),
 * shared by the model fingerprint, the artifact/dump identities and the text
 * readers' reports. */
#ifndef KVQ_SHA256_H
#define KVQ_SHA256_H

#include <stddef.h>

#include "status.h"

/* n bytes of d → 2n lowercase hex digits + NUL in hex. */
void kvq_hex(const unsigned char *d, size_t n, char *hex);

/* SHA-256 of n bytes into hex[65]. Errors: KVQ_EUNSUPPORTED if OpenSSL fails. */
kvq_status kvq_sha256_hex(const void *data, size_t n, char hex[65], kvq_err *err);

#endif
