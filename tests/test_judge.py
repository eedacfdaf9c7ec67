"""The greedy judge can tell (issue 36): on the trained tiny model it accepts true greedy streams and rejects
every stream that a retry continued from a context other than the one the caller received.

tests/greedy.py's judge backs each "continues from exactly the delivered tokens" claim (worker crashes, a
hung worker, a compiled engine, a Ray actor): it reads prompt + stream through the float32 model and
flags a token that is not within 0.1 nat of the best. On the random tiny model the two best tokens are
within 0.1 nat at most positions, so it could pass a wrong continuation; those tests serve the tiny model
trained on its corpus (engine/models.py, "tiny-trained"), whose margins this test prints and bounds.

A wrong context is what a broken retry would continue from: the last delivered token lost, repeated, or
replaced. The continuation is the model's own greedy output from that context (the most plausible wrong
stream there is), spliced after the tokens the caller did receive.
"""

from __future__ import annotations

import statistics

import pytest

from tests.greedy import TOLERANCE_NATS, Float32Judge
from tokenline.engine.models import TINY_MODEL, TINY_TRAINED_MODEL, resolve_model

PROMPTS = [f"stream number {i} tells a story" for i in range(16)]  # as tests/test_failures.py streams them
TOKENS = 96
CUT = 20  # tokens delivered before the (broken) retry


def greedy(judge: Float32Judge, ids: list[int], n: int) -> list[int]:
    torch = judge.torch
    with torch.inference_mode():
        out = judge.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                   pad_token_id=judge.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def margins(judge: Float32Judge, prompt: list[int], generated: list[int]) -> list[float]:
    torch = judge.torch
    with torch.inference_mode():
        logprobs = torch.log_softmax(judge.model(input_ids=torch.tensor([prompt + generated])).logits[0].float(), -1)
    top = logprobs[len(prompt) - 1:len(prompt) + len(generated) - 1].topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def wrong_contexts(delivered: list[int], vocab: int) -> dict[str, list[int]]:
    last = delivered[-1]
    return {"lost": delivered[:-1], "repeated": delivered + [last], "replaced": delivered[:-1] + [(last + 7) % vocab]}


def judge_on(model: str) -> tuple[Float32Judge, list[float], int, int]:
    """(judge, margins of its greedy streams, wrong continuations it accepted, wrong continuations tried)."""
    judge = Float32Judge(resolve_model(model))
    vocab = judge.model.config.vocab_size
    all_margins, accepted, tried = [], 0, 0
    for text in PROMPTS:
        prompt = judge.encode(text)
        stream = greedy(judge, prompt, TOKENS)
        assert judge.violations(prompt, stream) == [], f"{model}: its own greedy stream was rejected ({text!r})"
        all_margins += margins(judge, prompt, stream)
        delivered = stream[:CUT]
        for context in wrong_contexts(delivered, vocab).values():
            continuation = greedy(judge, prompt + context, TOKENS - CUT)
            tried += 1
            accepted += judge.violations(prompt, delivered + continuation) == []
    return judge, all_margins, accepted, tried


def describe(model: str, all_margins: list[float], accepted: int, tried: int) -> str:
    deciles = statistics.quantiles(all_margins, n=10)
    close = sum(m < TOLERANCE_NATS for m in all_margins) / len(all_margins)
    return (f"{model}: greedy margin (best - runner-up, nats) deciles 10%..90% "
            f"{' '.join(f'{d:.3f}' for d in deciles)}; within {TOLERANCE_NATS} nat at {close:.1%} of "
            f"{len(all_margins)} positions; wrong-context continuations accepted {accepted}/{tried}")


@pytest.fixture(scope="module")
def trained():
    return judge_on(TINY_TRAINED_MODEL)


def test_the_trained_tiny_models_greedy_choice_has_a_real_margin_almost_everywhere(trained):
    _, all_margins, accepted, tried = trained
    print("\n" + describe(TINY_TRAINED_MODEL, all_margins, accepted, tried))
    close = sum(m < TOLERANCE_NATS for m in all_margins) / len(all_margins)
    assert close <= 0.05, f"{close:.1%} of positions are near-ties: the judge could not tell there"
    assert statistics.median(all_margins) > 10 * TOLERANCE_NATS


def test_the_judge_rejects_every_stream_continued_from_a_lost_repeated_or_replaced_token(trained):
    _, _, accepted, tried = trained
    assert tried == 3 * len(PROMPTS)
    assert accepted == 0, f"the judge passed {accepted} of {tried} streams continued from a wrong context"


def test_on_the_random_tiny_model_the_judge_is_weaker_which_is_why_the_claims_use_the_trained_one(trained):
    # Printed for the record, asserted only as far as it is why: the random model's margins are near ties.
    _, all_margins, accepted, tried = judge_on(TINY_MODEL)
    print("\n" + describe(TINY_MODEL, all_margins, accepted, tried))
    assert statistics.median(all_margins) < statistics.median(trained[1])
