#!/usr/bin/env bash
# Downloads the wheels the GPU check's serve, tensor-parallel and pipeline-parallel
# sections need on a machine that has torch and triton but no network:
# experiments/gpu_requirements.txt and everything it depends on, for CPython 3.12 on
# manylinux x86_64 (UCX built for CUDA 13). Run it where pip reaches an index:
#
#     experiments/gpu_wheels.sh DIR          # then carry DIR with the checkout
#     python -m experiments.gpu_check --wheels DIR --out results/gpu   # on the GPU machine
#
# The wheels take about 100 MB as downloaded (libucx alone 42 MB), over what may travel
# with the checkout (64 MiB in all). So DIR receives one file, wheels.tar.xz: every
# wheel re-zipped without compression (a wheel's RECORD hashes its files, not their
# compressed bytes, so pip installs it as before), the folder then compressed by xz,
# which shrinks shared libraries far more than a wheel's deflate (about 46 MB).
# `gpu_check --wheels DIR` unpacks it to a temporary folder and installs from there.
# PYTHON (default python3) runs pip; the compression takes minutes on two cores.
set -euo pipefail

DIR=${1:?usage: experiments/gpu_wheels.sh DIR}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT

platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
    manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download --quiet --only-binary=:all: "${platforms[@]}" \
    --python-version 3.12 --implementation cp \
    -d "$STAGE/downloaded" -r "$REPO/experiments/gpu_requirements.txt"

"$PYTHON" - "$STAGE/downloaded" "$STAGE/stored" <<'EOF'
import sys, zipfile
from pathlib import Path

source, target = Path(sys.argv[1]), Path(sys.argv[2])
target.mkdir()
for wheel in sorted(source.glob("*.whl")):
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(target / wheel.name, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_STORED)
EOF

mkdir -p "$DIR"
tar -C "$STAGE/stored" -cf - . | xz -9 -T0 > "$DIR/wheels.tar.xz"
echo "downloaded: $(du -sb "$STAGE/downloaded" | cut -f1) bytes in $(ls "$STAGE/downloaded" | wc -l) wheels"
echo "$DIR/wheels.tar.xz: $(du -sb "$DIR/wheels.tar.xz" | cut -f1) bytes"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    tracked=$(cd "$REPO" && git ls-files -z | xargs -0 du -cb | awk '$2 == "total" {s += $1} END {print s}')
    echo "tracked checkout: $tracked bytes; with DIR: $((tracked + $(du -sb "$DIR" | cut -f1))) bytes (limit 60 MiB = 62914560)"
fi
