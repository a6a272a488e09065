"""Bad arguments, one line each: `edge0 generate`'s sampling values and the other commands'
counts, text files that are FIFOs, bytes that are not UTF-8, and GenerationConfig's own checks.
The contract of test_bad_inputs.py: exit status 2, one `edge0: error:` line, no traceback."""

from __future__ import annotations

import os

import pytest
from cli_runner import run_cli, run_process
from test_bad_inputs import assert_refused

from edge0_tui.cli import main
from engine import Edge0Error, GenerationConfig

# -- 8 and 10: arguments and sampling values, one line each ------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--top-k", "100000"], "top_k=100000 must be below the vocabulary size of 1024"),
        (["--top-k", "-1"], "top_k=-1 must be an integer 0 (off) or more"),
        (["--seed", "-1"], "seed=-1 must be an integer between 0 and"),
        (["--seed", str(2**70)], f"seed={2**70} must be an integer between 0 and"),
        (["--max-tokens", "0"], "max_tokens=0 must be an integer at least 1"),
        (["--max-tokens", "-1"], "max_tokens=-1 must be an integer at least 1"),
        (["--temp", "nan"], "temperature=nan must be a finite number >= 0"),
        (["--temp", "-1"], "temperature=-1.0 must be a finite number >= 0"),
        (["--temp", "inf"], "temperature=inf must be a finite number >= 0"),
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
        (["--top-p", "nan"], "top_p=nan must be in (0, 1]"),
        (["--min-p", "1.5"], "min_p=1.5 must be in [0, 1]"),
        (["--repetition-penalty", "0"], "repetition_penalty=0.0 must be in (0, 10]"),
        (["--presence-penalty", "3"], "presence_penalty=3.0 must be in [-2, 2]"),
        (["--frequency-penalty", "nan"], "frequency_penalty=nan must be in [-2, 2]"),
        (["--min-p", "most"], "argument --min-p: invalid float value: 'most'"),
        (["--expert-cache", "1.2.3"], "argument --expert-cache: cannot read size '1.2.3'"),
        (["--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
        (["--prompt", "a\udcff"], "argument --prompt: not valid UTF-8 (byte 0xff at character 1)"),
        (["--prompt", "a\udcff", "--json"], "argument --prompt: not valid UTF-8"),
    ],
)
def test_bad_argument_is_one_line(checkpoint_dir, capsys, extra, message):
    argv = ["generate", str(checkpoint_dir("qwen3_moe")), "--prompt", "hello", *extra]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors exit
        status = e.code
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edge0: error: {message}"), captured.err


def test_chat_sampling_value_is_one_line(checkpoint_dir, capsys):
    status = main(["chat", str(checkpoint_dir("qwen3_moe")), "--presence-penalty", "-3"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert (
        captured.err == "edge0: error: presence_penalty=-3.0 must be in [-2, 2] (0 turns it off)\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "M", "--rounds", "0"], "argument --rounds: 0 must be at least 1"),
        (["bench", "M", "--tokens", "-3"], "argument --tokens: -3 must be at least 1"),
        (["bench", "M", "--sync-cost", "2s"], "argument --sync-cost: 2s is more than a second"),
        (["bench", "M", "--sync-cost", "5x"], "argument --sync-cost: cannot read duration '5x'"),
        (["soak", "M", "--turns", "0"], "argument --turns: 0 must be at least 1"),
        (["soak", "M", "--steps", "-1"], "argument --steps: -1 must be at least 1"),
        (
            ["eval", "M", "--text", "t", "--samples", "0"],
            "argument --samples: 0 must be at least 1",
        ),
        (["eval", "M", "--text", "t", "--max-tokens", "0"], "argument --max-tokens: 0 must be"),
        (["synth", "OUT", "--seed", "-1"], "argument --seed: -1 must be between 0 and"),
        (["synth", "OUT", "--seed", str(2**64)], f"argument --seed: {2**64} must be between 0"),
        (["synth", "OUT", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
        # Training hyperparameters: each was accepted, and --lr nan trained to NaN and exited 0.
        (["train", "lora", "M", "--k", "2", "--text", "t", "--lr", "nan"], "argument --lr: nan"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--lr", "inf"], "argument --lr: inf"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--lr", "-1"], "argument --lr: -1"),
        (["train", "distill", "M", "--k", "2", "--text", "t", "--lr", "0"], "argument --lr: 0"),
        (["train", "lora", "M", "--k", "0", "--text", "t"], "argument --k: 0 must be at least 1"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--steps", "0"], "argument --steps"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--batch", "0"], "argument --batch"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--generate", "-5"], "argument --gen"),
        (["train", "heads", "M", "--k", "2", "--steps", "-1"], "argument --steps: -1 must be"),
        (["train", "heads", "M", "--k", "2", "--max-tokens", "0"], "argument --max-tokens: 0"),
        (["train", "heads", "M", "--k", "2", "--start-layer", "-1"], "argument --start-layer"),
        (["train", "base", "OUT", "--steps", "0"], "argument --steps: 0 must be at least 1"),
    ],
)
def test_bad_argument_of_the_other_commands_is_one_line(capsys, argv, message):
    """Each was a traceback (ZeroDivisionError, IndexError, mlx's seed()) or a two-line error."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edge0: error: {message}"), captured.err


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_text_file_that_is_a_fifo(checkpoint_dir, tmp_path, command):
    """A FIFO given as --prompt-file or --text blocked forever."""
    fifo = tmp_path / "text"
    os.mkfifo(fifo)
    option = "--prompt-file" if command == "bench" else "--text"
    out = run_cli(command, str(checkpoint_dir("qwen3_moe")), option, str(fifo))
    assert_refused(out, fifo, "not a regular file")


def test_synth_into_a_file_is_one_line(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    out = run_cli("synth", str(taken))
    assert_refused(out, taken, "cannot write the checkpoint (Not a directory)")
    assert taken.read_text() == "mine"


def test_bench_on_a_missing_model_says_so(capsys, tmp_path):
    assert main(["bench", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == (
        f"edge0: error: {tmp_path / 'nothing'}: no such local directory "
        f"({tmp_path / 'nothing'} does not exist)\n"
    )


def test_bench_says_a_child_error_once(checkpoint_dir):
    out = run_cli(
        "bench", str(checkpoint_dir("qwen3_moe")), "--k", "3", "--arms", "on-demand",
        "--rounds", "1", "--tokens", "2",
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("edge0: error: sampling the token sequence failed: K=3 is not available")


def test_prompt_bytes_that_are_not_utf8(checkpoint_dir):
    """The real thing: bytes on the command line, as `$(printf 'a\\xff')` passes them."""
    model = str(checkpoint_dir("qwen3_moe"))
    for extra in ([], ["--json"]):
        out = run_process("generate", model, "--prompt", b"a\xff", *extra)
        assert_refused(out, None, "argument --prompt: not valid UTF-8 (byte 0xff")


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
        {"max_tokens": 10**6, "temperature": 2.5, "top_p": 1e-9, "top_k": 5, "seed": 2**64 - 1},
    ],
)
def test_generation_config_accepts_the_bounds(fields):
    assert GenerationConfig(**fields).max_tokens == fields["max_tokens"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("top_k", -1),
        ("seed", -1),
        ("seed", 2**64),
        ("temperature", float("nan")),
        ("temperature", "0.5"),
        ("top_p", float("inf")),
    ],
)
def test_generation_config_refuses_naming_the_field(field, value):
    with pytest.raises(Edge0Error, match=f"^{field}="):
        GenerationConfig(**{field: value})
