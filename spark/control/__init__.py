"""The control plane: one GPU slot, many model names, one stable URL.

    slot.py      the slot manager: loads, drains, unloads and switches recipes; routes model names
    local.py     a spark-engine recipe loaded in this process (counted, evictable streams)
    upstream.py  the proxy to an external OpenAI-compatible server (SSE relayed, usage tallied)
    activity.py  one JSON line per generation request, rotated by size and age
    usage.py     token counters per recipe, kept across restarts
    bench.py     a short benchmark over HTTP (``spark inference bench``)
"""
