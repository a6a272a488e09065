"""The one thread that owns the engine, shared by the chat app and the HTTP server.

Thread rule: every MLX call (loading, generating, reading MLX memory, closing) happens on the
thread that runs `EngineService.run`: the service's own thread (`start`, the server) or one the
caller gives it (the app's Textual thread worker). MLX streams are thread-local, so the engine is
never touched from another thread, and that thread frees its streams before it returns.

Other threads talk to the engine thread only through the service:
- `submit` queues a `ReplyJob` in arrival order, or refuses it (`EngineUnavailable` until the
  model is loaded and after it closed, `QueueFull` past `queue_limit` waiting jobs);
- `ReplyJob.stop` ends a reply early (the engine checks after every token, so within one step)
  and `ReplyJob.cancel` also drops a job that has not started;
- `request_k`, `request_mode`, `request_page_cache` call the engine's thread-safe request methods
  (applied before its next step, mid-reply too) and queue a chore that applies them at once when
  idle; `reload` closes the engine and opens another (after an optional check that leaves
  the engine as it was when it fails: `ReloadRefused`); `count_tokens` counts a chat's tokens;
- the engine thread answers each job with `NewText`, then `ReplyDone` or `ReplyError`, handed to
  the job's `post`; loading and idle switches are reported to `on_event` (`EngineOpened`,
  `OpenFailed`, `SwitchNotApplied`, `ReloadRefused`). Both callbacks run on the engine thread
  (`cancel_all`'s on its caller's) and must not wait;
- `live`, `memory`, `kv_cache_bytes`, `info`, `profiles`, `modes`, `last_figures`, `state` are
  snapshots the engine thread replaces (plain attribute swaps) and any thread reads.
The engine serves one request at a time by design: one conversation's KV cache is kept between
requests, so a chat that sends its history again continues from it.

No UI here (neither Textual nor the HTTP stack) and no MLX math: the adapters in
`engine_session` (the app) and `server.engine_worker` (the server) turn these events into theirs.

    jobs.py     what goes in and comes out: ReplyJob, its text filter, the events, the refusals
    service.py  EngineService, the engine thread's loop, one reply's run, a request's figures
"""

from .jobs import (
    EngineOpened,
    EngineUnavailable,
    JobEvent,
    NewText,
    OpenFailed,
    QualityChanged,
    QueueFull,
    ReloadRefused,
    ReplyDone,
    ReplyError,
    ReplyJob,
    ServiceClosed,
    ServiceEvent,
    SwitchNotApplied,
    SwitchRefused,
    TextFilter,
)
from .service import EngineService, request_figures

__all__ = [
    "EngineOpened",
    "EngineService",
    "EngineUnavailable",
    "JobEvent",
    "NewText",
    "OpenFailed",
    "QueueFull",
    "ReloadRefused",
    "ReplyDone",
    "ReplyError",
    "ReplyJob",
    "ServiceClosed",
    "QualityChanged",
    "ServiceEvent",
    "SwitchNotApplied",
    "SwitchRefused",
    "TextFilter",
    "request_figures",
]
