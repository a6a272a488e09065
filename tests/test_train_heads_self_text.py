"""Phase 1's default text for a model other than the demo (issue 35 item 5): the text the model
writes itself from the built-in prompts, through its chat template, split by prompt, reproducible,
resumable, bounded; and the comparison with the heads found before on the same held-out tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from adapters import write_random_profile

import engine.train.heads as heads_module
from edge0_tui.cli import main
from engine.config import EngineConfig
from engine.runtime.generation import Engine
from engine.train.heads import TrainHeadsConfig, train_heads
from engine.train.self_prompts import PROMPTS, held_out_prompts
from engine.train.self_text import SAMPLES, SelfTextConfig, write_self_text

# Small enough for a tiny model in a few seconds, with a reply to every held-out prompt (their
# prompts take 408 tokens in the tiny models' tokenizer, and a reply at least 16) and a few train
# prompts' replies after them: every reply is a decode of its own, which is the cost here.
HELD = 640
SMALL = SelfTextConfig(tokens=HELD + 320, reply_tokens=24)
# What phase 1 asks for in `train_heads` (holdout 0.1 of it in whole windows of 64: 2 of them).
PHASE_1 = SelfTextConfig(tokens=1280, reply_tokens=24)


def samples(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / SAMPLES).read_text().splitlines()]


def write(model_dir, work, config=SMALL, engine_config=None):
    with Engine(model_dir, engine_config or EngineConfig()) as engine:
        return write_self_text(engine, work, config, HELD, log=lambda line: None)


@pytest.fixture(scope="module")
def small_text(checkpoint_dir, tmp_path_factory):
    """The tiny model's SMALL text, written once for the tests that only read it (a write is a
    decode per reply: the cost of this module)."""
    return write(checkpoint_dir("qwen3_moe"), tmp_path_factory.mktemp("self-text"))


def test_the_text_is_written_through_the_chat_template_split_by_prompt(
    checkpoint_dir, tmp_path, small_text
):
    model_dir = checkpoint_dir("qwen3_moe")
    written = small_text
    assert written.templated
    # Bounded: each part exactly its share of the tokens asked for.
    assert len(written.held_out) == HELD and len(written.train) == SMALL.tokens - HELD
    kept = samples(written.folder)
    with Engine(model_dir) as engine:
        im_start, im_end = engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        for sample in kept:
            prompt = PROMPTS[sample["prompt"]].text
            # The prompt as a user turn in the template, the reply after the assistant's mark.
            text = engine.tokenizer.decode(sample["tokens"])
            turn = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            assert text.startswith(turn), text[:200]
            assert sample["tokens"][0] == im_start
    # Split by prompt: the held-out stream is the held-out prompts' replies, the train stream the
    # others', each in the order written; no prompt is in both.
    held = held_out_prompts()
    assert len(held) == 8 and {PROMPTS[i].kind for i in held} == {p.kind for p in PROMPTS}
    held_tokens = [t for s in kept if s["prompt"] in held for t in s["tokens"]]
    train_tokens = [t for s in kept if s["prompt"] not in held for t in s["tokens"]]
    assert written.held_out.tolist() == held_tokens[:HELD]
    assert written.train.tolist() == train_tokens[: SMALL.tokens - HELD]
    assert {s["prompt"] for s in kept if s["prompt"] in held} == held  # every held-out prompt
    assert written.held_out_prompts == 8
    assert written.train_prompts == len({s["prompt"] for s in kept if s["prompt"] not in held})
    assert im_end in written.train.tolist()  # replies end their turn (or are cut at their cap)
    # Reproducible: the same seed writes the same tokens; another seed, others.
    again = write(model_dir, tmp_path / "b")
    assert np.array_equal(again.train, written.train)
    assert np.array_equal(again.held_out, written.held_out)
    other = write(model_dir, tmp_path / "c", dataclasses.replace(SMALL, seed=1))
    assert not np.array_equal(other.train, written.train)


def count_replies(monkeypatch, calls: list, stop_at: int | None = None) -> None:
    """Each reply the writer starts (`Batch.join`) counted in `calls`; a KeyboardInterrupt (a
    user's Ctrl+C) instead of the one after `stop_at`."""
    from engine.runtime.batch import Batch

    real = Batch.join

    def join(self, *args, **kwargs):
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Batch, "join", join)


def test_a_stopped_write_keeps_its_replies_and_a_rerun_goes_on(
    checkpoint_dir, tmp_path, small_text, monkeypatch
):
    model_dir = checkpoint_dir("qwen3_moe")
    whole = small_text
    replies = len(samples(whole.folder))
    calls = []
    count_replies(monkeypatch, calls, stop_at=5)  # one reply at a time: five written, then stopped
    with Engine(model_dir) as engine:
        with pytest.raises(KeyboardInterrupt):
            write_self_text(engine, tmp_path / "stopped", SMALL, HELD, log=lambda line: None)
    (folder,) = (tmp_path / "stopped").glob("self-text-*")
    assert folder.name == whole.folder.name  # the same text's key
    assert len(samples(folder)) == 5
    had = sum(len(s["tokens"]) for s in samples(folder))  # all five in the held-out stream
    with open(folder / SAMPLES, "a") as f:
        f.write('{"round": 0, "prompt": 3, "tok')  # a write cut short: dropped, written again
    lines = []
    calls.clear()
    monkeypatch.undo()  # (the stopping count goes)
    count_replies(monkeypatch, calls)
    with Engine(model_dir) as engine:
        resumed = write_self_text(engine, tmp_path / "stopped", SMALL, HELD, log=lines.append)
    assert len(calls) == replies - 5  # only the replies not written before
    assert f"; {had:,} tokens written before, resuming" in lines[0]
    assert np.array_equal(resumed.train, whole.train)
    assert np.array_equal(resumed.held_out, whole.held_out)
    # Written in full: a rerun writes nothing.
    calls.clear()
    with Engine(model_dir) as engine:
        lines.clear()
        cached = write_self_text(engine, tmp_path / "stopped", SMALL, HELD, log=lines.append)
    assert calls == [] and np.array_equal(cached.train, whole.train)
    assert "written before" in lines[0]


def test_replies_written_together_are_the_text_written_one_at_a_time(
    checkpoint_dir, tmp_path, small_text, monkeypatch
):
    """Three replies at once in one batch (issue 48 item 2: one read of an expert serves every
    reply routed to it): each reply samples with its own seed and key, so the text is the one
    written a reply at a time, though the replies end, and are kept, in another order; a
    resume after a gap (a reply kept past one that is missing) writes only the missing one."""
    model_dir = checkpoint_dir("qwen3_moe")
    together = write(model_dir, tmp_path / "together", engine_config=EngineConfig(max_batch=3))
    assert np.array_equal(together.held_out, small_text.held_out)
    assert np.array_equal(together.train, small_text.train)
    kept = samples(together.folder)
    by_slot = {(s["round"], s["prompt"]): s["tokens"] for s in kept}
    alone = {(s["round"], s["prompt"]): s["tokens"] for s in samples(small_text.folder)}
    assert all(by_slot[slot] == alone[slot] for slot in alone if slot in by_slot)
    # A gap: the second reply's line removed, the others kept.
    lines = (together.folder / SAMPLES).read_text().splitlines(keepends=True)
    second = next(
        i for i, line in enumerate(lines) if json.loads(line)["prompt"] == kept[1]["prompt"]
    )
    (together.folder / SAMPLES).write_text("".join(lines[:second] + lines[second + 1 :]))
    calls = []
    count_replies(monkeypatch, calls)
    resumed = write(model_dir, tmp_path / "together", engine_config=EngineConfig(max_batch=3))
    assert len(calls) == 1 and np.array_equal(resumed.held_out, small_text.held_out)


def test_a_model_without_a_chat_template_continues_the_prompts(checkpoint_dir, tmp_path):
    model_dir = tmp_path / "plain"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    del tokenizer_config["chat_template"]
    config_path.write_text(json.dumps(tokenizer_config))
    lines = []
    with Engine(model_dir) as engine:
        assert not engine.tokenizer.has_chat_template
        written = write_self_text(engine, tmp_path / "w", SMALL, HELD, log=lines.append)
        im_start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
        for sample in samples(written.folder):
            prompt = engine.tokenizer.encode(PROMPTS[sample["prompt"]].text + "\n\n")
            assert sample["tokens"][: len(prompt)] == prompt
    assert not written.templated and im_start not in written.train.tolist()
    assert "as plain text (it has no chat template)" in lines[0]
    assert "as plain-text continuations" in written.describe(1, 1)


def test_train_heads_by_default_writes_the_text_and_compares_on_the_same_held_out_tokens(
    checkpoint_dir, tmp_path, monkeypatch
):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)  # heads found before, for the comparison
    scored = []
    real = heads_module.heldout_recalls

    def recording(traces, owners, held, forward, routing):
        scored.append((traces.folder, held))
        return real(traces, owners, held, forward, routing)

    monkeypatch.setattr(heads_module, "heldout_recalls", recording)
    config = TrainHeadsConfig(k=2, max_tokens=PHASE_1.tokens, steps=2, window=64)
    lines = []
    data = EngineConfig(data_dir=tmp_path / "data")
    train_heads(
        model_dir, None, config, progress=lines.append, engine_config=data, self_text=PHASE_1
    )
    (text,) = [line for line in lines if line.startswith("training text: ")]
    assert "tokens the model wrote from" in text and "through its chat template" in text
    kept = samples(next((tmp_path / "data").glob("adapters/*/work/self-text-*")))
    asked = {s["prompt"] for s in kept if s["prompt"] in held_out_prompts()}
    assert f"held out: its replies to {len(asked)} other prompts" in text
    # Both sets of heads scored on the same traces' same first windows: the held-out prompts'.
    assert len(scored) == 2 and scored[0] == scored[1]
    folder, held = scored[0]
    (written,) = (tmp_path / "data").glob("adapters/*/work/self-text-*")
    held_prompts = held_out_prompts()
    kept = samples(written)
    held_tokens = [t for s in kept if s["prompt"] in held_prompts for t in s["tokens"]]
    train_tokens = [t for s in kept if s["prompt"] not in held_prompts for t in s["tokens"]]
    windows = np.load(folder / "tokens.npy")
    held_out_tokens = 64 * round(0.1 * PHASE_1.tokens / 64)  # phase 1's holdout, whole windows
    assert held == held_out_tokens // 64 > 1
    assert windows[:held].ravel().tolist() == held_tokens[:held_out_tokens]
    train_windows = (PHASE_1.tokens - held_out_tokens) // 64
    assert windows[held:].ravel().tolist() == train_tokens[: train_windows * 64]
    (said,) = [line for line in lines if line.startswith("held-out text: ")]
    assert f"{held_out_tokens:,} tokens ({held} windows)" in said and "held-out prompts" in said
    (found,) = [line for line in lines if line.startswith("the heads found before")]
    assert "on the same held-out text" in found


def test_cli_self_text_tokens_bounds_the_text(checkpoint_dir, tmp_path, monkeypatch, capsys):
    model_dir = checkpoint_dir("qwen3_moe")
    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path / "data"))
    args = ["train", "heads", str(model_dir), "--k", "2", "--steps", "2", "--window", "64"]
    assert main([*args, "--max-tokens", "3000", "--self-text-tokens", "1100"]) == 0
    printed = capsys.readouterr().out
    assert "the model writes its training text: 1,100 tokens" in printed
    assert "the first reply: " in printed and "left take about" in printed
    (settings,) = (tmp_path / "data").glob("adapters/*/work/self-text-*/settings.json")
    assert json.loads(settings.read_text())["tokens"] == 1100
    (progress,) = (tmp_path / "data").glob("adapters/*/work/traces-*/progress.json")
    assert json.loads(progress.read_text())["shape"]["windows"] == 1100 // 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--text", "README.md"],
            "--self-text-tokens is for the model's own text: not with --text",
        ),
        (["--max-tokens", "100"], "--self-text-tokens 500 is above --max-tokens 100"),
    ],
)
def test_cli_self_text_tokens_refused_where_it_has_no_meaning(
    checkpoint_dir, extra, message, capsys
):
    args = ["train", "heads", str(checkpoint_dir("qwen3_moe")), "--k", "2"]
    assert main([*args, "--self-text-tokens", "500", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_asking_for_more_text_takes_the_replies_kept_and_writes_only_the_rest(
    checkpoint_dir, tmp_path, monkeypatch
):
    """`--self-text-tokens` only changes how far the text goes (issue 48 item 2): a text asked
    longer after a shorter one was written keeps the replies that a reply's cap lets it keep
    (the same key, the same folder), writes the rest, and is the text a fresh run of that length
    writes; asked shorter again, it writes nothing."""
    model_dir = checkpoint_dir("qwen3_moe")
    short = dataclasses.replace(SMALL, tokens=HELD + 160)
    first = write(model_dir, tmp_path / "grown", short)
    calls = []
    count_replies(monkeypatch, calls)
    grown = write(model_dir, tmp_path / "grown", SMALL)
    assert grown.folder == first.folder
    fresh = write(model_dir, tmp_path / "fresh", SMALL)
    replies = len(calls) - len(samples(fresh.folder))  # the grown run's own replies
    assert 0 < replies < len(samples(fresh.folder))  # some were kept
    assert np.array_equal(grown.train, fresh.train)
    assert np.array_equal(grown.held_out, fresh.held_out)
    calls.clear()
    again = write(model_dir, tmp_path / "grown", short)
    assert calls == [] and np.array_equal(again.train, first.train)
