#!/usr/bin/env bash
# Where a start-up went: the server log's milestones (the front's first line, the core's, the compile workers'
# start, the weights loaded, the last program compiled and stored, the caches, every program run once, ready), each
# with its seconds since the log's first line.
#   bash scripts/startup_timeline.sh <server log>
set -uo pipefail
python3 - "$1" <<'PY'
import re, sys
from datetime import datetime
milestones = [("front starts", r"JAX compilation cache"), ("core: hot ops chosen", r"hot ops:"),
              ("compile workers started", r"compile workers started"), ("weights loaded", r"loaded .* in [0-9.]+s;"),
              ("first worker's first program", r"\[compile\].*lowered in"),
              ("last program stored", r"\[compile\].*lowered in"), ("device memory with caches", r"device memory:"),
              ("every program compiled and loaded", r"compiled \d+ programs in"), ("ready", r"engine ready")]
stamps = []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)", line)
    if m:
        stamps.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"), line.rstrip()))
if not stamps:
    sys.exit("no timestamped lines")
t0 = stamps[0][0]
for name, pattern in milestones:
    hits = [(t, line) for t, line in stamps if re.search(pattern, line)]
    if hits:
        t, line = hits[-1] if name.startswith("last") else hits[0]
        print(f"{(t - t0).total_seconds():7.1f} s  {name}: {line[24:150]}")
workers = [float(a) + float(b) for a, b in re.findall(r"lowered in ([0-9.]+)s, compiled in ([0-9.]+)s",
                                                       "\n".join(l for _, l in stamps))]
lowered = sum(float(a) for a in re.findall(r"lowered in ([0-9.]+)s", "\n".join(l for _, l in stamps)))
print(f"worker-seconds: {sum(workers):.0f} over {len(workers)} programs ({lowered:.0f} lowering)")
PY
