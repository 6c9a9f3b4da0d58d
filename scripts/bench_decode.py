"""Decoding benchmark (tokens/s against context length; see jxformers/bench_decode.py).

python scripts/bench_decode.py --out docs/decode.md
"""

import sys

from jxformers.tools.bench_decode import main

if __name__ == "__main__":
    sys.exit(main())
