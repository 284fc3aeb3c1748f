"""Tensor parallelism on the CPU (gloo, 2 ranks) gives what one rank gives: the logits, and the greedy
tokens of 32 steps through the leader and its follower; ``spark serve --world-size 2`` answers."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys

import attrs
import httpx
import pytest
import torch

from spark.engine import parallel, ranks
from spark.engine.config import ModelConfig
from spark.engine.engine import Engine
from spark.engine.offline import generate
from spark.engine.sampling import SamplingParams
from spark.engine.weights.dummy import PRESETS
from spark.recipes.schema import describe_errors, structure_recipe
from spark.recipes.serving import recipe_config
from spark.serve_config import ServeConfig
from tests.engine.conftest import prefill_logits

# A vocabulary that does not divide by 2 (the last rank's rows padded) and an untied head; then
# Qwen2's q/k/v biases and a head tied to the embedding.
MODELS = {
    "llama-odd-vocab": attrs.evolve(PRESETS["tiny-llama"], vocab_size=509),
    "qwen2-tied": "dummy:tiny-qwen2",
}
PROMPTS = [list(range(3, 40)), [7, 1, 500, 42, 9], [11]]
STEPS = 32
LOAD = dict(device="cpu", dtype=torch.float32, kv_cache_tokens=2048, progress=False)


def _load(spec, tp=parallel.SINGLE) -> Engine:
    if isinstance(spec, ModelConfig):
        return Engine.load("dummy", dummy_config=spec, tp=tp, **LOAD)
    return Engine.load(spec, tp=tp, **LOAD)


def _rank(rank: int, port: int, results) -> None:
    """One of the two ranks: each model's logits computed together, then rank 0 leads the greedy run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = parallel.join(rank, 2, "cpu")
    try:
        for name, spec in MODELS.items():
            engine = _load(spec, tp)
            with torch.inference_mode():
                logits = prefill_logits(engine, PROMPTS)  # both ranks: the same forward, collectives and all
            if rank == 0:
                leader = ranks.Leader(engine)
                params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
                tokens = [[o.token_id for o in out] for out in generate(leader, PROMPTS, params, max_prefill_tokens=16)]
                leader.close()
                results.put((name, logits, tokens))
            else:
                ranks.follow(engine)
    finally:
        parallel.leave()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = parallel.free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in MODELS:
            name, logits, tokens = results.get(timeout=120)
            out[name] = (logits, tokens)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_give_one_ranks_logits_and_greedy_tokens(two_ranks, name):
    engine = _load(MODELS[name])
    with torch.inference_mode():
        logits = prefill_logits(engine, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    tokens = [[o.token_id for o in out] for out in generate(engine, PROMPTS, params, max_prefill_tokens=16)]
    tp_logits, tp_tokens = two_ranks[name]
    assert tp_logits.shape == logits.shape == (len(PROMPTS), engine.vocab_size)
    cosine = torch.nn.functional.cosine_similarity(tp_logits, logits, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    assert tp_tokens == tokens and all(len(t) == STEPS for t in tokens)


def test_a_model_that_does_not_split_is_one_clear_line():
    with pytest.raises(ValueError, match="3 ranks"):
        PRESETS["tiny-llama"].shard(3)
    with pytest.raises(ValueError, match="mixture of experts"):
        PRESETS["tiny-mixtral"].shard(2)
    local = PRESETS["llama-3.1-8b"].shard(2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (16, 4, 7168)


def test_world_size_comes_from_the_flag_the_environment_and_recipes():
    from spark.cli import build_parser

    parser, _ = build_parser()
    assert parser.parse_args(["serve", "--world-size", "2"]).world_size == 2
    assert ServeConfig.from_env({"SPARK_WORLD_SIZE": "2"}).world_size == 2
    assert ServeConfig(world_size=2, engine_process="off").uses_engine_process()  # rank 0 is that process
    with pytest.raises(ValueError, match="world_size 0: needs at least 1 rank"):
        ServeConfig.from_env({}, world_size=0)
    recipe = structure_recipe({"id": "big", "served_name": "big", "model": "dummy:tiny-llama", "engine": "spark",
                               "world_size": 2})
    assert recipe_config(ServeConfig(), recipe).world_size == 2
    with pytest.raises(Exception) as err:
        structure_recipe({"id": "big", "served_name": "big", "model": "x", "engine": "spark", "world_size": 0})
    assert describe_errors(err.value) == [("$.world_size", "expected at least 1 rank, got 0")]


def test_spark_serve_world_size_2_answers_a_completion(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--world-size", "2", "--model", "dummy:tiny-llama",
           "--device", "cpu", "--port", "0", "--cpu-threads", "1", "--max-model-len", "256",
           "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"on (http://\S+)", line)
        assert url, line + proc.stdout.read(4000)
        r = httpx.post(url[1] + "/v1/completions", timeout=60,
                       json={"model": "sparky", "prompt": "hello world", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 8
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
