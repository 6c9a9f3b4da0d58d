"""Model-level benchmark, Table 2 of He et al. 2023 ("Fourier Transformer", arXiv 2305.15099):
the vanilla encoder against the Fourier Transformer.

    python scripts/bench_models.py --out docs/bench_models.md          # the paper's shape (a GPU)
    python scripts/bench_models.py --batch 2 --steps 1                 # on a CPU
"""

import sys

from jxformers.tools.bench_models import main

if __name__ == "__main__":
    sys.exit(main())
