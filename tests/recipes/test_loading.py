"""Recipes: every problem of every malformed file reported with file, path and line; the valid ones load;
the shipped recipes are valid; scaffold writes drafts that check; ``spark recipe check`` exits non-zero."""

from __future__ import annotations

import pathlib

import pytest

from spark.cli import main
from spark.recipes import catalog_for, implicit_recipe, load_recipes, project_recipes_dir, recipe_config, unavailable_reason
from spark.recipes.scaffold import scaffold
from spark.serve_config import TOOL_CALL_PARSER_CHOICES, ServeConfig
from tests.recipes.malformed import MALFORMED, VALID, write_malformed


@pytest.fixture(scope="module")
def malformed_dir(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("recipes")
    write_malformed(directory)
    return directory


def test_every_malformed_file_is_reported_per_problem_and_skipped(malformed_dir):
    catalog = load_recipes(malformed_dir)
    assert len(MALFORMED) >= 30
    assert sorted(r.id for r in catalog.recipes) == sorted(pathlib.Path(n).stem for n in VALID)
    by_file: dict[str, list[str]] = {}
    for problem in catalog.problems:
        by_file.setdefault(pathlib.Path(problem.file).name, []).append(str(problem))
    assert set(by_file) == set(MALFORMED)
    for name, (_, expected) in MALFORMED.items():
        lines = by_file[name]
        assert all(line.startswith(f"{malformed_dir / name}: $") for line in lines), lines
        for fragment in expected:
            assert any(fragment in line for line in lines), f"{name}: {fragment!r} not in {lines}"
    assert len(by_file["missing-fields.yaml"]) == 3  # every problem, not the first one only
    assert len(by_file["many-problems.yaml"]) == 3


def test_problem_paths_are_relative_to_the_working_directory(malformed_dir, monkeypatch):
    monkeypatch.chdir(malformed_dir.parent)
    problem = next(p for p in load_recipes(malformed_dir.name).problems if "context-type" in p.file)
    assert str(problem) == f"{malformed_dir.name}/context-type.yaml: $.context.default: expected an int, got str '8k'" \
                           " (line 6)"


def test_shipped_recipes_are_valid_and_the_missing_weights_unavailable():
    catalog = load_recipes(project_recipes_dir())
    assert catalog.problems == ()
    ids = {r.id for r in catalog.recipes}
    assert {"smollm2-135m-instruct", "qwen3-8b", "llama-3.1-8b-instruct", "dummy-tiny", "llamacpp-local"} <= ids
    assert any(r.draft for r in catalog.recipes) and all(not r.draft for r in catalog.enabled)
    default = catalog.get("smollm2-135m-instruct")
    assert unavailable_reason(default) is None and catalog.by_name("smol") is default
    qwen = catalog.get("qwen3-8b")
    if not qwen.model_path().exists():
        assert "no such file or directory" in unavailable_reason(qwen)
    draft = next(r for r in catalog.recipes if r.draft)
    assert catalog.by_name(draft.served_name) is None  # drafts are served only when brought up by id


def test_recipe_config_and_implicit_recipe():
    catalog = load_recipes(project_recipes_dir())
    base = ServeConfig(max_model_len=512, max_batch_size=8)
    config = recipe_config(base, catalog.get("qwen3-8b"))
    assert (config.served_name, config.max_model_len, config.max_batch_size) == ("qwen3-8b", 32768, 128)
    assert config.reasoning_parser == "think" and config.tool_call_parser == "hermes"
    tiny = recipe_config(base, catalog.get("dummy-tiny"))
    assert (tiny.max_model_len, tiny.max_batch_size) == (512, 8)  # the server's, where the recipe says nothing
    model, dummy = catalog.get("dummy-tiny").load_spec()
    assert model == "dummy" and dummy.max_position_embeddings == 2048 and dummy.num_layers == 2
    implicit = implicit_recipe(ServeConfig(model="dummy:tiny-qwen3"))
    assert (implicit.id, implicit.served_name, implicit.model) == ("dummy-tiny-qwen3",) * 2 + ("dummy:tiny-qwen3",)


def test_scaffold_writes_drafts_that_check(tmp_path, capsys):
    spark_path = scaffold("Qwen/Qwen3-8B", "spark", tmp_path)
    upstream_path = scaffold("meta-llama/Llama-3.3-70B-Instruct", "upstream", tmp_path)
    assert spark_path == tmp_path / "drafts" / "qwen-qwen3-8b.yaml"
    assert "# " + " | ".join(TOOL_CALL_PARSER_CHOICES) in spark_path.read_text()  # the registry's names
    catalog = load_recipes(tmp_path)
    assert catalog.problems == ()
    assert {r.id: r.engine for r in catalog.recipes} == {"qwen-qwen3-8b": "spark",
                                                         "meta-llama-llama-3.3-70b-instruct": "upstream"}
    assert all(r.draft and r.lifecycle == "draft" for r in catalog.recipes)
    with pytest.raises(ValueError, match="exists"):
        scaffold("Qwen/Qwen3-8B", "spark", tmp_path)
    for bad in (("Qwen3-8B", "spark"), ("Qwen/Qwen3-8B", "vllm")):
        with pytest.raises(ValueError):
            scaffold(*bad, tmp_path)
    assert main(["recipe", "scaffold", "mistralai/Mistral-7B", "spark", "--recipes", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out and upstream_path.exists()


def test_recipe_check_command(malformed_dir, tmp_path, capsys):
    assert main(["recipe", "check", "--recipes", str(malformed_dir)]) == 1
    out = capsys.readouterr().out
    assert "$.context.default: expected an int, got str '8k'" in out and "ok  valid-one" in out
    assert f"2 recipe(s) valid, {len(MALFORMED)} file(s)" in out
    assert main(["recipe", "check"]) == 0  # the shipped recipes
    assert main(["recipe", "check", "--recipes", str(tmp_path / "nowhere")]) == 1
    assert "no such recipes directory" in capsys.readouterr().out


def test_a_recipe_turns_prefix_caching_off():
    import attrs

    from spark.recipes.schema import Scheduler

    recipe = load_recipes(project_recipes_dir()).get("dummy-tiny")
    assert recipe_config(ServeConfig(), recipe).prefix_caching is True  # the server's default
    off = attrs.evolve(recipe, scheduler=attrs.evolve(recipe.scheduler, prefix_caching=False))
    assert recipe_config(ServeConfig(), off).prefix_caching is False
    assert Scheduler(prefix_caching=False) != Scheduler()


def _billion_laughs(recipe_id: str) -> str:
    """A recipe whose aliases nest 9 levels of 10: a billion nodes from 14 lines."""
    lines = [f"id: {recipe_id}", f"served_name: {recipe_id}", "engine: spark", "model: dummy:tiny-llama",
             'l0: &l0 ["lol"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 10)]
    return "\n".join(lines + ["aliases: *l9", ""])


def test_aliases_are_refused_at_their_line(malformed_dir, tmp_path):
    import subprocess
    import sys

    (tmp_path / "laughs.yaml").write_text(_billion_laughs("laughs"))
    # `recipe check` walked the billion nodes until killed; now it names the first alias.
    out = subprocess.run([sys.executable, "-m", "spark.cli", "recipe", "check", "--recipes", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert f"{tmp_path / 'laughs.yaml'}: $: YAML aliases (*l0) are not allowed: write the value out " \
           "(line 6)" in out.stdout.splitlines()
    # `spark serve --recipes DIR --recipe ID` refuses it with the same line.
    with pytest.raises(ValueError, match=r"recursive-alias.yaml: \$: YAML aliases \(\*a\) are not allowed"):
        catalog_for(ServeConfig(recipes_dir=str(malformed_dir), recipe="recursive-alias"))


def test_anchors_without_aliases_keep_their_lines(tmp_path):
    (tmp_path / "anchored.yaml").write_text(
        "id: anchored\nserved_name: anchored\nengine: spark\nmodel: dummy:tiny-llama\ncontext: &c\n  default: 8k\n")
    problems = [str(p) for p in load_recipes(tmp_path).problems]
    assert problems == [f"{tmp_path / 'anchored.yaml'}: $.context.default: expected an int, got str '8k' (line 6)"]


def test_scaffold_into_a_directory_that_cannot_be_made_is_one_line(capsys):
    # mkdir's FileNotFoundError was a traceback: _run caught only CommandError.
    assert main(["recipe", "scaffold", "--recipes", "/proc/no-such-dir", "Qwen/Qwen3-8B", "spark"]) == 1
    assert capsys.readouterr().err == "spark: /proc/no-such-dir: No such file or directory\n"
