#!/usr/bin/env python3
"""sass_loops.py — the loops of one kernel in a CUDA object or binary, as SASS: per backward branch the loop's
address range, its instruction count and the count per opcode (most frequent first). The inner loops' instructions
per element processed are the issue budget docs/BENCHMARKS.md counts for the NUQ decode kernel (issue 46).

usage: scripts/sass_loops.py OBJECT FUNCTION [MIN]
  OBJECT    a .o or binary with sm_90 code, e.g. build/gen/kvcache_cuda_inst_nuq_3.cu.o (`make CUDA=1`)
  FUNCTION  a prefix of the mangled kernel name, e.g. _ZN2v410nuq_decodeILi3ELi3ELi1ELi5E (nuq_decode<3, 3, 1, 5>)
  MIN       shortest loop listed, in instructions (default 100)
Needs cuobjdump and nvdisasm on PATH (CUDA toolkit, or the PyPI packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm: their nvidia/cu13/bin). Nested loops are listed each (an outer loop includes its inner ones).
Exit status 0, 2 on a usage error or when the function is not in the object."""
import collections
import re
import subprocess
import sys


def main():
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2
    obj, fn = sys.argv[1], sys.argv[2]
    minlen = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    try:
        sass = subprocess.run(["cuobjdump", "-sass", obj], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"sass_loops: cuobjdump -sass {obj}: {e}", file=sys.stderr)
        return 2
    funcs = [t for t in sass.split("Function : ") if t.startswith(fn)]
    if not funcs:
        print(f"sass_loops: no function starting with '{fn}' in {obj}", file=sys.stderr)
        return 2
    for f in funcs:
        name = f.split("\n", 1)[0].strip()
        ins = []
        for line in f.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        at = {a: i for i, (a, _) in enumerate(ins)}
        print(f"{name}: {len(ins)} instructions")
        for i, (a, t) in enumerate(ins):
            m = re.search(r"BRA(?:\.[A-Z]+)*\s+(?:`\()?(0x[0-9a-f]+)", t)
            if not m:
                continue
            tg = int(m.group(1), 16)
            if tg > a or tg not in at or i - at[tg] + 1 < minlen:
                continue
            body = ins[at[tg]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P[T0-9]+\s+", "", x[1]).split()[0].split(".")[0] for x in body)
            print(f"  loop {tg:#x}-{a:#x}: {len(body)} instructions  " + " ".join(f"{k} {v}" for k, v in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
