"""Replies served together: the engine thread's continuous batch (the engine's `Batch`).

With `max_batch` above one, the service runs queued replies as one batch. A job joins at the
batch's next step while the batch has room and the job runs with the batch's profile (its K and
mode); its prompt's prefill is interleaved with the members' decode steps, a chunk a step; it
leaves when its reply ends, and each keeps its own text filter, stop and cancel.

A job the batch cannot take (another K or mode) waits at the head of the queue until the batch
is empty, then runs as the next batch's first; a drafted one runs alone then. Jobs
start in the order they came, and none is refused for it. Chores (switches,
reloads) wait the same way. The plan counted `max_batch` KV caches before loading, so a job
that waits for room never takes memory the plan did not count.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

from engine import Edge0Error

from .jobs import ReplyJob

if TYPE_CHECKING:
    from engine import Batch

    from .service import EngineService, _ReplyRun


def batchable(job: ReplyJob) -> bool:
    """Whether the engine can run `job` in a batch: a batch verifies no drafts."""
    return job.generation.draft is None


class BatchRun:
    """The batch on the engine thread, from its first job until its last reply ends."""

    def __init__(self, service: EngineService, first: _ReplyRun, prompt, generation) -> None:
        self.service = service
        self.engine = service.engine
        self.batch: Batch = self.engine.batch()
        self.runs: dict[int, _ReplyRun] = {}  # id(member) -> its job's run
        self._join(first, prompt, generation)

    def run(self) -> None:
        """Step until every reply has ended, taking in the jobs that can join at each step. A
        failure (an expert read that fails, or a bug) ends every reply still in the batch with
        it, each answered; the service goes on."""
        try:
            self._steps()
        except Edge0Error as e:  # e.g. an expert read failed: every reply says so
            self._fail_all(e)
        except Exception as e:
            if self.service._bugs_end_service:
                raise
            traceback.print_exc()  # a bug: these requests fail, the service goes on
            self._fail_all(Edge0Error(f"the batch stopped: {e}"))

    def _steps(self) -> None:
        service, batch = self.service, self.batch
        while batch.busy:
            while batch.size < batch.max_batch and (run := service._take_joiner()) is not None:
                self._take(run)
            out = batch.step()
            for member, token in out.tokens:
                self.runs[id(member)]._took(token)
            for member in out.ended:
                run = self.runs.pop(id(member))
                run.answer(member.result)
                service._finished(run.job)

    def _take(self, run: _ReplyRun) -> None:
        try:
            prompt, generation = run.prepare()
        except Edge0Error as e:
            run.fail(e)
            self.service._finished(run.job)
            return
        self._join(run, prompt, generation)

    def _join(self, run: _ReplyRun, prompt, generation) -> None:
        try:
            member = self.batch.join(prompt, generation, run._should_stop)
        except Edge0Error as e:
            run.fail(e)
            self.service._finished(run.job)
            return
        self.runs[id(member)] = run

    def _fail_all(self, error: Edge0Error) -> None:
        self.batch.cancel_all()
        for run in self.runs.values():
            run.fail(error)
            self.service._finished(run.job)
        self.runs.clear()
