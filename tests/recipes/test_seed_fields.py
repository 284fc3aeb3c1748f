"""The control-plane seed's recipe fields (issue 25): accepted and given meaning; an enabled list; ROI
profiles, prices and tags turning usage into a cloud price. Truly unknown fields are still refused."""

from __future__ import annotations

import json
import pathlib

import pytest

from spark.cli import main
from spark.recipes import load_recipes
from spark.recipes.roi import tag_recipe
from spark.recipes.serving import engine_dtype

# The seed's example recipe, as an upstream recipe (Spark proxies eugr's vLLM): every field of it
# that the issue names, with the seed's values.
SEED = """\
id: opencode-qwen36-250k
name: Qwen3.6-35B-A3B 250k NVFP4
catalog_id: nvidia/qwen3.6-35b-a3b-nvfp4
engine: upstream
tier: heavy
served_name: qwen3.6-35b-a3b-nvfp4
model: qwen3.6-35b-a3b-nvfp4
upstream:
  base_url: http://127.0.0.1:8000/v1
lifecycle: works
context:
  default: 256000
  kv_default: fp8
roi_profile: qwen3.6-35b-a3b
speculative:
  method: mtp
  tokens: 3
"""
PROFILES = """\
profiles:
  qwen3.6-35b-a3b: {name: Qwen3.6 35B A3B, provider: alibaba, model: qwen3.6-35b-a3b, family: qwen3.6, params: 35B-A3B}
  gpt-small: {provider: openai, model: gpt-small}
"""
LOCAL = "id: {id}\nserved_name: {id}\nengine: spark\nmodel: dummy:tiny-llama\n"


@pytest.fixture
def recipes(tmp_path) -> pathlib.Path:
    directory = tmp_path / "recipes"
    (directory / "drafts").mkdir(parents=True)
    (directory / "opencode-qwen36-250k.yaml").write_text(SEED)
    (directory / "roi-profiles.yaml").write_text(PROFILES)
    (directory / "local-a.yaml").write_text(LOCAL.format(id="local-a") + "context:\n  kv_default: bfloat16\n")
    (directory / "local-b.yaml").write_text(LOCAL.format(id="local-b"))
    (directory / "drafts" / "local-d.yaml").write_text(LOCAL.format(id="local-d") + "lifecycle: draft\n")
    return directory


def test_the_seed_recipe_loads_with_its_fields(recipes):
    catalog = load_recipes(recipes)
    assert catalog.problems == ()  # roi-profiles.yaml is not read as a recipe
    seed = catalog.get("opencode-qwen36-250k")
    assert seed.catalog_id == "nvidia/qwen3.6-35b-a3b-nvfp4" and seed.tier == "heavy" and seed.lifecycle == "works"
    assert seed.context.default == 256000 and seed.context.kv_default == "fp8" and seed.roi_profile == "qwen3.6-35b-a3b"
    assert seed.speculative.method == "mtp" and seed.speculative.tokens == 3
    assert str(engine_dtype(catalog.get("local-a"))) == "torch.bfloat16"  # kv_default is kv_dtype for Spark's engine


def test_an_fp8_kv_cache_keeps_the_model_dtype(recipes):
    """``kv_default: fp8`` (the seed's) or ``kv_dtype: fp8`` on a Spark recipe: the model in its default
    dtype, the KV cache in fp8 (issue 22)."""
    from spark.recipes.serving import recipe_config
    from spark.serve_config import ServeConfig

    (recipes / "local-b.yaml").write_text(LOCAL.format(id="local-b") + "context:\n  kv_default: fp8\n")
    (recipes / "local-c.yaml").write_text(LOCAL.format(id="local-c") + "context:\n  kv_dtype: fp8\n")
    catalog = load_recipes(recipes)
    assert catalog.problems == ()
    for name in ("local-b", "local-c"):
        recipe = catalog.get(name)
        assert engine_dtype(recipe) is None and recipe_config(ServeConfig(), recipe).kv_cache_dtype == "fp8"
    assert recipe_config(ServeConfig(), catalog.get("local-a")).kv_cache_dtype == "auto"


@pytest.mark.parametrize("extra, where, message", [
    ("inventory_path: nvidia/qwen3.6\n", "$", "unknown field inventory_path"),  # truly unknown: still refused
    ("context:\n  kv_default: q8_0\n", "$.context.kv_default", "Spark's engine keeps its KV cache in one of"),
    ("context:\n  kv_dtype: float16\n  kv_default: bfloat16\n", "$.context.kv_default", "contradicts kv_dtype"),
    ("speculative:\n  method: dflash\n", "$.speculative.method", "an upstream engine's method"),
    ("roi_profile: nope\n", "$.roi_profile", "no ROI profile 'nope'"),
])
def test_what_the_seed_fields_cannot_mean_is_one_line_naming_file_and_field(recipes, extra, where, message):
    (recipes / "local-b.yaml").write_text(LOCAL.format(id="local-b") + extra)
    catalog = load_recipes(recipes)
    [problem] = catalog.problems
    assert str(problem).startswith(f"{recipes / 'local-b.yaml'}: {where}: ") and message in str(problem)
    assert "\n" not in str(problem) and catalog.get("local-b") is None


def test_the_enabled_list_decides_what_answers_by_name(recipes, tmp_path):
    assert [r.id for r in load_recipes(recipes).enabled] == ["local-a", "local-b", "opencode-qwen36-250k"]
    config = tmp_path / "config"
    config.mkdir()
    (config / "inference-profiles.yaml").write_text("enabled: [local-b, local-d]\n")
    catalog = load_recipes(recipes, config_dir=config)
    assert [r.id for r in catalog.enabled] == ["local-b", "local-d"] and catalog.problems == ()
    assert catalog.by_name("local-a") is None and catalog.by_name("local-d").id == "local-d"
    assert catalog.get("local-a") is not None  # still there: brought up by id
    (config / "inference-profiles.yaml").write_text("enabled: [local-b, gone]\n")
    [problem] = load_recipes(recipes, config_dir=config).problems
    assert str(problem) == f"{config / 'inference-profiles.yaml'}: $.enabled[1]: no valid recipe 'gone'"


def test_roi_prices_usage_as_the_tagged_cloud_model(recipes, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    (config / "inference-pricing.json").write_text(json.dumps({"qwen3.6-35b-a3b": {"in": 0.5, "out": 2.0},
                                                               "gpt-small": {"in": 1.0, "out": 4.0}}))
    (config / "roi-recipe-tags.json").write_text(json.dumps({"local-a": "gpt-small",
                                                             "opencode-qwen36-250k": "gpt-small"}))
    catalog = load_recipes(recipes, config_dir=config)
    assert catalog.problems == ()
    usage = {"opencode-qwen36-250k": {w: {"requests": 1, "prompt_tokens": 2_000_000, "completion_tokens": 500_000}
                                      for w in ("hour", "day", "total")},
             "local-a": {"hour": {"prompt_tokens": 0, "completion_tokens": 0},
                         "day": {"prompt_tokens": 1_000_000, "completion_tokens": 0},
                         "total": {"prompt_tokens": 1_000_000, "completion_tokens": 250_000}}}
    rollup = catalog.roi.rollup(usage, catalog.recipes)
    seed = rollup["recipes"]["opencode-qwen36-250k"]
    assert seed["source"] == "recipe" and seed["total"] == 2 * 0.5 + 0.5 * 2.0  # the recipe's tag wins
    assert rollup["recipes"]["local-a"] | {"price": None} == {
        "profile": "gpt-small", "provider": "openai", "model": "gpt-small", "price": None, "source": "tag",
        "hour": 0.0, "day": 1.0, "total": 2.0}
    assert "local-b" not in rollup["recipes"]  # untagged: no comparison
    assert rollup["profiles"]["gpt-small"]["recipes"] == ["local-a"] and rollup["profiles"]["gpt-small"]["total"] == 2.0
    (config / "inference-pricing.json").write_text(json.dumps({"nope": {"in": 1}, "gpt-small": {"in": "1"}}))
    problems = [str(p) for p in load_recipes(recipes, config_dir=config).problems]
    assert len(problems) == 2 and "$.nope: no ROI profile 'nope'" in problems[0] and "$.gpt-small: expected" in problems[1]


def test_spark_recipe_roi_tags_a_recipe_and_reports(recipes, tmp_path, capsys):
    config = tmp_path / "config"
    config.mkdir()
    (config / "inference-pricing.json").write_text(json.dumps({"gpt-small": {"in": 1.0, "out": 4.0}}))
    args = ["--recipes", str(recipes), "--config-dir", str(config), "--url", "http://127.0.0.1:9"]
    assert main(["recipe", "roi", "local-b", "gpt-small", *args]) == 0
    assert "roi_profile: gpt-small" in (recipes / "local-b.yaml").read_text()
    assert load_recipes(recipes).get("local-b").roi_profile == "gpt-small"
    assert main(["recipe", "roi", "local-b", "nope", *args]) == 1
    assert "no ROI profile 'nope'" in capsys.readouterr().err
    assert main(["recipe", "roi", *args]) == 0
    out = capsys.readouterr().out
    assert "local-b" in out and "openai/gpt-small" in out and "1.00 / 4.00" in out
    assert "local-a" in out and "(none)" in out  # untagged recipes are shown as such


def test_tag_recipe_rewrites_an_existing_tag(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("id: x\nroi_profile: a  # old\nserved_name: x")
    tag_recipe(path, "b")
    assert path.read_text() == "id: x\nroi_profile: b\nserved_name: x"


def test_spark_recipe_roi_says_what_is_broken_where_and_exits_1(recipes, tmp_path, capsys):
    profiles = recipes / "roi-profiles.yaml"
    profiles.write_text("profiles:\n  gpt-small: {provider: openai, model: [gpt-small}\n")
    args = ["--recipes", str(recipes), "--config-dir", str(tmp_path), "--url", "http://127.0.0.1:9"]
    # It said "cannot parse: while parsing a flow sequence" (the YAML error's context, no line) and exited 0.
    assert main(["recipe", "roi", *args]) == 1
    err = capsys.readouterr().err
    assert f"{profiles}: $: YAML syntax error: expected ',' or ']', but got '}}', while parsing a flow sequence " \
           "that starts at line 2 (line 2)" in err.splitlines(), err
    profiles.write_text("profiles:\n  gpt-small:\n    provider: openai\n    model: 5\n")
    assert main(["recipe", "roi", *args]) == 1
    assert f"{profiles}: $.profiles.gpt-small.model: expected a string, got int 5 (line 4)" in capsys.readouterr().err
    assert main(["recipe", "check", *args[:4]]) == 1  # `recipe check` reports the same files
    profiles.write_text(PROFILES)
    (recipes / "broken.yaml").write_text("id: broken\nserved_name: [\n")
    assert main(["recipe", "roi", *args]) == 1  # a broken recipe too
    assert f"{recipes / 'broken.yaml'}: $: YAML syntax error" in capsys.readouterr().err


def test_a_broken_enabled_list_says_what_and_where(recipes, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    (config / "inference-profiles.yaml").write_text("enabled: [local-b\n  local-d}\n")
    # It said "cannot read the enabled list: while parsing a flow sequence" (the context alone, no line).
    [problem] = load_recipes(recipes, config_dir=config).problems
    assert str(problem) == f"{config / 'inference-profiles.yaml'}: $: YAML syntax error: expected ',' or ']', but " \
                           "got '}', while parsing a flow sequence that starts at line 1 (line 2)"
