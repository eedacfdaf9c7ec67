"""What a caller can ask for, on the real engine: each sampling field, logprobs, structured output,
cached prompt tokens and the tokenizer RPCs, against vLLM's own offline `LLM.generate` with the same
parameters (the reference a user of vLLM would compare with).

The tiny random model's logits are nearly flat, so two engines can part ways at a near-tie without
either being wrong (vLLM is not bit-identical across batch shapes). Agreement is therefore checked
up to the first position where the reference's own two best tokens are within NEAR_TIE nats (its
processed log-probabilities: after penalties and biases, what the sampler chose from), and each
case must agree on at least MIN_AGREED tokens, so a case cannot pass by parting at once.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tokenline.client import Client
from tokenline.client.errors import InvalidRequest

pytestmark = pytest.mark.engine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
NEAR_TIE = 1e-3
MIN_AGREED = 8
# Same engine, same dtype, one sequence at a time: a float32 engine's logprobs agree to ~1e-5 nats;
# bf16 (another CPU's choice) rounds each to ~0.03. Beyond LOGPROB_TOLERANCE, a logprob is of
# another token or another context.
LOGPROB_TOLERANCE = {"float32": 1e-3}.get


def is_a_greedy_pick(p) -> bool:
    """A greedy token's logprobs as vLLM gives them: the token has the best logprob there is, and its rank counts
    every token whose logprob is at least its own. With bf16 logits two tokens can tie for the best: argmax takes one,
    the top list may put the other first, and the picked token's rank is then 2 (or more), not 1."""
    tied = [t for t in p.top if t.logprob >= p.token.logprob]
    return (p.token.logprob == p.top[0].logprob
            and (p.token.rank == len(tied) if len(tied) < len(p.top) else p.token.rank >= len(tied))
            and (p.token.token_id in {t.token_id for t in tied} or len(tied) == len(p.top)))


@pytest.fixture(scope="module")
def served(tiny_server):
    with Client(tiny_server.address) as client:
        model = client.list_models(timeout=30)[0]
        yield client, model


@pytest.fixture(scope="module")
def offline(served):
    """vLLM's offline engine on the same folder, dtype and block size as the server's worker."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM

    from tokenline.engine.models import resolve_model

    torch.cpu._init_amx()
    _, model = served
    llm = LLM(model=str(resolve_model("tiny")), enforce_eager=True, dtype=model.dtype, kv_cache_memory_bytes=64 << 20,
              block_size=128, max_model_len=2048, max_num_batched_tokens=2048, logprobs_mode="processed_logprobs", enable_prefix_caching=False)
    yield llm
    del llm


def reference(offline, **params):
    from vllm import SamplingParams

    params.setdefault("logprobs", 2)
    out = offline.generate({"prompt_token_ids": PROMPT}, SamplingParams(**params), use_tqdm=False)[0]
    return out.outputs[0]


def assert_agrees(ours: list[int], ref) -> int:
    """Tokens equal up to the first near-tie of the reference; returns how many were compared."""
    theirs = list(ref.token_ids)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            best = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)
            margin = best[0] - best[1] if len(best) > 1 else float("inf")
            assert margin < NEAR_TIE, f"token {i}: ours {a}, vLLM's {b}, its margin {margin:.4f} nats is no near-tie"
            assert i >= MIN_AGREED, f"parted at token {i}, before {MIN_AGREED} were compared"
            return i
    assert len(ours) == len(theirs), (ours, theirs)
    return len(ours)


SAMPLING_CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=0.7),
    "all three penalties": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    "logit_bias": dict(logit_bias={100: 30.0, 101: 29.5}),
    "min_p with temperature and seed": dict(min_p=0.002, temperature=0.9, seed=7),
    "top_k top_p seed": dict(top_k=40, top_p=0.9, temperature=1.0, seed=11),
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_a_sampling_field_chooses_the_tokens_vllm_offline_chooses(served, offline, case):
    client, _ = served
    params = SAMPLING_CASES[case]
    ours = client.complete(token_ids=PROMPT, max_tokens=40, ignore_eos=True, **({"temperature": 0} | params))
    ref = reference(offline, max_tokens=40, ignore_eos=True, **({"temperature": 0.0} | params))
    compared = assert_agrees(list(ours.token_ids), ref)
    print(f"{case}: {compared} of 40 tokens compared")


def test_penalties_change_the_output_so_the_comparison_above_means_something(served):
    client, _ = served
    plain = client.complete(token_ids=PROMPT, max_tokens=40, ignore_eos=True, temperature=0)
    penalised = client.complete(token_ids=PROMPT, max_tokens=40, ignore_eos=True, temperature=0, presence_penalty=1.5)
    assert len(set(plain.token_ids)) < 10  # the random model loops
    assert len(set(penalised.token_ids)) == 40  # a presence penalty far above the logits' spread: no repeat


def test_min_tokens_and_stop_token_ids_end_where_vllm_offline_ends(served, offline):
    client, model = served
    eos = model.eos_token_ids[0]
    # +100 on the end-of-sequence token: it is chosen as soon as min_tokens allows.
    ours = client.complete(token_ids=PROMPT, max_tokens=100, temperature=0, min_tokens=25, logit_bias={eos: 100})
    ref = reference(offline, max_tokens=100, temperature=0.0, min_tokens=25, logit_bias={eos: 100})
    assert list(ours.token_ids) == list(ref.token_ids)
    assert len(ours.token_ids) == 26 and ours.token_ids[-1] == eos and ours.finish_reason == "stop"

    stopper = client.complete(token_ids=PROMPT, max_tokens=100, temperature=0, stop_token_ids=[300], logit_bias={300: 50},
                              min_tokens=5)
    ref = reference(offline, max_tokens=100, temperature=0.0, stop_token_ids=[300], logit_bias={300: 50}, min_tokens=5)
    assert list(stopper.token_ids) == list(ref.token_ids) and stopper.token_ids[-1] == 300
    assert stopper.finish_reason == "stop"  # as for the end-of-sequence token (vLLM's "stop", stop_reason 300)


def test_a_stop_string_is_kept_in_the_text_when_asked(served):
    client, _ = served
    free = client.complete(token_ids=PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
    stop = free.text[10:13]
    assert stop.strip()
    cut = client.complete(token_ids=PROMPT, max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
    kept = client.complete(token_ids=PROMPT, max_tokens=40, temperature=0, ignore_eos=True, stop=stop,
                           include_stop_str_in_output=True)
    assert not cut.text.endswith(stop) and kept.text == cut.text + stop, (cut.text, kept.text, stop)
    assert kept.finish_reason == cut.finish_reason == "stop_string"


def test_logprobs_are_vllms_for_every_token_with_the_asked_alternatives(served, offline):
    client, model = served
    tolerance = LOGPROB_TOLERANCE(model.dtype, 0.05)
    streamed = list(client.generate(token_ids=PROMPT, max_tokens=24, ignore_eos=True, temperature=0, logprobs=3))
    tokens = [t for d in streamed for t in d.token_ids]
    positions = [p for d in streamed for p in d.logprobs]
    for d in streamed:
        assert len(d.logprobs) == len(d.token_ids)  # on every chunk, one per token
    assert [p.token.token_id for p in positions] == tokens
    from vllm import SamplingParams
    raw = offline.generate({"prompt_token_ids": PROMPT + tokens[:-1]},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    # The reference reads our tokens as a prompt: its logprob of each of them in its context.
    for i, p in enumerate(positions):
        ref = raw.prompt_logprobs[len(PROMPT) + i] if i < len(tokens) - 1 else None
        assert len(p.top) == 3 and [t.rank for t in p.top] == [1, 2, 3]
        assert p.top[0].logprob >= p.top[1].logprob >= p.top[2].logprob
        assert is_a_greedy_pick(p), p  # greedy: a best one
        if ref is not None:
            assert abs(ref[tokens[i]].logprob - p.token.logprob) <= tolerance, (i, ref[tokens[i]], p.token)
        assert p.top[1].text == client.detokenize([p.top[1].token_id], skip_special_tokens=True) or p.top[1].text == ""


def test_prompt_logprobs_come_once_on_the_first_chunk(served):
    client, _ = served
    streamed = list(client.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True, temperature=0, prompt_logprobs=2))
    with_prompt = [d for d in streamed if d.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    entries = with_prompt[0].prompt_logprobs
    assert [e.token.token_id for e in entries] == PROMPT[1:]
    assert all(len(e.top) == 2 and e.token.logprob <= 0 for e in entries)
    assert not any(d.logprobs for d in streamed)  # output logprobs were not asked for


def test_cached_prompt_tokens_count_the_prefix_cache_hits_of_a_repeated_prompt(served):
    client, _ = served
    prompt = [(7 * i) % 500 + 3 for i in range(300)]  # two full 128-token blocks and more
    first = client.complete(token_ids=prompt, max_tokens=4, ignore_eos=True, temperature=0)
    again = client.complete(token_ids=prompt, max_tokens=4, ignore_eos=True, temperature=0)
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == 256  # whole blocks only
    assert again.usage.prompt_tokens == 300


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


def valid_against_schema(text: str) -> bool:
    # strict=False: vLLM's JSON grammar lets a string hold raw control characters (the random model
    # writes some), which the JSON standard asks to be escaped; everything else is checked strictly.
    value = json.loads(text, strict=False)
    return (set(value) == {"name", "n", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["n"], int) and 0 <= value["n"] <= 999 and len(value["tags"]) <= 4
            and set(value["tags"]) <= {"x", "y", "z"})


def test_structured_output_follows_each_format(served):
    client, _ = served
    for seed in range(6):
        out = client.complete(token_ids=PROMPT[:-1] + [20 + seed], max_tokens=400, temperature=1.0, seed=seed, json_schema=SCHEMA)
        assert out.finish_reason == "stop", out
        assert valid_against_schema(out.text), out.text
    obj = client.complete(token_ids=PROMPT, max_tokens=400, temperature=1.0, seed=3, json_object=True)
    assert obj.finish_reason != "stop" or isinstance(json.loads(obj.text), dict)
    assert client.complete(token_ids=PROMPT, max_tokens=50, temperature=0, choice=["alpha", "beta"]).text in ("alpha", "beta")
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", client.complete(token_ids=PROMPT, max_tokens=50, temperature=0,
                                                                regex=r"[a-c]{3}-[0-9]{2}").text)
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    assert re.fullmatch(r"yes|no|maybe [0-9]", client.complete(token_ids=PROMPT, max_tokens=50, temperature=0, grammar=grammar).text)


def test_structured_output_gives_the_tokens_vllm_offline_gives(served, offline):
    from vllm.sampling_params import StructuredOutputsParams

    client, _ = served
    ours = client.complete(token_ids=PROMPT, max_tokens=300, temperature=1.0, seed=5, json_schema=SCHEMA)
    ref = reference(offline, max_tokens=300, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert_agrees(list(ours.token_ids), ref)


@pytest.mark.parametrize("fields, message", [
    (dict(json_schema='{"type": "objec"}'), "Unsupported type"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(regex="[a-"), "regex is not valid"),
    (dict(grammar="root ::= "), "not valid EBNF"),
    (dict(choice=[]), "choice needs 1 to"),
    (dict(logit_bias={100000: 1.0}), "outside the vocabulary"),
    (dict(logit_bias={5: 101.0}), "[-100, 100]"),
    (dict(stop_token_ids=[99999]), "outside the vocabulary"),
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens (10) must not be more"),
    (dict(logprobs=21), "logprobs must be in [0, 20]"),
])
def test_a_bad_field_is_refused_before_any_work_with_what_to_change(served, fields, message):
    client, _ = served
    with pytest.raises(InvalidRequest) as refused:
        client.complete(token_ids=PROMPT, **({"max_tokens": 8} | fields))
    assert message in refused.value.details
    assert ".cc:" not in refused.value.details  # the backend's source positions are not the caller's business


def test_without_max_tokens_a_request_may_use_the_rest_of_the_context(served):
    client, model = served
    assert model.default_max_tokens == min(4096, model.max_context - 1)
    out = client.complete(token_ids=PROMPT, temperature=0, ignore_eos=True, logit_bias={300: -100})
    assert len(out.token_ids) == model.max_context - len(PROMPT)
    assert out.finish_reason == "length"


def test_tokenize_gives_the_ids_a_generate_request_sends_and_detokenize_inverts_it(served):
    client, model = served
    text = "Tokens, counted before sending."
    ids = client.tokenize(text)
    out = client.complete(text, max_tokens=1)
    assert out.usage.prompt_tokens == len(ids)
    assert client.detokenize(ids) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat_ids = client.tokenize(messages=chat)
    assert client.complete(messages=chat, max_tokens=1).usage.prompt_tokens == len(chat_ids)
    assert "Be brief." in client.detokenize(chat_ids)
    assert model.vocab_size == 512 and model.eos_token_ids and model.has_chat_template
    assert "json_schema" in model.structured_output_formats
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        client.detokenize([model.vocab_size])


def test_the_cli_asks_for_a_format_and_logprobs(served, tmp_path):
    import subprocess
    import sys

    client, _ = served
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    done = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "generate", "--target", client.target,
                           "--raw", "--json", "--json-schema", str(schema), "--logprobs", "2", "--temperature", "1",
                           "--seed", "2", "--max-tokens", "400", "fill in"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert valid_against_schema(result["text"]) and result["finish_reason"] == "stop"
    assert [p["token"]["token_id"] for p in result["logprobs"]] == result["token_ids"]
    bad = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "generate", "--target", client.target,
                          "--raw", "--regex", "[a-", "hi"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "regex is not valid" in bad.stderr


def test_n_samples_are_vllms_n_samples_each_streamed_under_its_index(served, offline):
    from vllm import SamplingParams

    client, _ = served
    prompt = [(11 * i) % 500 + 3 for i in range(140)]  # more than one 128-token block: samples share it
    deltas = list(client.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, temperature=1.0, seed=21, n=3,
                                  logprobs=0))
    by_sample = {i: [d for d in deltas if d.sample_index == i] for i in range(3)}
    assert {d.sample_index for d in deltas} == {0, 1, 2}
    for i, own in by_sample.items():
        index = 0
        for d in own:
            assert d.index == index and len(d.logprobs) == len(d.token_ids)
            index += len(d.token_ids)
        assert index == 12 and own[-1].finish_reason == "length"  # each sample ends with its own last chunk
        assert sum(1 for d in own if d.finish_reason) == 1
    ours = [[t for d in by_sample[i] for t in d.token_ids] for i in range(3)]
    ref = offline.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=21, n=3, logprobs=1),
                           use_tqdm=False)[0]
    refs = sorted(ref.outputs, key=lambda o: o.index)
    assert len({tuple(s) for s in ours}) == 3  # three samples, not one thrice
    for mine, theirs in zip(ours, refs):
        assert_agrees(mine, theirs)
    whole = client.complete(token_ids=prompt, max_tokens=12, ignore_eos=True, temperature=1.0, seed=21, n=3)
    assert [list(s.token_ids) for s in whole.samples] == ours  # same seeds, same samples
    assert whole.usage.completion_tokens == 36 and list(whole.token_ids) == ours[0]
    # Their prompt was computed once: the later samples found its whole block in the prefix cache.
    assert sum(s.usage.cached_prompt_tokens for s in whole.samples) >= 2 * 128


def test_cancelling_an_n_request_stops_every_sample(served):
    client, _ = served
    stream = client.generate(token_ids=PROMPT, max_tokens=1800, ignore_eos=True, n=3, temperature=1.0,
                             request_id="three-at-once")
    first = next(iter(stream))
    assert client.cancel("three-at-once") is True
    rest = list(stream)
    finals = [d for d in [first, *rest] if d.finish_reason]
    assert sorted(d.sample_index for d in finals) == [0, 1, 2]
    assert all(d.finish_reason == "cancelled" for d in finals)
    assert sum(len(d.token_ids) for d in [first, *rest]) < 3 * 1800


@pytest.mark.parametrize("fields, message", [
    (dict(n=17, temperature=1.0), "n must be in [1, 16]"),
    (dict(n=2, idempotency_key="k", temperature=1.0), "idempotency key"),
    (dict(n=2, temperature=0), "need sampling (temperature > 0)"),
])
def test_n_beyond_what_is_served_is_refused(served, fields, message):
    client, _ = served
    with pytest.raises(InvalidRequest) as refused:
        client.complete(token_ids=PROMPT, max_tokens=4, **fields)
    assert message in refused.value.details


def test_a_seeded_request_whose_prompt_takes_several_steps_samples_as_if_it_took_one(served, offline):
    """vLLM 0.32 on a CPU crashed the worker here (it rewinds a generator by an offset CPU generators lack);
    the rewind is done from the generator's saved state, so the chunking of the prompt changes nothing."""
    from vllm import SamplingParams

    client, _ = served
    prompt = [(13 * i) % 500 + 3 for i in range(1300)]  # over the worker's 512-token step budget: 3 steps
    first = client.complete(token_ids=prompt, max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
    again = client.complete(token_ids=prompt, max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)  # cached prefix
    assert first.timeline.attempts == 1 and list(first.token_ids) == list(again.token_ids)
    assert again.usage.cached_prompt_tokens >= 1024  # the second ran its prompt in fewer steps
    ref = offline.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=1.0, seed=9,
                                                                        ignore_eos=True, logprobs=2), use_tqdm=False)[0]
    assert_agrees(list(first.token_ids), ref.outputs[0])  # the offline engine computes the prompt in one step
