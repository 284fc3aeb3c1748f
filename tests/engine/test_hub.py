"""``--model org/name`` from the local Hugging Face cache (issue 25), never downloaded: the cache's
directory settings, refs and revisions, a GGUF repo's one file, and one line naming what was searched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spark.engine.errors import ModelLoadError
from spark.engine.hub import hub_cache_dir, hub_model_path, looks_like_hf_id
from spark.engine.weights import default_model_path, resolve_model
from spark.recipes.schema import Recipe
from spark.recipes.serving import unavailable_reason
from spark.serve_config import ServeConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


def cached(cache, repo_id: str, files: dict[str, str | os.PathLike], *, commit: str = "c0ffee", ref: str = "main"):
    """A snapshot of ``repo_id`` in a hub cache laid out as huggingface_hub writes it (files are links
    to blobs there; here to the given paths, or small texts)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for name, value in files.items():
        if isinstance(value, str):
            (snapshot / name).write_text(value)
        else:
            (snapshot / name).symlink_to(value)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_the_cache_directory_follows_huggingface_hub(tmp_path):
    home = str(tmp_path)
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"})[0].as_posix() == "/a"
    assert hub_cache_dir({"HF_HOME": "/b"})[0].as_posix() == "/b/hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"})[0].as_posix() == "/c/huggingface/hub"
    assert hub_cache_dir({"HOME": home})[0] == hub_cache_dir({})[0]
    assert str(hub_cache_dir({})[0]).endswith(".cache/huggingface/hub")


def test_hub_ids_and_paths_are_told_apart():
    assert looks_like_hf_id("Qwen/Qwen3-0.6B") and looks_like_hf_id("org/name@v1.0")
    for not_an_id in ("model.gguf", "/abs/dir", "./rel/dir", "~/m", "a/b/c", "dummy:tiny-llama", "default", "../x"):
        assert not looks_like_hf_id(not_an_id), not_an_id


def test_a_cached_gguf_repo_resolves_to_its_file(cache):
    snapshot = cached(cache, GGUF_ID, {"model.Q4_1.gguf": default_model_path(), "README.md": "hi"})
    source = resolve_model(GGUF_ID)  # was "no such file or directory"
    assert source.kind == "gguf" and source.path == snapshot / "model.Q4_1.gguf"
    assert source.config == resolve_model("default").config


def test_refs_pick_the_snapshot_and_a_revision_picks_its_own(cache):
    old = cached(cache, "org/name", {"config.json": "{}"}, commit="aaa")
    new = cached(cache, "org/name", {"config.json": "{}"}, commit="bbb")  # refs/main now names bbb
    assert hub_model_path("org/name") == new
    assert hub_model_path("org/name@aaa") == old  # a commit
    (cache / "models--org--name" / "refs" / "v1").write_text("aaa")
    assert hub_model_path("org/name@v1") == old  # a tag or branch
    with pytest.raises(ModelLoadError, match="revision v9"):
        hub_model_path("org/name@v9")


def test_a_missing_model_names_the_directory_searched_and_never_downloads(cache):
    with pytest.raises(ModelLoadError) as info:
        resolve_model("org/absent")
    message = str(info.value)
    assert "\n" not in message and str(cache / "models--org--absent") in message and "HF_HUB_CACHE" in message
    assert "never downloads" in message and "huggingface-cli download org/absent" in message
    assert not (cache / "models--org--absent").exists()


def test_a_snapshot_with_several_ggufs_asks_for_one(cache):
    cached(cache, "org/quants", {"a.Q4.gguf": "x", "a.Q8.gguf": "y"})
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        hub_model_path("org/quants")


def test_the_served_name_is_the_hub_id_and_a_recipe_of_one_is_available(cache):
    assert ServeConfig(model=GGUF_ID).resolved_served_name() == GGUF_ID  # was "smollm2-135m-instruct-gguf"
    recipe = Recipe(id="hub", served_name="hub", model=GGUF_ID, engine="spark")
    assert "not in the Hugging Face cache" in unavailable_reason(recipe)
    cached(cache, GGUF_ID, {"m.gguf": default_model_path()})
    assert unavailable_reason(recipe) is None


def test_serve_with_an_absent_hub_id_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "SPARK_STATE_PATH": ":memory:", "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.run([sys.executable, "-m", "spark.cli", "serve", "--port", "0", "--model", "org/absent"],
                          capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert str(tmp_path / "hub" / "models--org--absent") in lines[0] and "Traceback" not in proc.stderr
