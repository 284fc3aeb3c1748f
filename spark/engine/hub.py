"""Hugging Face model ids (``org/name``) found in the local hub cache, never downloaded.

The cache is the one ``huggingface_hub`` writes: ``HF_HUB_CACHE`` (or its older name
``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``. A model lives in ``models--org--name/snapshots/<commit>``;
``refs/main`` names the commit (``org/name@rev`` reads ``refs/<rev>``, or a commit itself).

    path = hub_model_path("Qwen/Qwen3-0.6B")   # an HF directory, or a repo's one .gguf file

``spark.engine.weights.resolve_model`` asks here for a spec that is no file on disk but
has a hub id's shape; nothing here imports torch (``ServeConfig`` names models with it).
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping

from spark.engine.errors import ModelLoadError

# org/name, optionally @revision; what a path on disk rarely looks like (no leading / . ~)
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def looks_like_hf_id(spec: object) -> bool:
    """Whether ``spec`` has the shape of a hub id (``org/name`` or ``org/name@rev``)."""
    return isinstance(spec, str) and bool(_HF_ID.match(spec)) and ".." not in spec


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> tuple[pathlib.Path, str]:
    """The hub cache directory and the setting that named it (for error messages)."""
    env = os.environ if environ is None else environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return pathlib.Path(env[name]).expanduser(), name
    if env.get("HF_HOME"):
        return pathlib.Path(env["HF_HOME"]).expanduser() / "hub", "HF_HOME/hub"
    if env.get("XDG_CACHE_HOME"):
        return pathlib.Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface/hub", "XDG_CACHE_HOME/huggingface/hub"
    return pathlib.Path("~/.cache/huggingface/hub").expanduser(), "the default"


def hub_model_path(spec: str, environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """The cached snapshot of hub id ``spec``: its directory (with config.json), or its one .gguf file.

    Args:
      spec: ``org/name`` or ``org/name@rev`` (a branch, tag or commit).
      environ: the environment to read the cache settings from (default ``os.environ``).

    Raises:
      ModelLoadError: one line naming the directory searched when the model is not cached (or its
        snapshot holds neither config.json nor exactly one .gguf file).
    """
    repo_id, _, revision = spec.partition("@")
    revision = revision or "main"
    cache, source = hub_cache_dir(environ)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = f"Spark never downloads: fetch it first (`huggingface-cli download {repo_id}`) or pass a local path"
    snapshot = _snapshot(repo, revision)
    if snapshot is None:
        raise ModelLoadError(spec, f"not a local file, and not in the Hugging Face cache (searched {repo}, "
                                   f"{'revision ' + revision + ', ' if revision != 'main' else ''}"
                                   f"cache from {source}); {hint}")
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelLoadError(snapshot, f"holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs[:4])}"
                                       f"{', ...' if len(ggufs) > 4 else ''}): pass the path of one")
    raise ModelLoadError(snapshot, f"the cached snapshot of {repo_id} holds no config.json and no .gguf file "
                                   f"(an incomplete download?); {hint}")


def _snapshot(repo: pathlib.Path, revision: str) -> pathlib.Path | None:
    """The snapshot directory ``revision`` names in ``repo``, or None."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
        if (snapshots / commit).is_dir():
            return snapshots / commit
    if (snapshots / revision).is_dir():  # a commit hash given as the revision
        return snapshots / revision
    if revision == "main" and not ref.exists():  # no refs (a copied cache): the one, or newest, snapshot
        found = [p for p in snapshots.iterdir() if p.is_dir()]
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
    return None
