"""The ``spark`` command: generate, serve, chat.

Errors a user can fix (a missing model file, a bad flag value) end the command
with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from spark.engine.errors import ModelLoadError

    try:
        return handlers[args.command](args)
    except (ModelLoadError, ValueError) as exc:
        print(f"spark: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print("spark: interrupted", file=sys.stderr)  # Ctrl-C during a load: no 32-line traceback
        return 130


def _interrupted(exc: BaseException) -> bool:
    """A KeyboardInterrupt, alone or as every leaf of trio's exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The ``spark`` command's parser, and each subcommand's handler."""
    from spark.serve_config import (KV_CACHE_DTYPE_CHOICES, REASONING_PARSER_CHOICES, SCHEDULER_POLICIES,
                                    TOOL_CALL_PARSER_CHOICES)

    parser = argparse.ArgumentParser(prog="spark", description="Spark: an LLM server on trio")
    parser.add_argument("--version", action="version", version=f"spark {_version()}")
    # Choices, so that a bad level is argparse's one line and exit 2 (logging.basicConfig raised a traceback).
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="how much to log (default WARNING; any case)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default", help="a .gguf file, an HF directory, a Hugging Face id org/name "
                     "(from the local cache), 'default' or 'dummy:<preset>'")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message via the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    gen.add_argument("--json", action="store_true", help='print {"text", "token_ids", "prompt_token_ids"}')

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API", epilog=_environment_epilog(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    srv.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=None, help="port to listen on (default 8000; 0: a free one)")
    srv.add_argument("--model", default=None,
                     help="a .gguf file, an HF directory, a Hugging Face id org/name (from the local cache: "
                          "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; never downloaded), "
                          "'default' (the embedded SmolLM2-135M) or 'dummy:<preset>' "
                          "(default: default)")
    srv.add_argument("--served-name", default=None, help="the model name clients use (default: the file's name)")
    srv.add_argument("--device", default=None, help="cpu or cuda (default: cuda when torch sees a GPU)")
    srv.add_argument("--max-batch-size", type=int, default=None, help="sequences computed together at most (default 64)")
    srv.add_argument("--max-prefill-tokens", type=int, default=None,
                     help="prompt tokens per engine step at most; longer prompts are chunked (default 512)")
    srv.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default=None,
                     help="slai (default): keeps running streams within a time-between-tokens deadline while "
                          "prefills progress; fifo: first come, first served")
    srv.add_argument("--tbt-deadline-ms", type=float, default=None,
                     help="slai's time-between-tokens target of a stream, in ms (default 200; a request's tbt_ms wins)")
    srv.add_argument("--ttft-bound", dest="ttft_bound_s", type=float, default=None,
                     help="refuse a request (429, Anthropic 529, with Retry-After) whose first token is predicted to "
                          "come later than this many seconds (default: queue every request)")
    srv.add_argument("--scheduler-depth", type=int, default=None,
                     help="engine steps launched ahead of their results (default 2)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="context length in tokens (default: the model's, or its recipe's)")
    srv.add_argument("--world-size", type=int, default=None,
                     help="split the model over this many GPUs (tensor parallelism; on the CPU, processes over gloo), "
                          "one engine process each (default 1; under torchrun: its WORLD_SIZE)")
    srv.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default=None,
                     help="the KV cache's dtype: auto (default: the model's) or fp8 (e4m3 with per-head scales: "
                          "twice the tokens in the same memory)")
    srv.add_argument("--weight-format", choices=("int4", "int8", "dense"), default=None,
                     help="the weights on the CPU: int4 (default), int8, or dense float32 (batch-invariant)")
    srv.add_argument("--cpu-threads", "--threads", type=int, default=None,
                     help="torch threads of a CPU engine (default: they follow the cores other processes leave idle, from the usable cores less one up to all of them)")
    srv.add_argument("--api-key", action="append", default=None,
                     help="accepted Bearer key (repeatable; default: none, /v1 is open)")
    srv.add_argument("--recipe", default=None, help="start with this recipe active (see recipes/)")
    srv.add_argument("--recipes", default=None, help="the recipes directory (default with --recipe: recipes/)")
    srv.add_argument("--admin-key", default=None, help="Bearer key of the admin API (/api/inference)")
    srv.add_argument("--config-dir", default=None,
                     help="host-local control-plane config: inference-profiles.yaml (the enabled recipes), "
                          "inference-pricing.json and roi-recipe-tags.json (ROI) (default: $SPARK_CONFIG_DIR or "
                          "~/.config/spark)")
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_CHOICES, default=None,
                     help="tool-call format of the model's output (default auto: from the chat template)")
    srv.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default=None,
                     help="split <think> reasoning off the answer (default auto: when the model has <think>)")
    srv.add_argument("--max-thinking-budget", type=int, default=None,
                     help="reasoning tokens per request at most (default: unlimited)")
    srv.add_argument("--disable-thinking", action="store_true", default=None,
                     help="thinking off, whatever a request asks (a kill-switch)")
    srv.add_argument("--state-dir", default=None,
                     help="this server's activity log, usage counters and stored responses (default: "
                          "~/.local/state/spark/<port>/ for the log and counters, ~/.local/share/spark/ for responses)")
    srv.add_argument("--access-log", action="store_true", help="print one line per HTTP request to stdout")
    srv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                     help="compute every prompt in full (default: reuse the cached pages of a prompt's known prefix)")
    srv.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=None,
                     help="say ready as soon as the model is loaded (default on a GPU: after every step shape the "
                          "server will plan ran once, so that no kernel compiles in the first requests)")
    srv.add_argument("--speculative", choices=("ngram", "none"), default=None,
                     help="speculative decoding: ngram drafts tokens by prompt lookup and verifies them in one "
                          "forward (output unchanged); none (default): off")
    srv.add_argument("--spec-tokens", type=int, default=None, help="drafted tokens per step at most (default 4)")
    srv.add_argument("--spec-ngram", type=int, default=None,
                     help="longest n-gram of the context's end looked up for a draft (default 4)")
    srv.add_argument("--spec-max-batch", type=int, default=None,
                     help="speculation is off while more sequences than this decode (default 8)")

    chat = sub.add_parser("chat", help="talk to a model in the terminal")
    chat.add_argument("--url", default=None, help="a running Spark server (default: start the default model here)")
    chat.add_argument("--model", default="default", help="the model to serve, or to ask the server for")
    chat.add_argument("--api-key", default=None, help="the server's Bearer key (default: $SPARK_API_KEY)")

    from spark.cli_inference import add_commands

    handlers = {"generate": _generate, "serve": _serve, "chat": _chat, **add_commands(sub)}
    return parser, handlers


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spark")
    except PackageNotFoundError:
        return "(not installed)"


def _environment_epilog() -> str:
    """Every ``SPARK_*`` variable ``spark serve`` reads, with its default: from ServeConfig, so it cannot drift."""
    import attrs

    from spark.serve_config import ServeConfig

    lines = ["environment variables (a flag wins over its variable):"]
    for field in attrs.fields(ServeConfig):
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        shown = "none" if default in (None, (), "") else default
        lines.append(f"  SPARK_{field.name.upper():<28} default {shown}")
    lines.append("  SPARK_API_KEYS takes a comma-separated list; booleans take 1/0, true/false, yes/no, on/off.")
    return "\n".join(lines)


def _generate(args) -> int:
    from spark.engine.engine import Engine
    from spark.engine.offline import generate
    from spark.engine.sampling import SamplingParams

    engine = Engine.load(args.model, device=args.device)
    tok = engine.tokenizer
    if tok is None:
        raise ValueError(f"{args.model}: has no tokenizer; spark generate needs text")
    if args.chat:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        prompt_ids = tok.encode(args.prompt, add_special_tokens=True)
    if not prompt_ids:  # the engine would fail every step on it, with a traceback per step
        raise ValueError("the prompt is empty (it encodes to no tokens): give some text to complete")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    if args.json:
        outputs = generate(engine, [prompt_ids], params)[0]
        token_ids = [o.token_id for o in outputs]
        text = tok.decode(token_ids, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": token_ids, "prompt_token_ids": list(prompt_ids)}, ensure_ascii=False))
        return 0
    from spark.engine.detokenizer import IncrementalDetokenizer

    text = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=True)  # the text as it comes
    generate(engine, [prompt_ids], params, on_token=lambda _, out: print(text.push(out.token_id), end="", flush=True))
    print(text.flush(), flush=True)
    return 0


def _serve(args) -> int:
    from spark.http.serve import serve
    from spark.serve_config import ServeConfig

    config = ServeConfig.from_env(
        host=args.host, port=args.port, model=args.model, served_name=args.served_name, device=args.device,
        max_batch_size=args.max_batch_size, max_prefill_tokens=args.max_prefill_tokens,
        scheduler=args.scheduler, scheduler_depth=args.scheduler_depth, tbt_deadline_ms=args.tbt_deadline_ms,
        ttft_bound_s=args.ttft_bound_s, max_model_len=args.max_model_len,
        cpu_threads=args.cpu_threads, weight_format=args.weight_format, world_size=args.world_size,
        api_keys=tuple(args.api_key) if args.api_key else None,
        kv_cache_dtype=args.kv_cache_dtype,
        recipe=args.recipe, recipes_dir=args.recipes, admin_key=args.admin_key, config_dir=_config_dir(args.config_dir),
        **_state_paths(args.state_dir, args.port),
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_thinking_budget=args.max_thinking_budget, disable_thinking=args.disable_thinking,
        prefix_caching=args.prefix_caching, warm_up=args.warm_up, speculative=args.speculative, spec_tokens=args.spec_tokens,
        spec_ngram=args.spec_ngram, spec_max_batch=args.spec_max_batch,
    )
    from spark.engine.ranks import follows_torchrun

    if follows_torchrun(config.world_size, config.device):  # a rank > 0 of torchrun's: no server, it follows rank 0
        return 0
    _make_state_dirs(config)
    serve(config, access_log=args.access_log)
    return 0


def _config_dir(given: str | None) -> str:
    from spark.recipes.loading import default_config_dir

    return given or str(default_config_dir())


def _state_paths(state_dir: str | None, port: int | None) -> dict:
    """Where ``spark serve`` keeps its activity log and usage counters (and, with ``state_dir``, its stored
    responses), unless SPARK_* variables say: one directory per server, so that two servers on one
    machine never read each other's logs."""
    import os
    import pathlib

    if state_dir:
        base = pathlib.Path(state_dir).expanduser()
        paths = {"state_path": os.environ.get("SPARK_STATE_PATH") or str(base / "state.sqlite3")}
    else:
        root = pathlib.Path(os.environ.get("XDG_STATE_HOME") or pathlib.Path.home() / ".local" / "state") / "spark"
        port = port if port is not None else int(os.environ.get("SPARK_PORT") or 8000)
        base = root / (str(port) if port else f"pid-{os.getpid()}")  # port 0: a free one, this process's own
        paths = {}
    return {**paths, "activity_log_path": os.environ.get("SPARK_ACTIVITY_LOG_PATH") or str(base / "activity.jsonl"),
            "usage_path": os.environ.get("SPARK_USAGE_PATH") or str(base / "usage.json")}


def _make_state_dirs(config) -> None:
    """Make the directories of the server's state files now: one that cannot be made (``--state-dir /proc/x``)
    is then one line before the model loads, not a traceback from the app's start-up after it.

    Raises:
        ValueError: a directory cannot be made, naming it and the OS's reason.
    """
    import pathlib

    for path in (config.activity_log_path, config.usage_path, config.state_path):
        if not path or path == ":memory:":
            continue
        directory = pathlib.Path(path).expanduser().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot make the state directory {directory}: {exc.strerror or exc}") from None


def _chat(args) -> int:
    from spark.chat import chat

    return chat(args.url, model=args.model, api_key=args.api_key)


if __name__ == "__main__":
    sys.exit(main())
