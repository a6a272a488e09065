"""Expert parallelism (engine/experts/share.py, edge0_tui/ranks.py): two ranks on this machine,
each with its share of the routed experts, give one process's greedy tokens, each reading only
its own experts."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from adapters import profile_k, write_random_profile
from cli_runner import run_cli
from ranks_worker import greedy_reply
from test_server import API_KEY, private_env, start_server, stop_server

from edge0_tui.cli import main
from engine import Edge0Error, parse_size, run_ranks_here
from engine.config import EngineConfig, GenerationConfig
from engine.experts.share import ExpertShare
from engine.measure.bench import BenchConfig, run_bench
from engine.measure.bench_arms import ranked_arm
from engine.runtime.generation import Engine

TESTS = Path(__file__).resolve().parent
DEMO = TESTS.parent / "assets" / "demo"
TOKENS = 8
EVERY_EXPERT = 1 << 30  # a cache that holds every expert: layers held, routed on the device
# Prefetch reads its lookahead's guesses ahead even for tiny experts: the guesses are cut to the
# rank's share too.
MODES = [
    {"mode": "on-demand"},
    {"mode": "prefetch", "prefetch_min_expert_bytes": 0},
    {"mode": "prerouter", "k": 4},
]


@pytest.fixture(scope="module")
def profiled(checkpoint_dir, tmp_path_factory):
    """`profiled(family)`: a copy of the family's tiny checkpoint with a random K profile beside
    it (the session's checkpoints stay without one: other modules count on that)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            model = tmp_path_factory.mktemp("ranks") / family
            shutil.copytree(checkpoint_dir(family), model)
            write_random_profile(model, profile_k(family))
            made[family] = model
        return made[family]

    return get


def _one_layer_budget(model_dir: Path) -> int:
    """One expert more than a layer's routed set: experts are evicted every step."""
    with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
        store = engine.store
        layer = max(store.index.layers)
        return (engine.loaded.top_k + 1) * store.resident_expert_nbytes(layer)


def _cases(profiled) -> list[dict]:
    models = [(DEMO, parse_size("4M")), (DEMO, EVERY_EXPERT)]
    for family in ("qwen3_moe", "gpt_oss"):
        model_dir = profiled(family)
        models.append((model_dir, _one_layer_budget(model_dir)))
    cases = []
    for model_dir, budget in models:
        with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
            prompt = engine.encode("Tell me about the sea and the lighthouse.", chat=True)
        for mode in MODES:
            config = {**mode, "expert_cache_bytes": budget}
            cases.append({"model": str(model_dir), "config": config, "prompt": prompt})
    return [{**case, "tokens": TOKENS} for case in cases]


def _one_process(case: dict):
    with Engine(case["model"], EngineConfig(**case["config"])) as engine:
        result, logits = greedy_reply(engine, case["prompt"], TOKENS)
        cached = engine.store.pool.resident_bytes / 2**20
    return result.tokens, logits, sum(s.mib_read + s.whole_layer_mib for s in result.steps), cached


def test_two_ranks_give_one_process_tokens_each_reading_its_share(profiled, tmp_path):
    cases = _cases(profiled)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    command = [sys.executable, str(TESTS / "ranks_worker.py"), str(tmp_path / "cases.json")]
    assert run_ranks_here(2, [*command, str(tmp_path / "replies.json")]) == 0
    replies = json.loads((tmp_path / "replies.json").read_text())
    assert len(replies) == len(cases) == 12
    for case, reply in zip(cases, replies):
        tokens, logits, mib_read, cached = _one_process(case)
        where = f"{Path(case['model']).name} {case['config']}"
        assert reply["tokens"] == tokens and reply["logits"] == logits, where  # bit for bit
        ranks = reply["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], where
        # Each rank reads its own share of what one process reads, and where the cache holds
        # every expert, holds its own share of them.
        for r in ranks:
            assert 0 < r["expert_mib_read"] < mib_read, where
        assert sum(r["expert_mib_read"] for r in ranks) <= 1.1 * mib_read, where
        if case["config"]["expert_cache_bytes"] == EVERY_EXPERT:  # each holds half the experts
            assert sum(r["expert_cache_mib"] for r in ranks) == pytest.approx(cached), where


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m["mode"])
def test_a_rank_reads_and_caches_only_its_own_experts(profiled, mode):
    """In one process, as rank 0 of 2 (the sum over ranks is then this rank's alone): every read,
    read ahead and cached expert is even."""
    model_dir = profiled("qwen3_moe")
    config = EngineConfig(**mode, expert_cache_bytes=_one_layer_budget(model_dir))
    with Engine(model_dir, config) as engine:
        store = engine.store
        store.share = ExpertShare(0, 2)
        store.trace = []
        prompt = engine.encode("Tell me about the sea and the lighthouse.", chat=True)
        cached = set()  # what the pool held after each token (a request's end forgets reads ahead)
        for _ in engine.stream(prompt, GenerationConfig(max_tokens=TOKENS, temperature=0.0)):
            cached |= set(store.pool.resident_mask().nonzero()[1].tolist())
        read = {e for _, _, experts in store.trace for e in experts}
    assert read and all(e % 2 == 0 for e in read)
    assert cached and all(e % 2 == 0 for e in cached)


def test_hosts_refusals_are_one_line_before_any_rank_starts(tmp_path):
    for hosts, says in [
        ("1", "name 2 to 16 hosts"),
        ("a,,b", "name 2 to 16 hosts"),
        (str(tmp_path / "none.json"), "no such hostfile"),
    ]:
        result = run_cli("generate", "demo", "--prompt", "hi", "--hosts", hosts)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    result = run_cli("generate", "demo", "--prompt", "hi", "--hosts", "2", "--mode", "resident")
    assert result.returncode == 2 and "resident mode holds every expert" in result.stderr


def test_bench_hosts_runs_each_streamed_arm_as_ranks_too(checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["bench", str(checkpoint_dir("qwen3_moe")), "--arms", "resident,on-demand"]
    args += ["--hosts", "2", "--rounds", "1", "--tokens", "4", "--expert-cache", "60K"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["arm"] for r in report["runs"]] == ["resident", "on-demand", "on-demand@2"]
    assert all(r["ok"] and r["summary"]["generated_tokens"] == 4 for r in report["runs"])
    ranked = report["arms"]["on-demand@2"]
    assert [r["rank"] for r in ranked["ranks"]] == [0, 1]
    assert all(r["expert_mib_read"] > 0 for r in ranked["ranks"])
    assert ranked["figures"]["all_sum_ms"]["median"] > 0
    assert ranked["ratios"]["tok_s_vs_one_process"] > 0
    assert "**Ranks**" in capsys.readouterr().out


def test_ranked_arms_are_streamed_modes_on_two_to_sixteen_ranks():
    assert ranked_arm("prerouter@2") == ("prerouter", 2)
    assert ranked_arm("on-demand@16") == ("on-demand", 16)
    for arm in ("resident@2", "on-demand@1", "on-demand@17", "on-demand@x", "on-demand"):
        assert ranked_arm(arm) is None
    with pytest.raises(Edge0Error, match="MODE@N"):
        run_bench(BenchConfig(Path("unused"), ["resident@2"]), progress=lambda line: None)


def test_serve_hosts_answers_with_the_other_rank_following(profiled, tmp_path_factory):
    """Rank 0 serves; rank 1 runs each reply with it (K and mode switched per request): the
    replies are one process's greedy tokens, and SIGTERM stops every rank cleanly."""
    model = profiled("qwen3_moe")
    messages = [{"role": "user", "content": "Tell me about the sea and the lighthouse."}]
    expected = {}
    for mode, k in (("on-demand", None), ("prerouter", 4)):
        with Engine(model, EngineConfig(mode=mode, k=k)) as engine:
            prompt = engine.encode_chat(messages)
            tokens = engine.generate(prompt, GenerationConfig(8, 0.0)).tokens
            expected[mode] = engine.reply_text(tokens)
    log = tmp_path_factory.mktemp("ranks-serve") / "server.log"
    env = private_env(tmp_path_factory)
    server = start_server(model, log, env, "--api-key", API_KEY, "--hosts", "2")
    try:
        for mode, k in (("on-demand", None), ("prerouter", 4), ("on-demand", None)):
            reply = server.client().chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=8,
                temperature=0,
                extra_body={"mode": mode, **({"k": k} if k else {})},
            )
            assert reply.choices[0].message.content == expected[mode], mode
            assert [r["rank"] for r in reply.model_extra["edge0"]["ranks"]] == [0, 1]
        metrics = server.metrics()  # each rank's figures of the last reply, labelled
        for rank in (0, 1):
            assert metrics[f'edge0_rank_expert_bytes_read{{rank="{rank}"}}'] >= 0  # (all cached)
            assert metrics[f'edge0_rank_expert_cache_bytes{{rank="{rank}"}}'] > 0
    finally:
        stop_server(server)  # asserts status 0
    assert log.read_text().count("edge0 rank 1: [") == 3  # rank 1's line per reply


def test_two_ranks_draft_and_verify_as_one_process_decodes():
    """Speculative decoding with ranks: each verify step's forward over several positions sums
    their experts' outputs over the ranks; the tokens are one process's plain greedy ones."""
    prompt = "I am not a man, sir, and I will not be a man. I am not so, sir."  # (it repeats)
    args = ["generate", "demo", "--prompt", prompt, "--max-tokens", "24", "--mode", "on-demand"]
    args += ["--expert-cache", "4M", "--json"]
    plain = run_cli(*args)
    drafted = run_cli(*args, "--draft", "lookup", "--hosts", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    plain, drafted = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert drafted["tokens"] == plain["tokens"]
    assert drafted["summary"]["draft"]["steps"] > 0
    assert [r["rank"] for r in drafted["summary"]["ranks"]] == [0, 1]


def test_a_reply_cut_short_on_rank_0_refuses_the_next_one():
    """In one process standing as rank 0 of 2 (its sums are its own): a reply its caller stops
    reading leaves the other ranks inside it, so the engine refuses the next in one line; a rank
    other than 0 never starts a reply of its own."""
    with Engine(
        DEMO, EngineConfig(mode="on-demand", expert_cache_bytes=parse_size("4M"))
    ) as engine:
        engine.store.share = ExpertShare(0, 2)
        prompt = engine.encode("Speak.", chat=True)
        reply = iter(engine.stream(prompt, GenerationConfig(8, 0.0, ignore_eos=True)))
        next(reply)
        reply.close()
        with pytest.raises(Edge0Error, match="out of step"):
            engine.stream(prompt, GenerationConfig(8, 0.0))
        engine.store.share = ExpertShare(1, 2)
        with pytest.raises(Edge0Error, match="rank 1 runs rank 0's replies"):
            engine.stream(prompt, GenerationConfig(8, 0.0))
        engine.store.share = None  # (close announces the end to no one)


def _demo_as_rank_0() -> Engine:
    """The demo in one process standing as rank 0 of 2 (its sums are its own)."""
    engine = Engine(DEMO, EngineConfig(mode="on-demand", expert_cache_bytes=parse_size("4M")))
    engine.store.share = ExpertShare(0, 2)
    return engine


def test_a_k_switch_asked_after_the_ranks_agree_waits_for_the_next_agreement(monkeypatch):
    """The app asks for K on its own thread, mid-reply: a switch asked between rank 0's stop
    agreement (which told the others the next step's K) and that step's build must not reach rank
    0 alone; every step runs the K the ranks agreed on before it."""
    import engine.runtime.generation as generation

    engine = _demo_as_rank_0()
    agreed: list[int] = []

    def agree_then_ask(share, stop, k, mode):
        answer = real_agree(share, stop, k, mode)
        agreed.append(answer[1])
        if len(agreed) == 3:  # just agreed on the next step: the UI thread switches now
            engine.request_k(4)
        return answer

    real_agree = generation.agree
    monkeypatch.setattr(generation, "agree", agree_then_ask)
    try:
        prompt = engine.encode("Speak of the sea.", chat=True)
        tokens = list(engine.stream(prompt, GenerationConfig(6, 0.0, ignore_eos=True)))
        # One agreement before the prompt's one chunk, then one after each token but the last.
        assert [t.step.k for t in tokens] == agreed[: len(tokens)] != [8] * len(tokens)
        assert engine.k == 4
    finally:
        engine.store.share = None  # (close announces the end to no one)
        engine.close()


def test_a_rank_lost_mid_reply_is_one_line_and_later_replies_are_refused(monkeypatch):
    """A rank that dies makes MLX's sums raise (the ring: "connection to a peer was lost"): the
    reply fails with an Edge0Error that says what to do, the next reply is refused in one line,
    and closing an engine does not fail on the lost rank (idle, its word to the others meets
    it)."""
    import mlx.core as mx

    engine, idle = _demo_as_rank_0(), _demo_as_rank_0()
    prompt = engine.encode("Speak.", chat=True)

    def lost(*args, **kwargs):
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(mx.distributed, "all_sum", lost)
    with pytest.raises(Edge0Error, match="restart the ranks") as failed:
        engine.generate(prompt, GenerationConfig(4, 0.0))
    assert "connection to a peer was lost" in str(failed.value)
    assert "\n" not in str(failed.value)
    with pytest.raises(Edge0Error, match="out of step"):
        engine.stream(prompt, GenerationConfig(4, 0.0))
    engine.close()
    idle.close()


def test_the_other_ranks_are_stopped_once_rank_0_has_ended(monkeypatch):
    """A rank left waiting for rank 0 (inside a reply it never finished) is stopped once rank 0
    has ended and the grace has passed, not waited for forever."""
    import engine.runtime.ranks as ranks

    monkeypatch.setattr(ranks, "STOP_GRACE_S", 0.5)
    wait_unless_rank_0 = "import os, time; os.environ['MLX_RANK'] == '0' or time.sleep(600)"
    assert run_ranks_here(2, [sys.executable, "-c", wait_unless_rank_0], timeout_s=60) == 0
