"""A disk error mid-reply stops that reply with a clear error; the next request is correct."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=16)


@pytest.mark.parametrize("mode", ["on-demand", "prerouter"])
def test_read_error_mid_reply_then_a_correct_reply(checkpoint_dir, tmp_path, mode):
    import shutil

    from adapters import write_random_profile

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 4)
    config = EngineConfig(mode=mode, expert_cache_bytes=60_000)
    with Engine(model_dir, config) as fresh:
        expected = fresh.generate([5, 6, 7], GREEDY).tokens

    with Engine(model_dir, config) as engine:
        reader = engine.store.reader
        healthy = reader._pread_into
        reads = {"n": 0}

        def failing(fd, buffer, offset, file):
            reads["n"] += 1
            if reads["n"] > 40:  # well into the reply
                raise OSError(5, "Input/output error", str(file))
            return healthy(fd, buffer, offset, file)

        reader._pread_into = failing
        with pytest.raises(
            Edge0Error,
            match=r"model.safetensors: read error while loading layer \d+ .*Input/output error",
        ):
            engine.generate([1, 2, 3, 4], GREEDY)
        reader._pread_into = healthy
        assert engine.generate([5, 6, 7], GREEDY).tokens == expected
