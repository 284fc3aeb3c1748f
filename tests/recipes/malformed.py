"""Malformed recipe files, each with the problem lines it must produce (substrings of ``str(Problem)``).

Shared by the loader tests and the server tests (a server must start with the valid recipes beside these).
"""

from __future__ import annotations

import pathlib

_OK = "served_name: {name}\nengine: spark\nmodel: dummy:tiny-llama\n"


def _ok(recipe_id: str, extra: str = "", name: str | None = None) -> str:
    return f"id: {recipe_id}\n" + _OK.format(name=name or f"m-{recipe_id}") + extra


# file name -> (YAML text, substrings that must each appear in one of the file's problems)
MALFORMED: dict[str, tuple[str, list[str]]] = {
    "bad-yaml.yaml": ("id: bad-yaml\nserved_name: [unclosed\nengine: spark\n", ["YAML syntax error", "(line "]),
    "empty.yaml": ("", ["$: the file is empty"]),
    "top-list.yaml": ("- id: top-list\n", ["$: expected a mapping of recipe fields, got list"]),
    "missing-fields.yaml": ("id: missing-fields\nname: nothing else\n",
                            ["$.served_name: required field missing", "$.model: required field missing",
                             "$.engine: required field missing"]),
    "context-type.yaml": (_ok("context-type", "context:\n  default: 8k\n"),
                          ["$.context.default: expected an int, got str '8k' (line 6)"]),
    "unknown-engine.yaml": ("id: unknown-engine\nserved_name: ue\nengine: vllm\nmodel: x\n",
                            ["$.engine: expected one of spark, upstream; got 'vllm' (line 3)"]),
    "upstream-no-section.yaml": ("id: upstream-no-section\nserved_name: uns\nengine: upstream\nmodel: m\n",
                                 ["$.upstream: engine upstream needs an upstream section with base_url"]),
    "upstream-no-base-url.yaml": ("id: upstream-no-base-url\nserved_name: unb\nengine: upstream\nmodel: m\n"
                                  "upstream:\n  timeout_s: 5\n", ["$.upstream.base_url: required field missing"]),
    "upstream-bad-url.yaml": ("id: upstream-bad-url\nserved_name: ubu\nengine: upstream\nmodel: m\n"
                              "upstream:\n  base_url: localhost:8081/v1\n", ["is not an http:// or https:// URL"]),
    "upstream-on-spark.yaml": (_ok("upstream-on-spark", "upstream:\n  base_url: http://x/v1\n"),
                               ["$.upstream: an upstream section needs engine: upstream"]),
    "key-in-recipe.yaml": ("id: key-in-recipe\nserved_name: kir\nengine: upstream\nmodel: m\nupstream:\n"
                           "  base_url: http://127.0.0.1:1/v1\n  api_key_env: sk-abc123\n",
                           ["$.upstream.api_key_env: 'sk-abc123' is not an environment variable name"]),
    "reserved-alias.yaml": (_ok("reserved-alias", "aliases: [ok-name, sparky]\n"),
                            ["$.aliases[1]: 'sparky' is reserved"]),
    "reserved-served-name.yaml": (_ok("reserved-served-name", name="sparky"), ["$.served_name: 'sparky' is reserved"]),
    "extra-key.yaml": (_ok("extra-key", "temprature: 0.5\n"), ["$: unknown field temprature (line 5)"]),
    "nested-extra-key.yaml": (_ok("nested-extra-key", "context:\n  default: 1024\n  kv: fp8\n"),
                              ["$.context: unknown field kv (line 7)"]),
    "id-mismatch.yaml": (_ok("other-name"), ["$.id: 'other-name' differs from the file name 'id-mismatch'"]),
    "Bad_ID.yaml": (_ok("Bad_ID"), ["$.id: 'Bad_ID' is not an id"]),
    "kv-dtype.yaml": (_ok("kv-dtype", "context:\n  kv_dtype: fp16\n"),
                      ["$.context.kv_dtype: expected one of auto, float32, bfloat16, float16, fp8; got 'fp16'"]),
    "lifecycle.yaml": (_ok("lifecycle", "lifecycle: shipped\n"), ["$.lifecycle: expected one of draft, testing"]),
    "aliases-string.yaml": (_ok("aliases-string", "aliases: abc\n"),
                            ["$.aliases: expected a list of strings, got str 'abc'"]),
    "dummy-no-section.yaml": ("id: dummy-no-section\nserved_name: dns\nengine: spark\nmodel: dummy\n",
                              ["$.dummy: model: dummy needs a dummy section"]),
    "dummy-bad-preset.yaml": ("id: dummy-bad-preset\nserved_name: dbp\nengine: spark\nmodel: dummy\n"
                              "dummy:\n  preset: tiny-gpt\n", ["$.dummy.preset: unknown preset 'tiny-gpt'"]),
    "dummy-bad-field.yaml": ("id: dummy-bad-field\nserved_name: dbf\nengine: spark\nmodel: dummy\n"
                             "dummy:\n  config:\n    layers: 2\n", ["$.dummy.config.layers: not a model config field"]),
    "unknown-parser.yaml": (_ok("unknown-parser", "parsers:\n  tool_call: json\n"),
                            ["$.parsers.tool_call: unknown parser 'json'"]),
    "unknown-policy.yaml": (_ok("unknown-policy", "scheduler:\n  policy: lifo\n"),
                            ["$.scheduler.policy: unknown policy 'lifo'; known: fifo, slai"]),
    "zero-batch.yaml": (_ok("zero-batch", "scheduler:\n  max_batch_size: 0\n"),
                        ["$.scheduler.max_batch_size: must be at least 1, got 0"]),
    "top-p.yaml": (_ok("top-p", "sampling:\n  top_p: 1.5\n"), ["$.sampling.top_p: must be in (0, 1], got 1.5"]),
    "bool-number.yaml": (_ok("bool-number", "sampling:\n  temperature: yes\n"),
                         ["$.sampling.temperature: expected a number, got bool True"]),
    "duplicate-key.yaml": (_ok("duplicate-key", "id: again\n"), ["duplicate key 'id'", "(line 5)"]),
    # A cycle: the line index recursed until RecursionError, in `recipe check` and `serve --recipes` alike.
    "recursive-alias.yaml": (_ok("recursive-alias", "aliases: &a [*a]\n"),
                             ["$: YAML aliases (*a) are not allowed: write the value out (line 5)"]),
    "draft-outside.yaml": (_ok("draft-outside", "lifecycle: draft\n"), ["a draft belongs in recipes/drafts/"]),
    "null-section.yaml": (_ok("null-section", "context:\n"), ["$.context: expected a mapping, got NoneType None"]),
    "space-name.yaml": (_ok("space-name", name="my model"), ["$.served_name: 'my model' is not a model name"]),
    "many-problems.yaml": ("id: many-problems\nserved_name: 7\nengine: spark\nmodel: dummy:nope\n"
                           "context:\n  default: 4\n",
                           ["$.served_name: expected a string, got int 7", "$.model: unknown dummy preset 'dummy:nope'",
                            "$.context.default: must be at least 16, got 4"]),
    # Cross-file: the first file (in name order) keeps the name; the later one is skipped.
    "zz-dup-served.yaml": (_ok("zz-dup-served", name="m-valid-one"),
                           ["$.served_name: model name 'm-valid-one' is already used by recipe valid-one"]),
    "zz-dup-alias.yaml": (_ok("zz-dup-alias", "aliases: [v2]\n"),
                          ["$.aliases[0]: model name 'v2' is already used by recipe valid-two"]),
}

VALID: dict[str, str] = {
    "valid-one.yaml": _ok("valid-one"),
    "valid-two.yaml": _ok("valid-two", "aliases: [v2]\ncontext:\n  default: 256\n"),
}


def write_malformed(directory: pathlib.Path) -> None:
    """Write every malformed file and the valid ones they collide with into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (text, _) in MALFORMED.items():
        (directory / name).write_text(text)
    for name, text in VALID.items():
        (directory / name).write_text(text)
