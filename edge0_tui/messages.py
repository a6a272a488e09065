"""Messages the engine thread posts to the chat screen.

`post_message` is the one thread-safe way into the UI: it queues the message on the app's event loop
and returns at once, so decoding never waits for the UI. The handlers run on the UI thread.
They are for the chat screen alone, so none bubbles up to the app (`bubble=False`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message

from engine import KProfile


@dataclass
class ModelProgress(Message, bubble=False):
    """Preparing the model: downloading it, or writing the synthetic demo model."""

    what: str
    done: float
    total: float | None  # None: no known end (indeterminate)


@dataclass
class EngineReady(Message, bubble=False):
    model_name: str
    info: dict
    profiles: list[KProfile]
    modes: list[str]
    # What the user should know before chatting: the demo model is a random-weight stand-in, the
    # K in use does not recover quality, ...
    notices: list[str] = field(default_factory=list)


@dataclass
class EngineFailed(Message, bubble=False):
    """The model could not be prepared or loaded; `error` is the engine's one-line message."""

    error: str


@dataclass
class ReplyText(Message, bubble=False):
    """New text at the end of the reply being written (tokens batched, `text_every_s` at a
    time)."""

    text: str


@dataclass
class ReplyFinished(Message, bubble=False):
    text: str  # the whole reply, decoded once more from all its tokens
    stopped_by: str  # "eos", "max_tokens" or "cancelled"
    summary: dict = field(default_factory=dict)
    # Hidden values the engine's numerical guard repaired (NaN, inf) while writing the reply.
    nonfinite_repaired: int = 0


@dataclass
class ReplyFailed(Message, bubble=False):
    """The engine raised an `Edge0Error` mid-reply; `text` is what was written before it."""

    error: str
    text: str
    nonfinite_repaired: int = 0


@dataclass
class SwitchFailed(Message, bubble=False):
    """A K or mode switch the engine accepted could not be applied (the engine keeps the old)."""

    error: str


@dataclass
class QualityKept(Message, bubble=False):
    """`edge0 eval --profiles` kept a new table of the K profiles' perplexity while the app ran."""

    quality: dict[int, dict[str, float]]


@dataclass
class ModelRefused(Message, bubble=False):
    """Another model could not be opened; `error` is the one-line reason. `reloading`: the model
    before was closed first and is being loaded back (its EngineReady follows); else it was never
    closed and is ready as it was."""

    error: str
    reloading: bool


@dataclass
class ContextCounted(Message, bubble=False):
    """Tokens a reopened chat puts in the model's context (its messages through the template)."""

    chat_id: int
    tokens: int
