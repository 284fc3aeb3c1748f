"""Host time of a constrained step's masks on this machine (issue 21), no model and no GPU.

    python benchmarks/grammar_host.py [--batches 64 1] [--steps 70] [--repeats 5] [--no-chains]

The H200 check's requests (scripts/gpu_grammar_check.py: 16 forced calls in each of hermes,
qwen3_coder and minimax, 16 JSON answers) over the default model's tokenizer: each row walks its
grammar with random allowed tokens, recorded once, then replayed ``--repeats`` times. Per step, in
the order the core runs them: ``accept`` (the step's tokens, one call), ``fill`` (xgrammar's batch
fill alone), ``masks`` (``XGrammars.masks``: the fill and the rows handed out) next to ``masks_bytes``
(the same fill, each row copied to bytes, as before 2026-12-05), and ``unpack`` (the engine's
``unpack_token_masks`` into [B, V] bool, on this CPU: on a GPU only its host part stays). Also the
fill time of rows that cost over 0.5 ms alone, and which grammars they were in: the slow tail.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: spark, tests

from spark.engine.grammar import XGrammars  # noqa: E402
from spark.engine.sampler import unpack_token_masks  # noqa: E402
from spark.engine.tokenizer import Tokenizer  # noqa: E402
from spark.engine.weights import default_model_path  # noqa: E402


def specs():
    from spark.http.chat_prompt import ToolChoice
    from spark.http.structured import output_schema, turn_grammar
    from tests.grammar_cases import BOUNDED_PERSON, FORCED_TOOLS

    out = {fmt: turn_grammar(tool_parser=fmt, tools=FORCED_TOOLS, tool_choice=ToolChoice("required"),
                             parallel_tool_calls=False, schema=None, reasoning="disabled")
           for fmt in ("hermes", "qwen3_coder", "minimax")}
    out["json"] = turn_grammar(tool_parser=None, tools=None, tool_choice=ToolChoice("auto"), parallel_tool_calls=True,
                               schema=output_schema({"type": "json_schema", "json_schema": {"schema": BOUNDED_PERSON}},
                                                    param="response_format"), reasoning="disabled")
    return out


def masks_as_bytes(grammars: XGrammars, matchers) -> list[bytes]:
    """The masks as each row's bytes: what ``XGrammars.masks`` returned before (one copy per row)."""
    return [bytes(row) for row in grammars.masks(matchers)]


def walks(grammars, kinds, steps, seed=0) -> list[list[int | None]]:
    """Each row's tokens, drawn at random among the allowed ones (None once its grammar ended)."""
    rng, matchers = random.Random(seed), [grammars.matcher(k) for k in kinds]
    out = [[] for _ in kinds]
    for _ in range(steps):
        masks = grammars.masks(matchers)
        for row, (m, mask) in enumerate(zip(matchers, masks)):
            if m._matcher.is_terminated():
                out[row].append(None)
                continue
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:grammars.vocab_size])
            out[row].append(int(rng.choice(allowed)))
            m.accept(out[row][-1])
    return out


def replay(grammars, kinds, tokens, names) -> dict:
    """One pass over the walks: per step, each phase's seconds; the rows over 0.5 ms alone."""
    matchers = [grammars.matcher(k) for k in kinds]
    times = {n: [] for n in ("accept", "fill", "masks", "masks_bytes", "unpack")}
    slow, one = {}, np.empty((1, len(grammars._stop_words)), np.int32)
    batch = grammars._batch
    for step in range(len(tokens[0])):
        live = [m._matcher for m in matchers if not m._matcher.is_terminated()]
        t0 = time.perf_counter()
        if live:
            batch.batch_fill_next_token_bitmask(live, np.empty((len(live), one.shape[1]), np.int32))
        times["fill"].append(time.perf_counter() - t0)
        for name, call in (("masks_bytes", masks_as_bytes), ("masks", XGrammars.masks)) if step % 2 else \
                (("masks", XGrammars.masks), ("masks_bytes", masks_as_bytes)):
            t0 = time.perf_counter()
            masks = call(grammars, matchers)
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        unpack_token_masks(masks, grammars.vocab_size, torch.device("cpu"))
        times["unpack"].append(time.perf_counter() - t0)
        for row, m in enumerate(matchers):  # each row alone: which ones make the tail
            if not m._matcher.is_terminated():
                t0 = time.perf_counter()
                m._matcher.fill_next_token_bitmask(one)
                if (dt := time.perf_counter() - t0) > 0.5e-3:
                    slow[names[row]] = slow.get(names[row], 0.0) + dt
        taken = [t[step] for t in tokens]
        live_rows = [row for row, t in enumerate(taken) if t is not None]
        t0 = time.perf_counter()
        grammars.accept([matchers[r] for r in live_rows], [taken[r] for r in live_rows])
        times["accept"].append(time.perf_counter() - t0)
    return {"times": times, "slow_rows_s": slow}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-chains", action="store_true", help="compile the grammars as xgrammar writes them "
                    "(XGrammars chain_repeats=False): the A side of spark.engine.grammar_chains")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf(default_model_path())
    grammars = XGrammars(tokenizer, tokenizer.vocab_size, chain_repeats=not args.no_chains)
    by_name = specs()
    result = {"bench": "grammar_host", "vocab": tokenizer.vocab_size, "steps": args.steps}
    for batch in args.batches:
        names = [list(by_name)[row * len(by_name) // max(batch, len(by_name))] for row in range(batch)] \
            if batch >= len(by_name) else list(by_name)[:batch]
        kinds = [by_name[n] for n in names]
        tokens = walks(grammars, kinds, args.steps)
        runs = [replay(grammars, kinds, tokens, names) for _ in range(args.repeats)]
        ms = {}
        for phase in runs[0]["times"]:
            per_step = [statistics.mean(r["times"][phase]) for r in runs]  # mean over steps: what a step costs
            medians = [statistics.median(r["times"][phase]) for r in runs]
            ms[phase] = {"mean": round(statistics.median(per_step) * 1e3, 3),
                         "median": round(statistics.median(medians) * 1e3, 3)}
        slow = {n: round(statistics.median([r["slow_rows_s"].get(n, 0.0) for r in runs]) * 1e3 / args.steps, 3)
                for n in by_name}
        result[f"batch{batch}"] = {"host_ms_per_step": ms, "slow_rows_fill_ms_per_step": slow}
        print(f"batch {batch}: " + json.dumps(result[f"batch{batch}"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
