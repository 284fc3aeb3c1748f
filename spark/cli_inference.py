"""``spark inference ...`` (the control plane of a running server) and ``spark recipe ...`` (authoring).

    spark inference list | status | up ID | down | logs | usage | bench [ID] | help   [--url URL] [--admin-key KEY]
    spark gateway --list-aliases [--url URL]
    spark recipe check [--recipes DIR] [--config-dir DIR]
    spark recipe roi [RECIPE_ID ROI_PROFILE] [--recipes DIR] [--config-dir DIR] [--url URL]
    spark recipe scaffold <lab/slug> <spark|upstream> [--recipes DIR]

The server is ``--url`` (default ``$SPARK_URL``, else http://127.0.0.1:8000); the
admin key ``--admin-key`` (default ``$SPARK_ADMIN_KEY``).
"""

from __future__ import annotations

import os
import sys
import time

DEFAULT_URL = "http://127.0.0.1:8000"


class CommandError(Exception):
    """Ends the command with this line on stderr and exit status 1 (the server said no) or 2 (unreachable)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def add_commands(sub) -> dict:
    """Add the ``inference`` and ``recipe`` subcommands to ``sub``; returns ``{command: handler}``."""
    inf = sub.add_parser("inference", help="the running server's model slot: list, status, up, down, logs, usage, "
                                           "bench")
    isub = inf.add_subparsers(dest="action", required=True)
    actions = {
        "list": "every recipe and its state", "status": "the slot: active model, switch in progress, problems",
        "up": "switch to a recipe (waits until it serves)", "down": "unload the active model",
        "logs": "slot events and the last requests", "usage": "tokens per recipe: last hour, day, all time",
        "bench": "time to first token and tokens/s of the active model at 1 and 8 streams",
        "help": "how an agent or client uses this server: URL, model names, switching, headers",
    }
    for action, text in actions.items():
        p = isub.add_parser(action, help=text)
        p.add_argument("--url", default=os.environ.get("SPARK_URL", DEFAULT_URL))
        p.add_argument("--admin-key", default=os.environ.get("SPARK_ADMIN_KEY"))
        if action == "list":
            p.add_argument("--recipes", default=None, help="read this recipes directory when no server answers")
        if action in ("up", "bench"):
            p.add_argument("id", nargs="?" if action == "bench" else None, help="recipe id")
        if action in ("up", "down"):
            p.add_argument("--grace", type=float, default=None, help="seconds in-flight requests may finish")
        if action == "logs":
            p.add_argument("-n", type=int, default=20, help="activity lines to show")
        if action == "bench":
            p.add_argument("--api-key", default=os.environ.get("SPARK_API_KEY"), help="Bearer key for /v1")
            p.add_argument("--max-tokens", type=int, default=64)
            p.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    gw = sub.add_parser("gateway", help="the model names the server answers to")
    gw.add_argument("--list-aliases", action="store_true", required=True,
                    help="every name: sparky, sparky-think, sparky-fast, and each enabled recipe's names")
    gw.add_argument("--url", default=os.environ.get("SPARK_URL", DEFAULT_URL))
    gw.add_argument("--admin-key", default=os.environ.get("SPARK_ADMIN_KEY"))
    gw.add_argument("--recipes", default=None, help="read this recipes directory when no server answers")
    gw.add_argument("--config-dir", default=None, help="the host-local config (the enabled list) with --recipes")
    rec = sub.add_parser("recipe", help="author recipes: check, roi, scaffold")
    rsub = rec.add_subparsers(dest="action", required=True)
    check = rsub.add_parser("check", help="validate every recipe; exit 1 on any problem")
    check.add_argument("--recipes", default=None, help="the recipes directory (default: the project's recipes/)")
    check.add_argument("--config-dir", default=None, help="host-local config: the enabled list, ROI prices and "
                                                          "tags (default: $SPARK_CONFIG_DIR or ~/.config/spark)")
    roi = rsub.add_parser("roi", help="each recipe's ROI profile and cloud cost (exit 1 on any problem); with two "
                                      "ids, tag a recipe")
    roi.add_argument("ids", nargs="*", metavar="RECIPE_ID ROI_PROFILE", help="tag this recipe with this profile")
    roi.add_argument("--recipes", default=None, help="the recipes directory (default: the project's recipes/)")
    roi.add_argument("--config-dir", default=None, help="host-local ROI prices and tags (default: "
                                                        "$SPARK_CONFIG_DIR or ~/.config/spark)")
    roi.add_argument("--url", default=os.environ.get("SPARK_URL", DEFAULT_URL), help="a server whose usage to price")
    roi.add_argument("--admin-key", default=os.environ.get("SPARK_ADMIN_KEY"))
    scaf = rsub.add_parser("scaffold", help="write a draft recipe to edit")
    scaf.add_argument("spec", help="<lab>/<slug>, e.g. Qwen/Qwen3-8B")
    scaf.add_argument("engine", choices=("spark", "upstream"))
    scaf.add_argument("--recipes", default=None)
    scaf.add_argument("--force", action="store_true", help="overwrite an existing draft")
    return {"inference": _inference, "recipe": _recipe, "gateway": _gateway}


def _inference(args) -> int:
    return _run(lambda: _INFERENCE[args.action](args))


def _recipe(args) -> int:
    return _run(lambda: {"check": _check, "scaffold": _scaffold, "roi": _roi}[args.action](args))


def _gateway(args) -> int:
    return _run(lambda: _list_aliases(args))


def _run(fn) -> int:
    try:
        return fn() or 0
    except CommandError as exc:
        print(f"spark: {exc}", file=sys.stderr)
        return exc.status
    except OSError as exc:  # a directory or file that cannot be made or written (scaffold, roi's tag)
        print(f"spark: {_os_error_line(exc)}", file=sys.stderr)
        return 1


def _os_error_line(exc: OSError) -> str:
    """``path: what the OS said``, e.g. ``/proc/x: No such file or directory``."""
    if exc.filename is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror or exc}"


# -- talking to the server -------------------------------------------------------------------------


def _call(args, method: str, path: str, *, json=None, timeout: float = 30.0, params=None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    try:
        r = httpx.request(method, args.url.rstrip("/") + path, json=json, headers=headers, timeout=timeout,
                          params=params)
    except httpx.HTTPError as exc:
        raise CommandError(f"cannot reach the server at {args.url}: {exc}", 2) from None
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code >= 400:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        raise CommandError(f"{method} {path}: {r.status_code}: {message or r.text[:200]}")
    return body


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows])


def _list(args) -> int:
    try:
        status = _call(args, "GET", "/api/inference/status", timeout=5.0)
        recipes, where = status["recipes"], f"server {args.url}"
    except CommandError as exc:
        if exc.status != 2:
            raise
        from spark.recipes import load_recipes, project_recipes_dir, unavailable_reason
        from spark.recipes.loading import default_config_dir

        catalog = load_recipes(args.recipes or project_recipes_dir(), config_dir=default_config_dir())
        recipes = [{"id": r.id, "served_name": r.served_name, "aliases": list(r.aliases), "engine": r.engine,
                    "lifecycle": r.lifecycle, "draft": r.draft, "enabled": catalog.is_enabled(r),
                    "state": "unavailable" if unavailable_reason(r) else "available"} for r in catalog.recipes]
        where = f"{catalog.directory} (no server at {args.url})"
    rows = [[r["id"] + (" (draft)" if r["draft"] else "") + ("" if r.get("enabled", not r["draft"]) or r["draft"]
                                                             else " (not enabled)"),
             r["served_name"], ", ".join(r["aliases"]), r["engine"], r["lifecycle"], r["state"]] for r in recipes]
    print(f"recipes of {where}:")
    print(_table(rows, ["ID", "SERVED NAME", "ALIASES", "ENGINE", "LIFECYCLE", "STATE"]))
    return 0


def _status(args) -> int:
    s = _call(args, "GET", "/api/inference/status")
    active = s["active"]
    print(f"state:   {s['state']}" + (f" (switching to {s['target']})" if s["target"] else ""))
    if active:
        extra = f", {active['open_streams']} open stream(s)" if "open_streams" in active else ""
        print(f"active:  {active['id']} as {active['served_name']} ({active['engine']}, "
              f"up in {active['load_s']}s{extra})")
    else:
        print("active:  none")
    if s["error"]:
        print(f"error:   {s['error']}")
    if s["last_unload"]:
        u = s["last_unload"]
        print(f"last unload: {u['recipe']}: {u['cut_off']} generation(s) cut off, "
              f"{int(u['kv_pages_in_use'])} KV page(s) in use at close")
    print(f"recipes: {len(s['recipes'])} usable, {len(s['problems'])} skipped"
          + (f" ({s['recipes_dir']})" if s["recipes_dir"] else ""))
    for problem in s["problems"]:
        print(f"  {problem}")
    return 0


def _up(args) -> int:
    body = {"id": args.id, "wait": True} | ({"grace_s": args.grace} if args.grace is not None else {})
    print(f"switching to {args.id} ...", flush=True)
    t0 = time.monotonic()
    s = _call(args, "POST", "/api/inference/up", json=body, timeout=3600.0)
    print(f"{s['active']['id']} is active as {s['active']['served_name']} ({time.monotonic() - t0:.1f}s)")
    return 0


def _down(args) -> int:
    body = {"grace_s": args.grace} if args.grace is not None else {}
    s = _call(args, "POST", "/api/inference/down", json=body, timeout=3600.0)
    print(f"state: {s['state']}")
    return 0


def _logs(args) -> int:
    logs = _call(args, "GET", "/api/inference/logs", params={"n": args.n})
    for e in logs["events"]:
        print(f"{_clock(e['time'])}  {e['event']:<9} {e['recipe'] or '-':<28} {e['detail']}")
    if logs["activity"]:
        rows = [[a["time"], a["endpoint"], a.get("recipe") or "-", a.get("key_id") or "-",
                 str(a["prompt_tokens"]), str(a["completion_tokens"]), f"{a['latency_s']:.2f}s", str(a["status"]),
                 a.get("outcome", "")] for a in logs["activity"]]
        print()
        print(_table(rows, ["TIME", "ENDPOINT", "RECIPE", "KEY", "PROMPT", "COMPL", "LATENCY", "STATUS", "OUTCOME"]))
    return 0


def _usage(args) -> int:
    answer = _call(args, "GET", "/api/inference/usage")
    usage, roi = answer["recipes"], answer.get("roi", {}).get("recipes", {})
    if not usage:
        print("no usage yet")
        return 0
    rows = []
    for recipe_id, w in usage.items():
        rows.append([recipe_id] + [f"{w[k]['requests']} / {w[k]['prompt_tokens']} / {w[k]['completion_tokens']}"
                                   for k in ("hour", "day", "total")] + [_cloud_cost(roi.get(recipe_id))])
    print(_table(rows, ["RECIPE", "LAST HOUR (req / prompt / compl)", "LAST DAY", "ALL TIME",
                        "CLOUD COST 24H / ALL (ROI)"]))
    return 0


def _cloud_cost(roi: dict | None) -> str:
    """What a recipe's tokens would cost on its ROI profile's cloud model (``spark recipe roi``)."""
    if roi is None:
        return "-"
    if roi["total"] is None:
        return f"unpriced ({roi['profile']})"
    return f"${roi['day']:.4f} / ${roi['total']:.4f} ({roi['profile']})"


def _bench(args) -> int:
    from spark.control.bench import format_table, run_bench

    if args.id:
        _up(_with(args, grace=None))
    status = _call(args, "GET", "/api/inference/status")
    if status["state"] != "active":
        raise CommandError(f"no model is active (state {status['state']}): run `spark inference up <id>` first")
    streams = tuple(int(x) for x in args.streams.split(",") if x.strip())
    print(f"bench {status['active']['id']}: {args.max_tokens} tokens per stream, streams {streams}", flush=True)
    rows = run_bench(args.url, status["active"]["served_name"], api_key=args.api_key or args.admin_key,
                     streams=streams, max_tokens=args.max_tokens)
    print(format_table(rows))
    return 1 if any(r.errors for r in rows) else 0


def _with(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _help(args) -> int:
    print(AGENT_HELP.format(url=args.url.rstrip("/")))
    try:
        status = _call(args, "GET", "/api/inference/status", timeout=5.0)
    except CommandError as exc:
        print(f"\nnow: {exc}")
        return 0
    active = status["active"]
    print(f"\nnow: {status['state']}" + (f", {active['id']} active as {active['served_name']}" if active else "")
          + (f", switching to {status['target']}" if status["target"] else ""))
    names = [n for r in status["recipes"] if r.get("enabled", not r["draft"]) for n in [r["served_name"], *r["aliases"]]]
    print(f"names: sparky, sparky-think, sparky-fast, {', '.join(names)}")
    return 0


AGENT_HELP = """\
Spark: one model loaded at a time, many names in front of it, one URL that survives a switch.

Base URL: {url}/v1  (OpenAI chat/completions, completions, responses, embeddings; Anthropic messages)
Model names:
  sparky         the active model as its recipe serves it; never switches (use it when any model will do)
  sparky-think   the active model with thinking on (the request's own thinking switch wins)
  sparky-fast    the active model with thinking off
  <name>         a recipe's served name or alias: a local recipe that is not active is switched to, and the
                 request answered 503 + Retry-After until it is ready; an upstream recipe is proxied at once
Answers say X-Spark-Active-Profile (the recipe that answered) and X-Spark-Served-Model; a proxied one
also X-Spark-Upstream-Port. Routes Spark's engine lacks (/v1/embeddings) reach upstream recipes only.
Commands: spark inference list | status | up ID | down | logs | usage | bench;
          spark gateway --list-aliases; spark recipe check | roi | scaffold
Admin API (admin key): GET /api/inference/status | logs | usage | activity, POST /api/inference/up | down"""


def _list_aliases(args) -> int:
    """``spark gateway --list-aliases``: every name the server answers to, and what it means."""
    from spark.recipes.schema import RESERVED_NAMES

    try:
        status = _call(args, "GET", "/api/inference/status", timeout=5.0)
        recipes, where = status["recipes"], f"server {args.url}"
        active = status["active"]["id"] if status["active"] else None
    except CommandError as exc:
        if exc.status != 2:
            raise
        from spark.recipes import load_recipes, project_recipes_dir

        from spark.recipes.loading import default_config_dir

        catalog = load_recipes(args.recipes or project_recipes_dir(), config_dir=args.config_dir or default_config_dir())
        recipes = [{"id": r.id, "served_name": r.served_name, "aliases": list(r.aliases), "engine": r.engine,
                    "enabled": catalog.is_enabled(r), "draft": r.draft} for r in catalog.recipes]
        where, active = f"{catalog.directory} (no server at {args.url})", None
    means = {"sparky": "the active model", "sparky-think": "the active model, thinking on",
             "sparky-fast": "the active model, thinking off"}
    rows = [[name, means.get(name, "the active model"), active or "(whichever is active)", "-"]
            for name in RESERVED_NAMES]
    for r in recipes:
        if not r.get("enabled", not r["draft"]):
            continue
        rows.append([r["served_name"], "served name", r["id"], r["engine"]])
        rows += [[alias, f"alias of {r['served_name']}", r["id"], r["engine"]] for alias in r["aliases"]]
    print(f"gateway names of {where}:")
    print(_table(rows, ["NAME", "MEANS", "RECIPE", "ENGINE"]))
    return 0


_INFERENCE = {"list": _list, "status": _status, "up": _up, "down": _down, "logs": _logs, "usage": _usage,
              "bench": _bench, "help": _help}


# -- authoring ---------------------------------------------------------------------------------------


def _check(args) -> int:
    from spark.recipes import load_recipes, project_recipes_dir, unavailable_reason
    from spark.recipes.loading import default_config_dir

    catalog = load_recipes(args.recipes or project_recipes_dir(), config_dir=args.config_dir or default_config_dir())
    for problem in catalog.problems:
        print(problem)
    for recipe in catalog.recipes:
        reason = unavailable_reason(recipe)
        note = f"  (unavailable here: {reason})" if reason else ""
        if not catalog.is_enabled(recipe) and not recipe.draft:
            note += "  (not in the enabled list)"
        print(f"ok  {recipe.id}{' (draft)' if recipe.draft else ''}{note}")
    bad_files = len({p.file for p in catalog.problems})
    print(f"{len(catalog.recipes)} recipe(s) valid, {bad_files} file(s) with {len(catalog.problems)} problem(s)")
    return 1 if catalog.problems else 0


def _scaffold(args) -> int:
    from spark.recipes import project_recipes_dir, read_recipe
    from spark.recipes.scaffold import scaffold

    try:
        path = scaffold(args.spec, args.engine, args.recipes or project_recipes_dir(), force=args.force)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    _, problems = read_recipe(path, draft=True)
    for problem in problems:  # a template bug, never a user's
        print(problem, file=sys.stderr)
    print(f"wrote {path}")
    return 1 if problems else 0


def _roi(args) -> int:
    """``spark recipe roi``: each recipe's ROI profile and prices (and, when a server answers, what its
    usage would cost there); ``spark recipe roi RECIPE PROFILE`` writes the tag into the recipe file."""
    from spark.recipes import load_recipes, project_recipes_dir, read_recipe
    from spark.recipes.loading import default_config_dir
    from spark.recipes.roi import PROFILES_FILE, tag_recipe

    directory = args.recipes or project_recipes_dir()
    catalog = load_recipes(directory, config_dir=args.config_dir or default_config_dir())
    book = catalog.roi
    if args.ids:
        if len(args.ids) != 2:
            raise CommandError("usage: spark recipe roi RECIPE_ID ROI_PROFILE")
        recipe_id, profile_id = args.ids
        recipe = catalog.get(recipe_id)
        if recipe is None:
            raise CommandError(f"no valid recipe {recipe_id!r} in {catalog.directory}")
        if profile_id not in book.profiles:
            raise CommandError(f"no ROI profile {profile_id!r} in {book.profiles_path}; known: "
                               f"{', '.join(book.profiles) or 'none'}")
        tag_recipe(recipe.path, profile_id)
        _, problems = read_recipe(recipe.path, draft=recipe.draft)
        if problems:
            raise CommandError(f"{recipe.path} no longer checks: {problems[0]}")
        print(f"{recipe.id}: roi_profile {profile_id} ({recipe.path})")
        return 0
    for problem in catalog.problems:
        print(problem, file=sys.stderr)
    costs = {}
    try:
        costs = _call(args, "GET", "/api/inference/usage", timeout=5.0).get("roi", {}).get("recipes", {})
    except CommandError:
        pass  # no server: identities and prices only
    rows = []
    for recipe in catalog.recipes:
        pid, source = book.profile_of(recipe)
        profile, price = book.profiles.get(pid), book.prices.get(pid)
        cost = costs.get(recipe.id)
        rows.append([recipe.id, f"{pid} ({source})" if pid else "(none)",
                     f"{profile.provider}/{profile.model}" if profile else "-",
                     f"{price.in_:.2f} / {price.out:.2f}" if price else "-",
                     _cloud_cost(cost).rsplit(" (", 1)[0] if cost else "-"])
    print(f"ROI profiles of {catalog.directory / PROFILES_FILE if catalog.directory else PROFILES_FILE}:")
    print(_table(rows, ["RECIPE", "ROI PROFILE", "CLOUD MODEL", "USD/MTOK IN / OUT", "CLOUD COST 24H / ALL"]))
    return 1 if catalog.problems else 0  # as `recipe check`: a script must not read a partial table as whole
