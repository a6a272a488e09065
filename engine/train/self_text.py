"""Phase 1's default text for a model other than the demo: text the model writes itself.

Each built-in prompt (`self_prompts.py`) goes through the model's chat template as a user turn and
the engine samples the model's reply (on-demand: the routed experts stream through the bounded
expert cache, so any model that runs can write); the prompt's tokens and the reply's, its
end-of-turn token included, are one sample of the text. A model without a chat template continues
each prompt as plain text instead.

Why: heads learn the routing of the text they are trained on. The routing that matters is the
model's own in a chat (its template's role tokens, what it writes); text from elsewhere gave recall
figures that did not hold where the model is used (issue 35: heads trained on Python's
documentation for a model that knows Shakespeare). It needs no download and suits every model.

Split by prompt: one prompt of each kind is held out, and only the replies to those prompts are
held-out text, so the recall figures are on text from prompts never trained on. Each stream
(held out, train) goes round its prompts, one reply each a round, until it has its tokens.

The written text is kept in WORK/self-text-KEY/: `samples.jsonl`, one reply a line (with the most
tokens it was allowed), appended and flushed as each reply is written, and `settings.json` for
people. KEY hashes the base, the prompt set's version, the prompts as rendered (template and
tokenizer), the seed, the sampling and a reply's longest: not how much text is asked for. A
stopped run keeps every reply it finished; a rerun reads them and goes on with the next, and a
run asking for more or less text (`--self-text-tokens`) takes the replies it can from those kept
(`reusable`): only how far the text goes changes.
Each reply samples with a seed of its own (the seed, its round and its prompt), so a resumed text
is token for token the text of one uninterrupted run, and replies written together in a batch
(the writing engine's `max_batch`: one read of an expert serves every reply routed to it) are
the replies written one at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.outputs import check_output_folder
from ..config import MAX_SEED, GenerationConfig
from ..errors import Edge0Error
from ..runtime.generation import Engine
from .run import Log, ProgressLines, training_progress
from .self_prompts import PROMPT_SET_VERSION, PROMPTS, Prompt, held_out_prompts

# 2: a seeded reply draws from its own random key (runtime/sampling.py), not the global generator:
# text written before is another text.
FORMAT_VERSION = 2
SAMPLES = "samples.jsonl"
SETTINGS = "settings.json"
# The shortest reply cap a small budget gives (`_stream`).
MIN_REPLY_TOKENS = 16


@dataclass(frozen=True)
class SelfTextConfig:
    """How much text the model writes for itself, and how it samples."""

    tokens: int = 60_000  # held out and train together (phase 1's default --max-tokens)
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 0.95
    reply_tokens: int = 512  # a reply's most tokens; a stream needing more goes round again


@dataclass
class SelfText:
    """The text a model wrote: token streams split by prompt, and what it is."""

    train: np.ndarray  # int64, the replies to the train prompts (with the prompts)
    held_out: np.ndarray  # int64, the replies to the held-out prompts, never trained on
    train_prompts: int
    held_out_prompts: int
    templated: bool  # through the chat template; False: the prompts continued as plain text
    config: SelfTextConfig
    folder: Path

    def describe(self, train_tokens: int, held_out_tokens: int) -> str:
        """What the text is, with the tokens of each part that are used."""
        how = "through its chat template" if self.templated else "as plain-text continuations"
        return (
            f"{train_tokens:,} tokens the model wrote from {self.train_prompts} built-in "
            f"prompts {how} (T={self.config.temperature:g}, seed {self.config.seed}); held out: "
            f"its replies to {self.held_out_prompts} other prompts ({held_out_tokens:,} tokens)"
        )


# -- the prompts as the model reads them ----------------------------------------------------------------


def render_prompt(engine: Engine, prompt: Prompt) -> list[int]:
    """A prompt's tokens: a user turn in the chat template, ready for the assistant's reply; without
    a template, the prompt as plain text (the tokenizer's own special tokens, as for any text)
    followed by a blank line for the model to continue after."""
    if engine.tokenizer.has_chat_template:
        return engine.encode_chat([{"role": "user", "content": prompt.text}])
    return list(engine.tokenizer.encode(prompt.text + "\n\n"))


def reply_seed(seed: int, round_: int, prompt: int) -> int:
    """The seed of the reply to `prompt` in round `round_`: independent of what was written before,
    so a resumed text is the uninterrupted one."""
    digest = hashlib.sha256(f"{seed}|{round_}|{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (MAX_SEED + 1)


def text_key(fingerprint: str, rendered: list[list[int]], config: SelfTextConfig) -> str:
    """A short hash naming a written text: the base, the prompt set, the prompts as rendered and
    the settings (a changed template or tokenizer renders other tokens: another text), not the
    text's length nor its held-out share (the same replies serve any)."""
    kept = {k: v for k, v in dataclasses.asdict(config).items() if k != "tokens"}
    settings = json.dumps(kept, sort_keys=True)
    digest = hashlib.sha256(
        f"v{FORMAT_VERSION}|{fingerprint}|{PROMPT_SET_VERSION}|{settings}|".encode()
    )
    for tokens in rendered:
        digest.update(np.asarray(tokens, dtype=np.int64).tobytes() + b"|")
    return digest.hexdigest()[:16]


# -- the cache ------------------------------------------------------------------------------------------


class WrittenSamples:
    """`samples.jsonl`: {"round", "prompt", "tokens", "text"} a line, appended as replies are
    written. A line that is not a whole sample (a write cut short) and every line after it are
    dropped when the file is opened."""

    def __init__(self, folder: Path, vocab_size: int) -> None:
        self.path = folder / SAMPLES
        self.samples: dict[tuple[int, int], list[int]] = {}
        self.caps: dict[tuple[int, int], int] = {}  # the most tokens each reply was allowed
        if not self.path.exists():
            return
        good = 0
        with open(self.path, "rb") as f:
            for line in f:
                sample = _parse(line, vocab_size)
                if sample is None:
                    break
                self.samples[sample[0]], self.caps[sample[0]] = sample[1], sample[2]
                good += len(line)
        if good < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, round_: int, prompt: int, tokens: list[int], text: str, cap: int) -> None:
        line = json.dumps(
            {"round": round_, "prompt": prompt, "tokens": tokens, "text": text, "cap": cap}
        )
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise Edge0Error(f"{self.path}: cannot write the text ({e.strerror or e})") from None
        self.samples[(round_, prompt)] = tokens
        self.caps[(round_, prompt)] = cap

    def reusable(self, slot: tuple[int, int], prompt_tokens: int, cap: int) -> list[int] | None:
        """The kept sample of `slot` as a reply allowed `cap` tokens would be, None where it
        cannot be (not kept, or cut at a smaller cap than `cap`). A reply's tokens do not depend
        on its cap (its own seed and key), so a longer kept reply cut to `cap` is the one this
        run would write, and so is one that ended before its cap and before `cap`."""
        tokens = self.samples.get(slot)
        if tokens is None:
            return None
        reply = len(tokens) - prompt_tokens
        ended_early = reply < self.caps[slot]
        if cap <= reply:
            return tokens[: prompt_tokens + cap]
        return tokens if ended_early else None


def _parse(line: bytes, vocab_size: int) -> tuple[tuple[int, int], list[int], int] | None:
    if not line.endswith(b"\n"):
        return None
    try:
        sample = json.loads(line)
        slot = (sample["round"], sample["prompt"])
        tokens, cap = sample["tokens"], sample["cap"]
    except (ValueError, TypeError, KeyError):
        return None
    ints = all(type(v) is int for v in (*slot, cap, *tokens))
    if not ints or not tokens or cap < 1 or not all(0 <= t < vocab_size for t in tokens):
        return None
    return slot, tokens, cap


# -- writing --------------------------------------------------------------------------------------------


def write_self_text(
    engine: Engine,
    work: Path,
    config: SelfTextConfig,
    held_out_tokens: int,
    log: Log = print,
    bar: bool = False,
) -> SelfText:
    """The text `engine`'s model writes from the built-in prompts, `config.tokens` in all and
    `held_out_tokens` of those from the held-out prompts: what `work/self-text-KEY/` holds of it,
    and the rest written now (kept there reply by reply). `engine` should run an exact mode at the
    model's native K, without adapters: the model's own text."""
    if not 0 < held_out_tokens < config.tokens:
        raise Edge0Error(
            f"the written text's held-out part ({held_out_tokens} tokens) must be above 0 and "
            f"below its {config.tokens} tokens"
        )
    rendered = [render_prompt(engine, prompt) for prompt in PROMPTS]
    templated = bool(engine.tokenizer.has_chat_template)
    key = text_key(engine.fingerprint, rendered, config)
    folder = work / f"self-text-{key}"
    check_output_folder(folder, "the written text")
    settings = {
        "format": FORMAT_VERSION,
        "fingerprint": engine.fingerprint,
        "prompt_set_version": PROMPT_SET_VERSION,
        "prompts": len(PROMPTS),
        "chat_template": templated,
        **dataclasses.asdict(config),
        "held_out_tokens": held_out_tokens,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
        written = WrittenSamples(folder, engine.vocab_size)
    except OSError as e:
        raise Edge0Error(f"{folder}: cannot keep the written text ({e.strerror or e})") from None

    held = held_out_prompts()
    train_prompts = [i for i in range(len(PROMPTS)) if i not in held]
    context = engine.context_limit
    # Each stream's prompts and tokens, with what was written of it before and which reply is next.
    streams = {
        "held_out": _stream(sorted(held), held_out_tokens, config, written, rendered, context),
        "train": _stream(
            train_prompts, config.tokens - held_out_tokens, config, written, rendered, context
        ),
    }
    had = sum(min(len(s.tokens), s.budget) for s in streams.values())
    how = "through its chat template" if templated else "as plain text (it has no chat template)"
    if had >= config.tokens:
        log(f"the model's own text: {config.tokens:,} tokens, written before ({folder})")
    else:
        log(
            f"the model writes its training text: {config.tokens:,} tokens from {len(PROMPTS)} "
            f"built-in prompts {how} (T={config.temperature:g}, top-p {config.top_p:g}, seed "
            f"{config.seed}, at most {config.reply_tokens} tokens a reply), kept in {folder}"
            + (f"; {had:,} tokens written before, resuming" if had else "")
        )
        _write(engine, rendered, streams, written, config, had, log, bar)
    train, held_out = streams["train"], streams["held_out"]
    return SelfText(
        train=np.array(train.tokens[: train.budget], dtype=np.int64),
        held_out=np.array(held_out.tokens[: held_out.budget], dtype=np.int64),
        train_prompts=train.prompts_used,
        held_out_prompts=held_out.prompts_used,
        templated=templated,
        config=config,
        folder=folder,
    )


@dataclass
class _Stream:
    """One stream's replies so far (those already written, in order) and the next reply's slot."""

    prompts: list[int]
    budget: int
    reply_tokens: int  # a reply's most tokens (its prompt's with it: `reply_cap`)
    tokens: list[int]
    next: int  # the n-th reply of the stream: round n // len(prompts), prompt n % len(prompts)

    @property
    def prompts_used(self) -> int:
        return min(self.next, len(self.prompts))

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.budget

    def reply_cap(self, prompt_tokens: int) -> int:
        """A reply's most tokens: `reply_tokens`, less where the stream's budget is small, so
        that every prompt has its reply (48 prompts in 2,700 tokens: 56 each, prompt included)."""
        share = -(-self.budget // len(self.prompts)) - prompt_tokens
        return min(self.reply_tokens, max(MIN_REPLY_TOKENS, share))

    def cap(self, prompt_tokens: int, context: int) -> int:
        """The most tokens a reply to a prompt of `prompt_tokens` may have here, within the
        writing engine's `context`."""
        return max(1, min(self.reply_cap(prompt_tokens), context - prompt_tokens))

    def slot(self, n: int | None = None) -> tuple[int, int]:
        """(round, prompt) of the stream's n-th reply (by default the next one it takes)."""
        round_, i = divmod(self.next if n is None else n, len(self.prompts))
        return round_, self.prompts[i]


def _stream(
    prompts: list[int],
    budget: int,
    config: SelfTextConfig,
    written: WrittenSamples,
    rendered: list[list[int]],
    context: int,
) -> _Stream:
    """A stream with the written replies it starts with (in its order, up to the first that
    is missing or cannot be reused)."""
    stream = _Stream(prompts, budget, config.reply_tokens, [], 0)
    while not stream.done:
        prompt = stream.slot()[1]
        cap = stream.cap(len(rendered[prompt]), context)
        sample = written.reusable(stream.slot(), len(rendered[prompt]), cap)
        if sample is None:
            break
        stream.tokens += sample
        stream.next += 1
    return stream


def _write(
    engine: Engine,
    rendered: list[list[int]],
    streams: dict[str, _Stream],
    written: WrittenSamples,
    config: SelfTextConfig,
    had: int,
    log: Log,
    bar: bool,
) -> None:
    """Write the replies each stream lacks, as many at once as the engine batches
    (`EngineConfig.max_batch`: one read of an expert serves every reply routed to it). Each is
    kept as it ends, and a stream takes them in its order; each reply samples with its own seed,
    so the text is the one a reply at a time writes."""
    done = had
    lines = ProgressLines(log, "own text", "tokens", config.tokens, had, "the first reply")
    with training_progress(bar) as bars:
        task = bars.add_task("write text", total=config.tokens, completed=had, status="")
        for stream in streams.values():
            ended: dict[int, list[int]] = {}  # the stream's replies written, not yet taken
            for _ in _write_stream(engine, rendered, stream, written, config, ended):
                while stream.next in ended and not stream.done:
                    sample = ended.pop(stream.next)
                    counted = min(len(sample), stream.budget - len(stream.tokens))
                    stream.tokens += sample
                    stream.next += 1
                    done += counted
                    bars.update(task, advance=counted)
                    lines.advance(done)


def _write_stream(
    engine: Engine,
    rendered: list[list[int]],
    stream: _Stream,
    written: WrittenSamples,
    config: SelfTextConfig,
    ended: dict[int, list[int]],
) -> Iterator[None]:
    """The stream's replies from its next one on, up to `max_batch` at once in one batch: each
    that ends (or was written before) goes into `ended` by its place in the stream, and this
    yields after each step. Replies still being written once the stream has its tokens are
    dropped unkept."""
    batch = engine.batch()
    writing: dict[int, int] = {}  # id(member) -> its place in the stream
    most: dict[int, int] = {}  # id(member) -> the most tokens its sample can have
    n = stream.next
    try:
        while not stream.done:
            while batch.size < batch.max_batch and not _enough(stream, ended, most, n):
                round_, prompt = stream.slot(n)
                cap = stream.cap(len(rendered[prompt]), engine.context_limit)
                kept = written.reusable((round_, prompt), len(rendered[prompt]), cap)
                if kept is not None:  # kept by a run before (after a gap)
                    ended[n] = kept
                else:
                    gen = GenerationConfig(
                        max_tokens=cap,
                        temperature=config.temperature,
                        top_p=config.top_p,
                        seed=reply_seed(config.seed, round_, prompt),
                    )
                    member = batch.join(rendered[prompt], gen)
                    writing[id(member)] = n
                    most[id(member)] = len(rendered[prompt]) + gen.max_tokens
                n += 1
            if batch.busy:
                for member in batch.step().ended:
                    place = writing.pop(id(member))
                    most.pop(id(member))
                    round_, prompt = stream.slot(place)
                    sample = rendered[prompt] + member.result.tokens
                    written.append(
                        round_, prompt, sample, member.result.text, member.gen.max_tokens
                    )
                    ended[place] = sample
            yield
    finally:
        batch.cancel_all()


def _enough(stream: _Stream, ended: dict[int, list[int]], most: dict[int, int], n: int) -> bool:
    """Whether the replies ended and those being written (at their longest, `most`) may already
    fill the stream's budget: none past them is started (so at most a batch of replies is
    written past it)."""
    if n == stream.next:
        return False  # the stream's next reply is always started
    expected = len(stream.tokens) + sum(len(s) for s in ended.values()) + sum(most.values())
    return expected >= stream.budget
