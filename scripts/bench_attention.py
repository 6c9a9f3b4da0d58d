"""Attention benchmark (same as `jxformers bench`).

python scripts/bench_attention.py --out docs/benchmarks.md        # N = 512 .. 8192
python scripts/bench_attention.py --short                         # the demo's size
"""

import sys

from jxformers.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
