#!/usr/bin/env python3
"""results_table.py KVEVAL_JSON — the results table of docs/RESULTS.md from a kveval --json file:
scheme, effective bits per element, KV cache MiB at 2K/32K/128K context for this model and for a
Llama-2-7B-shaped cache (32 layers x 32 KV heads x 128), PPL, ΔPPL ± its paired standard error against
the fp32 baseline, and the KL divergence columns (mean, median, p99, same top %) when the run had them.
A size the accounting could not give (null in the JSON) is left empty."""
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
    kld = any(s.get("kld") for s in r["schemes"])
    print("| scheme | eff. bits/elem | KV MiB 2K | 32K | 128K | Llama-2-7B-shaped KV MiB 2K | 32K | 128K | PPL | ΔPPL ± SE |"
          + (" mean KLD | median KLD | p99 KLD | same top % |" if kld else ""))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: | ---: |" if kld else ""))

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for s in r["schemes"]:
        at = s["kv_cache_mib_at"]
        m, l7 = at["model"], at["llama2_7b"]
        if s["delta_ppl"] is None:
            d = "baseline"
        else:
            d = f"{s['delta_ppl']:+.4f}" + ("" if s.get("delta_ppl_se") is None else f" ± {s['delta_ppl_se']:.4f}")
        row = (f"| {s['name']} | {f(s['bits_per_element'], '.2f')} | {f(m['2048'], '.1f')} | {f(m['32768'], '.0f')} "
               f"| {f(m['131072'], '.0f')} | {f(l7['2048'], '.0f')} | {f(l7['32768'], '.0f')} | {f(l7['131072'], '.0f')} "
               f"| {s['ppl']:.4f} | {d} |")
        if kld:
            k = s.get("kld")
            row += (" — | — | — | — |" if not k else
                    f" {k['mean']:.4g} | {k['median']:.4g} | {k['p99']:.4g} | {100 * k['same_top_fraction']:.2f} |")
        print(row)

if __name__ == "__main__":
    main()
