"""``spark chat`` against the test server, driven through stdin like a person would."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.http.conftest import API_KEY, MAX_BODY_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chat_repl_streams_replies_and_keeps_history(server):
    env = {**os.environ, "SPARK_API_KEY": API_KEY,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    code = f"from spark.chat import chat; chat({server.url!r})"
    proc = subprocess.run([sys.executable, "-c", code], input="Hello!\nWhat did I just say?\n/reset\n/exit\n",
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("you> ") == 4 and "(conversation cleared)" in out
    replies = [part.strip() for part in out.split("you> ")[1:3]]
    assert all(replies) and "error" not in out


def _chat(*argv: str, stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPARK_API_KEY": API_KEY,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "spark.cli", "chat", *argv], input=stdin, capture_output=True,
                          text=True, timeout=180, env=env)


def test_an_unknown_model_is_refused_before_the_first_message(server):
    # It printed "(error: ...)" after each message and exited 0.
    proc = _chat("--url", server.url, "--model", "no-such-model", stdin="Hello!\n")
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr == f"spark: the server at {server.url} serves no model 'no-such-model'; it serves: " \
                          f"{server.model}, sparky, sparky-think, sparky-fast\n"


def test_piped_messages_that_fail_end_with_a_non_zero_exit(server):
    too_large = "x" * (MAX_BODY_BYTES + 1)  # a 413 for that message
    proc = _chat("--url", server.url, "--model", server.model, stdin=f"{too_large}\nHello!\n")
    assert "(error: 413" in proc.stdout and proc.stdout.count("you> ") == 3, proc.stdout
    assert proc.returncode == 1 and proc.stderr == "spark: 1 of 2 message(s) failed\n", (proc.returncode, proc.stderr)
