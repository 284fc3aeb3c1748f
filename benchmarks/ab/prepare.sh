#!/bin/bash
# Prepare a same-GPU A/B: two trees (ab/before, ab/after) from two commits, and the wheels the
# device machine lacks (.whl), both git-ignored locally (.git/info/exclude) and carried by the
# device call:   benchmarks/ab/prepare.sh e3dcaea HEAD
# then, on the device (carry [".whl", "ab"]):   bash ab/run_offline.sh   /   bash ab/run_serving.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
before=${1:?before commit}; after=${2:-HEAD}
grep -qx '/ab/' .git/info/exclude 2>/dev/null || echo '/ab/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
rm -rf ab && mkdir -p ab/before ab/after
git archive "$before" | tar -x -C ab/before
git archive "$after" | tar -x -C ab/after
cp benchmarks/ab/run_offline.sh benchmarks/ab/run_serving.sh ab/
# What spark needs beyond the device image's packages (KINDS.md lists those), for its Python 3.12.
for p in trio outcome sniffio hypercorn h2 hpack hyperframe priority wsproto quart quart-trio blinker itsdangerous \
         flask gguf cattrs; do
  v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$p==$v"
done
echo "ab/before = $(git rev-parse --short "$before"), ab/after = $(git rev-parse --short "$after"); wheels in .whl"
