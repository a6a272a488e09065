"""edge0 against a real HTTP hub: the HF-compatible endpoint of tests/hub_endpoint.py on 127.0.0.1.

- `edge0 generate OWNER/NAME` downloads the repo from it and runs;
- `edge0 info OWNER/NAME --memory` plans a repo with no copy here from its headers alone: less
  than 1% of its bytes transferred (of the memory-wall checkpoint's 6.4 GiB), the same plan as
  `edge0 info COPY --memory` prints;
- a hub that answers wrongly (a JSON shape, a 500, a truncated header, a redirect loop, a 100 GB
  header length) is one line naming the repo and what was wrong.
"""

from __future__ import annotations

import json
import shutil
import struct
from datetime import date
from pathlib import Path

import pytest
from hub_endpoint import HubEndpoint, files_of, pointed_at

from edge0_tui import cli
from edge0_tui.commands.info import NO_SPEED
from edge0_tui.machine_speed import this_machine
from engine import format_bytes

OWNER = "edge0-test"


@pytest.fixture(scope="session")
def endpoint():
    """The endpoint, started once per test run."""
    hub = HubEndpoint().start()
    yield hub
    hub.stop()


@pytest.fixture
def hub(endpoint, tmp_path):
    """huggingface_hub pointed at the endpoint, its cache in a fresh folder (no real cache)."""
    with pointed_at(endpoint, tmp_path / "hf-home"):
        yield endpoint


@pytest.fixture
def fixed_machine(monkeypatch):
    """The plan's two measured figures (this process's size, what the machine leaves) held
    still, so that two plans made at different moments print the same."""
    import engine.runtime.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "process_rss_bytes", lambda: 300 << 20)
    monkeypatch.setattr(memory_plan, "memory_limit", lambda: (8 << 30, "MemAvailable"))


# safetensors names of the dtypes a synthetic checkpoint holds.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32"}


@pytest.fixture(scope="session")
def sparse_wall(checkpoint_dir, tmp_path_factory) -> Path:
    """The synthetic memory-wall checkpoint (qwen3_moe), its headers as synth would write them
    and its data left as holes (sparse files: gigabytes that take no disk and no time to write).
    Neither plan reads a routed expert; the local one reads the resident weights as zeros. The
    tokenizer is the tiny checkpoint's (a plan does not use it)."""
    from mlx.utils import tree_flatten

    from engine.train import synth

    out = tmp_path_factory.mktemp("sparse") / "qwen3_moe-wall"
    out.mkdir()
    model, config = synth._build_model(synth._model_config("qwen3_moe", "wall"))
    weights = dict(tree_flatten(model.parameters()))
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in sorted(weights):  # shapes and dtypes only: nothing is evaluated
        array = weights[name]
        dtype = SAFETENSORS_DTYPES[str(array.dtype).rpartition(".")[2]]
        end = offset + array.nbytes
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    (out / "config.json").write_text(json.dumps(config))
    for tokenizer in checkpoint_dir("qwen3_moe", "tiny").glob("tokenizer*.json"):
        shutil.copy(tokenizer, out)
    return out


def plan_lines(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory plan ("))
    return lines[start:]


def test_generate_downloads_a_hub_repo_and_runs(hub, checkpoint_dir, capsys):
    model = checkpoint_dir("qwen3_moe", "tiny")
    hub.serve(f"{OWNER}/tiny", model)

    code = cli.main(["generate", f"{OWNER}/tiny", "--prompt", "hi", "--max-tokens", "2"])

    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip()
    assert hub.bytes_served(f"{OWNER}/tiny") == sum(p.stat().st_size for p in files_of(model))


def test_info_memory_plans_a_hub_repo_from_its_headers(hub, sparse_wall, fixed_machine, capsys):
    model = sparse_wall
    repo = f"{OWNER}/wall"
    hub.serve(repo, model)

    code = cli.main(["info", repo, "--memory"])
    remote, err = capsys.readouterr()
    assert code == 0, err
    checkpoint_bytes = sum(p.stat().st_size for p in files_of(model))
    assert 0 < hub.bytes_served(repo) < checkpoint_bytes / 100
    assert "nothing downloaded" in remote.splitlines()[0]
    assert checkpoint_bytes > 6 << 30
    assert not list((Path(hub_home()) / "hub").glob("models--*wall*/snapshots/*/*"))

    assert cli.main(["info", str(model), "--memory"]) == 0
    local, _ = capsys.readouterr()
    assert plan_lines(remote) == plan_lines(local)
    assert plan_lines(remote)[-2].endswith(": fits")
    assert remote.splitlines()[-1] == NO_SPEED  # edge0 doctor has not run here


def test_info_memory_says_the_speed_to_expect_once_the_doctor_has_run(
    hub, sparse_wall, fixed_machine, private_data_dir, capsys
):
    """Issue 49 item 1: the plan of a Hub repo comes with the decode speed to expect, from
    `edge0 doctor`'s figures kept for this machine (before the doctor has run, it says so:
    test_info_memory_plans_a_hub_repo_from_its_headers)."""
    from edge0_tui.machine_speed import save_speed
    from engine.measure.speed_estimate import MachineSpeed

    repo = f"{OWNER}/wall"
    hub.serve(repo, sparse_wall)
    save_speed(private_data_dir, MachineSpeed(2 << 30, 40 << 30), "demo")
    assert cli.main(["info", repo, "--memory", "--k", "4"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("expected speed at K=4 (on-demand): "), line
    cold, warm = (float(part.split(" tok/s")[0].split()[-1]) for part in line.split(" cold ", 1))
    assert 0 < cold < warm, line
    assert line.endswith(f"(from edge0 doctor on {this_machine()}, {date.today().isoformat()})")

    assert cli.main(["info", repo, "--memory", "--k", "4", "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert speed["cold_tok_per_s"] == pytest.approx(cold, rel=0.05)
    assert speed["measured"]["speed"]["disk_bytes_per_s"] == 2 << 30


def hub_home() -> str:
    import huggingface_hub.constants as constants

    return constants.HF_HOME


def shard_with_header_length(
    folder: Path, header_len: int, body: bytes, config: str = '{"num_hidden_layers": 2}'
) -> Path:
    """A repo whose one shard declares `header_len` header bytes and holds `body` after them."""
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", header_len) + body)
    return folder


HOSTILE_REPOS = {
    # case: (the shard's header length, what follows it, config.json, the endpoint's fault)
    "json_shape": (2, b"{}", "[]", None),
    "index_shape": (2, b"{}", "{}", None),
    "500": (2, b"{}", "{}", "500"),
    "redirect_loop": (2, b"{}", "{}", "redirect_loop"),
    "short_body": (2, b"{}", "{}", "short_body"),
    "huge_header": (100_000_000_000, b"{}" * 64, "{}", None),
    "truncated_header": (1000, b'{"a": {"dtype"', "{}", None),
}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("json_shape", "config.json: expected a JSON object"),
        ("index_shape", "model.safetensors.index.json: corrupt index (no weight_map object)"),
        ("500", "config.json: the Hub answered HTTP 500"),
        ("redirect_loop", "config.json: cannot read it from the Hub (TooManyRedirects"),
        ("short_body", "config.json: cannot read it from the Hub (RemoteProtocolError"),
        ("huge_header", "model.safetensors: corrupt safetensors header (declares 100000000000"),
        ("truncated_header", "model.safetensors: corrupt safetensors header (declares 1000 header"),
    ],
)
def test_a_hostile_hub_is_one_line_naming_the_repo(hub, tmp_path, capsys, case, expected):
    repo = f"{OWNER}/bad-{case.replace('_', '-')}"
    header_len, body, config, fault = HOSTILE_REPOS[case]
    folder = shard_with_header_length(tmp_path / "repo", header_len, body, config)
    if case == "index_shape":
        (folder / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    if fault:
        hub.fault(repo, fault)
    hub.serve(repo, folder)

    code = cli.main(["info", repo, "--memory"])

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{repo}/{expected}" in err or f"{repo}: {expected}" in err, err
    assert hub.bytes_served(repo) < 4096


def test_a_repo_the_hub_does_not_have_is_one_line(hub, capsys):
    assert cli.main(["info", f"{OWNER}/nowhere", "--memory"]) == 2
    _, err = capsys.readouterr()
    assert (
        err
        == f"edge0: error: {OWNER}/nowhere: no such model on the Hugging Face Hub (or it is private: `hf auth login`)\n"
    )


@pytest.mark.parametrize(
    "case, expected",
    [
        ("json_shape", "the Hugging Face Hub's answer cannot be used (TypeError: "),
        ("500", "the Hugging Face Hub answered HTTP 500, and no complete copy is cached"),
        ("redirect_loop", "the Hugging Face Hub's answer cannot be used (TooManyRedirects: "),
    ],
)
def test_a_hostile_hub_download_is_one_line(hub, tmp_path, capsys, case, expected):
    """The download path (`edge0 info OWNER/NAME` fetches the repo) says what the Hub did wrong
    too: the unexpected JSON shape was a TypeError traceback from inside huggingface_hub."""
    repo = f"{OWNER}/bad-download-{case.replace('_', '-')}"
    hub.serve(repo, shard_with_header_length(tmp_path / "repo", 2, b"{}"))
    hub.fault(repo, case)

    code = cli.main(["info", repo])

    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{repo}: {expected}" in err, err


async def test_the_picker_says_whether_a_typed_hub_id_fits_before_downloading(
    hub, sparse_wall, checkpoint_dir, tmp_path
):
    """Issue 49 item 1, in the app: an id typed in the model picker is planned from its headers
    once typing pauses, and the note under the box says whether it fits; nothing is downloaded."""
    from test_tui_app import make_app, ready, wait_until
    from textual.widgets import Input, Label

    from edge0_tui.screens.model_picker import ModelPickerScreen

    repo = f"{OWNER}/wall"
    hub.serve(repo, sparse_wall)
    app = make_app(checkpoint_dir("qwen3_moe", "tiny"), tmp_path / "app")
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(app, pilot)
        await pilot.press("ctrl+l")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")
        picker = app.screen
        picker.query_one("#path", Input).value = repo
        note = picker.query_one("#plan-note", Label)
        await wait_until(pilot, lambda: str(note.content).startswith(f"{repo}: "), "the plan", 60)
        line = str(note.content)
        assert " this machine: memory plan " in line and "nothing downloaded" in line, line
        assert ("fits" in line) != ("does NOT fit" in line)
        served = hub.bytes_served(repo)
        assert 0 < served < sum(p.stat().st_size for p in files_of(sparse_wall)) / 100
        # Another text: the note goes; a folder is not sent to the Hub.
        picker.query_one("#path", Input).value = str(tmp_path)
        await pilot.pause(1.0)
        assert str(note.content) == "" and hub.bytes_served(repo) == served


# -- edge0 pull ------------------------------------------------------------------------------------

SHARD = "model-00001-of-00001.safetensors"
# What a Hub repo holds beside edge0's files: other formats, which a pull leaves on the Hub.
OTHER_FORMATS = ("pytorch_model.bin", "model.pt", "model-q4.gguf", "onnx/model.onnx")


def repo_folder(folder: Path, shard_bytes: int = 3 << 20, other_formats: bool = True) -> Path:
    """A repo as a pull sees it: config, tokenizer, template, index and a shard of random bytes
    (a pull does not read them), and files of other formats."""
    import os

    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "model.safetensors.index.json").write_text(f'{{"weight_map": {{"a": "{SHARD}"}}}}')
    (folder / SHARD).write_bytes(os.urandom(shard_bytes))
    for name in OTHER_FORMATS if other_formats else ():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(b"x" * 4096)
    return folder


def edge0_files(folder: Path) -> list[Path]:
    return [p for p in files_of(folder) if p.relative_to(folder).as_posix() not in OTHER_FORMATS]


def pulled_folder(out: str) -> Path:
    return Path(out.split(" in ", 1)[1].split("; ", 1)[0])


def test_pull_fetches_only_what_edge0_reads_and_a_second_pull_transfers_nothing(
    hub, tmp_path, capsys
):
    repo = f"{OWNER}/pull"
    source = repo_folder(tmp_path / "repo")
    hub.serve(repo, source)
    needed = sum(p.stat().st_size for p in edge0_files(source))

    assert cli.main(["pull", repo]) == 0
    out, err = capsys.readouterr()
    assert hub.bytes_served(repo) == needed, err
    assert err == ""  # no progress drawn where stderr is no terminal
    folder = pulled_folder(out)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(source).as_posix() for p in edge0_files(source))
    assert (folder / SHARD).read_bytes() == (source / SHARD).read_bytes()

    assert cli.main(["pull", repo]) == 0
    out, _ = capsys.readouterr()
    assert hub.bytes_served(repo) == needed  # not one file byte more
    assert "complete already, nothing downloaded" in out


@pytest.fixture
def every_chunk(monkeypatch):
    """Progress reported after every chunk a download receives (not at most every so often), so
    that a callback stopping the download stops it at a known point."""
    from edge0_tui import hub_download

    monkeypatch.setattr(hub_download, "REPORT_EVERY_S", 0.0)


@pytest.mark.parametrize("no_range", [False, True], ids=["resumed", "server-ignores-ranges"])
def test_an_interrupted_pull_resumes_where_it_stopped(hub, tmp_path, capsys, every_chunk, no_range):
    """A connection dropped mid-file, then Ctrl+C: each run again fetches only what is missing
    (huggingface_hub alone removes a partial file and starts it again from zero)."""
    repo = f"{OWNER}/resume-{no_range}"
    source = repo_folder(tmp_path / "repo", shard_bytes=5 << 20, other_formats=False)
    hub.serve(repo, source)
    size = (source / SHARD).stat().st_size
    small = sum(p.stat().st_size for p in edge0_files(source)) - size
    hub.cut(repo, SHARD, 2 << 20)

    assert cli.main(["pull", repo]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{repo}: {SHARD}: the download stopped at 2.00 MiB of 5.00 MiB (" in err, err
    assert "run it again to resume from there" in err
    assert hub.bytes_served(repo) == small + (2 << 20)

    # A server that ignores the range sends the whole file: it is written from its start.
    if no_range:
        hub.fault(repo, "no_range")
        assert cli.main(["pull", repo]) == 0
        out, _ = capsys.readouterr()
        assert (pulled_folder(out) / SHARD).read_bytes() == (source / SHARD).read_bytes()
        return

    # Ctrl+C (or the app closing) once more of the file is in.
    from edge0_tui.model_source import pull_from_hub

    def interrupt(what: str, done: float, total: float | None) -> None:
        if what.startswith("downloading") and done > small + (2 << 20):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_from_hub(repo, interrupt)
    (partial,) = (Path(hub_home()) / "hub").rglob("*.incomplete")
    kept = partial.stat().st_size
    assert 2 << 20 < kept < size
    hub.wait_until_idle()  # the interrupted body's handler has counted all it sent
    served = hub.bytes_served(repo)

    assert cli.main(["pull", repo]) == 0
    out, _ = capsys.readouterr()
    assert hub.bytes_served(repo) - served == size - kept  # the rest of the file, once
    assert f"{format_bytes(size - kept)} downloaded ({format_bytes(small + kept)} were" in out
    assert (pulled_folder(out) / SHARD).read_bytes() == (source / SHARD).read_bytes()


def test_the_app_closing_mid_pull_stops_it_and_keeps_what_came(hub, tmp_path, every_chunk):
    """The app quits during a download by raising ServiceClosed from the progress callback: it
    stops the pull as it is (not read as a Hub failure), the partial file kept to resume."""
    from edge0_tui.engine_service.jobs import ServiceClosed
    from edge0_tui.model_source import pull_from_hub

    repo = f"{OWNER}/closing"
    hub.serve(repo, repo_folder(tmp_path / "repo", other_formats=False))

    def closing(what: str, done: float, total: float | None) -> None:
        if what.startswith("downloading") and done > 1 << 20:
            raise ServiceClosed

    with pytest.raises(ServiceClosed):
        pull_from_hub(repo, closing)
    (partial,) = (Path(hub_home()) / "hub").rglob("*.incomplete")
    assert partial.stat().st_size >= 1 << 20


def test_a_pull_the_disk_cannot_hold_is_refused_before_writing(hub, tmp_path, capsys, monkeypatch):
    from edge0_tui import hub_download

    repo = f"{OWNER}/big"
    hub.serve(repo, repo_folder(tmp_path / "repo", other_formats=False))
    monkeypatch.setattr(hub_download, "free_bytes", lambda folder: 1 << 20)

    assert cli.main(["pull", repo]) == 2

    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"edge0: error: {repo}: 3.00 MiB still to download but the disk of " in err, err
    assert "has 1.00 MiB free (2.00 MiB short)" in err
    assert hub.bytes_served(repo) == 0
    cache = Path(hub_home())
    assert not cache.exists() or not [p for p in cache.rglob("*") if not p.is_dir()]


def test_pull_a_revision(hub, tmp_path, capsys):
    repo = f"{OWNER}/tagged"
    hub.serve(repo, repo_folder(tmp_path / "repo", shard_bytes=4096), revisions=("v1",))

    assert cli.main(["pull", repo, "--revision", "v1"]) == 0
    capsys.readouterr()
    refs = Path(hub_home()) / "hub" / f"models--{OWNER}--tagged" / "refs"
    assert [p.name for p in refs.iterdir()] == ["v1"]

    assert cli.main(["pull", repo, "--revision", "nope"]) == 2
    _, err = capsys.readouterr()
    assert err == (
        f"edge0: error: {repo}: no revision 'nope' on the Hugging Face Hub (a branch, tag or "
        "commit)\n"
    )


def test_pull_adapters_fetches_their_adapter_files_only(hub, tmp_path, capsys):
    repo, adapters = f"{OWNER}/base", f"{OWNER}/adapters"
    hub.serve(repo, repo_folder(tmp_path / "repo", shard_bytes=4096, other_formats=False))
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "prerouter_k4.safetensors").write_bytes(b"p" * 1000)
    (folder / "lora_k4.safetensors").write_bytes(b"l" * 2000)
    (folder / "notes.bin").write_bytes(b"n" * 5000)
    hub.serve(adapters, folder)

    assert cli.main(["pull", repo, "--adapters", adapters]) == 0

    out, _ = capsys.readouterr()
    assert hub.bytes_served(adapters) == 3000
    assert f"{adapters}: 2 files, 2.93 KiB in " in out.splitlines()[1]


def test_a_hub_error_mid_pull_is_one_line_and_keeps_what_came(hub, tmp_path, capsys):
    repo = f"{OWNER}/flaky"
    hub.serve(repo, repo_folder(tmp_path / "repo", other_formats=False))
    hub.fault(repo, "get_500")

    assert cli.main(["pull", repo]) == 2

    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "the download stopped at 0 B of" in err and "answered HTTP 500" in err, err


def test_the_progress_line_says_the_rate_and_the_time_left():
    from edge0_tui.commands.options import StderrProgress

    now = [100.0]
    progress = StderrProgress(clock=lambda: now[0])
    assert progress.text("downloading a/b", 1 << 20, 9 << 20) == (
        "downloading a/b 1.00 MiB / 9.00 MiB"
    )
    now[0] += 4
    assert progress.text("downloading a/b", 3 << 20, 9 << 20) == (
        "downloading a/b 3.00 MiB / 9.00 MiB, 512.00 KiB/s, 12 s left"
    )
    # 2100 MiB left at 512 KiB/s: 4200 s
    assert progress.text("downloading a/b", 3 << 20, 2103 << 20).endswith(", 1 h 10 min left")
    assert progress.text("looking up a/b", 0, None) == "looking up a/b"


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("many_files", "100,001 shard files listed, more than the 4,096 a checkpoint can have"),
        ("size_differs", "the Hub sent no more); run it again to resume from there"),
    ],
)
def test_a_hub_listing_or_a_size_that_is_not_a_checkpoints_is_one_line(
    hub, tmp_path, capsys, fault, expected
):
    """Issue 49 item 3: a listing of 100,000 files is refused before one is asked for; a file
    shorter than its size on the Hub stops the pull in one line, what came kept."""
    repo = f"{OWNER}/odd-{fault.replace('_', '-')}"
    hub.serve(repo, repo_folder(tmp_path / "repo", other_formats=False))
    hub.fault(repo, fault)

    assert cli.main(["pull", repo]) == 2

    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err
    if fault == "many_files":
        assert hub.bytes_served(repo) == 0


def test_an_index_naming_100000_shards_is_one_line(hub, tmp_path, capsys):
    """`info --memory` reads the index, then each shard's header: an index naming more shards
    than a checkpoint has is refused before one header is asked for."""
    repo = f"{OWNER}/many-shards"
    folder = shard_with_header_length(tmp_path / "repo", 2, b"{}", '{"num_hidden_layers": 2}')
    names = {f"t{i}": f"model-{i:06d}-of-100000.safetensors" for i in range(100_000)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    hub.serve(repo, folder)

    assert cli.main(["info", repo, "--memory"]) == 2

    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "100,000 shard files listed, more than the 4,096" in err, err
    assert hub.bytes_served(repo) < 10_000_000  # the index only
