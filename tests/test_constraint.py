"""Constrained decoding in the engine (engine/runtime/constraint.py): a reply under a grammar
matches it, in every mode, and ends once the grammar allows nothing more."""

from __future__ import annotations

import json
import shutil

import pytest
from adapters import profile_k, write_random_profile

from engine.config import EngineConfig, GenerationConfig
from engine.runtime.constraint import (
    GrammarError,
    compile_grammar,
    gbnf_source,
    json_schema_source,
    lark_source,
)
from engine.runtime.generation import Engine

PROMPT = [11, 400, 97, 5, 300, 12]
# Every value bounded: a random-weight model's reply then ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "wild"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "word": {"type": "string", "pattern": "^[a-z]{1,5}$"},
    },
    "required": ["mood", "count", "ok", "word"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory):
    """The tiny checkpoint with a random K profile, so that prerouter mode has heads."""
    folder = tmp_path_factory.mktemp("constrained") / "qwen3_moe-profiled"
    shutil.copytree(checkpoint_dir("qwen3_moe"), folder)
    write_random_profile(folder, profile_k("qwen3_moe", 4), seed=0)
    return folder


def _valid(reply: dict) -> bool:
    return (
        set(reply) == {"mood", "count", "ok", "word"}
        and reply["mood"] in ("calm", "wild")
        and isinstance(reply["count"], int)
        and 0 <= reply["count"] <= 99
        and isinstance(reply["ok"], bool)
        and reply["word"].isalpha()
        and 1 <= len(reply["word"]) <= 5
    )


@pytest.fixture(scope="module")
def resident(model_dir):
    with Engine(model_dir, EngineConfig(mode="resident")) as engine:
        yield engine


@pytest.fixture(scope="module")
def streaming(model_dir):
    """One streaming engine for on-demand and prerouter mode (`request_mode` switches)."""
    with Engine(model_dir, EngineConfig(mode="on-demand", k=4)) as engine:
        yield engine


@pytest.mark.parametrize("mode", ["resident", "on-demand", "prerouter"])
def test_a_greedy_reply_under_a_schema_is_valid_in_every_mode(request, mode):
    engine = request.getfixturevalue("resident" if mode == "resident" else "streaming")
    if mode != "resident":
        engine.request_mode(mode)
    grammar = compile_grammar(json_schema_source(SCHEMA), engine.tokenizer)
    result = engine.generate(PROMPT, GenerationConfig(max_tokens=60, constraint=grammar))
    assert engine.mode == mode
    assert _valid(json.loads(result.text)), result.text
    # It ended because the grammar was complete, not at max_tokens.
    assert result.stopped_by == "eos"
    assert len(result.tokens) < 60
    assert result.summary["mask_ms"] > 0
    assert all(step.mask_ms > 0 for step in result.steps[-len(result.tokens) :])


def test_a_lark_grammar_and_a_gbnf_one_hold(resident):
    for source in (lark_source('start: "yes" | "no"'), gbnf_source('root ::= "yes" | "no"')):
        grammar = compile_grammar(source, resident.tokenizer)
        assert resident.generate(PROMPT, GenerationConfig(constraint=grammar)).text in ("yes", "no")


@pytest.mark.parametrize(
    "make, wanted",
    [
        (lambda: json_schema_source([1]), "must be a JSON object"),
        (lambda: json_schema_source({"type": "strin"}), "cannot be used"),
        (lambda: json_schema_source({"a": {"b": {}}} | _deep(100)), "nests more than"),
        (lambda: json_schema_source({"enum": ["x" * 600_000]}), "characters"),
        (lambda: lark_source("start: ("), "cannot be used"),
        (lambda: gbnf_source("root ::= ("), "not GBNF"),
    ],
)
def test_a_bad_grammar_is_one_line_saying_what_is_wrong(resident, make, wanted):
    with pytest.raises(GrammarError, match=wanted) as caught:
        compile_grammar(make(), resident.tokenizer)
    assert "\n" not in str(caught.value)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema
