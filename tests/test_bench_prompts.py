"""Prompt files: plain prompts, chat messages and ShareGPT conversations become token ids."""

from __future__ import annotations

import json
import random

import pytest
from tokenline.bench.prompts import FilePrompts, PromptError, SyntheticPrompts


class WordTokenizer:
    """One token per word; a chat template that wraps each message in markers."""

    all_special_ids = [0]
    chat_template = "fake"

    def __len__(self):
        return 1000

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [900, *self.encode(m["content"]), 901]
        return ids + ([902] if add_generation_prompt else [])


def write_lines(path, entries):
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return path


def test_plain_prompts_and_chat_messages_are_tokenized(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "a bb ccc"},
                                              {"messages": [{"role": "user", "content": "dd e"}], "max_tokens": 7}])
    prompts = FilePrompts(path, WordTokenizer()).prompts
    assert prompts[0].token_ids == (1, 2, 3) and prompts[0].output_len_hint is None
    assert prompts[1].token_ids == (900, 2, 1, 901, 902) and prompts[1].output_len_hint == 7


def test_a_sharegpt_conversation_gives_its_first_human_turn_and_the_replys_length(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "x", "conversations": [
        {"from": "human", "value": "hello there"}, {"from": "gpt", "value": "one two three four"},
        {"from": "human", "value": "later turns are ignored"}]}]))
    (prompt,) = FilePrompts(path, WordTokenizer()).prompts
    assert prompt.token_ids == (900, 5, 5, 901, 902)
    assert prompt.output_len_hint == 4 and prompt.text == "hello there"


def test_prompts_longer_than_the_limit_are_skipped_and_an_empty_result_is_an_error(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "a " * 50}, {"prompt": "b b"}])
    assert [len(p.token_ids) for p in FilePrompts(path, WordTokenizer(), max_input_tokens=10).prompts] == [2]
    with pytest.raises(PromptError, match="no usable prompts"):
        FilePrompts(path, WordTokenizer(), max_input_tokens=1)


def test_a_malformed_prompt_file_is_refused_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(PromptError, match="line 2"):
        FilePrompts(path, WordTokenizer())


def test_synthetic_prompts_have_the_asked_length_and_no_special_tokens():
    prompt = SyntheticPrompts(WordTokenizer()).prompt(random.Random(1), 300)
    assert len(prompt.token_ids) == 300 and 0 not in prompt.token_ids
