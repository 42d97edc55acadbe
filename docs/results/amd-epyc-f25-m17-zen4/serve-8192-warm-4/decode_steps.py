"""Decode-only intervals of a serving run's server logs (32 running, no prompt tokens): ms per step = 1000 * 32 / generation tok/s."""
import re, statistics, sys
pat = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs")
for path in sys.argv[1:]:
    steps = []
    for line in open(path):
        m = pat.search(line)
        if m and float(m.group(1)) == 0 and int(m.group(3)) == 32 and float(m.group(2)) > 0:
            steps.append(1000 * 32 / float(m.group(2)))
    if steps:
        print(f"{path.split('/')[-1]}: n={len(steps)} min {min(steps):.0f} median {statistics.median(steps):.0f} max {max(steps):.0f}")
