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


def test_a_short_read_goes_on_where_it_stopped_and_the_end_of_a_file_is_an_error(
    tmp_path, monkeypatch
):
    """`preadv` may return fewer bytes than asked: the read goes on from there until the buffer is
    full; a file that ends first is an error naming it."""
    import os

    import numpy as np

    from engine.experts.reads import ExpertReader

    path = tmp_path / "shard.safetensors"
    data = bytes(range(256)) * 4
    path.write_bytes(data)
    real = os.preadv
    offsets = []

    def at_most_30_bytes(fd, buffers, offset):
        offsets.append(offset)
        return real(fd, [memoryview(buffers[0]).cast("B")[:30]], offset)

    monkeypatch.setattr(os, "preadv", at_most_30_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = np.zeros(100, dtype=np.uint8)
        ExpertReader._pread_into(None, fd, buffer, 10, path)
        assert bytes(buffer) == data[10:110]
        assert offsets == [10, 40, 70, 100]
        with pytest.raises(OSError, match="unexpected end of file at byte 1024") as error:
            ExpertReader._pread_into(None, fd, np.zeros(100, dtype=np.uint8), 1000, path)
        assert error.value.filename == str(path)
    finally:
        os.close(fd)
