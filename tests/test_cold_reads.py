"""Cold accounting is real: evicted expert bytes read as cold, page-cached ones as warm."""

from __future__ import annotations

from engine.config import EngineConfig, GenerationConfig
from engine.experts.page_cache import FileResidency, evict_file
from engine.runtime.generation import Engine


def _first_forward(model_dir, evict: bool):
    engine = Engine(model_dir, EngineConfig(mode="on-demand", expert_cache_bytes=1 << 30))
    try:
        if evict:
            # Loading read the resident weights (with readahead): evict after, right before use.
            for shard in engine.loaded.index.shards:
                evict_file(shard)
            assert engine.memory.page_cache_bytes_now() == 0
        # A one-token prompt: the first forward routes one token and reads expert by expert.
        result = engine.generate([42], GenerationConfig(max_tokens=1))
        return result.steps[0], engine.loaded.index
    finally:
        engine.close()


def test_cold_then_warm(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3_moe", "small")
    cold_step, index = _first_forward(model_dir, evict=True)
    assert cold_step.loads > 0 and cold_step.mib_read > 0
    assert cold_step.cold_fraction > 0.9, cold_step

    # The bytes just read are now in the page cache, as mincore over the same ranges shows.
    assert sum(FileResidency(s).resident_bytes(0, s.stat().st_size) for s in index.shards) > 0

    warm_step, _ = _first_forward(model_dir, evict=False)
    assert warm_step.loads == cold_step.loads
    assert warm_step.cold_fraction < 0.1, warm_step


def test_residency_answers_are_right_from_many_threads_at_once(tmp_path):
    """Reader threads ask about different ranges at once; mincore runs without the GIL, so each
    answer must come from its own page vector."""
    import os
    import threading

    from engine.experts.page_cache import PAGE_SIZE

    pages = 64
    path = tmp_path / "half.bin"
    path.write_bytes(b"\1" * (pages * PAGE_SIZE))
    evict_file(path)
    half = pages // 2 * PAGE_SIZE
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly the first half
    os.pread(fd, half, 0)
    os.close(fd)
    residency = FileResidency(path)
    cases = [(0, half, half), (half, half, 0), (100, 2 * PAGE_SIZE, 2 * PAGE_SIZE)]
    assert [residency.resident_bytes(o, n) for o, n, _ in cases] == [c[2] for c in cases]
    wrong = []

    def ask(case):
        offset, length, expected = case
        for _ in range(2000):
            got = residency.resident_bytes(offset, length)
            if got != expected:
                wrong.append((case, got))
                return

    threads = [threading.Thread(target=ask, args=(cases[i % 3],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    residency.close()
    assert wrong == []


def test_a_whole_layer_read_after_eviction_is_all_cold(checkpoint_dir):
    """A whole layer (prefill) is read tensor after tensor through a descriptor with readahead,
    which runs on into the next tensors: their cold bytes are counted before any is read (counted
    just before each read, the readahead's pages made them look warm)."""
    engine = Engine(checkpoint_dir("qwen3_moe", "small"), EngineConfig(mode="on-demand"))
    try:
        index = engine.loaded.index
        layer = sorted(index.layers)[0]
        assert len(index.layers[layer].tensors) > 1
        for shard in index.shards:
            evict_file(shard)
        result = engine.store.reader.submit_layer(layer).result()
    finally:
        engine.close()
    assert result.nbytes == index.layers[layer].nbytes
    assert result.cold_bytes == result.nbytes
