"""The chat template's bound (loader.render_chat_template): it holds in any thread, leaves a
tracer as it was, and keeps `*` and `**` computing what templates use them for. The bound's
refusals, one line each, are cases of test_bad_checkpoints.py."""

from __future__ import annotations

import sys
import threading

from test_bad_checkpoints import LOOPS, _copy, chat_template

from engine import Edge0Error, EngineConfig
from engine.runtime import loader
from engine.runtime.generation import Engine

# -- 12: the chat template bound works in any thread and leaves tracing as it was -------------------


def test_chat_template_bound_in_a_worker_thread(checkpoint_dir, tmp_path, monkeypatch):
    model = _copy(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template(LOOPS)(model)
    monkeypatch.setattr(loader, "CHAT_TEMPLATE_SECONDS", 0.5)
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
    model = _copy(checkpoint_dir("qwen3_moe"), tmp_path)
    chat_template(
        "{{ '=' * 3 }}{{ 2 ** 8 }}{{ [0] * 2 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )(model)
    with Engine(model, EngineConfig()) as engine:
        ids = engine.encode_chat([{"role": "user", "content": "hi"}])
        assert engine.tokenizer.decode(ids) == "===256[0, 0]hi"
