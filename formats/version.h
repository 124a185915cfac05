/* version.h — the one kvq version: every binary's --version, the kvq_version attribute of a dump
 * (formats/DUMP.md) and the "version" of the JSON reports (docs/JSON.md) print this string.
 * Semantic versioning: bump it here only.
 *
 * The JSON reports' schemas (docs/JSON.md): each report starts with
 *   "schema": {"name": "kvq.kveval", "version": N}
 * N (an integer) counts incompatible changes of that report's keys (a key removed, renamed or
 * given another type or unit); adding a key does not change it. Readers check name and N. */
#ifndef KVQ_VERSION_H
#define KVQ_VERSION_H

#define KVQ_VERSION "0.2.0"

#define KVQ_JSON_KVEVAL_VERSION 1  /* "kvq.kveval": kveval --json, --task ppl */
#define KVQ_JSON_PASSKEY_VERSION 1 /* "kvq.kveval.passkey": kveval --json, --task passkey */
#define KVQ_JSON_DECODE_VERSION 1  /* "kvq.kveval.decode": kveval --json, --task decode */
#define KVQ_JSON_KVSTAT_VERSION 1  /* "kvq.kvstat": kvstat --json */

#endif
