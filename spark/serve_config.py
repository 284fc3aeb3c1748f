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

POLICIES = ("fifo", "slai")


@attrs.frozen
class ServeConfig:
    model: str = "default"  # "default", a .gguf path, an HF directory, or "dummy:<preset>"
    served_name: str | None = None  # the model name clients use; the file's stem by default
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None  # "cpu" | "cuda"; the GPU when there is one
    max_batch_size: int = 64  # running sequences at most
    max_prefill_tokens: int = 512  # prompt tokens per engine step at most (longer prompts are chunked)
    scheduler: str = attrs.field(default="slai", validator=attrs.validators.in_(POLICIES))
    tbt_deadline_ms: float = 200.0  # SLAI: time-between-tokens target of a running stream
    max_waiting: int = 128  # requests queued before new ones get 503 + Retry-After
    page_size: int = 16
    kv_cache_bytes: int | None = None  # KV cache budget; from free memory by default
    max_model_len: int | None = None  # context length; the model's by default
    api_keys: tuple[str, ...] = ()  # when set, every /v1 request needs one as a Bearer token
    rate_limit_rps: float = 0.0  # per API key; 0 = unlimited
    rate_limit_tpm: float = 0.0  # tokens (prompt + max new) per minute per key; 0 = unlimited
    rate_limit_max_keys: int = 10_000  # keys tracked at most; the idlest are forgotten first
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    default_max_tokens: int = 1024  # when a request names none (capped by the context left)

    def resolved_served_name(self) -> str:
        """The name clients use: ``served_name``, else the model file's (or directory's) stem."""
        import pathlib

        if self.served_name:
            return self.served_name
        if self.model in ("", "default"):
            return "smollm2-135m-instruct"
        if self.model.startswith("dummy"):
            return self.model.replace(":", "-")
        path = pathlib.Path(self.model)
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
            else:
                raw[field.name] = value
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return _converter.structure(raw, cls)
        except Exception as exc:  # cattrs groups every bad field into one exception
            lines = cattrs.transform_error(exc, path="SPARK") if isinstance(exc, cattrs.BaseValidationError) else [str(exc)]
            raise ValueError("; ".join(lines)) from None


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(int | None, lambda v, _: None if v in (None, "", "none") else int(v))
_converter.register_structure_hook(str | None, lambda v, _: None if v in (None, "") else str(v))
