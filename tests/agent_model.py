"""A tiny checkpoint that really calls a tool: the rig of the server's tool-calling tests.

The tiny qwen3_moe checkpoint (engine/train/synth.py) gets a Qwen3-style chat template (tools
listed in the system turn, calls written as `<tool_call>` JSON, results as `<tool_response>`,
`enable_thinking` opening `<think>`), and its float weights are trained, before they are cast
and quantized like every synthetic checkpoint, to memorize the replies of a few conversations:
plain next-token cross-entropy on the reply tokens, the prompts being what the server renders
for the requests the tests send (the OpenAI and the Anthropic requests go through the server's
own request parsers, then the template, so a prompt is token for token the one the server gives
the model). Memorized replies (greedy):

- asked the weather in Paris with the weather tool: `<tool_call>` get_weather {"city": "Paris"};
- the same with thinking on (the Anthropic request): reasoning, `</think>`, then the same call;
- given the tool's result: a final text answer.

Nothing in the server knows about this: it renders the template, runs the engine, and parses
what the model wrote. `PYTHONPATH=. python tests/agent_model.py DIR` writes the checkpoint for a
manual run.

The training is most of the cost, and its result depends only on its recipe: the examples (as
the server renders them today), this file, the synthetic model's code, MLX and mlx-lm. Given a
`weights_cache` folder, the trained float weights are kept there under a hash of that recipe and
reused while it holds; the checkpoint itself is written by today's code every time.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map_with_path

import engine.train.synth as synth
import engine.train.synth_families as synth_families
from edge0_tui.server.anthropic_shapes import parse_messages
from edge0_tui.server.openai_shapes import parse_chat
from engine.runtime.chat_template import render_chat_template
from engine.train.synth import EOS_TOKEN_ID, GROUP_SIZE, build_tokenizer, write_synthetic_checkpoint

MODEL_ID = "tiny-agent"
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>"
    "<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' + '
    "(call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ANTHROPIC_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
QUESTION = "What is the weather in Paris?"
CALL_ARGUMENTS = {"city": "Paris"}
TOOL_RESULT = "Sunny, 24 C"
ANSWER = "It is sunny in Paris, 24 C."
REASONING = "The user wants the weather in Paris. The get_weather tool knows it."
# Training stops once every reply token's logit, in the model as written, beats the next best by
# this much (what is left between the written model and `_as_written`'s is float rounding), or
# after MAX_STEPS.
MARGIN = 2.0
MAX_STEPS = 400
# The rate falls to a tenth over these steps (cosine), then stays: a constant rate kept
# overshooting the margins it had reached, and took longer to settle them.
DECAY_STEPS = 120
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(CALL_ARGUMENTS) + "}\n"
    "</tool_call>"
)


def openai_ask() -> list[dict]:
    return [{"role": "user", "content": QUESTION}]


def openai_after_call(call_id: str = "call_0") -> list[dict]:
    """The conversation once the model called the tool and the tool answered."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGUMENTS)},
    }
    return [
        *openai_ask(),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]


def anthropic_ask() -> list[dict]:
    return [{"role": "user", "content": QUESTION}]


def anthropic_after_call(use_id: str = "toolu_0") -> list[dict]:
    use = {"type": "tool_use", "id": use_id, "name": "get_weather", "input": CALL_ARGUMENTS}
    result = {"type": "tool_result", "tool_use_id": use_id, "content": TOOL_RESULT}
    return [
        *anthropic_ask(),
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]


def _lessons() -> list[tuple[object, str]]:
    """(the server's parsed request, the reply to memorize) for each conversation taught."""
    ids = (MODEL_ID,)
    openai = {"model": MODEL_ID, "tools": [WEATHER_TOOL]}
    anthropic = {"model": MODEL_ID, "max_tokens": 64, "tools": [ANTHROPIC_WEATHER_TOOL]}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    return [
        (parse_chat({**openai, "messages": openai_ask()}, ids), CALL_TEXT),
        (parse_chat({**openai, "messages": openai_after_call()}, ids), ANSWER),
        (parse_messages({**anthropic, "messages": anthropic_ask()}, ids), CALL_TEXT),
        (parse_messages({**anthropic, "messages": anthropic_after_call()}, ids), ANSWER),
        (
            parse_messages({**anthropic, "messages": anthropic_ask(), "thinking": thinking}, ids),
            REASONING + "\n</think>\n\n" + CALL_TEXT,
        ),
    ]


def _set_template(model_dir: Path) -> None:
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN_LIKE_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _examples() -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, reply tokens + EOS) of each lesson, rendered by the engine's own
    chat-template code with the checkpoint's tokenizer and template."""
    from mlx_lm.utils import load_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        build_tokenizer(Path(scratch), 1024)
        _set_template(Path(scratch))
        tokenizer = load_tokenizer(Path(scratch))
        examples = []
        for request, reply in _lessons():
            prompt = render_chat_template(
                tokenizer,
                list(request.messages),
                Path(scratch),
                list(request.tools) if request.tools else None,
                request.template_kwargs,
            )
            answer = list(tokenizer.encode(reply, add_special_tokens=False)) + [EOS_TOKEN_ID]
            if (prompt, answer) not in examples:  # the APIs may render the same prompt
                examples.append((prompt, answer))
    return examples


def _as_written(path: str, value: mx.array) -> mx.array:
    """`value` as the checkpoint will hold it: bf16, and the weights of Linears and Embeddings
    4-bit (routers 8-bit) as synth quantizes qwen3_moe (group 64), dequantized; the gradient
    passes straight through (quantization-aware training: a margin learned in float32 alone
    did not survive the rounding)."""
    written = value.astype(mx.bfloat16)
    if path.endswith(".weight") and value.ndim >= 2 and value.shape[-1] % GROUP_SIZE == 0:
        bits = 8 if path.endswith("mlp.gate.weight") else 4
        packed = mx.quantize(written, group_size=GROUP_SIZE, bits=bits)
        written = mx.dequantize(*packed, group_size=GROUP_SIZE, bits=bits)
    return value + mx.stop_gradient(written.astype(value.dtype) - value)


def _memorize(examples: list[tuple[list[int], list[int]]], learning_rate: float):
    """`fit` for write_synthetic_checkpoint: next-token cross-entropy on the replies only, of the
    model as it will be written (`_as_written`), until every reply token beats every other token
    by MARGIN logits (so the checkpoint replies the same, greedy), or MAX_STEPS."""
    length = max(len(p) + len(r) for p, r in examples)
    rows, targets, weights = [], [], []
    for prompt, reply in examples:
        sequence = prompt + reply
        pad = length - len(sequence)
        rows.append(sequence[:-1] + [0] * pad)
        targets.append(sequence[1:] + [0] * pad)
        weights.append([0.0] * (len(prompt) - 1) + [1.0] * len(reply) + [0.0] * pad)
    inputs, labels, mask = mx.array(rows), mx.array(targets), mx.array(weights)

    def loss_of(model: nn.Module) -> mx.array:
        losses = nn.losses.cross_entropy(model(inputs), labels, reduction="none")
        return (losses * mask).sum() / mask.sum()

    def smallest_margin(model: nn.Module) -> float:
        logits = model(inputs)
        target = mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        is_target = mx.arange(logits.shape[-1]) == labels[..., None]
        others = mx.where(is_target, -mx.inf, logits).max(axis=-1)
        return mx.where(mask > 0, target - others, mx.inf).min().item()

    def fit(model: nn.Module) -> None:
        params = model.trainable_parameters()

        def loss_as_written(params):
            model.update(tree_map_with_path(_as_written, params))
            return loss_of(model)

        rate = optim.cosine_decay(learning_rate, DECAY_STEPS, learning_rate / 10)
        optimizer = optim.Adam(learning_rate=rate)
        step = mx.value_and_grad(loss_as_written)
        for steps in range(1, MAX_STEPS + 1):
            loss, grads = step(params)
            params = optimizer.apply_gradients(grads, params)
            mx.eval(params, optimizer.state, loss)
            if steps % 10 == 0:
                model.update(tree_map_with_path(_as_written, params))
                if smallest_margin(model) > MARGIN:
                    break
        fit.steps, fit.loss, fit.margin = steps, loss.item(), smallest_margin(model)
        model.update(params)

    return fit


def recipe_key(examples: list[tuple[list[int], list[int]]], learning_rate: float) -> str:
    """A hash of everything the trained weights depend on: the examples' tokens, the training
    (this file), the model's config and initialization (synth's code) and the libraries."""
    import mlx_lm

    digest = hashlib.sha256(json.dumps([examples, learning_rate]).encode())
    for module in (sys.modules[__name__], synth, synth_families):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(f"mlx {mx.__version__} mlx-lm {mlx_lm.__version__}".encode())
    return digest.hexdigest()[:16]


def _reuse(weights: Path):
    """`fit` that puts the float weights trained before into the model instead of training."""

    def fit(model: nn.Module) -> None:
        model.load_weights(str(weights))
        fit.steps, fit.loss, fit.margin = 0, None, None

    return fit


def _keep(fit, weights: Path):
    """`fit`, then its float weights saved to `weights` (written whole, then renamed) in place of
    those of an older recipe."""

    def keep(model: nn.Module) -> None:
        fit(model)
        keep.steps, keep.loss, keep.margin = fit.steps, fit.loss, fit.margin
        partial = weights.with_suffix(".partial.safetensors")
        mx.save_safetensors(str(partial), dict(tree_flatten(model.parameters())))
        partial.replace(weights)
        for older in weights.parent.glob("agent-*.safetensors"):
            if older != weights:
                older.unlink()

    return keep


def write_agent_checkpoint(
    out_dir: Path, learning_rate: float = 1e-2, weights_cache: Path | None = None
) -> dict:
    """The tool-calling tiny checkpoint in `out_dir` (see the module's docstring); returns what
    its training took (steps, last loss, smallest margin of the model as written; 0 steps where
    the weights came from `weights_cache`)."""
    examples = _examples()
    fit = _memorize(examples, learning_rate)
    if weights_cache is not None:
        weights = weights_cache / f"agent-{recipe_key(examples, learning_rate)}.safetensors"
        fit = _reuse(weights) if weights.exists() else _keep(fit, weights)
    write_synthetic_checkpoint(out_dir, "qwen3_moe", "tiny", fit=fit)
    _set_template(out_dir)
    return {"steps": fit.steps, "loss": fit.loss, "margin": fit.margin}


if __name__ == "__main__":  # python tests/agent_model.py DIR (run with PYTHONPATH=.)
    print(json.dumps(write_agent_checkpoint(Path(sys.argv[1]))))
