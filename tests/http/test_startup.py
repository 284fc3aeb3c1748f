"""Start-up as a newcomer meets it (issue 19.2): the port first, 503 "loading" until ready, and one line
with exit status 2 for every start-up error, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import trio

from spark.http import loading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
            "SPARK_STATE_PATH": ":memory:", **extra}


def _spark(*args, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(**env))


def _one_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_in_use_is_one_line_before_any_load():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = _spark("serve", "--port", str(port))
        _one_line(proc, f"127.0.0.1:{port} is already in use")
        assert time.monotonic() - start < 30  # found at once: the model (15-115 s to load) was never loaded


@pytest.mark.parametrize("args,needle", [
    (("--device", "cuda"), "use --device cpu") if not __import__("torch").cuda.is_available() else
    (("--device", "nonsense"), "unknown device"),
    (("--model", "/no/such/model.gguf"), "/no/such/model.gguf: no such file or directory"),
])
def test_start_up_errors_are_one_line_and_status_2(args, needle):
    _one_line(_spark("serve", "--port", str(_free_port()), *args), needle)


def test_hypercorns_command_says_a_start_up_error_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hypercorn", "-k", "trio", "spark.http:app", "--bind",
                           f"127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=120,
                          env=_env(SPARK_MODEL="/no/such/model.gguf"), cwd=tmp_path)
    # Its worker ends with status 2; hypercorn's master reports 0 whatever its worker's (hypercorn.run).
    assert proc.stderr.strip() == "spark: /no/such/model.gguf: no such file or directory", proc.stderr[-3000:]


def test_health_says_loading_until_the_model_is_ready():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "spark.cli", "serve", "--port", str(port)], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, chat = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                assert not seen, "the port closed after it had answered"
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            if chat is None:
                chat = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=5)
            time.sleep(0.05)
        assert seen and seen[-1] == (200, {"status": "ok"}), seen[-3:]
        loading_answers = [body for status, body in seen if status == 503]
        assert loading_answers and all(b["status"] == "loading" for b in loading_answers), seen[:3]
        assert loading_answers[0]["model"] == "smollm2-135m-instruct"
        assert chat is not None and chat.status_code == 503 and chat.headers["retry-after"]
        assert chat.json()["error"]["code"] == "not_ready"
    finally:
        proc.terminate()
        proc.wait(60)


async def test_the_loading_answers_go_and_the_socket_stays_for_the_app():
    sock = loading.bind("127.0.0.1", 0, 16)
    port = sock.getsockname()[1]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loading.answer_while_loading, sock, lambda: {"status": "loading", "model": "m"})
            for path, shape in (("/health", "status"), ("/v1/messages", "type"), ("/v1/models", "error")):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
                answer = b""
                while chunk := await stream.receive_some(65536):
                    answer += chunk  # the server closes after its one answer
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in head.lower()
                assert shape.encode() in body
                await stream.aclose()
            nursery.cancel_scope.cancel()
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # still listening: the backlog waits for the app
    finally:
        sock.close()


def test_a_signal_drains_the_open_streams_then_exits_0():
    # A Ctrl-C cut streams with no finish reason and no [DONE] (curl rc 18) after 5 s (issue 19.6).
    import signal
    import threading

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "spark.cli", "serve", "--port", str(port)],
                            env=_env(SPARK_SHUTDOWN_GRACE_S="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        streams: dict[str, list[str]] = {}

        def stream(name: str, max_tokens: int) -> None:
            body = {"prompt": "Count: 1, 2,", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                streams[name] = [line for line in r.iter_lines() if line.startswith("data:")]

        long = threading.Thread(target=stream, args=("long", 5000))
        long.start()
        time.sleep(1.0)  # the long one runs
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        long.join(60)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (proc.returncode, err[-2000:])
        assert refused.status_code == 503
        assert streams["long"][-1] == "data: [DONE]" and "shutting down" in streams["long"][-2], streams["long"][-3:]
        assert "Spark stopping: 1 open stream(s)" in out and out.strip().endswith("Spark stopped"), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
