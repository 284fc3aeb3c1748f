"""The ``spark`` command as a newcomer reads it (issue 19.4, 19.7, 19.8): help for every option, the
variables listed, a version, one state directory per server, and chat's key."""

from __future__ import annotations

import argparse
import subprocess
import sys

import attrs
import pytest

from spark.cli import _state_paths, build_parser
from spark.serve_config import ServeConfig


def _serve_parser() -> argparse.ArgumentParser:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_option_says_what_it_does():
    for action in _serve_parser()._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings  # 9 of 18 had none
    scheduler = next(a for a in _serve_parser()._actions if "--scheduler" in a.option_strings)
    assert "slai (default)" in scheduler.help and "time-between-tokens" in scheduler.help  # "slai" was never explained


def test_the_epilog_lists_every_spark_variable():
    epilog = _serve_parser().epilog
    for field in attrs.fields(ServeConfig):
        assert f"SPARK_{field.name.upper()} " in epilog, field.name


def test_version():
    out = subprocess.run([sys.executable, "-m", "spark.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("spark "), (out.returncode, out.stdout, out.stderr)


def test_each_server_has_its_own_log_and_counters(tmp_path, monkeypatch):
    for name in ("SPARK_ACTIVITY_LOG_PATH", "SPARK_USAGE_PATH", "SPARK_STATE_PATH", "SPARK_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    a, b = _state_paths(None, 8000), _state_paths(None, 8001)
    assert a["activity_log_path"] != b["activity_log_path"] and a["usage_path"] != b["usage_path"]
    assert a["activity_log_path"].startswith(str(tmp_path / "spark" / "8000"))
    mine = _state_paths(str(tmp_path / "mine"), 8000)
    assert {mine["activity_log_path"], mine["usage_path"], mine["state_path"]} == {
        str(tmp_path / "mine" / n) for n in ("activity.jsonl", "usage.json", "state.sqlite3")}


def test_chat_takes_an_api_key():
    parser, _ = build_parser()
    args = parser.parse_args(["chat", "--url", "http://127.0.0.1:1", "--api-key", "k"])
    assert args.api_key == "k"


def test_an_interrupt_during_a_load_is_one_line():
    from spark.cli import _interrupted

    assert _interrupted(KeyboardInterrupt())
    assert _interrupted(BaseExceptionGroup("trio", [BaseExceptionGroup("inner", [KeyboardInterrupt()])]))
    assert not _interrupted(BaseExceptionGroup("trio", [KeyboardInterrupt(), ValueError("x")]))


def test_generate_prints_the_text_as_it_comes(capsys):
    # It printed nothing until the end (issue 19.8); streamed, it must still be the same text.
    from spark.cli import main
    from spark.engine import offline

    calls = []
    original = offline.generate

    def counting(*args, on_token=None, **kw):
        return original(*args, on_token=(lambda i, out: (calls.append(out), on_token(i, out))) if on_token else None,
                        **kw)

    prompt = ["generate", "--max-tokens", "12", "--device", "cpu", "The capital of France is"]
    import unittest.mock

    with unittest.mock.patch.object(offline, "generate", counting):
        assert main(prompt) == 0
    streamed = capsys.readouterr().out
    assert main(["generate", "--json", *prompt[1:]]) == 0
    import json

    assert streamed == json.loads(capsys.readouterr().out)["text"] + "\n"
    assert len(calls) == 12  # each token printed as it came


def _spark(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark.cli", *argv], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_serve_refuses_a_zero_batch_at_once():
    # It loaded the model and then hung, /health never answering; now one line, as --scheduler-depth 0 gives.
    out = _spark("serve", "--max-batch-size", "0", "--port", "0")
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "max_batch_size" in out.stderr and ">= 1" in out.stderr, out.stderr


@pytest.mark.parametrize("port, problem", [("99999", "<= 65535"), ("-1", ">= 0")])
def test_serve_refuses_a_port_out_of_range(port, problem, capsys):
    from spark.cli import main

    assert main(["serve", "--port", port]) == 2  # socket.bind's OverflowError was a traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'port'" in err and problem in err, err


def test_a_bad_log_level_is_one_usage_line(capsys):
    from spark.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", "bogus", "generate", "hi"])  # logging.basicConfig's ValueError was a traceback
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --log-level: invalid choice: 'BOGUS'" in err, err
    parser, _ = build_parser()
    assert parser.parse_args(["--log-level", "info", "chat"]).log_level == "INFO"


def test_generate_refuses_an_empty_prompt_before_the_engine_runs():
    # Two "engine step failed" tracebacks, then a RuntimeError's, exit 1; now one line and exit 2.
    out = _spark("generate", "--max-tokens", "4", "--device", "cpu", "")
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
    assert out.stderr == "spark: the prompt is empty (it encodes to no tokens): give some text to complete\n", out.stderr


def test_serve_refuses_a_state_dir_it_cannot_make(capsys):
    from spark.cli import main

    # It loaded the model, then the app's start-up raised FileNotFoundError (a traceback).
    assert main(["serve", "--state-dir", "/proc/no-such-dir", "--port", "0", "--model", "dummy:tiny-llama",
                 "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "spark: cannot make the state directory /proc/no-such-dir: " \
                                      "No such file or directory\n"


def test_chat_with_an_unreachable_server_fails_at_start():
    # It printed "(error: ...)" after the first message, and exited 0 at the end of the input.
    out = _spark("chat", "--url", "http://127.0.0.1:1", stdin="Hello!\n")
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("spark: cannot reach the server at http://127.0.0.1:1: ") and \
           out.stderr.count("\n") == 1, out.stderr
