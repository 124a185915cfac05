#!/usr/bin/env python3
"""protocol_streams_reference.py — independent reference of the token streams
kveval's perplexity protocols score, for tests/test_text.c.

Each protocol is named after a tool and must score exactly the token stream that
tool scores. This script re-implements both from the tools' own rules, reading
the text file in binary (never through kvq):

  llamacpp  (llama.cpp tools/perplexity): `-f FILE` reads the file's bytes as
            they are (common/arg.cpp read_file: an ifstream, no newline
            translation on POSIX) and pops ONE trailing "\\n"; the text is
            tokenised once with BOS when the vocabulary's add_bos is set
            (common_tokenize(ctx, prompt, true)); n_chunk = n_tokens / n_ctx;
            chunk i is tokens[i*n_ctx, (i+1)*n_ctx) with its first token replaced
            by BOS when add_bos (perplexity(): tokens[seq_start] = bos).
  kvquant   (GPTQ / KVQuant datautils get_wikitext2): the dataset rows (lines,
            each carrying its line end) joined with "\\n\\n", tokenised once (BOS
            at the start only, as the HF tokenizer adds it), windows
            [i*ctx, (i+1)*ctx) for i < n_tokens // ctx.
Newlines: "keep" leaves the file's bytes (CRLF stays CRLF), "lf" turns every
"\\r\\n" into "\\n" first (a lone "\\r" stays). Defaults: llamacpp keep, kvquant lf.

Tokenizer: the tiny llama2.c model's tokenizer (../shared/models/llama2c/
aidreams-tok512.bin), through a literal port of llama2.c run.c encode() (BOS id 1,
a dummy-prefix " " token, UTF-8 characters looked up whole, byte fallback
id = byte + 3, then repeated merging of the best-scoring adjacent pair, leftmost
on ties). The text is tests/fixtures/crlf_sample.txt, written here (CRLF line
ends, blank lines, a lone CR, a tab, non-ASCII UTF-8, a final CRLF).

Writes tests/fixtures/crlf_sample.txt and tests/fixtures/protocol_streams.txt
("key value" lines: per protocol/newlines the tokenised text's bytes and sha256,
the stream's token count, windows at ctx 64, and the sha256 of the windows' ids as
little-endian int32, row-major).

Usage (repo root): python3 tests/scripts/protocol_streams_reference.py [--shared ../shared]
"""
import argparse
import hashlib
import struct

import numpy as np

CTX = 64
BOS = 1

SAMPLE_LINES = [
    " = The Lighthouse Keeper = ",
    "",
    " The old keeper climbed the 127 steps every evening , lit the lamp and wrote the weather in a book .",
    " Ships passed at night ; some slowed , most did not . He counted them anyway : 3 , 7 , 12 .",
    "",
    " = = Early years = = ",
    "",
    " Born in 1901 in a small town near the cafe\u0301 called \u201cLa Mer\u201d , he learned the trade from his aunt \u2014 a strict teacher .",
    " She kept two lamps burning\tand one spare wick in a tin box .",
    " A lone carriage return sits here:\rand the line goes on after it .",
    "",
    " = = Later life = = ",
    "",
    " In 1950 the light was automated . The keeper stayed for another 5 years , painting the tower white and red .",
    " Visitors asked about storms . He told them about the calm nights instead , when the sea was flat as glass .",
    " Numbers he remembered : 1 , 22 , 333 , 4444 , 55555 .",
    "",
    " = = Legacy = = ",
    "",
    " The book of weather ran to 14 volumes . It is kept in the town library , where anyone may read it .",
    " Once upon a time there was a lamp , and a man , and the sea ; the story ends where it began .",
]


def sample_bytes():
    text = "\r\n".join(SAMPLE_LINES) + "\r\n"
    return text.encode("utf-8")


class Llama2cTokenizer:
    """llama2.c tokenizer.bin: uint32 max_token_length, then per token float32
    score, int32 length, bytes (run.c build_tokenizer)."""

    def __init__(self, path, vocab_size=512):
        raw = open(path, "rb").read()
        (self.max_len,) = struct.unpack_from("<I", raw, 0)
        off = 4
        self.vocab, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            self.vocab.append(raw[off:off + n])
            self.scores.append(score)
            off += n
        self.lookup = {}
        for i, v in enumerate(self.vocab):
            self.lookup.setdefault(v, i)  # run.c's bsearch over the sorted vocab: the first id of equal strings

    def encode(self, text, bos):
        """run.c encode(t, text, bos, eos=0): text is a byte string (C string: stops at NUL)."""
        text = text.split(b"\0", 1)[0]
        toks = []
        if bos:
            toks.append(1)
        if text:
            toks.append(self.lookup[b" "])
        buf = b""
        i = 0
        while i < len(text):
            c = text[i]
            if (c & 0xC0) != 0x80:
                buf = b""
            buf += bytes([c])
            nxt = text[i + 1] if i + 1 < len(text) else 0
            i += 1
            if (nxt & 0xC0) == 0x80 and len(buf) < 4:
                continue
            tid = self.lookup.get(buf, -1)
            if tid != -1:
                toks.append(tid)
            else:
                toks.extend(b + 3 for b in buf)
            buf = b""
        while True:
            best_score, best_id, best_idx = -1e10, -1, -1
            for k in range(len(toks) - 1):
                tid = self.lookup.get(self.vocab[toks[k]] + self.vocab[toks[k + 1]], -1)
                if tid != -1 and self.scores[tid] > best_score:
                    best_score, best_id, best_idx = self.scores[tid], tid, k
            if best_idx == -1:
                break
            toks[best_idx] = best_id
            del toks[best_idx + 1]
        return toks


def ids_sha(ids):
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def rows_of(data):
    """Lines of a byte string, each carrying its "\\n" (a last line without one stays a row)."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def stream_text(data, protocol, newlines):
    if newlines == "lf":
        data = data.replace(b"\r\n", b"\n")
    if protocol == "kvquant":
        return b"\n\n".join(rows_of(data))
    # llama.cpp -f: the bytes, one trailing "\n" popped
    return data[:-1] if data.endswith(b"\n") else data


def windows(ids, protocol, bos):
    nw = len(ids) // CTX
    w = np.asarray(ids[: nw * CTX], dtype=np.int64).reshape(nw, CTX)
    if protocol == "llamacpp" and bos:
        w[:, 0] = BOS
    return nw, ids_sha(w.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="../shared")
    a = ap.parse_args()
    data = sample_bytes()
    with open("tests/fixtures/crlf_sample.txt", "wb") as f:
        f.write(data)
    tok = Llama2cTokenizer(a.shared + "/models/llama2c/aidreams-tok512.bin")
    # sanity: the ids test_tokenizer.c pins for "Once upon a time" (BOS on)
    assert tok.encode(b"Once upon a time", True) == [1, 429, 491, 433, 295, 429, 444, 445, 265, 262, 263, 342, 430]
    out = {"file_bytes": len(data), "file_sha256": hashlib.sha256(data).hexdigest(), "file_crlf": data.count(b"\r\n"),
           "ctx": CTX}
    for protocol in ("llamacpp", "kvquant"):
        for newlines in ("keep", "lf"):
            s = stream_text(data, protocol, newlines)
            ids = tok.encode(s, True)  # llama2.c: BOS always (run.c generate(): encode(..., 1, 0, ...))
            nw, wsha = windows(ids, protocol, True)
            k = "%s_%s" % (protocol, newlines)
            out[k + "_text_bytes"] = len(s)
            out[k + "_text_sha256"] = hashlib.sha256(s).hexdigest()
            out[k + "_tokens"] = len(ids)
            out[k + "_stream_sha256"] = ids_sha(ids)
            out[k + "_windows"] = nw
            out[k + "_windows_sha256"] = wsha
    with open("tests/fixtures/protocol_streams.txt", "w") as f:
        for k, v in out.items():
            f.write("%s %s\n" % (k, v))
    print(open("tests/fixtures/protocol_streams.txt").read())


if __name__ == "__main__":
    main()
