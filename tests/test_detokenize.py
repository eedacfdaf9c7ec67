"""A stream's text does not depend on where attempts split it (engine/detokenize.py).

A continuation primes its decode stream with the prompt plus the tokens already delivered; the
caller must see exactly the text one uninterrupted stream would have shown, whatever bytes the
split falls between. Checked on the tiny model's byte-level tokenizer, whose random tokens are
full of unfinished and invalid UTF-8 (the hard case), and on a character split by hand.
"""

import random

import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenline.engine.detokenize import DecodeStreamPrimedAtACharacter
from tokenline.engine.models import resolve_model


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(resolve_model("tiny") / "tokenizer.json"))


@pytest.fixture(autouse=True)
def native_stream(monkeypatch):
    monkeypatch.setattr(DecodeStreamPrimedAtACharacter, "_native", DecodeStream)


def stream_text(tokenizer, prompt, tokens):
    stream = DecodeStreamPrimedAtACharacter(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(tokenizer, t) or "" for t in tokens)


def test_a_stream_split_anywhere_shows_the_same_text_as_one_stream(tokenizer):
    rng = random.Random(7)
    prompt = tokenizer.encode("stream number 8 tells a story", add_special_tokens=False).ids
    for _ in range(300):
        tokens = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(2, 40))]
        split = rng.randrange(1, len(tokens))

        whole = stream_text(tokenizer, prompt, tokens)
        first = stream_text(tokenizer, prompt, tokens[:split])
        rest = stream_text(tokenizer, prompt + tokens[:split], tokens[split:])  # the continuation

        assert first + rest == whole
        assert "stream number" not in rest


def test_a_split_inside_a_long_run_of_bytes_that_make_no_character_shows_no_prompt_text(tokenizer):
    # What a small random model emits: runs of one token, many of them stray UTF-8 bytes. A split
    # inside a run of more than 32 such tokens leaked the whole prompt into the continuation's text.
    rng = random.Random(3)
    prompt = tokenizer.encode("stream 5 about river", add_special_tokens=False).ids
    vocab = tokenizer.get_vocab()
    pool = [vocab[c] for c in _byte_level(bytes([0x80, 0xBF, 0xC3, 0xE6, 0xF0, 0x41, 0x20, 0x62]))]
    pool += [rng.randrange(tokenizer.get_vocab_size()) for _ in range(4)]
    for _ in range(600):
        tokens = [t for t in (rng.choice(pool) for _ in range(rng.randrange(2, 40))) for _ in range(rng.randrange(1, 12))]
        split = rng.randrange(1, len(tokens))

        whole = stream_text(tokenizer, prompt, tokens)
        rest = stream_text(tokenizer, prompt + tokens[:split], tokens[split:])

        assert stream_text(tokenizer, prompt, tokens[:split]) + rest == whole
        assert "about river" not in rest


def test_a_character_split_between_attempts_arrives_whole_with_the_continuation(tokenizer):
    prompt = tokenizer.encode("The story begins", add_special_tokens=False).ids
    vocab = tokenizer.get_vocab()
    encoded = "沨".encode()
    byte_tokens = [vocab[c] for c in _byte_level(encoded)]  # three one-byte tokens

    assert stream_text(tokenizer, prompt, byte_tokens[:2]) == ""  # nothing shown for half a character
    assert stream_text(tokenizer, prompt + byte_tokens[:2], byte_tokens[2:]) == "沨"


def _byte_level(data: bytes) -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b], extra = chr(256 + extra), extra + 1
    return [spelled[b] for b in data]


def test_a_continuation_shows_the_held_text_and_stops_where_one_uninterrupted_stream_would():
    """Whatever the split: held text + new text in any chunks give the text cut before the first stop string."""
    from tokenline.engine.detokenize import StopAcrossAttempts

    rng = random.Random(11)
    for _ in range(2000):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(1, 30)))
        stops = tuple({"".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))})
        expected = _cut_at_first_stop(text, stops)
        split = rng.randrange(0, len(text) + 1)
        if _cut_at_first_stop(text[:split], stops) != text[:split]:
            continue  # the first attempt would have stopped: no continuation
        shown = max(split - (max(map(len, stops)) - 1), 0)  # vLLM holds back what could begin a stop string
        checker = StopAcrossAttempts(text[shown:split], stops)
        out, rest, stopped = text[:shown], text[split:], False
        while not stopped:
            n = rng.randrange(0, 4)
            piece, rest = rest[:n], rest[n:]
            new, stopped = checker.feed(piece, finished=not rest)
            out += new
            if not rest:
                break
        assert out == expected, (text, stops, split, shown)
        assert stopped == (expected != text)


def _cut_at_first_stop(text: str, stops: tuple[str, ...]) -> str:
    hits = [(i + len(s), n, i) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    return text[: min(hits)[2]] if hits else text
