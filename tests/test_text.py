"""Streamed text is the text of the streamed tokens, even when a prompt ends inside a character.

A continuation after a crash or a preemption sends the delivered tokens back as part of the prompt;
they may stop between the bytes of a multi-byte character. Native priming of tokenizers'
DecodeStream then emits the whole prompt's text with the next token.
"""

import pytest
from tokenizers import Tokenizer

from tokenline.client import Client
from tokenline.engine.models import resolve_model

pytestmark = pytest.mark.engine


def byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """The tokens of single bytes (byte-level BPE spells byte b as one printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b], extra = chr(256 + extra), extra + 1
    vocab = tokenizer.get_vocab()
    return [vocab[spelled[b]] for b in data]


def test_a_prompt_ending_inside_a_character_streams_only_new_text(tiny_server):
    tokenizer = Tokenizer.from_file(str(resolve_model("tiny") / "tokenizer.json"))
    whole = tokenizer.encode("The story begins", add_special_tokens=False).ids
    prompt = whole + byte_token_ids(tokenizer, "沨".encode()[:2])  # stops after 2 of the 3 bytes

    with Client(tiny_server.address) as client:
        deltas = list(client.generate(token_ids=prompt, max_tokens=8, temperature=0, ignore_eos=True))

    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert "The story begins" not in text
    # What the caller sees is what the new tokens add to the prompt's complete characters.
    before = tokenizer.decode(whole, skip_special_tokens=True)
    # (An unfinished character at the very end is not sent.)
    assert text == tokenizer.decode(prompt + tokens, skip_special_tokens=True)[len(before):].rstrip("\ufffd")
