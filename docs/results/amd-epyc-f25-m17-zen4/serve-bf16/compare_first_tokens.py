import json
ref = json.load(open("./lp-stock-float32.json"))
for name in ("stock-bfloat16", "chunk-bfloat16"):
    run = json.load(open(f"./lp-{name}.json"))
    same_first = sum(a[0] == b[0] for a, b in zip(ref["tokens"], run["tokens"]))
    same_all = sum(a == b for a, b in zip(ref["tokens"], run["tokens"]))
    # step-0 logprob error over the tokens both list
    errs = []
    for a, b in zip(ref["logprobs"], run["logprobs"]):
        common = set(a[0]) & set(b[0])
        errs.append(max(abs(a[0][t] - b[0][t]) for t in common))
    gaps = []
    for a in ref["logprobs"]:
        v = sorted(a[0].values(), reverse=True); gaps.append(v[0] - v[1])
    print(f"{name} vs stock fp32: first token same {same_first}/16, all 8 tokens same {same_all}/16, "
          f"step-0 max |dlogprob| median {sorted(errs)[8]:.3f} max {max(errs):.3f}")
print("fp32 top-2 gaps at step 0:", " ".join(f"{g:.3f}" for g in gaps))
s = json.load(open("./lp-stock-bfloat16.json")); c = json.load(open("./lp-chunk-bfloat16.json"))
print("chunk bf16 vs stock bf16: first token same", sum(a[0] == b[0] for a, b in zip(s["tokens"], c["tokens"])), "/16")
