#!/bin/bash
# Same-H200 A/B of offline_decode (8B, batch 1 and 64): before (e3dcaea) and after, alternating.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH_BASE=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
for round in 1 2; do
  for v in before after; do
    echo "== $v round $round"
    (cd ab/$v && PYTHONPATH=/tmp/site:. python3 benchmarks/offline_decode.py --no-hf --only llama-3.1-8b:1,64 --commit $v --out $OUT/offline-$v-$round.json 2>&1 | grep -v "^{" | tail -4)
  done
done
