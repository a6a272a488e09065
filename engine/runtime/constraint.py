"""Constrained decoding: a reply that must match a grammar (a JSON schema, a Lark or GBNF grammar).

llguidance does the work: it compiles the grammar against the tokenizer's vocabulary and, before
each token, says which tokens keep the reply inside the grammar (a bitmask). The sampler sets every
other token's logit to -inf before mlx-lm's processors and sampler see the logits
(runtime/sampling.py), so every mode and every sampling setting keeps to the grammar. The mask for
token t+1 needs token t on the host: a constrained reply's steps are never built ahead
(`Decoder.pipelined`). The reply ends, as at an end-of-sequence token, once the grammar is complete
and allows nothing more.

A grammar comes from a client, so it is bounded before and while it is compiled: its text's size
(MAX_GRAMMAR_CHARS), its JSON's nesting (MAX_SCHEMA_DEPTH), and llguidance's own limits on the
work a compile and each token's mask may take (`LLParserLimits`: it answers an error, never hangs).
Every refusal is a GrammarError naming what is wrong.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from ..errors import Edge0Error

# A grammar's text (a schema as JSON, a Lark or GBNF grammar; a forced call's holds every tool's
# schema): above an agent's whole tool set, below what would take llguidance long to read.
MAX_GRAMMAR_CHARS = 500_000
# How deep a JSON schema may nest (the chat template's bound on a tool's): walked without
# recursion here; llguidance recurses.
MAX_SCHEMA_DEPTH = 64
# llguidance's bounds on a compile's work (lexer fuel, grammar size) and each token's mask (step
# fuel, Earley items): a grammar past them is an error, not a hang. Kept below llguidance's own
# defaults, which are sized for a server that can afford a slower first token.
LIMITS = dict(
    initial_lexer_fuel=500_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # an error names the fault, not the parser's state
)
# JSON as the model writes it under a schema: compact, no free whitespace (a small model given
# the choice can write spaces until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(Edge0Error):
    """A grammar the engine cannot use; the message says what is wrong."""


@dataclass(frozen=True)
class GrammarSource:
    """A grammar in llguidance's terms (`json_schema_source`, `lark_source`, `gbnf_source`):
    checked for size, not yet compiled against a tokenizer."""

    text: str


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"{what} has {len(text)} characters: at most {MAX_GRAMMAR_CHARS} are taken"
        )
    return text


def _json_depth(value: object) -> int:
    """How deep a JSON value nests (walked without recursion)."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        if isinstance(item, dict):
            pending += [(inner, depth + 1) for inner in item.values()]
        elif isinstance(item, list):
            pending += [(inner, depth + 1) for inner in item]
    return deepest


# Keywords whose values are data, not schemas: an object there is left as it is.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def closed_schema(schema: object) -> object:
    """A copy of `schema` where every object that lists its properties allows no others unless
    it says so (`additionalProperties: false`, as xgrammar's strict mode and OpenAI's strict
    schemas have it). The grammar only narrows: every value it allows still validates against
    `schema`; but a model is not led into writing a key of its own that never ends. The caller
    bounds the depth (MAX_SCHEMA_DEPTH)."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYWORDS else closed_schema(value)
        for key, value in schema.items()
    }
    opens = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if isinstance(schema.get("properties"), dict) and not any(key in schema for key in opens):
        out["additionalProperties"] = False
    return out


def _check_depth(schema: object, what: str) -> None:
    if _json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} nests more than {MAX_SCHEMA_DEPTH} levels deep")


def json_schema_source(schema: object, what: str = "the schema") -> GrammarSource:
    """A JSON schema (a dict, or True for any JSON object) as a grammar source, its objects
    closed (`closed_schema`)."""
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object")
    _check_depth(schema, what)
    text = _bounded(json.dumps(closed_schema(schema), ensure_ascii=False), what)
    try:
        return GrammarSource(llguidance.LLMatcher.grammar_from_json_schema(text, JSON_OPTIONS))
    except ValueError as e:
        raise GrammarError(f"{what} is not a usable JSON schema: {_first_line(e)}") from None


def lark_source(text: str, what: str = "the grammar") -> GrammarSource:
    """A Lark grammar (llguidance's dialect: `%json {...}` embeds a JSON schema)."""
    return GrammarSource(llguidance.LLMatcher.grammar_from_lark(_bounded(text, what)))


def gbnf_source(text: str, what: str = "the grammar") -> GrammarSource:
    """A GBNF grammar (llama.cpp's), turned into Lark."""
    try:
        lark = gbnf_to_lark(_bounded(text, what))
    except (GbnfToLarkError, ValueError, RecursionError) as e:
        raise GrammarError(f"{what} is not GBNF: {_first_line(e)}") from None
    return lark_source(lark, what)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


# llguidance's view of a tokenizer (its vocabulary as bytes, a token trie): built once per
# tokenizer, under a lock (two requests' first compiles must not build it twice).
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()


def _vocabulary(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for an mlx-lm TokenizerWrapper (or a transformers fast tokenizer)."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    with _VOCABULARIES_LOCK:
        found = _VOCABULARIES.get(tokenizer)
        if found is not None:
            return found
        hf = tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else tokenizer._tokenizer
        eos = getattr(tokenizer, "eos_token_ids", None) or hf.eos_token_id
        eos = sorted(eos) if isinstance(eos, (set, list, tuple)) else eos
        try:
            found = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        except ValueError as e:  # a slow (Python) tokenizer: llguidance reads fast ones only
            raise GrammarError(
                f"this model's tokenizer cannot be read for constrained decoding: {_first_line(e)}"
            ) from None
        _VOCABULARIES[tokenizer] = found
        return found


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled for one tokenizer: `start` gives each reply its own matcher, a copy of
    `compiled` (which shares its lexer and the masks it has worked out). What a
    GenerationConfig's `constraint` holds."""

    source: GrammarSource
    vocabulary: llguidance.LLTokenizer
    compiled: llguidance.LLMatcher

    def start(self) -> GrammarMatcher:
        return GrammarMatcher(self.compiled.deep_copy(), self.vocabulary.vocab_size)


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def compile_grammar(source: GrammarSource, tokenizer, what: str = "the grammar") -> Grammar:
    """`source` compiled for `tokenizer` (the engine's), or a GrammarError saying what is wrong.
    Needs no MLX: run it off the engine's thread (llguidance releases the GIL while it works).
    The first token's mask is worked out here too: a grammar's costly part (its lexer's large
    expressions) is then paid here, not by the engine's thread, and copies start from it."""
    vocabulary = _vocabulary(tokenizer)
    compiled = llguidance.LLMatcher(vocabulary, source.text, log_level=0, limits=_limits())
    if not compiled.is_error():
        compiled.compute_bitmask()
    if compiled.is_error():
        raise GrammarError(f"{what} cannot be used: {_first_line(Exception(compiled.get_error()))}")
    return Grammar(source, vocabulary, compiled)


class GrammarMatcher:
    """One reply's place in its grammar: the mask of the tokens allowed next, and the tokens
    taken. `mask_ms` counts the host time spent on masks since it was last taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.mask_ms = 0.0

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` (1, vocab) with every token the grammar does not allow next at -inf. A
        vocabulary larger than the tokenizer's (padded embeddings) has its extra ids masked."""
        started = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._error()}")
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").view(bool)
        vocab = logits.shape[-1]
        if allowed.size != vocab:
            allowed = np.pad(allowed[:vocab], (0, max(0, vocab - allowed.size)))
        masked = mx.where(mx.array(allowed), logits, -mx.inf)
        self.mask_ms += (time.perf_counter() - started) * 1e3
        return masked

    def advance(self, token: int) -> None:
        """Take the sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not fit the grammar: {self._error()}")

    def _error(self) -> str:
        return _first_line(Exception(self._matcher.get_error()))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the reply ends here."""
        return self._matcher.is_stopped()

    def take_mask_ms(self) -> float:
        taken, self.mask_ms = self.mask_ms, 0.0
        return taken
