"""Where a kernel's warps wait, by SASS opcode (foldc/profiling.py reads Nsight Compute's
per-instruction CSV, plain or gzipped):

    python3 benchmarks/ncu_stalls.py $OUT/b8_sass.csv.gz
"""
from __future__ import annotations

import sys

from foldc.profiling import summarize

if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    for p in sys.argv[1:]:
        print(summarize(p))
