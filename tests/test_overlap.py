"""Reads hidden under compute: the mechanisms behind `edge0 bench`'s overlap figures.

A miss the forward waits for is read in parts on every free thread; a read ahead yields to it
between tensors; the pool keeps the experts of self-routed layers (whose misses block) over those
of predicted layers (whose misses are read a step ahead); the compute-only arm measures the step a
streamed step cannot beat."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from adapters import write_random_profile

import engine.experts.reads as reads
from edge0_tui.cli import main
from engine.config import EngineConfig, GenerationConfig
from engine.experts.reads import NOW, ReadQueue
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=16, temperature=0.0)
PROMPT = [11, 400, 97]


def _tokens(model_dir, **config) -> list[int]:
    engine = Engine(model_dir, EngineConfig(**config))
    try:
        return engine.generate(PROMPT, GREEDY).tokens
    finally:
        engine.close()


def test_misses_read_in_parts_give_the_resident_tokens(checkpoint_dir, monkeypatch):
    model_dir = checkpoint_dir("qwen3_moe")
    resident = _tokens(model_dir, mode="resident")
    joined = []
    real_joined = reads._joined
    monkeypatch.setattr(reads, "SPLIT_BYTES", 0)  # every miss in parts, one per projection
    monkeypatch.setattr(
        reads, "_joined", lambda parts: joined.append(len(parts)) or real_joined(parts)
    )
    streamed = _tokens(model_dir, mode="on-demand", expert_cache_bytes=60_000)
    assert streamed == resident
    assert joined and set(joined) == {3}  # gate, up and down projections


def test_a_read_ahead_yields_to_a_miss_between_its_tensors():
    queue = ReadQueue(threads=1, name="test-read")
    first_tensor_done, miss_queued, order = threading.Event(), threading.Event(), []

    def read_ahead():
        order.append("ahead: tensor 1")
        first_tensor_done.set()
        miss_queued.wait(5)
        queue.run_urgent()  # what ExpertReader does between two tensors of a read ahead
        order.append("ahead: tensor 2")

    try:
        ahead = queue.submit((1, 0, 3), read_ahead)
        assert first_tensor_done.wait(5)
        miss = queue.submit(NOW, order.append, "miss")
        miss_queued.set()
        ahead.result(timeout=5)
        miss.result(timeout=5)
    finally:
        queue.shutdown()
    assert order == ["ahead: tensor 1", "miss", "ahead: tensor 2"]


def test_reads_for_the_next_step_go_after_this_steps_reads_ahead():
    queue = ReadQueue(threads=1, name="test-read")
    gate, order = threading.Event(), []
    try:
        queue.submit(NOW, gate.wait)
        time.sleep(0.05)
        futures = [
            queue.submit((1, 8, 1), order.append, "step 8, layer 1"),
            queue.submit((1, 7, 4), order.append, "step 7, layer 4"),
            queue.submit((1, 7, 2), order.append, "step 7, layer 2"),
        ]
        gate.set()
        for future in futures:
            future.result(timeout=5)
    finally:
        queue.shutdown()
    assert order == ["step 7, layer 2", "step 7, layer 4", "step 8, layer 1"]


def test_bench_reports_the_overlap_limit_from_a_compute_only_arm(checkpoint_dir, tmp_path):
    out = tmp_path / "report.json"
    args = ["bench", str(checkpoint_dir("qwen3_moe")), "--arms", "on-demand,compute-only"]
    assert (
        main(args + ["--rounds", "1", "--tokens", "6", "--expert-cache", "60K", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    compute = report["arms"]["compute-only"]["figures"]
    assert compute["median_loads"]["median"] == 0  # every expert resident before the replay
    overlap = report["arms"]["on-demand"]["overlap"]
    assert overlap["compute_ms"] == compute["median_wall_ms"]["median"]
    assert overlap["limit_ms"] >= overlap["compute_ms"] > 0
    assert overlap["step_vs_limit"] > 0


def test_a_small_miss_is_read_by_the_thread_that_needs_it(checkpoint_dir, monkeypatch):
    """No reader thread is handed a small miss: the forward's thread reads it at once, and the
    tokens are the resident model's."""
    model_dir = checkpoint_dir("qwen3_moe")
    resident = _tokens(model_dir, mode="resident")
    readers = []
    read_into = reads.ExpertReader._read_into

    def recording(self, *args, **kwargs):
        readers.append(threading.current_thread().name)
        return read_into(self, *args, **kwargs)

    monkeypatch.setattr(reads.ExpertReader, "_read_into", recording)
    assert _tokens(model_dir, mode="on-demand", expert_cache_bytes=60_000) == resident
    assert readers and set(readers) == {threading.current_thread().name}


@pytest.fixture
def profiled_overlap(checkpoint_dir, tmp_path):
    """A copy of the tiny checkpoint with a random K=2 profile (heads and LoRA)."""
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    return model_dir


def _cores_of_threads() -> dict[int, set[int]]:
    import os

    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


def test_reader_threads_get_a_core_of_their_own_in_prerouter_mode(profiled_overlap):
    """On Linux CPU with 2+ cores, in prerouter mode where it reads ahead, the readers and the
    Python threads (the engine's, building the next layer's graph) run on the last core, and
    MLX's compute worker with every other native thread on the rest; other modes (whose misses
    the engine thread helps read), a cache that holds every expert (nothing is read) and a
    closed engine leave every thread on every core."""
    import os
    import threading

    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "this check needs two cores (the CI box has two)"
    everywhere = set(allowed)
    reads = {"expert_cache_bytes": 60_000}  # not every expert: the next step's are read ahead
    engine = Engine(profiled_overlap, EngineConfig(mode="prerouter", k=2, **reads))
    try:
        tokens = engine.generate(PROMPT, GREEDY).tokens
        readers = engine.store.reader.native_ids
        cores = _cores_of_threads()
        assert len(readers) == 4
        python = {thread.native_id for thread in threading.enumerate()}
        assert threading.get_native_id() in python
        assert all(cores[t] == {allowed[-1]} for t in readers | python)
        native = {t: c for t, c in cores.items() if t not in readers | python}
        assert native, "MLX's compute worker is a native thread"
        assert all(c == set(allowed[:-1]) for c in native.values())
        engine.request_mode("on-demand")
        engine.apply_requests()
        assert all(c == everywhere for c in _cores_of_threads().values())
        engine.request_mode("prerouter")
        engine.apply_requests()
        assert _cores_of_threads()[next(iter(readers))] == {allowed[-1]}
    finally:
        engine.close()
    assert all(c == everywhere for c in _cores_of_threads().values())
    # Off, or every expert held: nothing pinned, the same tokens.
    for config in (
        EngineConfig(mode="prerouter", k=2, reader_core=False, **reads),
        EngineConfig(mode="prerouter", k=2),
    ):
        engine = Engine(profiled_overlap, config)
        try:
            assert engine.generate(PROMPT, GREEDY).tokens == tokens
            assert all(c == everywhere for c in _cores_of_threads().values())
        finally:
            engine.close()


def test_reads_ahead_in_chunks_land_the_same_bytes_and_let_misses_in(
    checkpoint_dir, monkeypatch, tmp_path
):
    """A read ahead of a tensor bigger than a chunk is read chunk by chunk, with the reads needed
    now run in between; the experts it lands are the same (the tokens of unchunked reads)."""
    model_dir = tmp_path / "qwen3_moe-tiny"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 4)
    config = dict(mode="prerouter", k=4, expert_cache_bytes=60_000)
    whole = _tokens(model_dir, **config)
    chunked, between_chunks, inside = [], [], threading.local()
    real_chunks = reads.ExpertReader._read_ahead_in_chunks
    real_urgent = reads.ReadQueue.run_urgent

    def chunks(self, plan, buffer, offset, length):
        chunked.append(length)
        inside.now = True
        try:
            return real_chunks(self, plan, buffer, offset, length)
        finally:
            inside.now = False

    def urgent(self):
        if getattr(inside, "now", False):
            between_chunks.append(1)
        return real_urgent(self)

    monkeypatch.setattr(reads, "READ_AHEAD_CHUNK", 512)
    monkeypatch.setattr(reads.ExpertReader, "_read_ahead_in_chunks", chunks)
    monkeypatch.setattr(reads.ReadQueue, "run_urgent", urgent)
    assert _tokens(model_dir, **config) == whole
    assert chunked and min(chunked) > 512
    assert len(between_chunks) >= sum((n - 1) // 512 for n in chunked)
