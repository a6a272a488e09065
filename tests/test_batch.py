"""Continuous batching (runtime/batch.py): replies that decode together, exactly.

Greedy tokens of every member equal the same reply run alone, in every mode, on the demo and
three families whose caches batch differently (attention, linear attention's recurrent state,
sliding windows); members join while others decode and leave when they end; a step reads the
union of its rows' experts once; each member keeps its own stop and cancel.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.batch import batch_metrics
from engine.runtime.generation import Engine

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"


class WholeText:
    """A job's text filter that sends nothing while the reply is written, all of it at its end."""

    stopped = False

    def update(self, text: str) -> str:
        return ""

    def finish(self, text: str) -> str:
        return text


def _greedy(max_tokens: int, **extra) -> GenerationConfig:
    return GenerationConfig(max_tokens=max_tokens, ignore_eos=True, **extra)


def _run_batch(engine: Engine, requests: list[tuple[list[int], GenerationConfig]], late: int = 0):
    """Every request through one batch; the last `late` join once the others have decoded a few
    steps. Returns the members in request order and every batch step's metrics."""
    batch = engine.batch()
    early = requests[: len(requests) - late]
    members = [batch.join(p, g) for p, g in early]
    steps = 0
    while batch.busy or len(members) < len(requests):
        if steps == 6 and len(members) < len(requests):
            members += [batch.join(p, g) for p, g in requests[len(members) :]]
        batch.step()
        steps += 1
    return members, batch._decoder.steps


def test_greedy_tokens_of_a_batch_are_each_reply_alone_on_the_demo_in_every_mode():
    """Resident, on-demand with a cache that misses, prefetch and prerouter (each row routed by
    its own sequence's predictions); replies of different lengths, one joining late; a batch
    step reads the union of its rows' experts, fewer than one row at a time."""
    texts = ["a b c d a b", "the cat sat on the mat and", "once upon a time there was a"]
    with Engine(DEMO, EngineConfig(mode="resident", max_batch=3)) as engine:
        prompts = [engine.encode(t) for t in texts]
        lengths = [10, 6, 8]
        alone = [engine.generate(p, _greedy(n)).tokens for p, n in zip(prompts, lengths)]
        requests = [(p, _greedy(n)) for p, n in zip(prompts, lengths)]
        members, _ = _run_batch(engine, requests, late=1)
        assert [m.result.tokens for m in members] == alone
    for mode in ("on-demand", "prefetch", "prerouter"):
        config = EngineConfig(mode=mode, expert_cache_bytes=4 << 20, max_batch=3)
        with Engine(DEMO, config) as engine:
            if mode == "prerouter":  # approximate: each reply's own tokens under its predictions
                alone = [engine.generate(p, g).tokens for p, g in requests]
            members, steps = _run_batch(engine, requests, late=1)
            assert [m.result.tokens for m in members] == alone, mode
            assert all(m.result.stopped_by == "max_tokens" for m in members)
            figures = batch_metrics(steps)
            assert figures["rows_per_step"] > 1
            assert 0 < figures["experts_union"] < figures["experts_summed"], mode
            assert sum(s.loads for s in steps) > 0  # the cache misses
            one_read = [
                s.host_sync_reasons.get("the step's token and what the next one needs")
                for s in steps
            ]
            assert all(r == 1 for r in one_read)  # one read for every row's token
            if mode == "prerouter":  # every consumer layer of a step routed by predictions
                assert all(s.predicted == len(engine.routing.heads.consumers) for s in steps)
                assert sum(s.dropped for s in steps) == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_greedy_tokens_of_a_batch_are_each_reply_alone_on_other_families(checkpoint_dir, family):
    """Attention caches, linear attention's recurrent state (qwen3_next) and sliding windows
    (gpt_oss) batch and leave alike; on-demand with a cache that misses, then resident."""
    model = checkpoint_dir(family)
    prompts = [[5, 9, 13, 17, 21, 5, 9], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    lengths = [9, 5, 7]
    requests = [(p, _greedy(n, repetition_penalty=1.2)) for p, n in zip(prompts, lengths)]
    with Engine(model, EngineConfig(mode="resident", max_batch=3)) as engine:
        alone = [engine.generate(p, g).tokens for p, g in requests]
        members, _ = _run_batch(engine, requests, late=1)
        assert [m.result.tokens for m in members] == alone
    with Engine(
        model, EngineConfig(mode="on-demand", expert_cache_bytes=120_000, max_batch=3)
    ) as engine:
        members, steps = _run_batch(engine, requests, late=1)
        assert [m.result.tokens for m in members] == alone
        assert sum(s.loads for s in steps) > 0


def test_each_member_keeps_its_own_stop_and_cancel(checkpoint_dir):
    """A cancelled member leaves at its next token (or during its prefill) and the others go
    on to their own ends, with the tokens they have alone; a full batch and a drafted request
    are refused in one line; a seeded sampled reply is its tokens alone."""
    model = checkpoint_dir("qwen3_moe")
    with Engine(
        model, EngineConfig(mode="on-demand", expert_cache_bytes=120_000, max_batch=3)
    ) as engine:
        prompts = [[5, 9, 13, 17], [7, 3, 8], [11, 12, 13, 14, 15]]
        alone = [engine.generate(p, _greedy(8)).tokens for p in prompts]
        batch = engine.batch()
        stop = {"now": False}
        kept = batch.join(prompts[0], _greedy(8))
        cancelled = batch.join(prompts[1], _greedy(8), should_stop=lambda: stop["now"])
        other = batch.join(prompts[2], _greedy(8))
        with pytest.raises(Edge0Error, match="full"):
            batch.join(prompts[0], _greedy(8))
        given = []
        while batch.busy:
            out = batch.step()
            given += [m for m, _ in out.tokens]
            if given.count(cancelled) == 3:
                stop["now"] = True
        assert cancelled.result.stopped_by == "cancelled"
        assert cancelled.result.tokens == alone[1][:3]  # asked once its caller took the 3rd
        assert kept.result.tokens == alone[0] and other.result.tokens == alone[2]
        assert kept.result.summary["generated_tokens"] == 8
        with pytest.raises(Edge0Error, match="draft"):
            engine.batch().join(prompts[0], GenerationConfig(draft="lookup"))
        # A seeded reply draws from its own key: its sampled tokens in a batch are its alone.
        sampled = GenerationConfig(
            max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7
        )
        alone_sampled = engine.generate(prompts[0], sampled).tokens
        batch = engine.batch()
        seeded = batch.join(prompts[0], sampled)
        batch.join(prompts[1], dataclasses.replace(sampled, seed=8))
        while batch.busy:
            batch.step()
        assert seeded.result.tokens == alone_sampled


def test_the_memory_plan_counts_the_batchs_kv_caches(checkpoint_dir):
    """`max_batch` sequences' KV caches at the planned context, and as many again for the copy
    mlx-lm makes when a reply joins or leaves; one reply's when nothing batches."""
    from engine.runtime.header_plan import plan_from_headers

    model = checkpoint_dir("qwen3_moe")
    one = plan_from_headers(model, EngineConfig(mode="on-demand", context_tokens=256)).plan
    config = EngineConfig(mode="on-demand", context_tokens=256, max_batch=4)
    four = plan_from_headers(model, config).plan
    assert four.kv_cache_bytes == 8 * one.kv_cache_bytes > 0
    assert "8 x 256 tokens" in " ".join(name for name, _ in four.terms())
    with pytest.raises(Edge0Error, match="max_batch"):
        EngineConfig(max_batch=0)


def test_the_service_runs_queued_replies_as_one_batch_and_a_drafted_one_after(checkpoint_dir):
    """EngineService(max_batch=3) on a real tiny engine: replies submitted together decode in
    one batch (steps of several rows) with each one's tokens as alone; a drafted reply, which a
    batch cannot run, waits for the batch to end and then runs alone; none is refused."""
    import queue
    import threading

    from edge0_tui.engine_service import ReplyDone, ReplyJob

    class StopsAfterThree(WholeText):  # a stop sequence found in the third token's text
        def __init__(self) -> None:
            self.seen = 0

        @property
        def stopped(self) -> bool:
            return self.seen >= 3

        def update(self, text: str) -> str:
            self.seen += 1
            return ""

    model = checkpoint_dir("qwen3_moe")
    config = EngineConfig(mode="on-demand", expert_cache_bytes=120_000, max_batch=3)
    prompts = [[5, 9, 13, 17], [7, 3, 8], [11, 12, 13, 14, 15]]
    with Engine(model, config) as engine:
        alone = [engine.generate(p, _greedy(8)).tokens for p in prompts]
    from edge0_tui.server.engine_worker import EngineWorker
    from edge0_tui.server.metrics import ServerStats, render

    opened = threading.Event()
    worker = EngineWorker(
        lambda: Engine(model, config), on_ready=lambda w: opened.set(), max_batch=3
    )
    service = worker.service
    worker.start()
    try:
        assert opened.wait(60)
        answers = [queue.Queue() for _ in range(5)]
        gens = [_greedy(8)] * 3 + [_greedy(8, draft="lookup")]
        texts = [WholeText() for _ in range(4)]
        for p, gen, answer, text in zip([*prompts, prompts[0]], gens, answers, texts):
            service.submit(ReplyJob("", gen, answer.put, text, prompt_tokens=p))
        stopping = ReplyJob("", _greedy(8), answers[4].put, StopsAfterThree(), prompt_tokens=[9])
        service.submit(stopping)  # it waits behind the seeded one, then batches alone
        done = [answer.get(timeout=120) for answer in answers]
        shown = render(worker, ServerStats(), "tiny")  # the latest decode step's figures
    finally:
        service.shutdown()
        service.join(30)
    assert all(isinstance(d, ReplyDone) for d in done), done
    batched = [d.figures.get("batch") for d in done[:3]]
    assert all(b is not None and b["rows_per_step"] > 1 for b in batched), batched
    assert "batch" not in done[3].figures  # the drafted reply ran alone
    gauges = dict(
        line.rsplit(" ", 1) for line in shown.splitlines() if line.startswith("edge0_step")
    )
    assert float(gauges["edge0_step_positions"]) == 1  # the last reply's last step
    assert done[4].stopped_at_text and done[4].completion_tokens == 3  # its own stop
    assert (
        0 < float(gauges["edge0_step_experts_union"]) <= float(gauges["edge0_step_experts_summed"])
    )
    texts = [d.text for d in done[:3]]
    with Engine(model, config) as engine:
        assert texts == [engine.reply_text(tokens) for tokens in alone]


def test_a_reply_past_the_planned_context_is_refused_naming_it(checkpoint_dir):
    """The plan counts KV caches for `context_tokens`: a longer prompt and reply is refused in
    one line before any work, not run past the plan."""
    model = checkpoint_dir("qwen3_moe")
    with Engine(model, EngineConfig(mode="on-demand", context_tokens=32)) as engine:
        assert engine.context_limit == 32 < engine.model_context
        with pytest.raises(Edge0Error, match="context of 32 tokens the memory plan counts"):
            engine.generate(list(range(5, 30)), _greedy(8))
        assert len(engine.generate(list(range(5, 20)), _greedy(8)).tokens) == 8


def test_serve_refuses_a_batch_with_ranks_before_any_rank_starts(capsys):
    from edge0_tui.cli import main

    assert main(["serve", "demo", "--max-batch", "2", "--hosts", "2"]) != 0
    err = capsys.readouterr().err
    assert "--max-batch does not run with --hosts" in err and "rank" not in err.split(":")[0]


def test_a_batch_that_fails_answers_every_reply_and_the_service_goes_on(
    checkpoint_dir, monkeypatch
):
    """An expert read that fails mid-batch (an Edge0Error from a step): each reply in the batch
    is answered with the error, none is left waiting, and the next request is served."""
    import queue
    import threading

    from edge0_tui.engine_service import ReplyDone, ReplyError, ReplyJob
    from edge0_tui.server.engine_worker import EngineWorker
    from engine.runtime.batch import Batch

    steps = []
    real = Batch.step

    def failing_step(self):
        steps.append(1)
        if len(steps) == 4:
            raise Edge0Error("model.safetensors: a read failed (test)")
        return real(self)

    monkeypatch.setattr(Batch, "step", failing_step)
    model = checkpoint_dir("qwen3_moe")
    config = EngineConfig(mode="on-demand", expert_cache_bytes=120_000, max_batch=2)
    opened = threading.Event()
    worker = EngineWorker(
        lambda: Engine(model, config), on_ready=lambda w: opened.set(), max_batch=2
    )
    worker.start()
    try:
        assert opened.wait(60)
        answers = [queue.Queue() for _ in range(3)]
        for prompt, answer in zip([[5, 9, 13], [7, 3, 8]], answers):
            worker.service.submit(
                ReplyJob("", _greedy(8), answer.put, WholeText(), prompt_tokens=prompt)
            )
        failed = [answers[0].get(timeout=60), answers[1].get(timeout=60)]
        assert all(isinstance(a, ReplyError) and "a read failed" in str(a.error) for a in failed)
        assert worker.service.running == 0
        worker.service.submit(
            ReplyJob("", _greedy(4), answers[2].put, WholeText(), prompt_tokens=[9])
        )
        assert isinstance(answers[2].get(timeout=60), ReplyDone)
        # A bug while a token is handed on (not in a step): the same, each reply answered.
        from edge0_tui.engine_service import service as service_module

        took = service_module._ReplyRun._took
        handed = []

        def buggy_took(self, token):
            handed.append(1)
            if len(handed) == 3:
                raise RuntimeError("a bug (test)")
            return took(self, token)

        monkeypatch.setattr(service_module._ReplyRun, "_took", buggy_took)
        answers = [queue.Queue() for _ in range(2)]
        for prompt, answer in zip([[5, 9, 13], [7, 3, 8]], answers):
            job = ReplyJob("", _greedy(8), answer.put, WholeText(), prompt_tokens=prompt)
            worker.service.submit(job)
        failed = [answers[0].get(timeout=60), answers[1].get(timeout=60)]
        assert all(isinstance(a, ReplyError) and "a bug" in str(a.error) for a in failed), failed
        assert worker.service.running == 0
    finally:
        worker.service.shutdown()
        worker.service.join(30)


def test_a_model_whose_caches_do_not_batch_runs_its_replies_one_at_a_time(checkpoint_dir):
    """llama4's chunked attention cache has no batched form in mlx-lm: its batch takes one reply
    at a time, the same tokens as alone, and a second join waits (refused as full)."""
    model = checkpoint_dir("llama4")
    with Engine(model, EngineConfig(mode="on-demand", max_batch=3)) as engine:
        alone = engine.generate([5, 9, 13], _greedy(6)).tokens
        batch = engine.batch()
        assert not batch.rows_merge and batch.max_batch == 1
        member = batch.join([5, 9, 13], _greedy(6))
        with pytest.raises(Edge0Error, match="full"):
            batch.join([7, 3], _greedy(6))
        while batch.busy:
            batch.step()
        assert member.result.tokens == alone
