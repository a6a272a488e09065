"""A chat template rendered within bounds: it is code that comes with the checkpoint, so its
rendering is bounded in time and in characters rendered, in a jinja2 sandbox whose operators
refuse what would compute past those bounds (real templates use a small fraction of both: little
time, and little more text than the conversation). A broken or hostile
template fails with an Edge0Error instead of hanging; jinja2's and transformers' own classes stay
as they are (tests/test_chat_template_bound.py)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from pathlib import Path

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers.utils import chat_template_utils

from ..errors import Edge0Error

CHAT_TEMPLATE_SECONDS = 5.0
CHAT_TEMPLATE_CHARS = 16 * 2**20


class ChatTemplateBudgetError(Exception):
    """The chat template ran past its time or output bound."""


# The most bits a power in a chat template may compute (10**10**8 is one long operation in C).
CHAT_TEMPLATE_POWER_BITS = 1 << 16


def _bounded_binop(self, context, operator: str, left, right):
    """`*` and `**` in a chat template (the sandbox's hook for intercepted operators): a string
    or list repeated past the output bound, or a power past CHAT_TEMPLATE_POWER_BITS, is refused
    before it runs. Each is one operation in C that the trace function cannot interrupt."""
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(items, (str, list, tuple)) and isinstance(times, int):
                if len(items) * times > CHAT_TEMPLATE_CHARS:
                    raise ChatTemplateBudgetError(
                        f"renders more than {CHAT_TEMPLATE_CHARS} characters"
                    )
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and right * (abs(left).bit_length() - 1) > CHAT_TEMPLATE_POWER_BITS:
            raise ChatTemplateBudgetError(
                f"computes a number of more than {CHAT_TEMPLATE_POWER_BITS} bits"
            )
    return self.binop_table[operator](left, right)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with `*` and `**` bounded by `_bounded_binop`. The
    compiler turns an intercepted operator into a call of `call_binop` (and never folds it at
    compile time), so the bound is part of a template compiled here: this class, used only for
    edge0's own rendering, is all it takes, and jinja2's own classes stay as they are."""

    intercepted_binops = frozenset({"*", "**"})
    call_binop = _bounded_binop


@functools.lru_cache(maxsize=2)
def _bounded_environment(stock_compile) -> _BoundedSandbox:
    """A `_BoundedSandbox` set up as transformers sets up its own (options, extensions, filters
    and globals, copied from the environment of an empty template it compiled). Never the chat
    template itself: transformers' sandbox folds constants at compile time, so compiling
    `{{ 'a' * 10**10 }}` there would already build the string."""
    stock = stock_compile("").environment
    env = _BoundedSandbox(
        trim_blocks=stock.trim_blocks,
        lstrip_blocks=stock.lstrip_blocks,
        extensions=[type(extension) for extension in stock.extensions.values()],
    )
    env.filters.update(stock.filters)
    env.globals.update(stock.globals)
    return env


@functools.lru_cache(maxsize=8)
def _compile_bounded(chat_template: str, stock_compile) -> Template:
    """The chat template compiled as transformers would, but in a `_BoundedSandbox`."""
    return _bounded_environment(stock_compile).from_string(chat_template)


# The threads rendering a chat template under edge0's bound now; the lock guards the set and
# the name transformers compiles by, never a rendering (see `_bounded_templates`).
_RENDERING: set[int] = set()
_RENDERING_LOCK = threading.Lock()
_STOCK_COMPILE: list = []  # transformers' own compiler while edge0's stands in for it


def _compile_for_rendering_threads(chat_template: str) -> Template:
    stock_compile = _STOCK_COMPILE[0]
    if threading.get_ident() in _RENDERING:
        return _compile_bounded(chat_template, stock_compile)
    return stock_compile(chat_template)


@contextlib.contextmanager
def _bounded_templates():
    """While edge0 renders a chat template: transformers compiles templates in
    `_compile_jinja_template`, cached by template text and looked up by name at each rendering,
    so for the rendering threads, and only for them, that name gives `_compile_bounded`; any
    other thread, and anything after the last rendering, gets transformers' own compiler.
    Renderings in several threads run at once: one long rendering holds up no other. Nothing
    is changed at import, and nothing of jinja2 at all. (A transformers without that name
    fails here, loudly, rather than render unbounded: the tests of the bound catch it.)"""
    owner = threading.get_ident()
    with _RENDERING_LOCK:
        if not _RENDERING:
            _STOCK_COMPILE[:] = [chat_template_utils._compile_jinja_template]
            chat_template_utils._compile_jinja_template = _compile_for_rendering_threads
        _RENDERING.add(owner)
    try:
        yield
    finally:
        with _RENDERING_LOCK:
            _RENDERING.discard(owner)
            if not _RENDERING:
                chat_template_utils._compile_jinja_template = _STOCK_COMPILE.pop()


class _TemplateBudget:
    """A trace function that bounds a Jinja rendering in the thread that renders it (a signal
    would work only in the main thread). Jinja compiles a template to Python code whose file name
    is `<template>`, so its loops run line events there: each checks the time since the rendering
    began (wall time, not the thread's CPU time: others wait for it in wall time), and every piece
    the template yields (a `return` event) counts toward the output bound. A single
    long operation inside C is not interrupted: `_bounded_binop` refuses the repetitions and
    powers; a string method given a huge width (`'a'.ljust(10**10)`) still runs."""

    # Look at the clock every this many events, not at every one.
    CLOCK_EVERY = 1000

    def __init__(self, seconds: float, chars: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.chars_left = chars
        self.chars = chars
        self.events = 0

    def __call__(self, frame, event: str, arg):
        # Called on each new frame: trace only the template's own code, at no cost elsewhere.
        return self._step if frame.f_code.co_filename == "<template>" else None

    def _step(self, frame, event: str, arg):
        if event == "return" and isinstance(arg, str):
            self.chars_left -= len(arg)
            if self.chars_left < 0:
                raise ChatTemplateBudgetError(f"renders more than {self.chars} characters")
        self.events += 1
        if self.events % self.CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
            raise ChatTemplateBudgetError(f"ran for more than {self.seconds:g} s")
        return self._step


def render_chat_template(
    tokenizer: TokenizerWrapper,
    messages: list[dict],
    where: Path,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a conversation (`role`/`content` dicts) in the tokenizer's chat template,
    ready for the assistant's turn; any failure is an Edge0Error naming `where`.

    transformers renders the template in a sandboxed Jinja environment (a template that reaches
    for Python internals fails); the sandbox has no time or size limit, so rendering runs under
    a `_TemplateBudget`, with the template compiled in a `_BoundedSandbox`
    (`_bounded_templates`)."""
    budget = _TemplateBudget(CHAT_TEMPLATE_SECONDS, CHAT_TEMPLATE_CHARS)
    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    with _bounded_templates():
        sys.settrace(budget)
        try:
            return list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tools=tools, **(template_kwargs or {})
                )
            )
        except ChatTemplateBudgetError as e:
            raise Edge0Error(f"{where}: the chat template {e}; refused") from None
        except Exception as e:  # jinja2 raises SecurityError, TemplateError, UndefinedError...
            raise Edge0Error(
                f"{where}: the chat template failed ({type(e).__name__}: {e})"
            ) from None
        finally:
            sys.settrace(previous)
