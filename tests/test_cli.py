"""The `edge0 generate` contract other tools depend on, and errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_runner import run_cli

from edge0_tui.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    """In a process of its own, as the `edge0` command (`run_cli`: the same, seen in-process)."""
    command = [sys.executable, "-m", "edge0_tui.cli", *args]
    return subprocess.run(command, capture_output=True, text=True)


def test_generate_json_contract(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    # A cache short of every expert: held whole, a layer would need no guess.
    out = _run(
        "generate",
        str(model),
        "--prompt",
        "def main():",
        "--max-tokens",
        "6",
        "--json",
        "--expert-cache",
        "100K",
    )
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)  # stdout is exactly one JSON object
    assert {"mode", "prompt_tokens", "tokens", "text", "steps", "summary"} <= set(payload)
    assert (
        payload["mode"] == "prefetch"
    )  # the default: exact, reading ahead the lookahead's guesses
    assert 0.0 <= payload["summary"]["lookahead_recall"] <= 1.0
    assert payload["summary"]["routed_by_layer"]
    assert 1 <= len(payload["tokens"]) <= 6
    step = payload["steps"][-1]
    for key in (
        "wall_ms",
        "blocked_ms",
        "loads",
        "hits",
        "mib_read",
        "mib_per_load",
        "cold_fraction",
        "ms_per_load",
        "mlx_active_bytes",
        "mlx_cache_bytes",
        "mlx_peak_bytes",
        "page_cache_expert_bytes",
        "rss_bytes",
        "host_syncs",
        "host_sync_reasons",
    ):
        assert key in step
    summary = payload["summary"]
    # Every MoE layer reads its routing back (nothing is held), and the step its token.
    assert step["host_syncs"] == len(step["routed_by_layer"]) + 1
    assert summary["median_host_syncs"] == step["host_syncs"]
    assert summary["peak_mlx_bytes"] > 0
    assert summary["prefill_tok_per_s"] > 0 and summary["ttft_ms"] > 0


def test_generate_is_seeded_and_resident_agrees(checkpoint_dir, capsys):
    model = str(checkpoint_dir("qwen3_moe"))
    common = ["generate", model, "--prompt", "x = 1", "--max-tokens", "8", "--json"]
    sampled = ["--temp", "0.9", "--top-p", "0.9", "--seed", "7"]
    outputs = []
    for extra in (sampled, sampled, ["--mode", "resident", *sampled]):
        assert main(common + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outputs[0] == outputs[1] == outputs[2]


def test_generate_takes_the_samplers_options(checkpoint_dir, capsys):
    common = ["generate", str(checkpoint_dir("qwen3_moe")), "--prompt", "x = 1"]
    common += ["--max-tokens", "16", "--json"]

    def tokens(*extra: str) -> list[int]:
        assert main(common + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    greedy = tokens()
    repeated = [t for i, t in enumerate(greedy) if t in greedy[:i]]
    assert repeated  # this checkpoint's greedy reply repeats a token: penalties have work to do
    for flag, value in [
        ("--repetition-penalty", "10"),
        ("--presence-penalty", "2"),
        ("--frequency-penalty", "2"),
    ]:
        penalized = tokens(flag, value)
        assert penalized != greedy and penalized.count(repeated[0]) == 1, flag
    # min-p 1 keeps only the likeliest token: a hot sampler gives the greedy reply.
    assert tokens("--temp", "5", "--seed", "1") != greedy
    assert tokens("--temp", "5", "--seed", "1", "--min-p", "1") == greedy


def test_chat_hands_the_samplers_options_to_the_app(checkpoint_dir, monkeypatch):
    from edge0_tui.app import Edge0App
    from edge0_tui.model_start import DEFAULT_SETTINGS

    seen = []
    monkeypatch.setattr(
        Edge0App, "run", lambda app: seen.append(app.chat_screen.controller.settings)
    )
    model = str(checkpoint_dir("qwen3_moe"))
    assert main(["chat", model, "--min-p", "0.05", "--repetition-penalty", "1.2"]) == 0
    assert main(["chat", model]) == 0
    given, plain = seen
    assert (given.min_p, given.repetition_penalty) == (0.05, 1.2)
    assert given.temperature == DEFAULT_SETTINGS.temperature  # the rest as kept
    assert plain == DEFAULT_SETTINGS


def test_chat_template_applied_by_default_raw_on_request(checkpoint_dir, capsys):
    model = str(checkpoint_dir("qwen3_moe"))
    common = ["generate", model, "--prompt", "hi", "--max-tokens", "2", "--json"]
    prompts = []
    for extra in ([], ["--chat"], ["--raw"]):  # --chat: the default, still accepted
        assert main(common + extra) == 0
        prompts.append(json.loads(capsys.readouterr().out)["prompt_tokens"])
    default, chat, raw = prompts
    assert default == chat and len(default) > len(raw)


def test_version():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.startswith("edge0 ")


def test_raw_and_chat_together_are_one_line_error(checkpoint_dir):
    out = run_cli("generate", str(checkpoint_dir()), "--prompt", "x", "--raw", "--chat")
    assert out.returncode == 2 and out.stderr.startswith("edge0: error: ")
    assert out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "/nonexistent/model", "--prompt", "x"], "no such local directory"),
        (["generate", "{model}", "--prompt", "x", "--expert-cache", "1K"], "minimum is"),
        (["generate", "{model}", "--prompt", "x", "--expert-cache", "lots"], "cannot read size"),
        (["synth", "{tmp}/out", "--family", "llama"], "llama"),
    ],
)
def test_errors_are_one_line(checkpoint_dir, tmp_path, args, message):
    args = [a.format(model=checkpoint_dir("qwen3_moe"), tmp=tmp_path) for a in args]
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_generate_draft_reports_each_verify_step_in_json(checkpoint_dir):
    """--draft lookup: each step says its positions, drafts, kept drafts and tokens given, and
    the union of its routed experts against one position at a time; a mode that cannot draft
    is one line."""
    model = str(checkpoint_dir("qwen3_moe"))
    args = ["generate", model, "--prompt", "a b a b a b a b", "--raw", "--max-tokens", "8"]
    out = run_cli(*args, "--draft", "lookup", "--expert-cache", "100K", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    decode = [s for s in payload["steps"] if s["phase"] == "decode"]
    assert sum(s["given"] for s in decode) + 1 == len(payload["tokens"])
    for step in decode:
        assert step["tokens"] == step["drafted"] + 1 and step["accepted"] <= step["drafted"]
        assert 0 < step["experts_union"] <= step["experts_summed"]
    out = run_cli("generate", "demo", "--prompt", "x", "--draft", "lookup", "--mode", "prerouter")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "its routing of a position is predicted" in out.stderr


def test_failed_start_leaves_no_thread(checkpoint_dir):
    import threading

    from engine.config import EngineConfig
    from engine.errors import Edge0Error
    from engine.runtime.generation import Engine

    before = threading.active_count()
    with pytest.raises(Edge0Error, match="minimum"):
        Engine(checkpoint_dir("qwen3_moe"), EngineConfig(expert_cache_bytes=1000))
    assert threading.active_count() == before


@pytest.mark.parametrize(
    "command, says",
    [
        (("generate",), ["checkpoint directory, Hugging Face repo id, or demo"]),
        (("bench",), ["default: resident,on-demand,prerouter", "MODE+lookup"]),
        (
            ("generate",),
            ["Greedy output equals the plain run's (exact); sampled output keeps its distribution"],
        ),
        (
            ("train", "heads"),
            [
                "the routing width the heads predict",
                "(default: 400)",
                "(default: 60000)",
                "(default: the second MoE layer)",
            ],
        ),
    ],
)
def test_help_states_what_a_model_can_be_and_each_default(command, says):
    """What a new user reads first: the model argument and the defaults, said in --help."""
    out = run_cli(*command, "--help")
    assert out.returncode == 0
    # argparse wraps at any column, and after a hyphen
    text = " ".join(out.stdout.split()).replace("- ", "-")
    for said in says:
        assert said in text, said
