#!/usr/bin/env bash
# Fetch Fashion-MNIST from Debian's package dataset-fashion-mnist into DIR (default
# data/) without root: `apt-get download` the .deb, unpack it with `dpkg -x`, and copy
# its four idx .gz files to DIR/fashion-mnist (what data.settings.path names).
# With root, `apt install dataset-fashion-mnist` puts them in /usr/share/datasets/fashion-mnist,
# the tasks' default path.
set -euo pipefail
dir="${1:-data}"
mkdir -p "$dir/fashion-mnist"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download dataset-fashion-mnist)
dpkg -x "$work"/dataset-fashion-mnist_*.deb "$work/root"
cp "$work"/root/usr/share/datasets/fashion-mnist/*.gz "$dir/fashion-mnist/"
ls "$dir/fashion-mnist"
echo "data.settings.path=$dir/fashion-mnist"
