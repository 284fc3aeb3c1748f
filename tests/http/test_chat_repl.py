"""``spark chat`` against the test server, driven through stdin like a person would."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.http.conftest import API_KEY

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
