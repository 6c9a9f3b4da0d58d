"""Images/s of whole-image generation, seed 002's table 2 (see jxformers/tools/bench_images.py).

    python scripts/bench_image_generation.py
"""

import sys

from jxformers.tools.bench_images import main

if __name__ == "__main__":
    sys.exit(main())
