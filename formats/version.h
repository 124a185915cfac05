/* version.h — the one kvq version: every binary's --version, the kvq_version attribute of a dump
 * (formats/DUMP.md) and the "version" of the JSON reports print this string.
 * Semantic versioning: bump it here only. */
#ifndef KVQ_VERSION_H
#define KVQ_VERSION_H

#define KVQ_VERSION "0.2.0"

#endif
