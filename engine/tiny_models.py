"""The tiny test models: "tiny", a ~1M-parameter Llama with random weights and a tokenizer trained here on a
fixed corpus, and "tiny-trained", the same trained on that corpus so its greedy choices have real margins.

torch, transformers and tokenizers are imported inside the functions that need them; never vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenline.engine.model_folders import (BUILD_FORMAT, ModelPrepError, build_once, llama_config, llama_weight_shapes,
                                            save_tokenizer_and_config, save_weights, set_byte_level_pipeline)


_TINY_VOCAB_SIZE = 512


_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Fixed training text for the tiny tokenizer; changing it changes every tiny model's version.
_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.
A server answers requests from many clients at once, and each client waits for its own reply.
When the queue is long, the scheduler decides which request runs next and which one must wait.
Tokens stream back one at a time, so the first words arrive long before the answer is complete.
She opened the window, looked at the river, and counted the boats that passed under the bridge.
In the morning the market was full of people buying bread, apples, cheese, fish and flowers.
Good software is simple to read, easy to test, and honest about the errors it cannot handle.
The capital of France is Paris; the capital of Italy is Rome; the capital of Spain is Madrid.
Numbers such as 1, 2, 3, 10, 42, 100, 2024 and 3.14159 appear in tables, prices and dates.
He said: "Please bring the red book, the blue pen, and the small green box to the library."
Every evening they walked along the beach, talking about music, travel, science and history.
Memory is limited, so a careful program frees what it no longer needs and reuses what it can.
Children played football in the park until the rain started and everyone ran back home.
The teacher explained how plants turn light, water and air into sugar and fresh oxygen.
Questions are welcome: what time is it, where are we going, and why is the sky blue today?
A long journey begins with a single step, and a large system begins with a small program.
"""


def build_tiny_model(dest: Path, *, seed: int = 0) -> Path:
    """Build a ~1M-parameter random Llama with a locally trained tokenizer at `dest`, once."""
    stamp = {"kind": "tiny-llama", "format": BUILD_FORMAT, "seed": seed}
    return build_once(Path(dest), stamp, lambda out: _build_tiny(out, seed), lambda _msg: None)


def build_tiny_trained_model(dest: Path, *, steps: int = 100) -> Path:
    """The tiny model trained `steps` Adam steps on its tokenizer's corpus, once (~15 s on one core).

    The random tiny model's logits are nearly flat: at 9 positions in 10 its two best tokens are within
    0.1 nat, so a greedy judge (tests/greedy.py) could not tell a stream continued from a wrong context.
    Trained, its greedy choice leads the runner-up by several nats almost everywhere (median ~6 nats)."""
    stamp = {"kind": "tiny-llama-trained", "format": BUILD_FORMAT, "steps": steps}
    return build_once(Path(dest), stamp, lambda out: _build_tiny_trained(out, steps), lambda _msg: None)


def _build_tiny_trained(out: Path, steps: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _build_tiny(out, seed=0)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(_TINY_CORPUS, add_special_tokens=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    length, batch = 64, 16
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
        x = torch.stack([ids[i:i + length] for i in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = {name for name, _ in llama_weight_shapes(json.loads((out / "config.json").read_text()))}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k in names}
    missing = names - set(tensors)
    if missing:
        raise ModelPrepError(f"training the tiny model lost weights {sorted(missing)}")
    return {"weights_sha256": save_weights(tensors, out), "final_loss": round(loss.item(), 4)}


def _build_tiny(out: Path, seed: int) -> dict[str, Any]:
    import torch

    tokenizer = _train_tiny_tokenizer()
    special_ids = {t: tokenizer.token_to_id(t) for t in _TINY_SPECIAL_TOKENS}
    config = llama_config(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention accepts
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=tokenizer.get_vocab_size(),
        tie_word_embeddings=False,
        bos_token_id=special_ids["<|im_start|>"],
        eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|im_end|>"],
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in llama_weight_shapes(config):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    weights_sha256 = save_weights(tensors, out)
    save_tokenizer_and_config(
        out,
        config=config,
        tokenizer=tokenizer,
        chat_template=_CHATML_TEMPLATE,
        special_tokens={
            "bos": "<|im_start|>",
            "eos": "<|im_end|>",
            "pad": "<|im_end|>",
            "unk": "<|endoftext|>",
        },
    )
    return {"weights_sha256": weights_sha256}


def _train_tiny_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    set_byte_level_pipeline(tokenizer, split_digits=True)
    trainer = BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        special_tokens=[
            AddedToken(t, special=True, normalized=False) for t in _TINY_SPECIAL_TOKENS
        ],
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TINY_CORPUS.splitlines(), trainer=trainer)
    return tokenizer
