"""The engine thread shared by the app and the server, on a fake engine (no model, no GPU)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from edge0_tui.engine_service import (
    EngineOpened,
    EngineService,
    EngineUnavailable,
    NewText,
    QueueFull,
    ReplyDone,
    ReplyError,
    ReplyJob,
    SwitchNotApplied,
)
from engine import Edge0Error, GeneratedToken, GenerationConfig, Reply


class FakeEngine:
    """The Engine surface the service uses: token t is the letter 'a' + t."""

    context_limit = 64
    last_prefill = None

    def __init__(self) -> None:
        self.k, self.mode = 4, "on-demand"
        self.requested: dict = {}
        self.gate = threading.Event()
        self.gate.set()  # cleared: generate waits for it before its first token
        self.broken_switch = False
        self.closed = False
        zeros = dict.fromkeys(
            (
                "mlx_active_bytes",
                "mlx_cache_bytes",
                "mlx_peak_bytes",
                "rss_bytes",
                "rss_peak_bytes",
            ),
            0,
        )
        snapshot = SimpleNamespace(page_cache_expert_bytes=0, **zeros)
        self.memory = SimpleNamespace(snapshot=lambda: snapshot)  # the load's memory
        self.step = SimpleNamespace(
            phase="decode",
            k=4,
            mode="on-demand",
            page_cache_expert_bytes=0,
            nonfinite_repaired=0,
            **zeros,
        )

    def info(self) -> dict:
        return {"model": "fake", "k": self.k, "mode": self.mode}

    def profiles(self) -> list:
        return []

    def modes(self) -> list[str]:
        return ["on-demand", "prefetch"]

    def request_k(self, k: int):
        self.requested["k"] = k

    def request_mode(self, mode: str):
        self.requested["mode"] = mode

    def apply_requests(self) -> None:
        requested, self.requested = self.requested, {}
        if self.broken_switch and requested:
            raise Edge0Error("cannot read the heads")
        self.k = requested.get("k", self.k)
        self.mode = requested.get("mode", self.mode)

    def encode(self, text: str) -> list[int]:
        return [0] * len(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [0] * sum(len(m["content"]) for m in messages)

    def reply_text(self, tokens: list[int]) -> str:
        return "".join(chr(97 + t) for t in tokens)

    def stream(self, prompt, gen, should_stop):
        return Reply(self._reply(prompt, gen, should_stop))

    def _reply(self, prompt, gen, should_stop):
        self.gate.wait(10)
        tokens, stopped_by = [], "max_tokens"
        for t in range(gen.max_tokens):  # at least one token, as the engine's prefill makes
            tokens.append(t % 26)
            self.step.k, self.step.mode = self.k, self.mode
            yield GeneratedToken(t % 26, self.step)
            if len(tokens) < gen.max_tokens and should_stop():
                stopped_by = "cancelled"
                break
        summary = dict.fromkeys(
            ("ttft_ms", "prefill_tok_per_s", "decode_tok_per_s", "median_blocked_ms",
             "median_cold_fraction", "median_loads", "median_mib_read", "median_expert_pool_mib",
             "prefill_mib_read", "peak_mlx_bytes", "peak_rss_bytes"), 0.0,
        )  # fmt: skip
        summary.update(prompt_tokens=len(prompt), generated_tokens=len(tokens))
        text = self.reply_text(tokens)
        return SimpleNamespace(
            tokens=tokens, text=text, steps=[], summary=summary, stopped_by=stopped_by
        )

    def close(self) -> None:
        self.closed = True


class PlainText:
    stopped = False

    def __init__(self) -> None:
        self.sent = 0

    def update(self, text: str) -> str:
        new, self.sent = text[self.sent :], len(text)
        return new

    def finish(self, text: str) -> str:
        return text[self.sent :]


def job(events: queue.Queue, content: str = "hi", max_tokens: int = 5) -> ReplyJob:
    return ReplyJob(
        [{"role": "user", "content": content}],
        GenerationConfig(max_tokens=max_tokens),
        events.put,
        PlainText(),
    )


def answer(events: queue.Queue) -> tuple[str, ReplyDone | ReplyError]:
    parts = []
    while True:
        event = events.get(timeout=10)
        if isinstance(event, NewText):
            parts.append(event.text)
        else:
            return "".join(parts), event


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def started():
    """A service on its own thread, its fake engine, and its service events."""
    fake = FakeEngine()
    events: queue.Queue = queue.Queue()
    service = EngineService(lambda: fake, on_event=events.put, queue_limit=2)
    service.start()
    assert isinstance(events.get(timeout=30), EngineOpened)
    yield service, fake, events
    service.shutdown()
    service.join(10)
    assert service.closed.is_set() and fake.closed and service.engine is None


def test_the_service_imports_no_ui():
    """The server uses it without Textual, the app without the HTTP stack."""
    code = (
        "import sys, edge0_tui.engine_service; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'textual', 'starlette', "
        "'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_stopped_job_answers_and_a_cancelled_one_does_not(started):
    service, fake, _ = started
    first, stopped, cancelled = queue.Queue(), queue.Queue(), queue.Queue()
    fake.gate.clear()  # the first job holds the engine: the others wait
    service.submit(job(first))
    wait_for(lambda: service.running)
    stopping, dropping = job(stopped, max_tokens=9), job(cancelled)
    service.submit(stopping)
    service.submit(dropping)
    with pytest.raises(QueueFull):
        service.submit(job(queue.Queue()))
    assert service.queue_depth == 2
    stopping.stop()  # the app's Escape before the engine picked it up: still answered
    dropping.cancel()  # a client that went away: dropped unanswered
    assert service.queue_depth == 1
    counted: queue.Queue = queue.Queue()
    service.count_tokens([{"role": "user", "content": "four"}], counted.put)
    fake.gate.set()
    text, done = answer(first)
    assert text == "abcde" and isinstance(done, ReplyDone) and done.stopped_by == "max_tokens"
    assert done.figures["generated_tokens"] == 5
    text, done = answer(stopped)
    assert isinstance(done, ReplyDone) and done.stopped_by == "cancelled"
    assert done.completion_tokens == 1 and text + done.rest == done.text == "a"
    assert service.last_figures == done.figures  # the latest request's
    assert counted.get(timeout=10) == 4  # chores run in order, after the jobs before them
    assert cancelled.empty()
    assert service.live.context_tokens == 2 + 1  # the latest request's prompt and reply


def test_an_idle_switch_applies_at_once_and_a_failed_one_says_so(started):
    service, fake, events = started
    service.request_k(8)
    service.request_mode("prefetch")
    wait_for(lambda: (service.live.k, service.live.mode) == (8, "prefetch"))
    fake.broken_switch = True
    service.request_k(2)
    failed = events.get(timeout=10)
    assert isinstance(failed, SwitchNotApplied) and failed.message == "cannot read the heads"
    assert service.live.k == 8  # what stands


def test_a_bug_ends_the_service_when_asked_and_every_waiting_job_is_told():
    fake = FakeEngine()
    fake.gate.clear()
    ready = threading.Event()
    service = EngineService(lambda: fake, lambda event: ready.set(), bugs_end_service=True)
    failures: queue.Queue = queue.Queue()
    thread_error: list[BaseException] = []

    def run() -> None:
        try:
            service.run()
        except RuntimeError as e:
            thread_error.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(30)

    def broken_post(event) -> None:
        raise RuntimeError("a bug")

    service.submit(ReplyJob("x", GenerationConfig(max_tokens=3), broken_post, PlainText()))
    service.submit(job(failures))
    fake.gate.set()
    thread.join(10)
    assert [str(e) for e in thread_error] == ["a bug"]
    assert service.closed.is_set() and fake.closed and service.state == "closed"
    _, told = answer(failures)
    assert isinstance(told, ReplyError) and isinstance(told.error, EngineUnavailable)
    with pytest.raises(EngineUnavailable):
        service.submit(job(queue.Queue()))
