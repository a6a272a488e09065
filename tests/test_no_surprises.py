"""No network at run time, no remote code, and a sandboxed chat template."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine


def test_loading_and_generating_touch_no_network(checkpoint_dir, monkeypatch):
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError("network use in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    with Engine(checkpoint_dir("qwen3_moe"), EngineConfig()) as engine:
        engine.generate(engine.encode("hello", chat=True), GenerationConfig(max_tokens=4))
    assert attempts == []


def test_chat_template_is_sandboxed(checkpoint_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine(model, EngineConfig()) as engine:
        with pytest.raises(Edge0Error, match="chat template failed.*unsafe"):
            engine.encode_chat([{"role": "user", "content": "hi"}])


def test_remote_code_is_never_run(checkpoint_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    (model / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    config = json.loads((model / "config.json").read_text())
    config["model_file"] = "evil.py"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(Edge0Error, match="never runs code that comes with a model"):
        Engine(model, EngineConfig())
