"""The ``spark`` command: generate, serve, chat.

Errors a user can fix (a missing model file, a bad flag value) end the command
with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from spark.serve_config import REASONING_PARSER_CHOICES, SCHEDULER_POLICIES, TOOL_CALL_PARSER_CHOICES

    parser = argparse.ArgumentParser(prog="spark", description="Spark: an LLM server on trio")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default", help="a .gguf file, an HF directory, 'default' or 'dummy:<preset>'")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message via the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    gen.add_argument("--json", action="store_true", help='print {"text", "token_ids", "prompt_token_ids"}')

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    srv.add_argument("--host", default=None)
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--model", default=None)
    srv.add_argument("--served-name", default=None)
    srv.add_argument("--device", default=None)
    srv.add_argument("--max-batch-size", type=int, default=None)
    srv.add_argument("--max-prefill-tokens", type=int, default=None)
    srv.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default=None)
    srv.add_argument("--scheduler-depth", type=int, default=None,
                     help="engine steps planned ahead (default 3)")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--cpu-threads", type=int, default=None,
                     help="torch threads of a CPU engine (default: the usable cores less one, at least 1)")
    srv.add_argument("--api-key", action="append", default=None, help="accepted Bearer key (repeatable)")
    srv.add_argument("--recipe", default=None, help="start with this recipe active (see recipes/)")
    srv.add_argument("--recipes", default=None, help="the recipes directory (default with --recipe: recipes/)")
    srv.add_argument("--admin-key", default=None, help="Bearer key of the admin API (/api/inference)")
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_CHOICES, default=None,
                     help="tool-call format of the model's output (default auto: from the chat template)")
    srv.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default=None,
                     help="split <think> reasoning off the answer (default auto: when the model has <think>)")
    srv.add_argument("--max-thinking-budget", type=int, default=None,
                     help="reasoning tokens per request at most (default: unlimited)")
    srv.add_argument("--disable-thinking", action="store_true", default=None,
                     help="thinking off unless a request turns it on (chat_template_kwargs.enable_thinking)")

    chat = sub.add_parser("chat", help="talk to a model in the terminal")
    chat.add_argument("--url", default=None, help="a running Spark server (default: start the default model here)")
    chat.add_argument("--model", default="default")

    from spark.cli_inference import add_commands

    handlers = {"generate": _generate, "serve": _serve, "chat": _chat, **add_commands(sub)}

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from spark.engine.errors import ModelLoadError

    try:
        return handlers[args.command](args)
    except (ModelLoadError, ValueError) as exc:
        print(f"spark: {exc}", file=sys.stderr)
        return 2


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
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    outputs = generate(engine, [prompt_ids], params)[0]
    token_ids = [o.token_id for o in outputs]
    text = tok.decode(token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "prompt_token_ids": list(prompt_ids)}, ensure_ascii=False))
    else:
        print(text)
    return 0


def _serve(args) -> int:
    from spark.http.serve import serve
    from spark.serve_config import ServeConfig

    config = ServeConfig.from_env(
        host=args.host, port=args.port, model=args.model, served_name=args.served_name, device=args.device,
        max_batch_size=args.max_batch_size, max_prefill_tokens=args.max_prefill_tokens,
        scheduler=args.scheduler, scheduler_depth=args.scheduler_depth, max_model_len=args.max_model_len,
        cpu_threads=args.cpu_threads, api_keys=tuple(args.api_key) if args.api_key else None,
        recipe=args.recipe, recipes_dir=args.recipes, admin_key=args.admin_key, **_state_paths(),
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_thinking_budget=args.max_thinking_budget, disable_thinking=args.disable_thinking,
    )
    serve(config)
    return 0


def _state_paths() -> dict:
    """Where ``spark serve`` keeps its activity log and usage counters, unless SPARK_* variables say."""
    import os
    import pathlib

    base = pathlib.Path(os.environ.get("XDG_STATE_HOME") or pathlib.Path.home() / ".local" / "state") / "spark"
    return {"activity_log_path": os.environ.get("SPARK_ACTIVITY_LOG_PATH") or str(base / "activity.jsonl"),
            "usage_path": os.environ.get("SPARK_USAGE_PATH") or str(base / "usage.json")}


def _chat(args) -> int:
    from spark.chat import chat

    chat(args.url, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
