"""Training results that do not mislead (issue 35 item 5): the demo trains its heads on its own
corpus by default (another model on the text it writes itself: test_train_heads_self_text.py), the
comparison with the heads found before is on the same held-out windows of that text, heads written where another folder shadows them are said to be shadowed before the
work starts, and heads without a LoRA are not called "without trained adapters"."""

from __future__ import annotations

import shutil

from adapters import write_random_profile
from test_train_base import texts_dir  # noqa: F401 (a fixture: 40 fake works, no download)

from edge0_tui.cli import main
from edge0_tui.model_source import BUNDLED_DEMO
from engine.config import EngineConfig
from engine.runtime.generation import Engine
from engine.train import corpus


def test_train_heads_on_the_demo_uses_its_own_corpus_and_warns_first(
    texts_dir,  # noqa: F811
    monkeypatch,
    capsys,
):
    monkeypatch.setattr(corpus, "fetch_corpus", lambda cache_dir=None: texts_dir)
    read = []
    split_text = corpus.train_split_text
    monkeypatch.setattr(corpus, "train_split_text", lambda: read.append(1) or split_text())
    args = ["train", "heads", "demo", "--k", "2", "--steps", "2", "--max-tokens", "1280"]
    assert main([*args, "--window", "64"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert read == [1]  # the fake works' train split, as `train.txt` holds it
    (text,) = [line for line in printed if line.startswith("training text: ")]
    assert "the demo's own corpus" in text and "the model wrote" not in text
    assert not any(line.startswith("the model writes") for line in printed)
    # The demo's own K=2 heads come first in the adapter search: said before the work starts.
    (note,) = [i for i, line in enumerate(printed) if line.startswith("note: the heads will")]
    (collected,) = [i for i, line in enumerate(printed) if line.startswith("collected ")]
    assert note < collected and "--adapters" in printed[note]
    assert str(BUNDLED_DEMO / "prerouter_k2.safetensors") in printed[note]
    (found,) = [line for line in printed if line.startswith("the heads found before")]
    assert "on the same held-out text" in found
    (held,) = [line for line in printed if line.startswith("held-out text: ")]
    assert "its first" in held and "windows)" in held


def test_the_demo_asked_for_its_own_text_writes_it_and_reads_no_corpus(
    tmp_path, monkeypatch, capsys
):
    def no_corpus(*args):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(corpus, "train_split_text", no_corpus)
    args = ["train", "heads", "demo", "--k", "2", "--steps", "1", "--window", "64"]
    args += ["--max-tokens", "320", "--self-text-tokens", "320", "--adapters", str(tmp_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    (text,) = [line for line in printed if line.startswith("training text: ")]
    assert "tokens the model wrote from" in text and "through its chat template" in text
    assert list(tmp_path.glob("work/self-text-*/samples.jsonl"))


def test_heads_without_a_lora_are_named_as_such(checkpoint_dir, tmp_path, capsys):
    model_dir = checkpoint_dir("qwen3_moe")
    heads_only = tmp_path / "heads"
    scratch = tmp_path / "scratch"
    shutil.copytree(model_dir, scratch)
    write_random_profile(scratch, 2)
    heads_only.mkdir()
    shutil.copy(scratch / "prerouter_k2.safetensors", heads_only)
    config = EngineConfig(k=2, adapter_dirs=(heads_only,), data_dir=tmp_path / "data")
    for mode in ("on-demand", "prerouter"):
        with Engine(model_dir, EngineConfig(**{**vars(config), "mode": mode})) as engine:
            note = engine.quality_note()
        assert "without trained adapters" not in note
        assert "prerouter heads but no recovery LoRA" in note and "quality is not recovered" in note
    prompt = ["--prompt", "x", "--max-tokens", "1", "--k", "2", "--adapters", str(heads_only)]
    assert main(["generate", str(model_dir), *prompt]) == 0
    err = capsys.readouterr().err
    assert "without trained adapters" not in err and "no recovery LoRA" in err
    with Engine(model_dir, EngineConfig(k=2, data_dir=tmp_path / "data")) as engine:
        assert "without trained adapters" in engine.quality_note()  # nothing trained at all
