"""One rank of tests/test_expert_parallel.py: for each case of the JSON file `sys.argv[1]`, a
greedy reply with this rank's share of the experts; rank 0 writes the tokens and every rank's
figures to `sys.argv[2]`."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's engine

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine import Engine, EngineConfig, GenerationConfig  # noqa: E402


def greedy_reply(engine: Engine, prompt: list[int], tokens: int):
    """A greedy reply, and a digest of every token's logits (to compare them bit for bit)."""
    digest = hashlib.sha256()
    reply = engine.stream(prompt, GenerationConfig(tokens, 0.0, ignore_eos=True), keep_logits=True)
    for token in reply:
        digest.update(np.array(token.logits.astype(mx.float32)).tobytes())
    return reply.result, digest.hexdigest()


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    replies = []
    for case in cases:
        config = EngineConfig(expert_parallel=True, **case["config"])
        with Engine(case["model"], config) as engine:
            rank = engine.share.rank
            if rank != 0:
                engine.follow()  # every reply of rank 0's, step by step
                continue
            result, logits = greedy_reply(engine, case["prompt"], case["tokens"])
            replies.append(
                {"tokens": result.tokens, "logits": logits, "ranks": result.summary["ranks"]}
            )
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(replies, f)


if __name__ == "__main__":
    main()
