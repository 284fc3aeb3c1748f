"""Read a recipes directory: every file checked, every problem reported, the valid recipes kept.

A problem names its file, the path inside it and (when known) the line:

    recipes/x.yaml: $.context.default: expected an int, got str '8k' (line 7)

A file with any problem is skipped as a whole; the others still load. Across
files, ids and model names (served names and aliases together) must be unique:
the later file in name order is the one skipped.

Beside the recipes, ``roi-profiles.yaml`` (``spark.recipes.roi``) names the cloud models a
``roi_profile`` may point at. A host-local config directory (``spark serve --config-dir``) may
hold ``inference-profiles.yaml``, the enabled list: ``enabled: [id, ...]``. With it only those
recipes answer to their names and are listed; without it every recipe outside ``drafts/`` does.
Any recipe can still be brought up by id.
"""

from __future__ import annotations

import os
import pathlib
import re

import attrs
import yaml

from spark.recipes.roi import PROFILES_FILE, RoiBook, load_roi
from spark.recipes.schema import (KV_DTYPES, RESERVED_NAMES, SPARK_SPECULATIVE, Recipe, describe_errors,
                                  structure_recipe)
from spark.recipes.yaml_lines import Problem, line_of, parse_yaml, yaml_problem

DRAFTS = "drafts"
ENABLED_FILE = "inference-profiles.yaml"  # in the host-local config directory
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,79}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*$")


@attrs.frozen
class Catalog:
    """The valid recipes of a directory (drafts included, flagged) and the problems of the rest."""

    recipes: tuple[Recipe, ...] = ()
    problems: tuple[Problem, ...] = ()
    directory: pathlib.Path | None = None
    files: int = 0  # recipe files read, valid or not
    enabled_ids: frozenset[str] | None = None  # the host's enabled list; None: every recipe outside drafts/
    roi: RoiBook = RoiBook()

    def get(self, recipe_id: str) -> Recipe | None:
        return next((r for r in self.recipes if r.id == recipe_id), None)

    def is_enabled(self, recipe: Recipe) -> bool:
        return recipe.id in self.enabled_ids if self.enabled_ids is not None else not recipe.draft

    @property
    def enabled(self) -> tuple[Recipe, ...]:
        """The recipes served by name: the enabled list's, else every one outside drafts/ (the rest are
        served only when brought up by id)."""
        return tuple(r for r in self.recipes if self.is_enabled(r))

    def by_name(self, name: str) -> Recipe | None:
        """The enabled recipe whose served name or alias is ``name``."""
        return next((r for r in self.enabled if name in r.names), None)


def default_config_dir() -> pathlib.Path:
    """The host-local config directory: ``$SPARK_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/spark`` (~/.config/spark)."""
    if os.environ.get("SPARK_CONFIG_DIR"):
        return pathlib.Path(os.environ["SPARK_CONFIG_DIR"]).expanduser()
    return pathlib.Path(os.environ.get("XDG_CONFIG_HOME") or pathlib.Path.home() / ".config") / "spark"


def project_recipes_dir() -> pathlib.Path:
    """``recipes/`` at the root of Spark's source tree: the default of every ``--recipes``."""
    return pathlib.Path(__file__).resolve().parents[2] / "recipes"


def load_recipes(directory: str | os.PathLike, *, config_dir: str | os.PathLike | None = None) -> Catalog:
    """Read ``directory/*.yaml`` and ``directory/drafts/*.yaml``, the ROI profiles beside them, and the
    enabled list, ROI prices and tags of the host-local ``config_dir`` (when given).

    Returns:
        The catalog; a missing directory is one problem, not an exception.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return Catalog(problems=(Problem(_shown(directory), "$", "no such recipes directory"),), directory=directory)
    roi = load_roi(directory, config_dir)
    files = [(p, False) for p in sorted(directory.glob("*.y*ml")) if p.name != PROFILES_FILE]
    files += [(p, True) for p in sorted((directory / DRAFTS).glob("*.y*ml"))]
    recipes: list[Recipe] = []
    problems: list[Problem] = []
    owners: dict[str, Recipe] = {}  # model name or "id:<id>" -> the recipe that claimed it first
    for path, draft in files:
        recipe, found = read_recipe(path, draft=draft)
        if recipe is not None and recipe.roi_profile is not None and recipe.roi_profile not in roi.profiles:
            where = roi.profiles_path if roi.profiles_path.exists() else f"{roi.profiles_path} (missing)"
            found = [Problem(_shown(path), "$.roi_profile", f"no ROI profile {recipe.roi_profile!r} in {where}")]
        elif recipe is not None:
            found = _claim(recipe, owners, _shown(path))
        if found:
            problems.extend(found)
        else:
            recipes.append(recipe)
    problems += [attrs.evolve(p, file=_shown(pathlib.Path(p.file))) for p in roi.problems]
    enabled, found = _enabled_list(pathlib.Path(config_dir).expanduser() / ENABLED_FILE if config_dir else None,
                                   {r.id for r in recipes})
    return Catalog(tuple(recipes), tuple(problems + found), directory, len(files), enabled, roi)


def _enabled_list(path: pathlib.Path | None, known: set[str]) -> tuple[frozenset[str] | None, list[Problem]]:
    """The host's enabled recipe ids (``enabled: [id, ...]``), or None when it keeps no list."""
    if path is None or not path.exists():
        return None, []
    shown = _shown(path)
    try:
        raw, _ = parse_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return frozenset(), [Problem(shown, "$", f"cannot read the enabled list: {exc}")]
    except yaml.YAMLError as exc:
        return frozenset(), [yaml_problem(shown, exc)]
    ids = raw.get("enabled") if isinstance(raw, dict) and set(raw) == {"enabled"} else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return frozenset(), [Problem(shown, "$", "expected `enabled: [recipe id, ...]`")]
    problems = [Problem(shown, f"$.enabled[{i}]", f"no valid recipe {rid!r}") for i, rid in enumerate(ids)
                if rid not in known]
    return frozenset(ids), problems


def read_recipe(path: str | os.PathLike, *, draft: bool = False) -> tuple[Recipe | None, list[Problem]]:
    """One recipe file: the recipe, or None and every problem found in it."""
    path = pathlib.Path(path)
    shown = _shown(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, [Problem(shown, "$", f"cannot read: {exc}")]
    try:
        raw, lines = parse_yaml(text)
    except yaml.YAMLError as exc:
        return None, [yaml_problem(shown, exc)]
    if raw is None:
        return None, [Problem(shown, "$", "the file is empty")]
    if not isinstance(raw, dict):
        return None, [Problem(shown, "$", f"expected a mapping of recipe fields, got {type(raw).__name__}", 1)]
    found = [Problem(shown, p, m, line_of(lines, p)) for p, m in _semantic_problems(raw, path.stem, draft)]
    recipe = None
    try:
        recipe = structure_recipe(raw)
    except Exception as exc:  # noqa: BLE001 -- cattrs groups every type problem into one exception
        seen = {(p.path, p.message) for p in found}
        found += [problem for p, m in describe_errors(exc) if (p, m) not in seen
                  for problem in _located(shown, lines, p, m)]
    if found:
        return None, sorted(found, key=lambda p: (p.line or 0, p.path))
    return attrs.evolve(recipe, path=path, draft=draft), []


# -- checks beyond types ---------------------------------------------------------------------


def _semantic_problems(raw: dict, stem: str, draft: bool) -> list[tuple[str, str]]:
    """What the types cannot say; reads ``raw`` defensively, since its types are not checked yet."""
    out = []
    rid, served, engine, model = raw.get("id"), raw.get("served_name"), raw.get("engine"), raw.get("model")
    if isinstance(rid, str):
        if not _ID.match(rid):
            out.append(("$.id", f"{rid!r} is not an id: lowercase letters, digits, '.', '_' and '-'"))
        elif rid != stem:
            out.append(("$.id", f"{rid!r} differs from the file name {stem!r}: name the file {rid}.yaml"))
    names = [("$.served_name", served)] if isinstance(served, str) else []
    aliases = raw.get("aliases")
    if isinstance(aliases, list):
        names += [(f"$.aliases[{i}]", a) for i, a in enumerate(aliases) if isinstance(a, str)]
    seen: set[str] = set()
    for where, name in names:
        if name in RESERVED_NAMES:
            out.append((where, f"{name!r} is reserved: it always names the active model"))
        elif not _NAME.match(name):
            out.append((where, f"{name!r} is not a model name: letters, digits and . _ : / @ + - (no spaces)"))
        elif name in seen:
            out.append((where, f"{name!r} is given twice"))
        seen.add(name)
    sections = {k: raw.get(k) for k in ("upstream", "dummy", "parsers", "context", "scheduler", "sampling")}
    if engine == "upstream":
        if sections["upstream"] is None:
            out.append(("$.upstream", "engine upstream needs an upstream section with base_url"))
        if sections["dummy"] is not None:
            out.append(("$.dummy", "dummy weights are for engine spark"))
    elif engine == "spark":
        if sections["upstream"] is not None:
            out.append(("$.upstream", "an upstream section needs engine: upstream"))
        if model == "dummy" and not isinstance(sections["dummy"], dict):
            out.append(("$.dummy", "model: dummy needs a dummy section (preset and config)"))
        if sections["dummy"] is not None and model != "dummy":
            out.append(("$.dummy", "a dummy section needs model: dummy"))
        if isinstance(model, str):
            out += _model_problems(model)
    up = sections["upstream"]
    if isinstance(up, dict):
        url = up.get("base_url")
        if isinstance(url, str) and not re.match(r"^https?://[^/\s]+", url):
            out.append(("$.upstream.base_url", f"{url!r} is not an http:// or https:// URL"))
        env = up.get("api_key_env")
        if isinstance(env, str) and not _ENV.match(env):
            out.append(("$.upstream.api_key_env", f"{env!r} is not an environment variable name (the key itself "
                                                  "never goes in a recipe)"))
    out += _dummy_problems(sections["dummy"]) + _parser_problems(sections["parsers"])
    out += _policy_problems(sections["scheduler"])
    out += _range_problems(sections)
    out += _engine_field_problems(engine, sections["context"], raw.get("speculative"))
    if raw.get("lifecycle") == "draft" and not draft:
        out.append(("$.lifecycle", "a draft belongs in recipes/drafts/"))
    return out


def _engine_field_problems(engine, context, speculative) -> list[tuple[str, str]]:
    """The seed's fields that mean something only to some engines: ``context.kv_default`` and a
    speculative method other than n-gram lookup are an upstream engine's business."""
    out = []
    kv = context.get("kv_default") if isinstance(context, dict) else None
    if engine == "spark" and isinstance(kv, str):
        if kv not in KV_DTYPES:
            out.append(("$.context.kv_default", f"Spark's engine keeps its KV cache in one of {', '.join(KV_DTYPES)}; "
                                                f"got {kv!r} (an upstream recipe may name its engine's own)"))
        elif context.get("kv_dtype", kv) != kv:
            out.append(("$.context.kv_default", f"{kv!r} contradicts kv_dtype {context['kv_dtype']!r}: set one"))
    elif isinstance(kv, str) and not re.match(r"^[A-Za-z0-9_.-]{1,32}$", kv):
        out.append(("$.context.kv_default", f"{kv!r} is not a dtype name"))
    method = speculative.get("method") if isinstance(speculative, dict) else None
    if engine == "spark" and isinstance(method, str) and method not in SPARK_SPECULATIVE and method in (
            "mtp", "eagle", "eagle3", "dflash", "dspark"):
        out.append(("$.speculative.method", f"{method!r} is an upstream engine's method; Spark's engine "
                                            f"speculates by {' or '.join(SPARK_SPECULATIVE)}"))
    return out


def _model_problems(model: str) -> list[tuple[str, str]]:
    if model.startswith("dummy:"):
        from spark.engine.weights.dummy import PRESETS

        if model.removeprefix("dummy:") not in PRESETS:
            return [("$.model", f"unknown dummy preset {model!r}; known: {', '.join(PRESETS)}")]
    elif not model.strip():
        return [("$.model", "is empty")]
    return []


def _dummy_problems(dummy) -> list[tuple[str, str]]:
    if not isinstance(dummy, dict):
        return []
    from spark.engine.config import ModelConfig
    from spark.engine.weights.dummy import PRESETS

    out = []
    preset = dummy.get("preset", "tiny-llama")
    if isinstance(preset, str) and preset not in PRESETS:
        out.append(("$.dummy.preset", f"unknown preset {preset!r}; known: {', '.join(PRESETS)}"))
    config = dummy.get("config")
    if isinstance(config, dict):
        fields = {f.name for f in attrs.fields(ModelConfig)} - {"rope_scaling", "eos_token_ids"}
        out += [(f"$.dummy.config.{k}", f"not a model config field; known: {', '.join(sorted(fields))}")
                for k in config if k not in fields]
    return out


def _parser_problems(parsers) -> list[tuple[str, str]]:
    if not isinstance(parsers, dict):
        return []
    from spark.serve_config import REASONING_PARSER_CHOICES, TOOL_CALL_PARSER_CHOICES

    out = []
    for key, choices in (("tool_call", TOOL_CALL_PARSER_CHOICES), ("reasoning", REASONING_PARSER_CHOICES)):
        value = parsers.get(key)
        if isinstance(value, str) and value not in choices:
            out.append((f"$.parsers.{key}", f"unknown parser {value!r}; known: {', '.join(choices)}"))
    return out


def _policy_problems(scheduler) -> list[tuple[str, str]]:
    if not isinstance(scheduler, dict):
        return []
    from spark.serve_config import SCHEDULER_POLICIES

    policy = scheduler.get("policy")
    if isinstance(policy, str) and policy not in SCHEDULER_POLICIES:
        return [("$.scheduler.policy", f"unknown policy {policy!r}; known: {', '.join(SCHEDULER_POLICIES)}")]
    return []


_MINIMA = {("context", "default"): 16, ("scheduler", "max_batch_size"): 1, ("scheduler", "max_prefill_tokens"): 1,
           ("sampling", "max_tokens"): 1, ("sampling", "top_k"): 0, ("sampling", "temperature"): 0,
           ("sampling", "min_p"): 0, ("sampling", "repetition_penalty"): 0}


def _range_problems(sections: dict) -> list[tuple[str, str]]:
    out = []
    for (section, key), least in _MINIMA.items():
        value = sections[section].get(key) if isinstance(sections[section], dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < least:
            out.append((f"$.{section}.{key}", f"must be at least {least}, got {value}"))
    sampling = sections["sampling"]
    top_p = sampling.get("top_p") if isinstance(sampling, dict) else None
    if isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and not 0 < top_p <= 1:
        out.append(("$.sampling.top_p", f"must be in (0, 1], got {top_p}"))
    return out


def _claim(recipe: Recipe, owners: dict[str, Recipe], shown: str) -> list[Problem]:
    """Register the recipe's id and names; problems when an earlier file holds one of them."""
    out = []
    wanted = [("$.id", f"id:{recipe.id}")] + [("$.served_name", recipe.served_name)]
    wanted += [(f"$.aliases[{i}]", a) for i, a in enumerate(recipe.aliases)]
    for where, key in wanted:
        other = owners.get(key)
        if other is not None:
            what = "id" if key.startswith("id:") else "model name"
            out.append(Problem(shown, where, f"{what} {key.removeprefix('id:')!r} is already used by recipe "
                                             f"{other.id} ({_shown(other.path)})"))
    if not out:
        owners.update({key: recipe for _, key in wanted})
    return out


def _located(shown: str, lines: dict[str, int], path: str, message: str) -> list[Problem]:
    """The problem at the line it is on: an unknown field at its own line (its mapping's was shown),
    one problem per field."""
    if message.startswith("unknown field"):
        names = message.split(" ", 2)[2].split(", ")
        return [Problem(shown, path, f"unknown field {name}", line_of(lines, f"{path}.{name}")) for name in names]
    return [Problem(shown, path, message, line_of(lines, path))]


def _shown(path: pathlib.Path | None) -> str:
    if path is None:
        return "<none>"
    try:
        return str(pathlib.Path(path).resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)
