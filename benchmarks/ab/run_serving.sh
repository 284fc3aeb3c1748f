#!/bin/bash
# Same-H200 A/B of serving.py (256 clients, 1000 requests, 512+256 tokens): before (e3dcaea) and after.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
for v in before after; do
  echo "== $v"
  (cd ab/$v && PYTHONPATH=/tmp/site:. timeout 280 python3 benchmarks/serving.py --settle 60 --out $OUT/serving-$v.json 2>&1 | grep -E "^serving|errors|Error|Traceback" | tail -6)
done
