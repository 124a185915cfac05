#!/usr/bin/env python3
"""results_table.py KVEVAL_JSON — the results table of docs/RESULTS.md from a kveval --json file:
scheme, effective bits per element, KV cache MiB at 2K/32K/128K context for this model and for a
Llama-2-7B-shaped cache (32 layers x 32 KV heads x 128), PPL and ΔPPL against the fp32 baseline."""
import json
import sys

def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        r = json.load(f)
    p = r["protocol"]
    print(f"Perplexity on {r['text']['path']} ({p['name']} protocol, ctx {p['ctx']}, "
          f"{p['windows']} windows, {p['scored_tokens']} scored tokens), model {r['model']['path']}.")
    print()
    print("| scheme | eff. bits/elem | KV MiB 2K | 32K | 128K | Llama-2-7B-shaped KV MiB 2K | 32K | 128K | PPL | ΔPPL |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in r["schemes"]:
        at = s["kv_cache_mib_at"]
        m, l7 = at["model"], at["llama2_7b"]
        d = "baseline" if s["delta_ppl"] is None else f"{s['delta_ppl']:+.4f}"
        print(f"| {s['name']} | {s['bits_per_element']:.2f} | {m['2048']:.1f} | {m['32768']:.0f} | {m['131072']:.0f} "
              f"| {l7['2048']:.0f} | {l7['32768']:.0f} | {l7['131072']:.0f} | {s['ppl']:.4f} | {d} |")

if __name__ == "__main__":
    main()
