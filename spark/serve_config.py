"""What ``spark serve`` is configured with: CLI flags, or ``SPARK_*`` environment variables.

``hypercorn -k trio spark.http:app`` has no flags of ours, so every field can
also come from the environment: field ``max_batch_size`` is
``SPARK_MAX_BATCH_SIZE``; lists are comma-separated (``SPARK_API_KEYS=a,b``).
"""

from __future__ import annotations

import os
from typing import Mapping

import attrs
import cattrs

from spark import parsers
from spark.core.faults import Faults
from spark.core.policies import POLICIES
from spark.core.speculation import METHODS as SPECULATIVE_METHODS, SpecConfig

SCHEDULER_POLICIES = tuple(POLICIES)  # the registry's names
# The values of the parser settings (flags, SPARK_* variables, recipes): the registry's names, plus
# "auto" (the format the chat template shows) and "none" (no parsing).
TOOL_CALL_PARSER_CHOICES = ("auto", "none", *parsers.TOOL_PARSERS)
REASONING_PARSER_CHOICES = ("auto", "none", *parsers.REASONING_PARSERS)
# The KV cache dtypes (spark.engine.kv_cache.KV_DTYPES, named here without importing torch).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8")


def _at_least(least: float, *, default):
    """A number field that refuses values below ``least``; where the default is None, None stays allowed.

    A count or size out of range must fail at start with one line naming it: 0 sequences or prompt tokens
    per step left the server loading forever without a word.
    """
    check = attrs.validators.ge(least)
    return attrs.field(default=default, validator=attrs.validators.optional(check) if default is None else check)


def _above(bound: float, *, default):
    """A number field that refuses values at or below ``bound`` (None stays allowed where it is the default)."""
    check = attrs.validators.gt(bound)
    return attrs.field(default=default, validator=attrs.validators.optional(check) if default is None else check)


@attrs.frozen
class ServeConfig:
    model: str = "default"  # "default", a .gguf path, an HF directory, or "dummy:<preset>"
    served_name: str | None = None  # the model name clients use; the file's stem by default
    host: str = "127.0.0.1"
    # 0: a free one. Checked here: socket.bind raises OverflowError (no OSError) outside 0-65535.
    port: int = attrs.field(default=8000, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    device: str | None = None  # "cpu" | "cuda"; the GPU when there is one
    # The engine in its own process ("on"), in a thread of the server ("off"), or on
    # when the device is a GPU ("auto"): there the HTTP side's Python would stall it.
    engine_process: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "on", "off")))
    # torch's intra-op threads of an engine on the CPU; None: one fewer than this process may use (at
    # least 1). The event loop needs a core: OpenMP threads spinning on every core made steps 24x slower.
    cpu_threads: int | None = _at_least(1, default=None)
    # The weights' format on the CPU: "int4" (the default there), "int8" or "dense" (float32; batch-
    # invariant: a prompt samples the same alone or in a batch); None: the engine's default.
    weight_format: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(("dense", "int4", "int8"))))
    max_batch_size: int = _at_least(1, default=64)  # running sequences at most
    # Prompt tokens per engine step at most (longer prompts are chunked).
    max_prefill_tokens: int = _at_least(1, default=512)
    scheduler: str = attrs.field(default="slai", validator=attrs.validators.in_(SCHEDULER_POLICIES))
    # SLAI: time-between-tokens target of a running stream (a request's tbt_ms wins).
    tbt_deadline_ms: float = _above(0, default=200.0)
    # Refuse (429; Anthropic 529) a request whose first token is predicted to come later than this, with a
    # Retry-After from the prediction (spark/actors/admission.py); None: queue every request.
    ttft_bound_s: float | None = _above(0, default=None)
    # Engine steps launched ahead of their results; None: 2 (the host prepares step N+1 while the
    # device runs N). Each more costs an ended sequence one more wasted row.
    scheduler_depth: int | None = _at_least(1, default=None)
    # Diagnostics: log each turn of the core loop slower than this (where its time went, the steps it
    # collected, garbage collections and CUDA allocator retries meanwhile); None: off.
    slow_turn_ms: float | None = _above(0, default=None)
    # Diagnostics: append one JSON line per engine step to this file (its shape, the context it read, the
    # policy's prediction and budget, its seconds: what fits a step-time model); None: off.
    step_trace: str | None = None
    max_waiting: int = _at_least(0, default=128)  # requests queued before new ones get 503 + Retry-After
    # Full prompt pages are cached and reused by later prompts that start with the same tokens.
    prefix_caching: bool = True
    # On a GPU, every step shape the server will plan runs once before it says ready (spark/engine/warmup.py).
    warm_up: bool = True
    # A stored Response's prefix (and an Anthropic cache_control breakpoint's without a ttl) stays
    # cached this long; pinned pages never exceed this share of the KV cache.
    prefix_pin_ttl_s: float = _at_least(0, default=300.0)
    prefix_pin_share: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0), attrs.validators.le(1)])
    # Speculative decoding: "ngram" drafts by prompt lookup (a decode verifies up to spec_tokens drafted
    # tokens in one forward); None: off. Greedy output and a seed's samples are unchanged by it.
    speculative: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(SPECULATIVE_METHODS)))
    spec_tokens: int = _at_least(1, default=4)  # drafted tokens per step at most
    spec_ngram: int = _at_least(1, default=4)  # longest suffix looked up
    # Off while more sequences than this decode: the step is then compute-bound, and the drafts' extra
    # positions cost about what they give.
    spec_max_batch: int = _at_least(1, default=8)
    page_size: int = _at_least(1, default=16)
    # Tensor parallelism: the model split over this many ranks (GPUs; CPU processes over gloo), one engine
    # process each, rank 0 scheduling for all (spark/engine/ranks.py). Torchrun may start the ranks instead.
    world_size: int = attrs.field(default=1, validator=lambda _, __, value: _check_world_size(value))
    kv_cache_bytes: int | None = _at_least(1, default=None)  # KV cache budget; from free memory by default
    # The KV cache's dtype: "auto" (the model's) or "fp8" (e4m3 with per-head scales: twice the tokens
    # in the same bytes, half the bytes a decode step reads; spark/engine/kv_cache.py).
    kv_cache_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(KV_CACHE_DTYPE_CHOICES))
    max_model_len: int | None = _at_least(1, default=None)  # context length; the model's by default
    api_keys: tuple[str, ...] = ()  # when set, every /v1 request needs one as a Bearer token
    rate_limit_rps: float = _at_least(0, default=0.0)  # per API key; 0 = unlimited
    rate_limit_tpm: float = _at_least(0, default=0.0)  # tokens (prompt + max new) per minute per key; 0 = unlimited
    rate_limit_max_keys: int = _at_least(1, default=10_000)  # keys tracked at most; the idlest are forgotten first
    # 401s (a missing or unknown key) answered per second at most, across the server; the rest wait
    # their turn, so a flood of bad keys cannot crowd out the real ones. 0: unpaced.
    refusals_per_s: float = _at_least(0, default=200.0)
    max_body_bytes: int = _at_least(1, default=4 << 20)  # larger request bodies get 413
    default_max_tokens: int = _at_least(1, default=1024)  # when a request names none (capped by the context left)
    # The Responses API's stored responses and conversations (spark.state): a SQLite file; None:
    # $XDG_DATA_HOME/spark/state.sqlite3 (~/.local/share/spark/...), ":memory:": nothing survives a restart.
    state_path: str | None = None
    state_max_age_s: float = _above(0, default=30 * 24 * 3600.0)  # stored objects unused for longer are evicted
    state_max_bytes: int = _at_least(1, default=1 << 30)  # stored JSON at most; the oldest objects are evicted first
    # Chat output parsing (spark.http.turn): "auto" (or None) detects the tool-call format from the
    # chat template; "auto" reasoning is on when the template or the vocabulary has <think>.
    tool_call_parser: str = attrs.field(default="auto", validator=attrs.validators.optional(
        attrs.validators.in_(TOOL_CALL_PARSER_CHOICES)))
    reasoning_parser: str = attrs.field(default="auto", validator=attrs.validators.in_(REASONING_PARSER_CHOICES))
    max_thinking_budget: int | None = _at_least(0, default=None)  # reasoning tokens per request; None: unlimited
    disable_thinking: bool = False  # thinking off, whatever a request asks: a kill-switch
    # An answer that opens with a refusal goes to each API's refusal field (spark.parsers.refusal); the
    # patterns replace the built-in openings (SPARK_REFUSAL_PATTERNS: separated by "|").
    refusal_filter: bool = True
    refusal_patterns: tuple[str, ...] = ()
    citations: bool = True  # the answer's links as url_citation annotations / citations (spark.parsers.citations)
    # Recipes and the one-slot control plane (spark.recipes, spark.control). Without recipes_dir and
    # recipe the server serves `model` alone, as an implicit recipe.
    recipes_dir: str | None = None  # the recipes directory; the project's recipes/ when only `recipe` is set
    recipe: str | None = None  # the recipe active at start; none loaded until named when unset
    switch_on_demand: bool = True  # a request naming another recipe switches to it (503 + Retry-After meanwhile)
    # How long in-flight requests may finish before a switch cuts them off.
    switch_grace_s: float = _at_least(0, default=30.0)
    # On SIGTERM/SIGINT: no new requests, open streams get this long to finish, the rest end with an
    # error event saying the server is shutting down (a second signal ends them at once).
    shutdown_grace_s: float = _at_least(0, default=30.0)
    # Host-local control-plane settings (spark.recipes): inference-profiles.yaml (the enabled recipes),
    # inference-pricing.json and roi-recipe-tags.json (ROI); None: none (every non-draft recipe enabled).
    config_dir: str | None = None
    admin_key: str | None = None  # Bearer key of /api/inference/*; required there once any key is configured
    activity_log_path: str | None = None  # one JSON line per generation request; None: no log
    # Faults on purpose, for tests and drills (spark.core.faults): "step=3,7;request=5" makes the 3rd
    # and 7th engine steps raise and every 5th request fail; "" (the default): none.
    faults: str = attrs.field(default="", validator=lambda _, __, value: Faults.parse(value))
    activity_log_max_bytes: int = _at_least(1, default=50 << 20)  # rotated by size...
    activity_log_max_age_s: float = _above(0, default=7 * 24 * 3600.0)  # ...and by age
    usage_path: str | None = None  # token counters per recipe, kept across restarts; None: in memory only

    def uses_engine_process(self) -> bool:
        """Whether the engine runs in a process of its own (``engine_process``: auto = on a GPU; always with
        more than one rank: rank 0 is that process)."""
        if self.world_size > 1:
            return True
        if self.engine_process != "auto":
            return self.engine_process == "on"
        if self.device is not None:
            return self.device.startswith("cuda")
        import torch

        return torch.cuda.is_available()

    def spec_config(self) -> SpecConfig | None:
        """How requests speculate (``spark.core.speculation``); None when they do not."""
        if self.speculative is None:
            return None
        return SpecConfig(method=self.speculative, num_tokens=self.spec_tokens, ngram_max=self.spec_ngram,
                          max_batch=self.spec_max_batch)

    def verify_graph_rows(self) -> int:
        """Rows of the largest verify step the engine captures a graph for: 0 unless requests speculate."""
        spec = self.spec_config()
        return 0 if spec is None else spec.verify_rows

    def resolved_cpu_threads(self) -> int:
        """``cpu_threads``, or to start with (``cpu_threads`` None: the engine then follows the idle cores,
        ``device.IdleCoreThreads``) the cores this process may run on less one, at least 1."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores - 1)

    def resolved_served_name(self) -> str:
        """The name clients use: ``served_name``, else the model file's (or directory's) stem."""
        import pathlib

        from spark.engine.hub import looks_like_hf_id

        if self.served_name:
            return self.served_name
        if self.model in ("", "default"):
            return "smollm2-135m-instruct"
        if self.model.startswith("dummy"):
            return self.model.replace(":", "-")
        path = pathlib.Path(self.model)
        if not path.exists() and looks_like_hf_id(self.model):
            return self.model  # a hub id is served under its own name, as vLLM does
        return (path.name if path.is_dir() else path.name.split(".")[0]).lower()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "ServeConfig":
        """Read ``SPARK_<FIELD>`` variables; ``overrides`` win over them.

        Raises:
            ValueError: one line per bad variable, naming it.
        """
        environ = os.environ if environ is None else environ
        raw: dict[str, object] = {}
        for field in attrs.fields(cls):
            value = environ.get(f"SPARK_{field.name.upper()}")
            if value is None:
                continue
            if field.name == "api_keys":
                raw[field.name] = tuple(k.strip() for k in value.split(",") if k.strip())
            elif field.name == "refusal_patterns":  # a refusal's opening may hold commas
                raw[field.name] = tuple(p.strip() for p in value.split("|") if p.strip())
            else:
                raw[field.name] = value
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return _converter.structure(raw, cls)
        except Exception as exc:  # cattrs groups every bad field into one exception
            lines = (cattrs.transform_error(exc, path="SPARK", format_exception=_describe)
                     if isinstance(exc, cattrs.BaseValidationError) else [str(exc)])
            raise ValueError("; ".join(lines)) from None


def _check_world_size(value: int) -> None:
    if value < 1:
        raise ValueError(f"world_size {value}: needs at least 1 rank")


def _describe(exc: BaseException, tp: type | None) -> str:
    if isinstance(exc, ValueError) and exc.args:  # a validator's message names the field and the choices
        return f"invalid value ({exc.args[0]})"
    return cattrs.v.format_exception(exc, tp)


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(int | None, lambda v, _: None if v in (None, "", "none") else int(v))
_converter.register_structure_hook(str | None, lambda v, _: None if v in (None, "", "none") else str(v))


def _as_bool(value: object, _: type) -> bool:
    """A bool, or its spelling in an environment variable (``bool("0")`` would be True)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


_converter.register_structure_hook(bool, _as_bool)
