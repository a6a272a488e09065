"""What goes in and comes out of the engine thread: jobs, their events, and the refusals.

Events are plain frozen values handed to a callback on the engine thread; each side turns them into
its own (Textual messages, HTTP events). See the package's docstring for the whole protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine import Edge0Error, GenerationConfig

if TYPE_CHECKING:
    from engine import KProfile

    from .service import EngineService


class EngineUnavailable(Exception):
    """The engine takes no request: it is still loading, it failed to load, or it closed."""

    def __init__(self, state: str, error: str | None) -> None:
        self.state = state
        self.error = error
        if state == "loading":
            message = "the model is loading"
        else:
            message = f"the model is not available: {error or 'the engine is shutting down'}"
        super().__init__(message)


class QueueFull(Exception):
    """`queue_limit` jobs already wait behind the one running."""

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        super().__init__(f"{waiting} requests already wait")


class SwitchRefused(Edge0Error):
    """A job's own K or mode cannot be used; `param` names which ("k" or "mode")."""

    def __init__(self, message: str, param: str) -> None:
        self.param = param
        super().__init__(message)


class ServiceClosed(Exception):
    """Raised inside a long preparation step (a download) to abandon it when the service quits."""


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewText:
    text: str  # new reply text, never taken back
    # The log-probabilities (engine TokenLogprobs) of the tokens since the last event, when the
    # job's GenerationConfig asks for them.
    logprobs: tuple = ()


@dataclass(frozen=True)
class ReplyDone:
    rest: str  # what NewText events have not carried yet
    text: str  # the whole reply, decoded once more from all its tokens
    stopped_by: str  # the engine's: "eos", "max_tokens" or "cancelled"
    stopped_at_text: bool  # the job's text filter ended the reply (a stop sequence)
    prompt_tokens: int
    completion_tokens: int
    summary: dict  # the engine's summary of the request's steps
    figures: dict  # the request's own measurements (`request_figures`)
    nonfinite_repaired: int  # hidden values the numerical guard repaired (NaN, inf)
    logprobs: tuple = ()  # as NewText's: the tokens' not sent yet


@dataclass(frozen=True)
class ReplyError:
    # Edge0Error (SwitchRefused before the prompt), EngineUnavailable (never started), or a bug
    # when the service keeps going after bugs.
    error: Exception
    text: str  # the reply decoded so far, as the engine wrote it
    completion_tokens: int  # tokens generated before the error (0: nothing was sent)
    nonfinite_repaired: int


JobEvent = NewText | ReplyDone | ReplyError


@dataclass(frozen=True)
class EngineOpened:
    """Loaded (or loaded again) and ready; the engine's facts as the snapshots now hold them."""

    info: dict
    profiles: list[KProfile]
    modes: list[str]


@dataclass(frozen=True)
class OpenFailed:
    message: str  # the model could not be prepared or loaded; the engine thread has ended


@dataclass(frozen=True)
class SwitchNotApplied:
    message: str  # a K, mode or page-cache change the engine accepted could not be applied


@dataclass(frozen=True)
class QualityChanged:
    """`edge0 eval --profiles` kept a new table while the engine was open."""

    quality: dict[int, dict[str, float]]


@dataclass(frozen=True)
class ReloadRefused:
    message: str  # a reload's check failed before the engine was closed: it stays as it was


ServiceEvent = EngineOpened | OpenFailed | SwitchNotApplied | ReloadRefused | QualityChanged


# -- jobs -----------------------------------------------------------------------------------------


class TextFilter(Protocol):
    """What of the reply may be sent as it is written: the app cleans it for the terminal, the
    server cuts it at stop sequences. Called on the engine thread with the whole reply so far."""

    @property
    def stopped(self) -> bool:
        """True once the reply must end here (a stop sequence): the engine stops at once."""
        ...

    def update(self, text: str) -> str:
        """The new text that may be sent, given the whole reply decoded so far."""
        ...

    def finish(self, text: str) -> str:
        """The rest of the reply once generation has ended."""
        ...


class ReplyJob:
    """One reply to write: a prompt, its sampling settings, and where its events go."""

    def __init__(
        self,
        prompt: str | list[dict],
        generation: GenerationConfig,
        post: Callable[[JobEvent], object],
        text: TextFilter,
        text_every_s: float = 0.0,
        k: int | None = None,
        mode: str | None = None,
        fit_context: bool = False,
        prompt_tokens: list[int] | None = None,
        base_profile: tuple[int, str] | None = None,
    ) -> None:
        # A list of `role`/`content` dicts goes through the chat template; a string as it is.
        self.prompt = prompt
        # The prompt already encoded (by the caller, off the engine thread); None: encoded there.
        self.prompt_tokens = prompt_tokens
        self.generation = generation
        self.post = post  # called on the engine thread; must hand the event on without waiting
        self.text = text
        # NewText at most this often (0: after every token), so that a few hundred tokens a
        # second do not flood a UI, and the reply is decoded only as often.
        self.text_every_s = text_every_s
        # Switched to before the prompt; None: the base profile's (or what stands).
        self.k = k
        self.mode = mode
        # (K, mode) this job runs with where it names neither: the server's configured profile,
        # so one client's K never carries over to another's reply. None: what stands (the app,
        # whose switches are the user's and stay).
        self.base_profile = base_profile
        # The length was not asked for: never past the model's context.
        self.fit_context = fit_context
        self.stop_asked = threading.Event()
        self.dropped = False
        self.service: EngineService | None = None

    def stop(self) -> None:
        """End the reply early: it stops before its next step and answers with what it wrote."""
        self.stop_asked.set()

    def cancel(self) -> None:
        """Nobody wants the answer: a waiting job is dropped unanswered, a running one stops."""
        self.dropped = True
        self.stop_asked.set()
        if self.service is not None:
            self.service.discard(self)
