"""The engine end to end on the default model (float32, CPU) and on dummy weights.

Batching must not change a token: a sequence's output is the same alone, in a
batch, with its prompt chunked, on small pages, and next to other sequences'
prefill chunks in one step. Then stop conditions, logprobs and bad input.
"""

from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from spark.engine.offline import generate
from spark.engine.engine import Engine
from spark.core.plan import Chunk, StepPlan
from spark.engine.errors import ModelLoadError
from spark.engine.sampling import SamplingParams

from .conftest import prefill_logits

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he wrote down the colour of the sea, the direction of the wind and the names of "
    "the ships that passed. In winter the storms came from the north and the waves broke over the rocks "
    "below, so he stayed inside, mending nets and reading old letters. 42 + 17 = 59; def f(x): return x * 2. "
    "Spring brought fishermen back to the harbour, and children ran along the pier to watch them unload."
)
PROMPT_LENGTHS = (3, 9, 17, 26, 41, 60)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)


def token_ids(results) -> list[list[int]]:
    return [[out.token_id for out in outs] for outs in results]


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """Six prompts of 3..60 tokens, each starting at a different place in TEXT."""
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) >= 7 * len(PROMPT_LENGTHS) + max(PROMPT_LENGTHS)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def alone(engine, prompts) -> list[list[int]]:
    """Greedy tokens of each prompt run by itself: the reference for every batched mode."""
    return [token_ids(generate(engine, [p], GREEDY))[0] for p in prompts]


def small_engine(engine: Engine, **kwargs) -> Engine:
    """Another engine on the same weights (a new KV cache, other page size or context limit)."""
    return Engine(engine.model, tokenizer=engine.tokenizer, kv_cache_bytes=kwargs.pop("kv_cache_bytes", 16 << 20), **kwargs)


# --- batching invariance ----------------------------------------------------------------------

def test_batch_equals_alone(engine, prompts, alone):
    assert all(len(t) == NEW_TOKENS for t in alone)
    assert token_ids(generate(engine, prompts, GREEDY)) == alone


def test_chunked_prefill_equals_alone(engine, prompts, alone):
    assert token_ids(generate(engine, prompts, GREEDY, max_prefill_tokens=7)) == alone


def test_small_pages_equal_alone(engine, prompts, alone):
    tiny_pages = small_engine(engine, page_size=4)
    assert token_ids(generate(tiny_pages, prompts, GREEDY, max_prefill_tokens=7)) == alone


def test_mixed_prefill_chunk_and_decodes_in_one_step(engine, prompts, alone):
    """Raw ``step()``: a long prompt goes in 13-token chunks while two others decode beside it."""
    allocator = engine.new_page_allocator()
    a, c, b = prompts[1], prompts[2], prompts[5]  # 9, 17 and 60 tokens
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_sequence("a", a, params)
    engine.add_sequence("b", b, params)
    running, got = ["a", "b"], {"a": [], "b": [], "c": []}
    mixed_steps = 0
    try:
        for step in range(40):
            if step == 1:  # c arrives while a decodes and b is mid-prompt
                engine.add_sequence("c", c, params)
                running.append("c")
            if not running:
                break
            chunks, continued, decodes = [], False, 0
            for sid in running:
                computed = engine.num_tokens(sid) - engine.num_uncomputed(sid)
                n = min(13, engine.num_uncomputed(sid))
                table = allocator.append(sid, computed + n) if allocator.has(sid) else allocator.allocate(sid, computed + n)
                chunks.append(Chunk(sid, n, table))
                continued |= n > 1 and computed > 0  # a prompt chunk after an earlier one
                decodes += n == 1
            mixed_steps += continued and decodes > 0
            for out in engine.step(StepPlan(tuple(chunks))):
                got[out.seq_id].append(out.token_id)
                if out.finish_reason is not None:
                    running.remove(out.seq_id)
                    allocator.free(out.seq_id)
    finally:
        for sid in "abc":
            engine.remove_sequence(sid)
    assert mixed_steps >= 2
    assert allocator.num_used == 0
    assert got == {"a": alone[1][:12], "b": alone[5][:12], "c": alone[2][:12]}


def test_preempted_sequence_recomputes_and_continues(engine, prompts, alone):
    """reset_computed after losing the pages: the next chunk recomputes prompt + output so far, same tokens."""
    allocator = engine.new_page_allocator()
    prompt = prompts[2]
    engine.add_sequence("p", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    got = []
    try:
        while len(got) < 10:
            if len(got) == 5:  # preempt: the pages go back, the cache contents are lost
                allocator.free("p")
                engine.reset_computed("p")
                assert engine.num_uncomputed("p") == len(prompt) + 5
            n, total = engine.num_uncomputed("p"), engine.num_tokens("p")
            table = allocator.append("p", total) if allocator.has("p") else allocator.allocate("p", total)
            (out,) = engine.step(StepPlan((Chunk("p", n, table),)))
            got.append(out.token_id)
    finally:
        engine.remove_sequence("p")
    assert out.finish_reason == "length"
    assert got == alone[2][:10]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine, prompts, alone):
    solo = token_ids(generate(engine, [prompts[3]], SEEDED))[0]
    others = [SamplingParams(temperature=0, max_tokens=8), SEEDED, SamplingParams(temperature=1.0, seed=7, max_tokens=20)]
    batched = token_ids(generate(engine, prompts[2:5], others, max_prefill_tokens=11))
    assert batched[1] == solo
    assert len(solo) == 16 and solo != alone[3][:16]  # it did sample, not argmax
    other_seed = token_ids(generate(engine, [prompts[3]], SamplingParams(temperature=0.8, seed=4321, max_tokens=16)))[0]
    assert other_seed != solo


# --- dummy weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_tiny_dummy_families_generate(preset):
    prompt = [1, 17, 300, 42, 5, 99, 511]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs, logits = [], None
    for _ in range(2):
        e = Engine.load(f"dummy:{preset}", device="cpu", dtype=torch.float32, kv_cache_bytes=1 << 20, progress=False)
        assert e.config.arch == preset.removeprefix("tiny-")
        runs.append(token_ids(generate(e, [prompt, prompt[:3]], params)))
        logits = prefill_logits(e, [prompt])
    assert runs[0] == runs[1]
    assert [len(t) for t in runs[0]] == [8, 8]
    assert all(0 <= t < e.config.vocab_size for t in runs[0][0])
    assert logits.shape == (1, e.config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_dummy_smollm2_has_real_shapes_and_steps():
    e = Engine.load("dummy:smollm2-135m", device="cpu", dtype=torch.float32, kv_cache_bytes=8 << 20, progress=False)
    m, c = e.model, e.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert m.tok_embeddings.weight.shape == (49152, 576) and m.output is None  # tied embeddings
    assert len(m.layers) == 30
    assert m.layers[0].attention.wqkv.weight.shape == (576 + 2 * 192, 576)
    assert m.layers[0].feed_forward.w13.weight.shape == (2 * 1536, 576)
    e.add_sequence(0, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    outs = e.step(StepPlan((Chunk(0, 5, e.new_page_allocator().allocate(0, 5)),)))
    e.remove_sequence(0)
    assert len(outs) == 1 and 0 <= outs[0].token_id < 49152 and outs[0].finish_reason is None


# --- stop conditions --------------------------------------------------------------------------

def test_max_tokens_finishes_with_length(engine, golden):
    outs = generate(engine, [golden["cases"][0]["prompt_ids"]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]


def test_stop_token_finishes_with_stop(engine, golden):
    case = golden["cases"][0]  # greedy: 7042, 30, 198, 198, ...
    outs = generate(engine, [case["prompt_ids"]], SamplingParams(temperature=0, stop_token_ids=[198]))[0]
    assert [o.token_id for o in outs] == case["greedy_ids"][:3]
    assert [o.finish_reason for o in outs] == [None, None, "stop"]


def test_eos_stops_unless_ignored(engine, golden):
    case = golden["cases"][7]  # chat: greedy emits EOS (<|im_end|>, id 2) as its 8th token
    eos_at = case["greedy_ids"].index(2)
    assert 2 in engine.eos_token_ids and eos_at == 7
    stopped = generate(engine, [case["prompt_ids"]], SamplingParams(temperature=0, max_tokens=32))[0]
    assert [o.token_id for o in stopped] == case["greedy_ids"][: eos_at + 1]
    assert stopped[-1].finish_reason == "stop"
    ignored = generate(engine, [case["prompt_ids"]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert [o.token_id for o in ignored] == case["greedy_ids"][:10]
    assert ignored[eos_at].finish_reason is None and ignored[-1].finish_reason == "length"


def test_context_limit_finishes_with_length(engine, golden):
    case = golden["cases"][0]  # 5 prompt tokens
    short = small_engine(engine, max_model_len=12, kv_cache_bytes=4 << 20)
    outs = generate(short, [case["prompt_ids"]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert [o.token_id for o in outs] == case["greedy_ids"][:7]
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert len(generate(short, [list(range(11))], SamplingParams(temperature=0, max_tokens=5))[0]) == 1
    with pytest.raises(ValueError, match="context"):
        short.add_sequence("long", list(range(12)), SamplingParams())


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs(engine, golden):
    prompt = golden["cases"][1]["prompt_ids"]
    outs = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    for o in outs:
        assert len(o.top_logprobs) == 3
        values = [lp for _, lp in o.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert o.top_logprobs[0][0] == o.token_id and o.logprob == pytest.approx(values[0])
    # The first token's logprobs are log-softmax of the prefill logits.
    ref = torch.log_softmax(prefill_logits(engine, [prompt])[0].double(), -1)
    top = ref.topk(3)
    assert [t for t, _ in outs[0].top_logprobs] == top.indices.tolist()
    assert [lp for _, lp in outs[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    none = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))[0][0]
    zero = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0))[0][0]
    assert none.logprob is None and none.top_logprobs == ()
    assert zero.top_logprobs == () and zero.logprob == pytest.approx(outs[0].logprob)


# --- bad input --------------------------------------------------------------------------------

def assert_one_line_load_error(path, problem: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        Engine.load(str(path), device="cpu", progress=False)
    message = str(info.value)
    assert "\n" not in message and path.name in message and problem in message, message


def test_load_missing_file(tmp_path):
    assert_one_line_load_error(tmp_path / "nowhere.gguf", "no such file")


def test_load_corrupt_file(tmp_path):
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_one_line_load_error(noise, "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    assert_one_line_load_error(truncated, "corrupt")


def test_load_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_load_error(path, "unsupported architecture 'gpt2'")


def test_add_sequence_rejects_bad_prompts(engine):
    params = SamplingParams()
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_sequence("bad", [], params)
    for token in (engine.config.vocab_size, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_sequence("bad", [1, token], params)
    with pytest.raises(ValueError, match="context"):
        engine.add_sequence("bad", [1] * engine.max_model_len, params)
    engine.add_sequence("bad", [1, 2], params)  # none of the above registered it
    engine.remove_sequence("bad")


def test_plan_beyond_the_known_tokens_is_refused(engine):
    engine.add_sequence("over", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=2))
    try:
        table = engine.new_page_allocator().allocate("over", 16)
        with pytest.raises(ValueError, match="left"):
            engine.step(StepPlan((Chunk("over", 6, table),)))
        with pytest.raises(ValueError):
            engine.step(StepPlan((Chunk("over", 0, table),)))
        with pytest.raises(ValueError, match="block table"):
            engine.step(StepPlan((Chunk("over", 5, ()),)))
        assert engine.num_uncomputed("over") == 5  # a refused plan changes nothing
        (out,) = engine.step(StepPlan((Chunk("over", 5, table),)))
        with pytest.raises(ValueError, match="left"):
            engine.step(StepPlan((Chunk("over", 2, table),)))  # one token to decode, not two
    finally:
        engine.remove_sequence("over")


def test_a_cpu_engine_of_the_default_kv_size_keeps_few_cached_pages_written_and_a_sized_one_all():
    from spark.engine.engine import CPU_KV_WARM_TOKENS

    default = Engine.load("dummy:tiny-llama", device="cpu", dtype=torch.float32, progress=False)
    assert default.new_page_allocator().warm_pages == -(-CPU_KV_WARM_TOKENS // default.page_size)
    sized = Engine.load("dummy:tiny-llama", device="cpu", dtype=torch.float32, kv_cache_tokens=8192, progress=False)
    alloc = sized.new_page_allocator()
    assert alloc.warm_pages == alloc.num_total
