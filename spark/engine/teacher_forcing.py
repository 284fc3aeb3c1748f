"""Teacher-forced logits: one batched prefill straight through an engine's model, outside its steps.

Fidelity checks and the fp8 KV calibration read logits (or the cache the prefill writes) at given
positions whatever either side would sample. It needs nothing of the engine's stepping, so it sits
apart from ``offline.py`` (which drives a whole core) and the engine itself can load through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Sequence as Seq

if TYPE_CHECKING:
    from spark.engine.engine import Engine


def prefill_logits(engine: Engine, sequences: Seq[Seq[int]], last: int = 1):
    """Logits [B, last, V] at the last ``last`` positions of each sequence, from one batched prefill through
    ``engine.model`` (teacher-forced: fidelity checks compare these, whatever either side would sample).

    Builds the ``AttentionMetadata`` the way ``Engine.step`` does, on pages of a private allocator, so it
    overwrites whatever those pages held: call it with no live sequence.
    """
    import torch

    from spark.engine.attention import AttentionMetadata

    allocator, page_size, device = engine.new_page_allocator(), engine.page_size, engine.device
    ids, positions, slots, qsl, tables = [], [], [], [0], []
    for b, seq in enumerate(sequences):
        table = allocator.allocate(b, len(seq))
        tables.append(table)
        ids += seq
        positions += range(len(seq))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(len(seq))]
        qsl.append(qsl[-1] + len(seq))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=device),
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        decode_only=False, max_query_len=max(map(len, sequences)),
    )
    rows = torch.tensor([end - last + i for end in qsl[1:] for i in range(last)], device=device)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                              engine.kv_cache.layers, meta)  # [T, D]
        return engine.model.compute_logits(hidden[rows]).view(len(sequences), last, -1)
