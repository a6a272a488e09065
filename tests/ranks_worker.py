"""One rank of tests/test_expert_parallel.py: for each case of the JSON file `sys.argv[1]`, a
greedy reply with this rank's share of the experts; rank 0 writes the tokens and every rank's
figures to `sys.argv[2]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's engine

from engine import Engine, EngineConfig, GenerationConfig  # noqa: E402


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    replies = []
    for case in cases:
        config = EngineConfig(expert_parallel=True, **case["config"])
        with Engine(case["model"], config) as engine:
            gen = GenerationConfig(max_tokens=case["tokens"], temperature=0.0, ignore_eos=True)
            result = engine.generate(case["prompt"], gen)
            replies.append({"tokens": result.tokens, "ranks": result.summary["ranks"]})
            rank = engine.store.share.rank
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(replies, f)


if __name__ == "__main__":
    main()
