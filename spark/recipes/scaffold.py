"""``spark recipe scaffold <lab/slug> <engine>``: a draft recipe to edit, valid as written."""

from __future__ import annotations

import os
import pathlib
import re

from spark.recipes.loading import DRAFTS
from spark.recipes.schema import ENGINES
from spark.serve_config import REASONING_PARSER_CHOICES, SCHEDULER_POLICIES, TOOL_CALL_PARSER_CHOICES

_SPARK = """\
# Draft: edit it and run `spark recipe check`; to serve it by name, set lifecycle: testing and move it
# to {directory}/ (until then `spark inference up {id}` still brings it up).
id: {id}
name: {name}
catalog_id: {lab}/{slug}               # the model's catalog identity, shown in listings
served_name: {served}
engine: spark
model: ~/models/{lab}/{slug}        # a .gguf file or an HF directory; `default` for the embedded model
lifecycle: draft
tier: medium
context:
  default: 8192                     # context length (tokens)
  kv_dtype: auto                    # auto | bfloat16 | float16 | float32 (the model's, shared by the KV cache) | fp8 (KV cache only)
scheduler:
  policy: slai                      # {policy_choices}
  max_batch_size: 64
parsers:
  tool_call: auto                   # {tool_call_choices}
  reasoning: auto                   # {reasoning_choices}
sampling:
  temperature: 0.7
"""

_UPSTREAM = """\
# Draft: edit it and run `spark recipe check`; to serve it by name, set lifecycle: testing and move it
# to {directory}/ (until then `spark inference up {id}` still brings it up).
id: {id}
name: {name}
catalog_id: {lab}/{slug}               # the model's catalog identity, shown in listings
served_name: {served}
engine: upstream
model: {lab}/{slug}                 # the name the upstream server knows the model by
lifecycle: draft
tier: heavy
upstream:
  base_url: http://127.0.0.1:8081/v1   # llama.cpp's llama-server; vLLM: http://127.0.0.1:8001/v1
  # api_key_env: UPSTREAM_API_KEY      # the environment variable holding its key (never the key itself)
"""


def scaffold(spec: str, engine: str, directory: str | os.PathLike, *, force: bool = False) -> pathlib.Path:
    """Write ``<directory>/drafts/<lab>-<slug>.yaml``.

    Args:
      spec: ``lab/slug``, as on Hugging Face (``Qwen/Qwen3-8B``).
      engine: ``spark`` or ``upstream``.

    Returns:
      The path written.

    Raises:
      ValueError: a bad spec or engine, or the file exists (without ``force``).
    """
    lab, sep, slug = spec.partition("/")
    if not sep or not lab or not slug or "/" in slug:
        raise ValueError(f"{spec!r}: expected <lab>/<slug>, e.g. Qwen/Qwen3-8B")
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    recipe_id = re.sub(r"[^a-z0-9._-]+", "-", f"{lab}-{slug}".lower()).strip("-._")
    served = re.sub(r"[^a-z0-9._-]+", "-", slug.lower()).strip("-._")
    path = pathlib.Path(directory) / DRAFTS / f"{recipe_id}.yaml"
    if path.exists() and not force:
        raise ValueError(f"{path} exists (use --force to overwrite)")
    template = _SPARK if engine == "spark" else _UPSTREAM
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(template.format(id=recipe_id, name=f"{lab}/{slug}", served=served, lab=lab, slug=slug,
                                    directory=pathlib.Path(directory).name or directory,
                                    tool_call_choices=" | ".join(TOOL_CALL_PARSER_CHOICES),
                                    reasoning_choices=" | ".join(REASONING_PARSER_CHOICES),
                                    policy_choices=" | ".join(SCHEDULER_POLICIES)))
    return path
