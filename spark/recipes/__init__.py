"""Recipes: one YAML file per serving profile under ``recipes/`` (drafts under ``recipes/drafts/``).

    id: qwen3-8b                      # = the file name
    served_name: qwen3-8b             # what clients put in "model"
    model: ~/models/Qwen/Qwen3-8B     # a .gguf, an HF directory, `default`, or `dummy` (+ a dummy section)
    engine: spark                     # spark (in this process) | upstream (proxied: upstream.base_url)
    aliases: [qwen3]
    context: {default: 32768, kv_dtype: auto}
    scheduler: {policy: slai, max_batch_size: 64, max_prefill_tokens: 512}
    parsers: {tool_call: hermes, reasoning: think}
    sampling: {temperature: 0.6, top_p: 0.95}
    lifecycle: works                  # draft | testing | works | production | promote
    tier: medium                      # light | medium | heavy
    catalog_id: Qwen/Qwen3-8B         # the catalog identity, shown in listings
    roi_profile: qwen3-8b             # an id in recipes/roi-profiles.yaml (spark.recipes.roi)

    catalog = load_recipes("recipes", config_dir="~/.config/spark")  # + the host's enabled list, ROI prices
                                                                     # every valid recipe; catalog.problems for the rest
    for problem in catalog.problems:
        print(problem)                         # recipes/x.yaml: $.context.default: expected an int, got ...
"""

from spark.recipes.loading import Catalog, Problem, load_recipes, project_recipes_dir, read_recipe
from spark.recipes.schema import ENGINES, LIFECYCLES, RESERVED_NAMES, Recipe
from spark.recipes.serving import catalog_for, implicit_recipe, recipe_config, unavailable_reason

__all__ = ["ENGINES", "LIFECYCLES", "RESERVED_NAMES", "Catalog", "Problem", "Recipe", "catalog_for",
           "implicit_recipe", "load_recipes", "project_recipes_dir", "read_recipe", "recipe_config",
           "unavailable_reason"]
