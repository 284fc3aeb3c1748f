"""What a recipe is: one serving profile, as the YAML file under ``recipes/`` spells it.

Values are frozen attrs classes structured by one strict cattrs converter: extra
keys are refused, and a scalar must already have its type (YAML's ``"8"`` is not
an int, ``1`` is not a string), so a typo never turns into a silent default.
"""

from __future__ import annotations

import os
import pathlib
import typing
from typing import Literal

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, override

ENGINES = ("spark", "upstream")
LIFECYCLES = ("draft", "testing", "works", "production", "promote")
TIERS = ("light", "medium", "heavy")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
# Speculative methods: Spark's engine drafts by n-gram lookup; the others name what an upstream engine
# was launched with (vLLM's MTP/EAGLE, DFlash, DSpark), for people and the portal.
SPARK_SPECULATIVE = ("ngram", "none")
SPECULATIVE_METHODS = (*SPARK_SPECULATIVE, "mtp", "eagle", "eagle3", "dflash", "dspark")
# Gateway names that always mean the active model (no recipe may claim one, none switches):
# sparky as its recipe serves it, sparky-think with thinking on, sparky-fast with thinking off.
RESERVED_NAMES = ("sparky", "sparky-think", "sparky-fast")


@attrs.frozen
class Context:
    default: int | None = None  # context length; the model's own when None
    # Spark: a dtype names the model's, which the KV cache shares; fp8 keeps the model's dtype and the KV
    # cache in e4m3 with scales (ServeConfig.kv_cache_dtype).
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    # The control plane's name for the KV cache's dtype. Spark's engine: one of KV_DTYPES, as kv_dtype;
    # an upstream recipe: what its engine was launched with (fp8, q8_0, ...), shown, not enforced.
    kv_default: str | None = None

    @property
    def kv(self) -> str:
        """The KV dtype Spark's engine loads with: ``kv_default`` when it names one, else ``kv_dtype``."""
        return self.kv_default if self.kv_default in KV_DTYPES else self.kv_dtype


@attrs.frozen
class Scheduler:
    policy: str | None = None  # a name in spark.core.policies.POLICIES; None: the server's
    max_batch_size: int | None = None
    max_prefill_tokens: int | None = None
    prefix_caching: bool | None = None  # reuse cached prompt pages; None: the server's (on by default)


@attrs.frozen
class Speculative:
    """Speculative decoding (``spark.core.speculation``); a field left out keeps the server's."""

    # ngram: drafts by prompt lookup; none: off. mtp, eagle, eagle3, dflash, dspark: an upstream engine's own
    # (recorded for an upstream recipe; Spark's engine refuses them).
    method: Literal["ngram", "none", "mtp", "eagle", "eagle3", "dflash", "dspark"] = "ngram"
    tokens: int | None = None  # drafted tokens per step at most
    ngram: int | None = None  # the longest n-gram of the context's end looked up
    max_batch: int | None = None  # off while more sequences than this decode


@attrs.frozen
class Parsers:
    tool_call: str | None = None  # one of spark.serve_config.TOOL_CALL_PARSER_CHOICES (checked on loading)
    reasoning: str | None = None  # one of spark.serve_config.REASONING_PARSER_CHOICES (checked on loading)


@attrs.frozen
class Sampling:
    """Defaults for the fields a request leaves out."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def defaults(self) -> dict[str, float | int]:
        """The fields set, minus ``max_tokens`` (which caps rather than samples)."""
        return {k: v for k, v in attrs.asdict(self).items() if v is not None and k != "max_tokens"}


@attrs.frozen
class Upstream:
    """An external OpenAI-compatible server (llama.cpp's, vLLM's, another Spark)."""

    base_url: str  # up to and including /v1, e.g. http://127.0.0.1:8081/v1
    api_key_env: str | None = None  # the environment variable holding its key; never the key itself
    timeout_s: float = 600.0


@attrs.frozen
class Dummy:
    """Random weights: a preset (``spark.engine.weights.dummy.PRESETS``) and field overrides."""

    preset: str = "tiny-llama"
    config: dict[str, int | float | bool | str] = attrs.Factory(dict)  # ModelConfig fields


@attrs.frozen
class Recipe:
    """One serving profile.

    ``model`` is what the engine loads: ``default`` (the embedded SmolLM2), a .gguf
    path, an HF directory, ``dummy`` (with a ``dummy`` section) or ``dummy:<preset>``.
    For ``engine: upstream`` it is the name the upstream server knows the model by.
    """

    id: str
    served_name: str
    model: str
    engine: Literal["spark", "upstream"]
    name: str | None = None  # for people; the id by default
    catalog_id: str | None = None  # the model's identity in the catalog (lab/model-variant), shown in listings
    aliases: tuple[str, ...] = ()
    context: Context = Context()
    scheduler: Scheduler = Scheduler()
    parsers: Parsers = Parsers()
    sampling: Sampling = Sampling()
    speculative: Speculative | None = None  # None: the server's (off by default)
    # Spark's engine: the model split over this many GPUs (tensor parallelism); None: the server's (1).
    world_size: int | None = attrs.field(default=None, validator=lambda _, __, value: _check_world_size(value))
    lifecycle: Literal["draft", "testing", "works", "production"] = "testing"
    tier: Literal["light", "medium", "heavy"] = "medium"
    roi_profile: str | None = None  # an id in <recipes>/roi-profiles.yaml: the cloud model its usage is priced as
    upstream: Upstream | None = None
    dummy: Dummy | None = None
    # Set by the loader, never read from YAML:
    path: pathlib.Path | None = None
    draft: bool = False  # under recipes/drafts/: listed, served only when named by id

    @property
    def display_name(self) -> str:
        return self.name or self.id

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may use for this recipe."""
        return (self.served_name, *self.aliases)

    def model_path(self) -> pathlib.Path | None:
        """The file or directory a spark-engine recipe loads; None for ``default`` and dummy weights."""
        if self.engine != "spark" or self.model == "default" or self.model.split(":")[0] == "dummy":
            return None
        return pathlib.Path(os.path.expandvars(self.model)).expanduser()

    def load_spec(self):
        """``(model, dummy_config)`` for ``Engine.load``."""
        if self.model == "dummy":
            from spark.engine.weights.dummy import dummy_config

            dummy = self.dummy or Dummy()
            return "dummy", attrs.evolve(dummy_config(dummy.preset), **_model_config_fields(dummy.config))
        path = self.model_path()
        return (str(path) if path is not None else self.model), None


def _world_size(value, _) -> int | None:
    """A recipe's ``world_size``, checked while structuring, so that the error names its path."""
    if value is not None:
        _strict(int, "an int")(value, int)
    _check_world_size(value)
    return value


def _check_world_size(value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"expected at least 1 rank, got {value}")


def _model_config_fields(overrides: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


# -- structuring ------------------------------------------------------------------------------


def _strict(tp: type, name: str):
    def structure(value, _):
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise TypeError(f"expected {name}, got {_kind(value)}")
        return value

    return structure


def _number(value, _) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {_kind(value)}")
    return float(value)


def _kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _literal_hook(tp) -> object:
    choices = typing.get_args(tp)

    def structure(value, _):
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}; got {value!r}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(int, _strict(int, "an int"))
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(float, _number)
    conv.register_structure_hook(int | float | bool | str, _strict((int, float, bool, str), "a number, string or bool"))
    conv.register_structure_hook_factory(lambda tp: typing.get_origin(tp) is Literal, _literal_hook)
    conv.register_structure_hook_func(lambda tp: tp == tuple[str, ...], _string_list)
    conv.register_structure_hook_factory(attrs.has, lambda cl: _section(cl, conv))
    return conv


def _string_list(value, _) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of strings, got {_kind(value)}")
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise TypeError(f"expected a list of strings, got {_kind(bad[0])} in it")
    return tuple(value)


def _section(cl: type, conv: cattrs.Converter):
    """A mapping check in front of cattrs' generated function (YAML's empty ``context:`` is None)."""
    omit = {"path": override(omit=True), "draft": override(omit=True),
            "world_size": override(struct_hook=_world_size)} if cl is Recipe else {}
    structure = make_dict_structure_fn(cl, conv, _cattrs_forbid_extra_keys=True, **omit)

    def checked(value, tp):
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping, got {_kind(value)}")
        return structure(value, tp)

    return checked


converter = _make_converter()


def structure_recipe(raw: dict) -> Recipe:
    """``raw`` (a YAML mapping) as a ``Recipe``.

    Raises:
        cattrs.BaseValidationError: every type problem at once (see ``describe_errors``).
    """
    return converter.structure(raw, Recipe)


def describe_errors(exc: BaseException) -> list[tuple[str, str]]:
    """``(path, message)`` per problem in a cattrs error, paths like ``$.context.default``."""
    if not isinstance(exc, cattrs.BaseValidationError):
        return [("$", str(exc))]
    out = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_format):
        message, _, path = line.rpartition(" @ ")
        out.append((path, message))
    return out


def _format(exc: BaseException, tp) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        fields = sorted(map(str, exc.extra_fields))
        return f"unknown field{'s' if len(fields) > 1 else ''} {', '.join(fields)}"
    if isinstance(exc, (TypeError, ValueError)) and exc.args:
        return str(exc.args[0])
    return cattrs.v.format_exception(exc, tp)
