"""From recipes to what serving needs: availability, the ServeConfig of a profile, the implicit recipe."""

from __future__ import annotations

import logging

import attrs

from spark.recipes.loading import Catalog
from spark.recipes.schema import Recipe
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.recipes")

def unavailable_reason(recipe: Recipe) -> str | None:
    """Why ``recipe`` cannot be loaded here (its weights are missing), or None when it can be tried."""
    if recipe.engine != "spark":
        return None
    if recipe.model == "default":
        from spark.engine.errors import ModelLoadError
        from spark.engine.weights import default_model_path

        try:
            default_model_path()
        except ModelLoadError as exc:
            return str(exc)
        return None
    path = recipe.model_path()
    if path is not None and not path.exists():
        from spark.engine.errors import ModelLoadError
        from spark.engine.hub import hub_model_path, looks_like_hf_id

        if not looks_like_hf_id(recipe.model):
            return f"{path}: no such file or directory"
        try:
            hub_model_path(recipe.model)  # org/name: in the local Hugging Face cache, or unavailable
        except ModelLoadError as exc:
            return str(exc)
    return None


def recipe_config(base: ServeConfig, recipe: Recipe) -> ServeConfig:
    """The server's config with the recipe's model, name, context, scheduler, parsers and defaults."""
    sched, parsers = recipe.scheduler, recipe.parsers
    changes = {
        "model": recipe.model,
        "served_name": recipe.served_name,
        "max_model_len": recipe.context.default or base.max_model_len,
        "scheduler": sched.policy or base.scheduler,
        "max_batch_size": sched.max_batch_size or base.max_batch_size,
        "max_prefill_tokens": sched.max_prefill_tokens or base.max_prefill_tokens,
        "default_max_tokens": recipe.sampling.max_tokens or base.default_max_tokens,
    }
    if sched.prefix_caching is not None:
        changes["prefix_caching"] = sched.prefix_caching
    if recipe.engine == "spark" and recipe.context.kv == "fp8":
        changes["kv_cache_dtype"] = "fp8"
    if recipe.world_size is not None:
        changes["world_size"] = recipe.world_size
    spec = recipe.speculative
    if spec is not None:
        changes["speculative"] = None if spec.method == "none" else spec.method
        changes |= {name: value for name, value in (("spec_tokens", spec.tokens), ("spec_ngram", spec.ngram),
                                                    ("spec_max_batch", spec.max_batch)) if value is not None}
    if parsers.tool_call is not None:
        changes["tool_call_parser"] = parsers.tool_call
    if parsers.reasoning is not None:
        changes["reasoning_parser"] = parsers.reasoning
    return attrs.evolve(base, **changes)


def engine_dtype(recipe: Recipe):
    """The torch dtype of the model and its KV cache (Spark's KV cache shares the model's unless it is
    fp8, ``recipe_config``'s ``kv_cache_dtype``), or None: the device's default."""
    kv = recipe.context.kv
    if kv in ("auto", "fp8"):
        return None
    import torch

    return getattr(torch, kv)  # float32 | bfloat16 | float16


def implicit_recipe(config: ServeConfig) -> Recipe:
    """``spark serve --model X`` as a recipe: the one profile of a server started without recipes."""
    from spark.recipes.model_defaults import describe, model_sampling

    name = config.resolved_served_name()
    model = config.model or "default"
    sampling, source = model_sampling(model)
    if source is not None:
        log.info("sampling defaults of %s from %s: %s", model, source, describe(sampling))
    return Recipe(id=name, served_name=name, model=model, engine="spark", name=f"{name} (--model)",
                  lifecycle="works", sampling=sampling)


def catalog_for(config: ServeConfig) -> tuple[Catalog, Recipe | None]:
    """The catalog a server serves, and the recipe active at start (None: start with none loaded).

    Without ``recipes_dir`` and ``recipe`` the catalog is the implicit recipe alone, active.

    Raises:
        ValueError: ``config.recipe`` is unknown or invalid.
    """
    from spark.recipes.loading import load_recipes, project_recipes_dir

    if not config.recipes_dir and not config.recipe:
        recipe = implicit_recipe(config)
        return Catalog((recipe,), files=0), recipe
    catalog = load_recipes(config.recipes_dir or project_recipes_dir(), config_dir=config.config_dir)
    if not config.recipe:
        return catalog, None
    recipe = catalog.get(config.recipe)
    if recipe is None:
        own = [str(p) for p in catalog.problems if p.file.endswith(f"{config.recipe}.yaml")]
        known = ", ".join(r.id for r in catalog.recipes) or "none"
        detail = ("; ".join(own)) if own else f"known: {known}"
        raise ValueError(f"recipe {config.recipe!r} is not usable in {catalog.directory}: {detail}")
    return catalog, recipe
