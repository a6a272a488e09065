"""The chat template's bound (chat_template.render_chat_template): it holds in any thread, leaves a
tracer as it was, keeps `*` and `**` computing what templates use them for, and is edge0's alone:
jinja2 and transformers behave as stock for other code in the process. The bound's refusals, one
line each, are cases of test_bad_checkpoints.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from adapters import copy_model
from cli_runner import REPO
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_bad_checkpoints import LOOPS, chat_template
from transformers.utils import chat_template_utils

from engine import Edge0Error, EngineConfig
from engine.runtime import chat_template as chat_template_module
from engine.runtime.generation import Engine

# Past the bound's CHAT_TEMPLATE_POWER_BITS: stock jinja2 computes it, edge0's rendering refuses it.
BIG_POWER = "{% set n = 70000 %}{{ (2 ** n).bit_length() }}"  # a name: jinja2 folds no constant

# -- 12: the chat template bound works in any thread and leaves tracing as it was -------------------


def test_chat_template_bound_in_a_worker_thread(checkpoint_dir, tmp_path, monkeypatch):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template(LOOPS)(model)
    monkeypatch.setattr(chat_template_module, "CHAT_TEMPLATE_SECONDS", 0.5)
    errors = []
    with Engine(model, EngineConfig()) as engine:

        def render() -> None:
            try:
                engine.encode_chat([{"role": "user", "content": "hi"}])
            except Edge0Error as e:
                errors.append(str(e))

        worker = threading.Thread(target=render)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive()
    assert len(errors) == 1 and "ran for more than 0.5 s" in errors[0]


def test_chat_template_bound_keeps_the_tracer(checkpoint_dir):
    def tracer(frame, event, arg):
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with Engine(checkpoint_dir("qwen3_moe"), EngineConfig()) as engine:
            assert engine.encode_chat([{"role": "user", "content": "hi"}])
            assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)


def test_chat_template_keeps_ordinary_operators(checkpoint_dir, tmp_path):
    """The bounded `*` and `**` still compute what templates use them for."""
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template(
        "{{ '=' * 3 }}{{ 2 ** 8 }}{{ [0] * 2 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )(model)
    with Engine(model, EngineConfig()) as engine:
        ids = engine.encode_chat([{"role": "user", "content": "hi"}])
        assert engine.tokenizer.decode(ids) == "===256[0, 0]hi"


# -- the bound is edge0's own: jinja2 and transformers are left as they are --------------------------

IMPORT_CHECK = """
import jinja2.sandbox as sandbox
from transformers.utils import chat_template_utils as ctu

cls = sandbox.ImmutableSandboxedEnvironment
before = (dict(vars(cls)), dict(vars(sandbox.SandboxedEnvironment)), ctu._compile_jinja_template)
import engine.runtime.loader  # noqa: E402,F401
import engine.runtime.chat_template  # noqa: E402,F401
after = (dict(vars(cls)), dict(vars(sandbox.SandboxedEnvironment)), ctu._compile_jinja_template)
assert before == after, "importing the loader or the template bound changed jinja2 or transformers"
print(cls().from_string(BIG_POWER).render())
""".replace("BIG_POWER", repr(BIG_POWER))


def test_importing_the_loader_leaves_jinja2_as_it_is():
    """In a fresh interpreter (this one imported the loader long ago): the sandbox classes and
    transformers' template compiler are the same objects before and after the import, and a
    template renders a power the bound would refuse."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "70001"


def test_bound_applies_to_edge0_rendering_only(checkpoint_dir, tmp_path):
    """edge0 refuses the power; jinja2's sandbox and transformers' compiler, before and after
    edge0 rendered the same template, compute it."""
    stock_compile = chat_template_utils._compile_jinja_template
    assert ImmutableSandboxedEnvironment().from_string(BIG_POWER).render() == "70001"
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template(BIG_POWER)(model)
    with Engine(model, EngineConfig()) as engine:
        with pytest.raises(Edge0Error, match="computes a number of more than"):
            engine.encode_chat([{"role": "user", "content": "hi"}])
    assert chat_template_utils._compile_jinja_template is stock_compile
    assert stock_compile(BIG_POWER).render() == "70001"
    assert ImmutableSandboxedEnvironment().from_string(BIG_POWER).render() == "70001"


# -- issue 47 item 7: a long rendering holds up no other, and its bound is wall time ---------------


def template_global(monkeypatch, name: str, function) -> None:
    """`function` callable by `name` in chat templates edge0 renders (the keyword arguments of a
    rendering reach a template as data, not as functions)."""
    environment = chat_template_module._bounded_environment(
        chat_template_utils._compile_jinja_template
    )
    monkeypatch.setitem(environment.globals, name, function)


def test_a_rendering_in_one_thread_holds_up_no_other(checkpoint_dir, tmp_path, monkeypatch):
    """While one thread is inside its rendering (held there), another renders and finishes."""
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template("{{ hold() }}{% for m in messages %}{{ m.content }}{% endfor %}")(model)
    inside, release = threading.Event(), threading.Event()

    def hold() -> str:
        if not inside.is_set():  # the first rendering only
            inside.set()
            release.wait(20)
        return ""

    template_global(monkeypatch, "hold", hold)
    with Engine(model, EngineConfig()) as engine:
        held = threading.Thread(
            target=engine.encode_chat, args=([{"role": "user", "content": "a"}],)
        )
        held.start()
        assert inside.wait(20)
        other: list = []
        free = threading.Thread(
            target=lambda: other.append(engine.encode_chat([{"role": "user", "content": "hi"}]))
        )
        free.start()
        free.join(timeout=20)
        finished_while_held = not free.is_alive() and not release.is_set()
        release.set()
        held.join(timeout=20)
        assert finished_while_held and engine.tokenizer.decode(other[0]) == "hi"


def test_the_chat_template_bound_counts_waiting_too(checkpoint_dir, tmp_path, monkeypatch):
    """A template that waits (here on a sleeping function; as a busy machine makes it wait)
    uses little CPU: the bound is the time since it began, which others waiting see."""
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template("{% for i in range(3000) %}{{ pause() }}{% endfor %}")(model)
    monkeypatch.setattr(chat_template_module, "CHAT_TEMPLATE_SECONDS", 0.2)
    template_global(monkeypatch, "pause", lambda: time.sleep(0.001) or "")
    with Engine(model, EngineConfig()) as engine:
        with pytest.raises(Edge0Error, match="ran for more than 0.2 s"):
            engine.encode_chat([{"role": "user", "content": "hi"}])
