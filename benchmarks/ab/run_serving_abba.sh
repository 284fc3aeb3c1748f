#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
n=0
for v in before after after before; do
  n=$((n+1)); echo "== $n $v"
  (cd ab/$v && PYTHONPATH=/tmp/site:. timeout 200 python3 benchmarks/serving.py --settle 60 --out $OUT/serving-$n-$v.json 2>&1 | grep -E "^serving|errors|Error|Traceback" | tail -4)
done
