#!/usr/bin/env python3
"""Reference windows for kvq's text protocols on WikiText-2 raw test with the
default model's tokenizer, computed independently in Python with the HF
`tokenizers` package (tokenizer.json rebuilt from the GGUF by
make_smollm2_tok_fixture.py, at /tmp/smollm2_rebuilt_tokenizer.json) and the
`random` module (KVQuant datautils: random.seed(seed); randint(0, n - L - 1)).

Writes tests/fixtures/smollm2_wikitext_windows.txt ("key value" lines).
Usage: python3 tests/scripts/make_smollm2_tok_fixture.py && python3 tests/scripts/make_wikitext_windows_fixture.py
"""
import hashlib
import random

import numpy as np
import tokenizers

RAW = "../shared/datasets/wikitext-2-raw/wiki.test.raw"
CTX = 2048
BOS = 1


def h(ids):
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def main():
    tk = tokenizers.Tokenizer.from_file("/tmp/smollm2_rebuilt_tokenizer.json")
    data = open(RAW, "rb").read()
    text = data.replace(b"\r\n", b"\n").decode("utf-8")
    out = {"file_sha256": hashlib.sha256(data).hexdigest(), "bytes_read": len(data),
           "crlf_replaced": data.count(b"\r\n")}
    # kvquant: rows = lines with their "\n", joined by "\n\n", no BOS (SmolLM2 add_bos_token = false)
    parts = text.split("\n")  # not splitlines(): rows end at "\n" only
    rows = [r + "\n" for r in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    joined = "\n\n".join(rows)
    out["kvquant_text_sha256"] = hashlib.sha256(joined.encode()).hexdigest()
    ids = tk.encode(joined, add_special_tokens=False).ids
    nw = len(ids) // CTX
    out["kvquant_tokens"] = len(ids)
    out["kvquant_windows"] = nw
    out["kvquant_windows_sha256"] = h(ids[: nw * CTX])
    # llamacpp with BOS forced: [BOS] + ids(text), chunks with the first token overwritten by BOS
    ids2 = [BOS] + tk.encode(text, add_special_tokens=False).ids
    nw2 = len(ids2) // CTX
    win = np.asarray(ids2[: nw2 * CTX]).reshape(nw2, CTX)
    win[:, 0] = BOS
    out["llamacpp_bos_tokens"] = len(ids2)
    out["llamacpp_bos_windows"] = nw2
    out["llamacpp_bos_windows_sha256"] = h(win.reshape(-1))
    # llamacpp as llama-perplexity -f runs it (the default --newlines keep): the file's bytes, CRLF kept, one
    # trailing "\n" popped (common/arg.cpp), no BOS (add_bos_token = false), ctx 512 (the tool's default -c)
    raw = data[:-1] if data.endswith(b"\n") else data
    ids3 = tk.encode(raw.decode("utf-8"), add_special_tokens=False).ids
    nw3 = len(ids3) // 512
    out["llamacpp_keep_text_sha256"] = hashlib.sha256(raw).hexdigest()
    out["llamacpp_keep_tokens"] = len(ids3)
    out["llamacpp_keep512_windows"] = nw3
    out["llamacpp_keep512_windows_sha256"] = h(ids3[: nw3 * 512])
    # calibration: 16 x 2048 from the kvquant stream, seed 0
    random.seed(0)
    offs = [random.randint(0, len(ids) - CTX - 1) for _ in range(16)]
    out["calib_offsets"] = " ".join(map(str, offs))
    out["calib_windows_sha256"] = h(np.concatenate([ids[o:o + CTX] for o in offs]))
    with open("tests/fixtures/smollm2_wikitext_windows.txt", "w") as f:
        for k, v in out.items():
            f.write("%s %s\n" % (k, v))
    print(open("tests/fixtures/smollm2_wikitext_windows.txt").read())


if __name__ == "__main__":
    main()
