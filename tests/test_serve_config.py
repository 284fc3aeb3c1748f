"""ServeConfig from SPARK_* variables: values, defaults, and one clear line per bad variable."""

import pytest

from spark.serve_config import ServeConfig


def test_scheduler_depth_from_the_environment():
    assert ServeConfig.from_env({}).scheduler_depth is None  # the scheduler's default
    assert ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": "4"}).scheduler_depth == 4
    assert ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": "4"}, scheduler_depth=2).scheduler_depth == 2


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_scheduler_depth_names_the_variable(value):
    with pytest.raises(ValueError, match="scheduler_depth"):
        ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": value})


def test_the_kv_cache_dtype_from_flag_or_variable(capsys):
    from spark.cli import main
    from spark.engine.kv_cache import KV_DTYPES
    from spark.serve_config import KV_CACHE_DTYPE_CHOICES

    assert KV_CACHE_DTYPE_CHOICES == KV_DTYPES
    assert ServeConfig.from_env({}).kv_cache_dtype == "auto"
    assert ServeConfig.from_env({"SPARK_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    assert ServeConfig.from_env({"SPARK_KV_CACHE_DTYPE": "fp8"}, kv_cache_dtype="auto").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServeConfig.from_env({"SPARK_KV_CACHE_DTYPE": "int8"})
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--kv-cache-dtype {auto,fp8}" in capsys.readouterr().out


def test_parser_choices_are_the_registrys_names():
    from spark import parsers
    from spark.serve_config import REASONING_PARSER_CHOICES, TOOL_CALL_PARSER_CHOICES

    assert TOOL_CALL_PARSER_CHOICES == ("auto", "none", *parsers.TOOL_PARSERS)
    assert REASONING_PARSER_CHOICES == ("auto", "none", *parsers.REASONING_PARSERS)
    for name in parsers.TOOL_PARSERS:
        assert ServeConfig.from_env({"SPARK_TOOL_CALL_PARSER": name}).tool_call_parser == name
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServeConfig.from_env({"SPARK_TOOL_CALL_PARSER": "json"})


def test_the_cli_offers_the_registrys_parser_names(capsys):
    from spark.cli import main
    from spark.serve_config import REASONING_PARSER_CHOICES, TOOL_CALL_PARSER_CHOICES

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = capsys.readouterr().out
    assert "{" + ",".join(TOOL_CALL_PARSER_CHOICES) + "}" in usage
    assert "{" + ",".join(REASONING_PARSER_CHOICES) + "}" in usage


def test_cpu_threads_leave_the_event_loop_a_core(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert ServeConfig().resolved_cpu_threads() == 1  # two shared cores: one for torch, one for the loop
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert ServeConfig().resolved_cpu_threads() == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert ServeConfig().resolved_cpu_threads() == 1
    assert ServeConfig.from_env({"SPARK_CPU_THREADS": "3"}).resolved_cpu_threads() == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        ServeConfig.from_env({"SPARK_CPU_THREADS": "0"})


def test_a_cpu_engine_loads_with_those_threads():
    import torch
    import trio

    from spark.control.local import load_engine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = trio.run(load_engine, ServeConfig(model="dummy:tiny-llama", device="cpu", cpu_threads=1))
        assert torch.get_num_threads() == 1
        engine.close()
    finally:
        torch.set_num_threads(before)


# Each of these once started a server that hung without a word (0 sequences or prompt tokens per step) or
# failed deep inside it; now it is one line at start naming the variable.
@pytest.mark.parametrize("field, value", [
    ("max_batch_size", "0"), ("max_batch_size", "-1"), ("max_prefill_tokens", "0"), ("max_model_len", "0"),
    ("kv_cache_bytes", "-1"), ("page_size", "0"), ("max_waiting", "-1"), ("tbt_deadline_ms", "0"),
    ("prefix_pin_ttl_s", "-1"), ("prefix_pin_share", "1.5"), ("default_max_tokens", "0"), ("max_body_bytes", "0"),
    ("rate_limit_rps", "-1"), ("rate_limit_tpm", "-1"), ("rate_limit_max_keys", "0"), ("state_max_bytes", "0"),
    ("state_max_age_s", "0"), ("switch_grace_s", "-1"), ("activity_log_max_bytes", "0"),
    ("activity_log_max_age_s", "0"),
])
def test_an_out_of_range_number_names_its_variable(field, value):
    with pytest.raises(ValueError, match=field):
        ServeConfig.from_env({f"SPARK_{field.upper()}": value})


def test_the_range_checks_keep_the_defaults_and_unset_values():
    assert ServeConfig.from_env({}) == ServeConfig()
    config = ServeConfig.from_env({"SPARK_MAX_MODEL_LEN": "none", "SPARK_KV_CACHE_BYTES": "", "SPARK_MAX_WAITING": "0"})
    assert (config.max_model_len, config.kv_cache_bytes, config.max_waiting) == (None, None, 0)
