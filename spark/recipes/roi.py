"""ROI: what the tokens a recipe served would have cost on the cloud model it stands in for.

Three files, as the control plane this project comes from keeps them:

    recipes/roi-profiles.yaml              (git-tracked) the cloud identities, no prices:
      profiles:
        qwen3-8b: {name: Qwen3 8B, provider: alibaba, model: qwen3-8b, family: qwen3, params: 8B}
    <config>/inference-pricing.json        (host-local) USD per million tokens, by profile id:
      {"qwen3-8b": {"in": 0.18, "out": 0.7}}
    <config>/roi-recipe-tags.json          (host-local) recipe id -> profile id, for recipes that set none:
      {"llamacpp-local": "qwen3-8b"}

A recipe's own ``roi_profile`` wins over the tag map. Token counters stay keyed by recipe id
(``spark.control.usage``); ``RoiBook.rollup`` prices them, per recipe and per profile.

    book = load_roi(recipes_dir, config_dir)
    book.rollup(usage.summary(), catalog.recipes)["recipes"]["qwen3-8b"]["total"]   # USD, or None unpriced
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import attrs
import yaml

from spark.recipes.schema import converter, describe_errors
from spark.recipes.yaml_lines import Problem, line_of, parse_yaml, yaml_problem

PROFILES_FILE = "roi-profiles.yaml"  # beside the recipes; never read as a recipe
PRICES_FILE = "inference-pricing.json"
TAGS_FILE = "roi-recipe-tags.json"
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,79}$")
_WINDOWS = ("hour", "day", "total")


@attrs.frozen
class RoiProfile:
    """A cloud model's identity: who sells it and under which name (prices are host-local)."""

    provider: str  # openai, anthropic, alibaba, together, ...
    model: str  # the provider's model name
    name: str | None = None  # for people
    family: str | None = None
    version: str | None = None
    params: str | None = None  # "8B", "35B-A3B"


@attrs.frozen
class Price:
    """USD per million tokens."""

    in_: float  # prompt tokens
    out: float = 0.0  # completion tokens

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.in_ + completion_tokens * self.out) / 1e6


@attrs.frozen
class RoiBook:
    """The profiles, prices and tags of one server, and the problems of their files."""

    profiles: dict[str, RoiProfile] = attrs.Factory(dict)
    prices: dict[str, Price] = attrs.Factory(dict)
    tags: dict[str, str] = attrs.Factory(dict)  # recipe id -> profile id (host-local)
    problems: tuple[Problem, ...] = ()
    profiles_path: pathlib.Path | None = None  # where profiles are read (and ``roi-new`` writes)

    def profile_of(self, recipe) -> tuple[str | None, str | None]:
        """``(profile id, "recipe" | "tag")`` of a recipe, or ``(None, None)`` when it has none."""
        if recipe.roi_profile:
            return recipe.roi_profile, "recipe"
        tagged = self.tags.get(recipe.id)
        return (tagged, "tag") if tagged else (None, None)

    def rollup(self, summary: dict, recipes) -> dict:
        """Price a usage summary (``UsageCounters.summary``).

        Returns:
            ``{"recipes": {id: {"profile", "source", "provider", "model", "price", "hour", "day", "total"}},
            "profiles": {id: {..., "recipes": [...], "hour", "day", "total"}}}``; a window's value is USD,
            or None when the profile has no price. Recipes with no profile are left out.
        """
        out: dict[str, dict] = {"recipes": {}, "profiles": {}}
        for recipe in recipes:
            pid, source = self.profile_of(recipe)
            profile = self.profiles.get(pid) if pid else None
            if profile is None:
                continue
            price = self.prices.get(pid)
            windows = summary.get(recipe.id, {})
            costs = {w: None if price is None else round(price.cost(windows.get(w, {}).get("prompt_tokens", 0),
                                                                    windows.get(w, {}).get("completion_tokens", 0)), 6)
                     for w in _WINDOWS}
            head = {"profile": pid, "provider": profile.provider, "model": profile.model,
                    "price": None if price is None else {"in": price.in_, "out": price.out}}
            out["recipes"][recipe.id] = {**head, "source": source, **costs}
            group = out["profiles"].setdefault(pid, {**head, "recipes": [], **{w: None if price is None else 0.0
                                                                               for w in _WINDOWS}})
            group["recipes"].append(recipe.id)
            for w in _WINDOWS:
                if costs[w] is not None:
                    group[w] = round(group[w] + costs[w], 6)
        return out


def load_roi(recipes_dir: str | os.PathLike | None, config_dir: str | os.PathLike | None) -> RoiBook:
    """Read the profiles beside ``recipes_dir`` and the prices and tags in ``config_dir`` (each optional)."""
    problems: list = []
    profiles_path = pathlib.Path(recipes_dir) / PROFILES_FILE if recipes_dir else None
    profiles = _profiles(profiles_path, problems) if profiles_path else {}
    prices: dict[str, Price] = {}
    tags: dict[str, str] = {}
    if config_dir:
        config_dir = pathlib.Path(config_dir).expanduser()
        prices = _prices(config_dir / PRICES_FILE, profiles, problems)
        tags = _tags(config_dir / TAGS_FILE, profiles, problems)
    return RoiBook(profiles, prices, tags, tuple(problems), profiles_path)


def _profiles(path: pathlib.Path, problems: list) -> dict[str, RoiProfile]:
    text = _read(path, problems)
    if text is None:
        return {}
    try:
        raw, lines = parse_yaml(text)  # as a recipe is read: its problems say what and where alike
    except yaml.YAMLError as exc:
        problems.append(yaml_problem(str(path), exc))
        return {}
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) != {"profiles"} or not isinstance(raw["profiles"], dict):
        problems.append(Problem(str(path), "$", "expected a mapping with one field, profiles: {id: {provider, model, "
                                                "...}}", 1))
        return {}
    out = {}
    for pid, fields in raw["profiles"].items():
        if not isinstance(pid, str) or not _ID.match(pid):
            problems.append(Problem(str(path), "$.profiles", f"{pid!r} is not an id: lowercase letters, digits, '.', "
                                                             "'_', '-'", line_of(lines, f"$.profiles.{pid}")))
            continue
        try:
            out[pid] = converter.structure(fields, RoiProfile)
        except Exception as exc:  # noqa: BLE001 -- cattrs groups every problem into one exception
            for where, message in describe_errors(exc):
                where = where.replace("$", f"$.profiles.{pid}", 1)
                problems.append(Problem(str(path), where, message, line_of(lines, where)))
    return out


def _prices(path: pathlib.Path, profiles: dict, problems: list) -> dict[str, Price]:
    raw = _read_json(path, problems)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(Problem(str(path), "$", 'expected {"<roi profile>": {"in": usd_per_mtok, "out": '
                                                'usd_per_mtok}}'))
        return {}
    out = {}
    for pid, fields in raw.items():
        where = f"$.{pid}"
        if pid not in profiles:
            problems.append(Problem(str(path), where, f"no ROI profile {pid!r} in {PROFILES_FILE}"))
        elif not isinstance(fields, dict) or set(fields) - {"in", "out"} or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in fields.values()):
            problems.append(Problem(str(path), where, 'expected {"in": usd_per_mtok, "out": usd_per_mtok}, '
                                                      'numbers >= 0'))
        else:
            out[pid] = Price(float(fields.get("in", 0.0)), float(fields.get("out", 0.0)))
    return out


def _tags(path: pathlib.Path, profiles: dict, problems: list) -> dict[str, str]:
    raw = _read_json(path, problems)
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        problems.append(Problem(str(path), "$", 'expected {"<recipe id>": "<roi profile>"}'))
        return {}
    bad = [k for k, v in raw.items() if v not in profiles]
    problems += [Problem(str(path), f"$.{k}", f"no ROI profile {raw[k]!r} in {PROFILES_FILE}") for k in bad]
    return {k: v for k, v in raw.items() if k not in bad}


def _read(path: pathlib.Path, problems: list) -> str | None:
    """The file's text; None when it is missing (each file is optional) or unreadable (a problem)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(Problem(str(path), "$", f"cannot read: {exc}"))
        return None


def _read_json(path: pathlib.Path, problems: list):
    text = _read(path, problems)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        problems.append(Problem(str(path), "$", f"not JSON: {exc.msg}", exc.lineno))
        return None


def tag_recipe(path: pathlib.Path, profile_id: str) -> None:
    """Set ``roi_profile: <profile_id>`` in a recipe file, keeping the rest of it as written."""
    text = path.read_text(encoding="utf-8")
    line = f"roi_profile: {profile_id}"
    if re.search(r"(?m)^roi_profile:.*$", text):
        text = re.sub(r"(?m)^roi_profile:.*$", line, text)
    else:
        text = text + ("" if text.endswith("\n") or not text else "\n") + line + "\n"
    path.write_text(text, encoding="utf-8")
