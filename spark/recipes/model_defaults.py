"""Sampling defaults of a model served without a recipe: what its own files say, else its bundled recipe's.

vLLM takes a model's defaults from its ``generation_config.json``, Ollama from its Modelfile; the
GGUF format has ``general.sampling.*`` keys for the same. A model that says nothing (the embedded
SmolLM2 file) takes the sampling section of the bundled recipe that serves the same model. Without
any, a request's missing fields keep the API's own defaults (temperature 1), which a small model
answers with nonsense.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib

import attrs

from spark.recipes.schema import Sampling

log = logging.getLogger("spark.recipes")

GGUF_KEYS = {  # Sampling field -> GGUF metadata key
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_tokens": "max_new_tokens"}


@functools.lru_cache(maxsize=16)
def model_sampling(model: str, recipes_dir: str | pathlib.Path | None = None) -> tuple[Sampling, str | None]:
    """The sampling defaults of ``model`` (an ``Engine.load`` spec) and where they come from; read once per
    process (start-up asks twice: before the load and for the slot's catalog, and a GGUF header takes seconds).

    Returns:
      ``(sampling, source)``: source names the file or recipe read, None when nothing said anything
      (dummy weights, an unreadable model: loading it reports that).
    """
    if model.split(":")[0] == "dummy":
        return Sampling(), None
    if model == "default":  # the embedded file says nothing: its recipe, without reading the file
        recipe = _bundled_recipe(model, None, recipes_dir)
        return (recipe.sampling, f"recipe {recipe.id}") if recipe is not None else (Sampling(), None)
    from spark.engine.errors import ModelLoadError
    from spark.engine.weights import resolve_model

    try:
        source = resolve_model(model)
    except ModelLoadError:
        return Sampling(), None
    found: dict = {}
    if source.kind == "gguf":
        found = _gguf_sampling(source.path)
    elif source.kind == "hf":
        found = _hf_sampling(source.path / "generation_config.json")
    if found:
        return _sampling(found), str(source.path)
    recipe = _bundled_recipe(model, source.path, recipes_dir)
    if recipe is not None and recipe.sampling != Sampling():
        return recipe.sampling, f"recipe {recipe.id}"
    return Sampling(), None


def _sampling(found: dict) -> Sampling:
    ints = {"top_k", "max_tokens"}
    return Sampling(**{k: (int(v) if k in ints else float(v)) for k, v in found.items()})


def _gguf_sampling(path: pathlib.Path) -> dict:
    from spark.engine.weights.gguf_header import read_header

    meta = read_header(path).metadata  # the tokenizer's arrays skipped: 130 MB of objects with gguf's reader
    return {name: meta[key] for name, key in GGUF_KEYS.items() if key in meta}


def _hf_sampling(path: pathlib.Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {name: config[key] for name, key in HF_KEYS.items()
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def _bundled_recipe(model: str, path: pathlib.Path | None, recipes_dir):
    """The recipe in ``recipes_dir`` (the project's by default) that serves the same model, if one does."""
    from spark.recipes.loading import load_recipes, project_recipes_dir

    directory = pathlib.Path(recipes_dir) if recipes_dir else project_recipes_dir()
    if not directory.is_dir():
        return None
    for recipe in load_recipes(directory).recipes:
        if recipe.engine != "spark" or recipe.draft:
            continue
        if recipe.model == model or (path is not None and recipe.model_path() is not None
                                     and _same_file(recipe.model_path(), path)):
            return recipe
        if recipe.model == "default" and path is not None:
            from spark.engine.weights import default_model_path

            if _same_file(default_model_path(), path):
                return recipe
    return None


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def describe(sampling: Sampling) -> str:
    return ", ".join(f"{k}={v}" for k, v in attrs.asdict(sampling).items() if v is not None) or "none"
