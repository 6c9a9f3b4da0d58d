"""Images/s of whole-image generation, Table 1 of Katharopoulos et al. 2020 ("Transformers are
RNNs", arXiv 2006.16236; see jxformers/tools/bench_images.py).

    python scripts/bench_image_generation.py
"""

import sys

from jxformers.tools.bench_images import main

if __name__ == "__main__":
    sys.exit(main())
