"""`edge0 serve` as a client sees it: a real server process on a free loopback port, driven by the
official `openai` client (and raw HTTP where a client would not send such a request).

Every request goes to 127.0.0.1. The model is the tiny synthetic checkpoint with a random K=2
profile beside it (so prerouter and prefetch modes exist); replies are a few tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from adapters import write_random_profile
from test_peak_rss import cli_holding_a_transient

API_KEY = "test-key-15"
QUEUE_LIMIT = 4
PROMPT = "Tell me about the sea."


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path, model: Path) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.model = model
        self.url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str = API_KEY, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def http(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            sent = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
            sent.update(headers or {})
            connection.request(method, path, body=body, headers=sent)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.http("GET", "/metrics")
        assert status == 200
        return parse_prometheus(body.decode())

    def rss_bytes(self) -> int:
        """The server process's resident set: /proc on Linux, else what the server reports."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return int(metric(self.metrics(), "edge0_process_resident_bytes"))
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


SAMPLE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*=\"(?:[^\"\\]|\\.)*\",?)*\})? (\S+)$"
)


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, `name{labels}` -> value; fails on a line that
    is not a comment, a TYPE/HELP line or a sample."""
    samples = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("gauge", "counter"), line
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        name, labels, value = match.groups()
        assert name in types, f"{name} has no TYPE line"
        samples[name + (labels or "")] = float(value)
    return samples


def metric(samples: dict[str, float], name: str) -> float:
    return next(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with random K=2 heads and LoRA beside it."""
    model = tmp_path_factory.mktemp("serve") / "tiny-moe"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    write_random_profile(model, 2)
    return model


def private_env(tmp_path_factory) -> dict[str, str]:
    env = dict(os.environ)
    env["EDGE0_DATA_DIR"] = str(tmp_path_factory.mktemp("serve-data"))
    env["EDGE0_CONFIG_DIR"] = str(tmp_path_factory.mktemp("serve-config"))
    env.pop("EDGE0_API_KEY", None)
    return env


def start_server(
    model: Path,
    log: Path,
    env: dict,
    *args: str,
    launcher: tuple[str, ...] = ("-m", "edge0_tui.cli"),
) -> Server:
    """`edge0 serve MODEL ARGS` on a free port; `launcher`: how Python starts the command."""
    command = [sys.executable, *launcher, "serve", str(model), "--port", "0", *args]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    port = None
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)", log.read_text())
        if found:
            port = int(found.group(1))
            break
        time.sleep(0.05)
    assert port is not None, log.read_text()
    server = Server(process, port, log, model)
    while time.monotonic() < deadline:
        status, _ = server.http("GET", "/health")
        if status == 200:
            return server
        assert status == 503  # loading
        time.sleep(0.05)
    raise AssertionError(f"the server did not get ready:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        assert server.process.wait(timeout=20) == 0, server.log.read_text()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    env = private_env(tmp_path_factory)
    server = start_server(
        model_dir, log, env, "--api-key", API_KEY, "--queue-limit", str(QUEUE_LIMIT)
    )
    server.env = env
    yield server
    stop_server(server)


# The same requests, in the same order, as test_replies_equal_the_engines_own_tokens sends them:
# the engine keeps one conversation's KV cache, so its own run must see the same sequence.
REFERENCE = textwrap.dedent(
    """
    import json, sys
    from engine import preload_fast_blas
    preload_fast_blas()  # as every edge0 command (the server too) does
    from engine import Engine, EngineConfig, GenerationConfig
    cases = json.loads(sys.argv[2])
    out = []
    with Engine(sys.argv[1], EngineConfig()) as engine:
        for case in cases:
            prompt = (engine.encode_chat([{"role": "user", "content": case["prompt"]}])
                      if case["chat"] else engine.encode(case["prompt"]))
            gen = GenerationConfig(max_tokens=case["max_tokens"], temperature=case["temperature"],
                                   top_p=case["top_p"], seed=case["seed"])
            result = engine.generate(prompt, gen)
            out.append({"tokens": result.tokens, "text": result.text,
                        "prompt_tokens": len(prompt), "stopped_by": result.stopped_by})
    print(json.dumps(out))
    """
)

CASES = [
    # greedy, whole then streamed (the second continues from the first's KV cache)
    {
        "chat": True,
        "stream": False,
        "prompt": PROMPT,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
    },
    {
        "chat": True,
        "stream": True,
        "prompt": PROMPT,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
    },
    # sampled with a seed
    {"chat": True, "stream": False, "prompt": "Sing.", "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"chat": True, "stream": True, "prompt": "Sing.", "temperature": 0.8, "top_p": 0.9, "seed": 7},
    # /v1/completions: the prompt as is
    {
        "chat": False,
        "stream": False,
        "prompt": "Once upon",
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
    },
    {
        "chat": False,
        "stream": True,
        "prompt": "Once upon",
        "temperature": 0.5,
        "top_p": 1.0,
        "seed": 3,
    },
]
for _case in CASES:
    _case["max_tokens"] = 12


def ask(client: openai.OpenAI, case: dict, model: str) -> tuple[str, str, dict, dict]:
    """(text, finish reason, usage, edge0 figures) of one request of CASES."""
    common = dict(
        model=model,
        max_tokens=case["max_tokens"],
        temperature=case["temperature"],
        top_p=case["top_p"],
        seed=case["seed"],
        extra_body={"k": 4, "mode": "on-demand"},
    )
    if case["chat"]:
        messages = [{"role": "user", "content": case["prompt"]}]
        create = client.chat.completions.create
        kwargs = dict(messages=messages, **common)
    else:
        create = client.completions.create
        kwargs = dict(prompt=case["prompt"], **common)
    if not case["stream"]:
        reply = create(**kwargs)
        choice = reply.choices[0]
        text = choice.message.content if case["chat"] else choice.text
        return text, choice.finish_reason, reply.usage.model_dump(), reply.model_extra["edge0"]
    parts, finish, used, figures = [], None, None, None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append((choice.delta.content if case["chat"] else choice.text) or "")
            finish = choice.finish_reason or finish
            figures = (chunk.model_extra or {}).get("edge0") or figures
        else:
            used = chunk.usage.model_dump()
    return "".join(parts), finish, used, figures


def test_replies_equal_the_engines_own_tokens(server):
    """Streamed and whole, chat and completions, greedy and seeded sampling: the text and token
    counts are those of the engine run directly. First in this file: see REFERENCE."""
    client = server.client()
    got = [ask(client, case, "tiny-moe") for case in CASES]
    reference = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(server.model), json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=server.env,
        timeout=120,
    )
    assert reference.returncode == 0, reference.stderr
    expected = json.loads(reference.stdout.splitlines()[-1])
    for case, (text, finish, used, figures), want in zip(CASES, got, expected):
        assert text == want["text"], case
        assert used["completion_tokens"] == len(want["tokens"]), case
        assert used["prompt_tokens"] == want["prompt_tokens"], case
        assert finish == {"max_tokens": "length", "eos": "stop"}[want["stopped_by"]]
        assert figures["k"] == 4 and figures["mode"] == "on-demand"
        for key in ("decode_tok_per_s", "blocked_ms_per_step", "cold_fraction", "loads_per_step"):
            assert figures[key] >= 0
    # The streamed greedy request repeated the whole one's prompt: only its last token ran.
    assert got[1][3]["reused_prompt_tokens"] == expected[1]["prompt_tokens"] - 1


def test_models_health_and_metrics_parse(server):
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    assert client.models.retrieve("edge0").id == "edge0"  # the alias
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert models.data[0].model_extra["edge0"]["family"] == "qwen3_moe"
    status, body = server.http("GET", "/health", headers={"Authorization": ""})
    assert status == 200 and json.loads(body)["status"] == "ok"
    before = server.metrics()
    for name in (
        "edge0_decode_tokens_per_second",
        "edge0_blocked_ms_per_step",
        "edge0_cold_fraction",
        "edge0_loads_per_step",
        "edge0_mlx_active_bytes",
        "edge0_mlx_cache_bytes",
        "edge0_checkpoint_page_cache_bytes",
        "edge0_expert_pool_bytes",
        "edge0_k",
        "edge0_queue_depth",
        "edge0_requests_running",
        "edge0_requests_served_total",
        "edge0_requests_failed_total",
        "edge0_requests_client_errors_total",
        "edge0_requests_cancelled_total",
        "edge0_requests_rejected_total",
    ):
        assert any(k == name or k.startswith(name + "{") for k in before), name
    info = next(k for k in before if k.startswith("edge0_info{"))
    assert 'model="tiny-moe"' in info and 'k="' in info and 'mode="' in info
    client.chat.completions.create(
        model="edge0", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    server.http("POST", "/v1/chat/completions", b"{")  # the client's mistake
    server.http("GET", "/v1/nowhere")  # another (404, refused before any route)
    after = server.metrics()
    served = "edge0_requests_served_total"
    assert metric(after, served) == metric(before, served) + 1
    client_errors = "edge0_requests_client_errors_total"
    assert metric(after, client_errors) == metric(before, client_errors) + 2
    failed = "edge0_requests_failed_total"  # the server's own failures only
    assert metric(after, failed) == metric(before, failed)
    log = server.log.read_text()
    # The start-up text says what is offered: where, which model, its profile, the memory plan.
    url = f"http://127.0.0.1:{server.port}"
    assert "edge0: ready: tiny-moe (qwen3_moe), also answers to edge0" in log
    assert f"OpenAI API     {url}/v1/chat/completions" in log
    assert f"Anthropic API  {url}/v1/messages" in log
    assert re.search(r"profile        K=4 prefetch; a request may name its own k \(2, 4", log)
    assert re.search(r"edge0:   memory plan: \d", log) and f"metrics        {url}/metrics" in log
    # every request has its line, refusals with their reason
    assert re.search(r"edge0: POST /v1/chat/completions 400 \d+ ms: the body is not valid", log)
    assert re.search(r"edge0: GET /v1/nowhere 404 \d+ ms: GET /v1/nowhere: Not Found", log)
    assert re.search(r"edge0: POST /v1/chat/completions 200 \d+ ms: chat \d+\+3 tokens", log)
    tokens = "edge0_completion_tokens_total"
    assert metric(after, tokens) == metric(before, tokens) + 3
    assert metric(after, "edge0_mlx_active_bytes") > 0
    assert metric(after, "edge0_expert_pool_bytes") > 0
    # Where routed experts came from, and in prefetch mode (the default) the lookahead's recall
    # by layer.
    shares = {k: v for k, v in after.items() if k.startswith("edge0_routed_experts_share{")}
    assert set(shares) == {
        f'edge0_routed_experts_share{{source="{s}"}}'
        for s in ("resident", "heads", "lookahead", "missed")
    }
    assert sum(float(v) for v in shares.values()) == pytest.approx(1.0)
    # The tiny model's every expert fits the cache: every layer is held, routed on the device,
    # and a decode step waits on it once (for its token); no layer needs a guess.
    assert float(after["edge0_host_syncs_per_step"]) == 1.0
    assert not any(k.startswith('edge0_lookahead_recall{layer="') for k in after)


def test_metrics_describe_each_name_once():
    """Prometheus's text format: one HELP and one TYPE per metric name, however many samples."""
    from edge0_tui.server.metrics import _Writer

    writer = _Writer()
    for layer in range(3):
        writer.metric("edge0_x", "gauge", "X.", layer, {"layer": layer})
    lines = writer.text().splitlines()
    assert lines.count("# HELP edge0_x X.") == 1 and lines.count("# TYPE edge0_x gauge") == 1
    assert len(lines) == 5


# The server, its engine holding TRANSIENT_BYTES for a moment inside each prompt's prefill:
# between the per-step RSS samples, so only the kernel's high-water mark sees it.
TRANSIENT_BYTES = 300 << 20
SERVE_WITH_A_TRANSIENT = cli_holding_a_transient(TRANSIENT_BYTES)


def test_metrics_give_the_kernels_peak_rss_of_the_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-peak") / "server.log"
    env = private_env(tmp_path_factory)
    server = start_server(
        model_dir, log, env, "--api-key", API_KEY, launcher=("-c", SERVE_WITH_A_TRANSIENT)
    )
    try:
        server.client().chat.completions.create(
            model="edge0", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        status, body = server.http("GET", "/metrics")
        assert status == 200
        text = body.decode()
        samples = parse_prometheus(text)
        help_line = next(
            line for line in text.splitlines() if line.startswith("# HELP edge0_process_peak_rss")
        )
        assert "high-water mark" in help_line
        peak = metric(samples, "edge0_process_peak_rss_bytes")
        assert metric(samples, "edge0_mlx_peak_bytes") > 0  # MLX's own peak stays beside it
        # The transient is gone from the resident set, not from the peak.
        assert peak >= server.rss_bytes() + TRANSIENT_BYTES // 2, (peak, server.rss_bytes())
        try:
            status_file = Path(f"/proc/{server.process.pid}/status").read_text()
        except OSError:  # no /proc (macOS): the resident set above is the check
            return
        # What the kernel counts for the server: its high-water mark since the request began,
        # which holds the transient. The gauge is the lifetime peak: that or a little more.
        kernel = int(re.search(r"VmHWM:\s+(\d+) kB", status_file).group(1)) * 1024
        assert kernel <= peak <= kernel * 1.1, (peak, kernel)
    finally:
        stop_server(server)


def test_k_and_mode_apply_to_their_request_only(server):
    client = server.client()

    def chat(**extra):
        reply = client.chat.completions.create(
            model="tiny-moe",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            extra_body=extra,
        )
        return reply.model_extra["edge0"]

    figures = chat(k=2, mode="prefetch")
    assert (figures["k"], figures["mode"]) == (2, "prefetch")
    # The tiny model's experts are below prefetch_min_expert_bytes: no heads read ahead.
    assert "prefetch_hit_rate" not in figures
    info = next(k for k in server.metrics() if k.startswith("edge0_info{"))
    assert 'k="2"' in info and 'mode="prefetch"' in info  # the engine's profile, as it last ran
    figures = chat()  # the next request without them runs the server's profile (its default)
    assert (figures["k"], figures["mode"]) == (4, "prefetch")
    figures = chat(mode="prerouter")  # K=4 has no heads: the mode's own K
    assert (figures["k"], figures["mode"]) == (2, "prerouter")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(k=4, mode="prerouter")  # no heads for K=4: refused
    assert refused.value.body["param"] == "k"
    assert (chat()["k"], chat()["mode"]) == (4, "prefetch")
    card = client.models.retrieve("tiny-moe").model_extra["edge0"]
    assert (card["k"], card["mode"]) == (4, "prefetch")
    log = server.log.read_text()
    assert re.search(r"K=2 prerouter \(asked\)", log) and re.search(r"K=4 prefetch,", log), log


def test_two_interleaved_clients_keep_their_own_profile(server):
    """One client asks for K=2 in prefetch mode, the other names no profile; their requests
    alternate in the queue (both streaming at once). Each reply runs with its own profile, and
    its text is that of the same request sent alone."""
    client = server.client()
    kwargs = dict(model="tiny-moe", max_tokens=6, temperature=0)

    def reply(profile: dict, prompt: str) -> tuple[str, dict]:
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], stream=True, extra_body=profile,
            **kwargs,
        )  # fmt: skip
        text, figures = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            figures = (chunk.model_extra or {}).get("edge0") or figures
        return text, figures

    alone = {name: reply(profile, name) for name, profile in PROFILES.items()}
    got: dict[str, list] = {name: [] for name in PROFILES}

    def client_loop(name: str) -> None:
        for _ in range(3):
            got[name].append(reply(PROFILES[name], name))

    threads = [threading.Thread(target=client_loop, args=(name,)) for name in PROFILES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for name, replies in got.items():
        assert len(replies) == 3, name
        for text, figures in replies:
            assert (figures["k"], figures["mode"]) == EXPECTED_PROFILE[name], (name, figures)
            assert text == alone[name][0], name


PROFILES = {"wide": {}, "narrow": {"k": 2, "mode": "on-demand"}}
EXPECTED_PROFILE = {"wide": (4, "prefetch"), "narrow": (2, "on-demand")}


def test_logprobs_and_sampling_options_reach_the_engine(server):
    client = server.client()
    common = dict(model="tiny-moe", messages=[{"role": "user", "content": "Sea."}], max_tokens=6)
    reply = client.chat.completions.create(
        **common, temperature=0, logprobs=True, top_logprobs=2, extra_body={"k": 4}
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:  # greedy: each token is the likeliest of its alternatives
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
    streamed = client.chat.completions.create(**common, temperature=0, logprobs=True, stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]  # fmt: skip
    assert tokens == [e.token for e in entries]
    # A first token banned by logit_bias never comes; penalties are taken (not refused).
    first = reply.choices[0].logprobs.content[0]
    token_id = server_token_id(server, first.token)
    banned = client.chat.completions.create(
        **common, temperature=0, logprobs=True, logit_bias={str(token_id): -100},
        frequency_penalty=0.5, presence_penalty=0.5, extra_body={"min_p": 0.05,
        "repetition_penalty": 1.2},
    )  # fmt: skip
    assert banned.choices[0].logprobs.content[0].token != first.token


def server_token_id(server: Server, token: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(server.model))
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1, (token, ids)
    return ids[0]


def test_stop_sequences_cut_the_text_and_stop_generating(server):
    client = server.client()
    messages = [{"role": "user", "content": "Count."}]
    full = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=16, temperature=0, extra_body={"k": 4}
    )
    text = full.choices[0].message.content
    stop = text[4:7]
    cut = text[: text.index(stop)]
    cut_reply = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=16, temperature=0, stop=[stop, "\x00"]
    )
    assert cut_reply.choices[0].message.content == cut
    assert cut_reply.choices[0].finish_reason == "stop"
    assert cut_reply.usage.completion_tokens < full.usage.completion_tokens
    stream = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_conversation_continues_from_its_kv_cache(server):
    client = server.client()
    messages = [{"role": "user", "content": "Hello there."}]
    first = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=6, temperature=0
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=6, temperature=0
    )
    reused = second.model_extra["edge0"]["reused_prompt_tokens"]
    assert reused >= first.usage.prompt_tokens, (reused, first.usage.prompt_tokens)
    # OpenAI's own field for it; the weights and the K profile as the system fingerprint.
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert re.fullmatch(r"edge0-[0-9a-f]{16}-k4", second.system_fingerprint), second
    stream = client.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=2, stream=True, extra_body={"k": 2}
    )
    assert {chunk.system_fingerprint for chunk in stream} == {
        second.system_fingerprint.replace("-k4", "-k2")
    }


def test_any_model_name_is_answered_by_the_served_model(server):
    """Front ends send a default name: the one model answers, the reply names it, the log says
    which name was asked; /v1/models lists the model's own id."""
    client = server.client()
    reply = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.model == "tiny-moe" and reply.choices[0].finish_reason in ("length", "stop")
    completion = client.completions.create(model="default_model", prompt="Once", max_tokens=2)
    assert completion.model == "tiny-moe"
    assert [m.id for m in client.models.list()] == ["tiny-moe"]
    log = server.log.read_text()
    assert "chat for model 'gpt-4o' (answered by tiny-moe) " in log
    assert "completion for model 'default_model' (answered by tiny-moe) " in log


def test_strict_model_name_refuses_other_names(monkeypatch):
    """--strict-model-name reaches the server's settings, and with it another name is a 404."""
    import edge0_tui.server as server_module
    from edge0_tui.cli import main
    from edge0_tui.server.openai_shapes import ApiError, parse_chat

    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body, ("tiny-moe", "edge0")).model == "tiny-moe"
    with pytest.raises(ApiError) as refused:
        parse_chat(body, ("tiny-moe", "edge0"), strict=True)
    assert refused.value.status == 404 and refused.value.code == "model_not_found"
    assert parse_chat({**body, "model": "edge0"}, ("tiny-moe", "edge0"), strict=True)
    given = []
    monkeypatch.setattr(server_module, "open_engine_for", lambda *a: None)
    monkeypatch.setattr(server_module, "serve_model", lambda *a, **kw: given.append(kw))
    monkeypatch.setattr("edge0_tui.model_source.check_model", lambda model: None)
    assert main(["serve", "demo", "--strict-model-name"]) == 0
    assert main(["serve", "demo"]) == 0
    assert [kw["strict_model_name"] for kw in given] == [True, False]


def test_every_reply_has_a_request_id(server):
    """The client's own x-request-id when sane (else a new one), on replies and refusals alike,
    and in the request's log line."""
    client = server.client()
    hi = [{"role": "user", "content": "hi"}]
    mine = client.chat.completions.with_raw_response.create(
        model="tiny-moe", messages=hi, max_tokens=1, extra_headers={"x-request-id": "req-abc.1"}
    )
    assert mine.headers["x-request-id"] == "req-abc.1"
    made = client.chat.completions.with_raw_response.create(
        model="tiny-moe", messages=hi, max_tokens=1, extra_headers={"x-request-id": "a b\\"}
    )
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("GET", "/v1/nowhere", headers={"x-request-id": "x" * 129})
    refused = connection.getresponse()
    refused.read()
    connection.close()
    assert refused.status == 404
    assert re.fullmatch(r"[0-9a-f]{32}", refused.getheader("x-request-id"))
    made_id, refused_id = made.headers["x-request-id"], refused.getheader("x-request-id")
    ids = ("req-abc.1", made_id, refused_id)
    log = log_holding(server, *(f"[x-request-id {i}]" for i in ids))
    assert re.search(
        r"POST /v1/chat/completions 200 \d+ ms: chat .* \[x-request-id req-abc\.1\]", log
    )
    assert f"[x-request-id {made_id}]" in log and f"[x-request-id {refused_id}]" in log


GOOD = json.dumps(
    {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()


def chat_body(**fields) -> bytes:
    body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


# (what, path, body, headers, status, param or code expected in the error)
BAD_INPUTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', {}, 400, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
    ("not UTF-8", "/v1/chat/completions", b'{"a": "\xff"}', {}, 400, "invalid_json"),
    ("messages missing", "/v1/chat/completions", chat_body(messages=...), {}, 400, "messages"),
    ("messages a string", "/v1/chat/completions", chat_body(messages="hi"), {}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", chat_body(messages=[]), {}, 400, "messages"),
    ("bad role", "/v1/chat/completions",
     chat_body(messages=[{"role": "robot", "content": "x"}]), {}, 400, "messages[0].role"),
    ("content a number", "/v1/chat/completions",
     chat_body(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content"),
    ("max_tokens negative", "/v1/chat/completions", chat_body(max_tokens=-5), {}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/chat/completions", chat_body(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens a string", "/v1/chat/completions", chat_body(max_tokens="5"), {}, 400, "max_tokens"),
    ("max_tokens a float", "/v1/chat/completions", chat_body(max_tokens=2.5), {}, 400, "max_tokens"),
    ("max_completion_tokens negative", "/v1/chat/completions",
     chat_body(max_completion_tokens=-1), {}, 400, "max_completion_tokens"),
    ("temperature a string", "/v1/chat/completions", chat_body(temperature="hot"), {}, 400, "temperature"),
    ("temperature negative", "/v1/chat/completions", chat_body(temperature=-1), {}, 400, "temperature"),
    ("top_p over 1", "/v1/chat/completions", chat_body(top_p=1.5), {}, 400, "top_p"),
    ("top_p zero", "/v1/chat/completions", chat_body(top_p=0), {}, 400, "top_p"),
    ("seed negative", "/v1/chat/completions", chat_body(seed=-1), {}, 400, "seed"),
    ("seed too big", "/v1/chat/completions", chat_body(seed=2**64), {}, 400, "seed"),
    ("stream a string", "/v1/chat/completions", chat_body(stream="yes"), {}, 400, "stream"),
    ("stop a number", "/v1/chat/completions", chat_body(stop=5), {}, 400, "stop"),
    ("stop empty", "/v1/chat/completions", chat_body(stop=[""]), {}, 400, "stop"),
    ("unknown k", "/v1/chat/completions", chat_body(k=3), {}, 400, "k"),
    ("k a string", "/v1/chat/completions", chat_body(k="4"), {}, 400, "k"),
    ("unknown mode", "/v1/chat/completions", chat_body(mode="fast"), {}, 400, "mode"),
    ("resident by request", "/v1/chat/completions", chat_body(mode="resident"), {}, 400, "mode"),
    ("n of 2", "/v1/chat/completions", chat_body(n=2), {}, 400, "n"),
    ("logprobs a string", "/v1/chat/completions", chat_body(logprobs="yes"), {}, 400, "logprobs"),
    ("top_logprobs alone", "/v1/chat/completions", chat_body(top_logprobs=2), {}, 400, "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions",
     chat_body(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("min_p over 1", "/v1/chat/completions", chat_body(min_p=2), {}, 400, "min_p"),
    ("frequency_penalty over 2", "/v1/chat/completions",
     chat_body(frequency_penalty=3), {}, 400, "frequency_penalty"),
    ("logit_bias by word", "/v1/chat/completions",
     chat_body(logit_bias={"hello": 1}), {}, 400, "logit_bias"),
    ("logit_bias past the vocabulary", "/v1/chat/completions",
     chat_body(logit_bias={"999999": 1}), {}, 400, "logit_bias"),
    ("json_schema", "/v1/chat/completions",
     chat_body(response_format={"type": "json_schema", "json_schema": {}}), {}, 400,
     "response_format.json_schema.name"),
    ("tool without a function", "/v1/chat/completions",
     chat_body(tools=[{"type": "function"}]), {}, 400, "tools"),
    ("tool_choice required", "/v1/chat/completions",
     chat_body(tool_choice="required"), {}, 400, "tool_choice"),
    ("tool_choice named", "/v1/chat/completions",
     chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), {}, 400, "tool_choice"),
    ("history call not JSON", "/v1/chat/completions",
     chat_body(messages=[{"role": "assistant", "tool_calls": [
         {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
     {}, 400, "messages[0].tool_calls"),
    ("prompt missing", "/v1/completions", b'{"model": "tiny-moe"}', {}, 400, "prompt"),
    ("prompt tokens", "/v1/completions", b'{"prompt": [1, 2]}', {}, 400, "prompt"),
    ("stream_options without stream", "/v1/chat/completions",
     chat_body(stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("unknown path", "/v1/embeddings", GOOD, {}, 404, "not_found"),
    ("wrong method", "/v1/chat/completions", None, {"X-Method": "GET"}, 405, None),
    ("wrong API key", "/v1/chat/completions", GOOD, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("no API key", "/v1/chat/completions", GOOD, {"Authorization": ""}, 401, "invalid_api_key"),
    ("metrics without the key", "/metrics", None, {"Authorization": "", "X-Method": "GET"}, 401, "invalid_api_key"),
    ("huge body", "/v1/chat/completions",
     chat_body(messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}]), {}, 413, "request_too_large"),
    ("prompt over the context", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 40000}).encode(), {}, 400, "context_length_exceeded"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_clear_error_and_the_next_request_is_served(server, case):
    what, path, body, headers, status, where = case
    method = headers.get("X-Method", "POST")
    sent = {k: v for k, v in headers.items() if k != "X-Method"}
    got, raw = server.http(method, path, body, sent)
    assert got == status, (what, raw)
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if where is not None:
        assert where in (error["param"], error["code"]), error
    ok, reply = server.http("POST", "/v1/chat/completions", GOOD)
    assert ok == 200, reply
    assert json.loads(reply)["choices"][0]["finish_reason"] in ("length", "stop")


def test_the_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    assert refused.value.body["param"] == "max_tokens"


def test_load_8_streaming_clients_queue_or_429_none_hang(server):
    """8 clients x 4 rounds of streamed requests, all at once each round: every request
    completes or gets 429 (queue limit 4), none hangs, memory is flat from the first round to the
    last."""
    clients, rounds = 8, 4
    results: list[tuple[str, float | None, float]] = []  # (outcome, ttft s, total s)
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1, timeout=60)

    def one(client: openai.OpenAI, i: int, r: int) -> None:
        start = time.perf_counter()
        first = None
        try:
            stream = client.chat.completions.create(
                model="tiny-moe",
                messages=[{"role": "user", "content": f"client {i} round {r}"}],
                max_tokens=8,
                temperature=0.7,
                seed=i * 10 + r,
                stream=True,
            )
            finish = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            outcome = "ok" if finish in ("length", "stop") else f"no finish ({finish})"
        except openai.RateLimitError:
            outcome = "429"
        except Exception as e:  # noqa: BLE001 - counted as a failure
            outcome = f"failed: {e!r}"
        with lock:
            results.append((outcome, first, time.perf_counter() - start))

    def client_thread(i: int) -> None:
        client = server.client(timeout=30)
        for r in range(rounds):
            barrier.wait()
            one(client, i, r)
            barrier.wait()

    threads = [
        threading.Thread(target=client_thread, args=(i,), daemon=True) for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    rss = []
    started = time.monotonic()
    for _ in range(rounds):
        barrier.wait()  # the round starts
        barrier.wait()  # every client of the round is done
        rss.append(server.rss_bytes())
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client hung"
    elapsed = time.monotonic() - started
    outcomes = [o for o, _, _ in results]
    ok = outcomes.count("ok")
    rejected = outcomes.count("429")
    failures = [o for o in outcomes if o not in ("ok", "429")]
    ttfts = sorted(t for o, t, _ in results if o == "ok" and t is not None)
    p50 = statistics.median(ttfts)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]
    print(
        f"\nload: {len(results)} requests in {elapsed:.1f} s: {ok} completed, {rejected} got 429, "
        f"{len(failures)} failed; time to first token p50 {p50 * 1e3:.0f} ms, p95 "
        f"{p95 * 1e3:.0f} ms; server RSS {rss[0] / 2**20:.1f} MiB after round 1, "
        f"{rss[-1] / 2**20:.1f} MiB after round {rounds}"
    )
    assert len(results) == clients * rounds
    assert failures == []
    assert ok >= rounds * (QUEUE_LIMIT + 1) // 2  # the queue took work every round
    assert rss[-1] - rss[0] < 24 * 2**20, rss
    samples = server.metrics()
    assert metric(samples, "edge0_queue_depth") == 0
    assert metric(samples, "edge0_requests_running") == 0


KILLED_CLIENT = textwrap.dedent(
    """
    import sys, openai
    client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
    stream = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "go on"}], max_tokens=3000,
        temperature=0.7, seed=1, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print("streaming", flush=True)
            break
    for chunk in stream:  # read on until killed
        pass
    """
)


def test_a_client_killed_mid_stream_frees_the_engine_at_once(server):
    before = server.metrics()
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, f"{server.url}/v1", API_KEY],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "streaming"
        time.sleep(0.3)  # well into its reply
        during = server.metrics()
        assert metric(during, "edge0_requests_running") == 1
        killed_at = time.perf_counter()
        client.kill()
        client.wait()
    finally:
        if client.poll() is None:
            client.kill()
    cancelled = "edge0_requests_cancelled_total"
    while True:
        samples = server.metrics()
        if (
            metric(samples, cancelled) > metric(before, cancelled)
            and metric(samples, "edge0_requests_running") == 0
        ):
            break
        assert time.perf_counter() - killed_at < 5, "the engine still generates for a dead client"
        time.sleep(0.01)
    freed_s = time.perf_counter() - killed_at
    # Tokens generated after the kill: the reply's context stops growing within a step or two.
    steps_after = metric(samples, "edge0_context_tokens") - metric(during, "edge0_context_tokens")
    start = time.perf_counter()
    stream = server.client().chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "next"}], max_tokens=2, stream=True
    )
    next(iter(stream))
    next_ttft = time.perf_counter() - start
    list(stream)
    print(
        f"\nkilled client: engine free {freed_s * 1e3:.0f} ms after the kill; next request's "
        f"first chunk after {next_ttft * 1e3:.0f} ms; {steps_after:.0f} tokens generated between "
        "the last sample before the kill and the stop"
    )
    assert freed_s < 1.0
    assert next_ttft < 2.0
    assert steps_after < 200  # ~3000 tokens were asked for
    log = server.log.read_text()
    assert re.search(r"POST /v1/chat/completions 499 \d+ ms: cancelled: the client went away", log)


def test_503_while_loading_then_failed(tmp_path):
    """In-process: an engine that takes its time to load, then fails. Requests meanwhile get 503
    in OpenAI's shape; /health says why."""
    import uvicorn

    from edge0_tui.server import EngineWorker, ServerSettings, create_app
    from engine import Edge0Error

    release = threading.Event()

    def open_engine():
        release.wait(30)
        raise Edge0Error("no checkpoint here")

    worker = EngineWorker(open_engine, queue_limit=2)
    app = create_app(worker, ServerSettings(model_ids=("slow",), log=lambda line: None))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.01)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as loading:
            client.chat.completions.create(
                model="slow", messages=[{"role": "user", "content": "a"}]
            )
        assert loading.value.status_code == 503
        assert loading.value.body["code"] == "model_loading"
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 503 and json.loads(response.read())["status"] == "loading"
        assert response.getheader("Retry-After") == "1"  # as the README says
        release.set()
        while worker.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = json.loads(response.read())
        assert response.status == 503 and body["error"] == "no checkpoint here"
        assert response.getheader("Retry-After") is None  # failed: no use asking again
        connection.close()
    finally:
        release.set()
        uv.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()


def test_serve_refuses_a_missing_model_and_a_busy_port(tmp_path):
    command = [sys.executable, "-m", "edge0_tui.cli", "serve"]
    missing = subprocess.run([*command, str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.startswith("edge0: error:") and "Traceback" not in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [*command, "demo", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert busy.returncode == 2, busy.stderr
    assert "cannot listen on 127.0.0.1" in busy.stderr and "Traceback" not in busy.stderr


def raw_request(server: Server, body: dict) -> socket.socket:
    """A POST sent on a socket of its own, the reply left unread."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def log_holding(server: Server, *texts: str, limit_s: float = 10.0) -> str:
    """The server's log once it holds every one of `texts` (or at `limit_s`): a request's line
    is written after its reply is sent, so a client can read the reply before the line is there."""
    deadline = time.monotonic() + limit_s
    log = server.log.read_text()
    while not all(t in log for t in texts) and time.monotonic() < deadline:
        time.sleep(0.05)
        log = server.log.read_text()
    return log


def wait_for(server: Server, check, what: str, limit_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + limit_s
    while True:
        samples = server.metrics()
        if check(samples):
            return samples
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_waiting_request_whose_client_leaves_never_runs(server):
    before = server.metrics()
    messages = [{"role": "user", "content": "wait"}]
    running = raw_request(
        server, {"messages": messages, "max_tokens": 3000, "stream": True, "temperature": 0.7}
    )
    try:
        assert running.recv(64).startswith(b"HTTP/1.1 200")  # generating
        waiting = raw_request(server, {"messages": messages, "max_tokens": 4})
        wait_for(server, lambda s: metric(s, "edge0_queue_depth") == 1, "not queued")
        waiting.close()
        cancelled = "edge0_requests_cancelled_total"
        wait_for(
            server,
            lambda s: (
                metric(s, "edge0_queue_depth") == 0
                and metric(s, cancelled) == metric(before, cancelled) + 1
            ),
            "the waiting request was not dropped",
        )
    finally:
        running.close()
    after = wait_for(server, lambda s: metric(s, "edge0_requests_running") == 0, "still running")
    assert metric(after, cancelled) == metric(before, cancelled) + 2
    served = "edge0_requests_served_total"
    assert metric(after, served) == metric(before, served)  # neither finished, nor ran


def test_stop_text_holds_back_what_may_become_a_stop_sequence():
    from edge0_tui.server.engine_worker import StopText

    text = StopText(("END", "\n\n"))
    assert text.update("Hello E") == "Hello "  # "E" may start "END"
    assert text.update("Hello EN") == ""
    assert text.update("Hello ENx") == "ENx"  # it did not
    assert text.update("Hello ENx\n") == ""
    assert text.update("Hello ENx\n\ufffd") == ""  # a character still being decoded
    assert text.update("Hello ENx\nyEND and more") == "\ny"
    assert text.stopped
    assert text.finish("Hello ENx\nyEND and more tokens") == ""
    plain = StopText(())
    assert plain.update("caf\ufffd") == "caf"
    assert plain.finish("caf\ufffd") == "\ufffd"  # what the model wrote, in the end


class FakeEngine:
    """The Engine surface the worker uses, without a model: token t is the letter 'a' + t."""

    context_limit = 12
    k, mode, last_prefill, tokenizer = 4, "on-demand", None, None

    def __init__(self) -> None:
        from types import SimpleNamespace

        zeros = dict.fromkeys(
            (
                "mlx_active_bytes",
                "mlx_cache_bytes",
                "mlx_peak_bytes",
                "rss_bytes",
                "rss_peak_bytes",
            ),
            0,
        )
        snapshot = SimpleNamespace(page_cache_expert_bytes=0, **zeros)
        self.memory = SimpleNamespace(snapshot=lambda: snapshot)
        self.step = SimpleNamespace(
            phase="decode",
            k=4,
            mode="on-demand",
            page_cache_expert_bytes=0,
            nonfinite_repaired=0,
            **zeros,
        )
        self.asked: list[int] = []
        self.broken = False

    def info(self) -> dict:
        keys = ("model", "family", "native_k", "experts", "layers", "expert_cache_bytes")
        return {**dict.fromkeys(keys, 0), "expert_bytes": 0}

    def profiles(self):
        return []

    def modes(self):
        return ["on-demand"]

    def kv_cache_bytes(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        return [0] * len(text)

    def reply_text(self, tokens: list[int]) -> str:
        return "".join(chr(97 + t) for t in tokens)

    def stream(self, prompt, gen, should_stop):
        from engine import Reply

        return Reply(self._reply(prompt, gen, should_stop))

    def _reply(self, prompt, gen, should_stop):
        from types import SimpleNamespace

        from engine import GeneratedToken

        self.asked.append(gen.max_tokens)
        tokens, stopped_by = [], "max_tokens"
        for t in range(gen.max_tokens):
            tokens.append(t % 26)
            yield GeneratedToken(t % 26, self.step)
            if len(tokens) < gen.max_tokens and should_stop():
                stopped_by = "cancelled"
                break
        summary = dict.fromkeys(
            ("ttft_ms", "prefill_tok_per_s", "decode_tok_per_s", "median_blocked_ms",
             "median_cold_fraction", "median_loads", "median_mib_read", "median_expert_pool_mib",
             "prefill_mib_read", "peak_mlx_bytes", "peak_rss_bytes"), 0.0,
        )  # fmt: skip
        summary.update(prompt_tokens=len(prompt), generated_tokens=len(tokens))
        if self.broken:  # a bug after generating: the figures cannot be made
            summary.clear()
        text = self.reply_text(tokens)
        return SimpleNamespace(tokens=tokens, text=text, steps=[], summary=summary,
                               stopped_by=stopped_by)  # fmt: skip

    def close(self) -> None:
        pass


def test_worker_keeps_a_default_length_inside_the_context_and_stops_at_a_stop_sequence():
    """Without a GPU or a model: the engine thread's own logic, on a fake engine."""
    import queue

    from edge0_tui.server.engine_worker import EngineWorker, Failed, Finished, Job, Text
    from edge0_tui.server.openai_shapes import parse_completion

    fake = FakeEngine()
    worker = EngineWorker(lambda: fake)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while worker.state != "ready" and time.monotonic() < deadline:
            time.sleep(0.01)

        def run(body: dict) -> tuple[str, Finished | Failed]:
            events: queue.Queue = queue.Queue()
            worker.submit(Job(parse_completion(body, ("fake",)), events.put))
            parts = []
            while True:
                event = events.get(timeout=10)
                if isinstance(event, Text):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    return "".join(parts), event
                else:
                    return "".join(parts) + event.text, event

        text, done = run({"prompt": "four"})  # no max_tokens: what 12 - 4 leaves
        assert fake.asked[-1] == 8 and text == "abcdefgh" and done.finish_reason == "length"
        text, done = run({"prompt": "four", "max_tokens": 20})  # asked for: as is (the engine
        # refuses a length past its context: 400 context_length_exceeded, in BAD_INPUTS)
        assert fake.asked[-1] == 20
        text, done = run({"prompt": "x", "max_tokens": 10, "stop": ["de", "zz"]})
        assert text == "abc" and done.finish_reason == "stop"
        assert done.completion_tokens == 5  # "d", then "e" completed the stop: no more tokens
        fake.broken = True
        _, failed = run({"prompt": "x", "max_tokens": 2})
        assert isinstance(failed, Failed) and failed.error.status == 500
        fake.broken = False
        text, done = run({"prompt": "x", "max_tokens": 2})  # the engine thread goes on
        assert text == "ab" and worker.state == "ready"
    finally:
        worker.shutdown()
    assert worker.state == "closed"


def test_serve_says_nothing_of_panels():
    from edge0_tui.model_source import BUNDLED_NOTICE, DEMO_NOTICE
    from edge0_tui.server.engine_worker import server_notice

    for notice in (BUNDLED_NOTICE, DEMO_NOTICE):
        said = server_notice(notice)
        assert said.startswith("demo: ") and "panel" not in said and said.endswith("."), said
    assert server_notice("other") == "other"


def test_serve_demo_shows_the_wall_as_the_chat_does(monkeypatch):
    """`edge0 serve demo` runs with the chat's 4 MB expert cache and page-cache budget; another
    model (or an explicit option) keeps its own."""
    import edge0_tui.server as server
    from edge0_tui.cli import main

    configs = []
    monkeypatch.setattr(
        server, "open_engine_for", lambda model, config, cache: configs.append(config)
    )
    monkeypatch.setattr(server, "serve_model", lambda *a, **kw: None)
    monkeypatch.setattr("edge0_tui.model_source.check_model", lambda model: None)
    assert main(["serve", "demo"]) == 0
    assert main(["serve", "demo", "--page-cache", "off", "--expert-cache", "64M"]) == 0
    assert main(["serve", "some/model"]) == 0
    demo, explicit, other = configs
    assert (demo.expert_cache_bytes, demo.page_cache_bytes) == (4 << 20, 4 << 20)
    assert (explicit.expert_cache_bytes, explicit.page_cache_bytes) == (64 << 20, None)
    assert (other.expert_cache_bytes, other.page_cache_bytes) == (1 << 30, None)


def test_tools_a_template_never_reads_are_said_to_be_ignored(server):
    """The synthetic model's chat template does not take tools: a request that brings them is
    answered (the reply is still the model's), with a warning header and a log line, not
    silently (tests/test_server_tools.py: a template that takes them gets no warning)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    question = [{"role": "user", "content": "hi"}]
    client = server.client()
    whole = client.chat.completions.with_raw_response.create(
        model="edge0", messages=question, max_tokens=2, tools=[tool]
    )
    warning = "tools ignored: this model's chat template does not take tools"
    assert whole.headers.get("x-edge0-warning") == warning
    stream = client.chat.completions.with_raw_response.create(
        model="edge0", messages=question, max_tokens=2, tools=[tool], stream=True
    )
    assert stream.headers.get("x-edge0-warning") == warning
    list(stream.parse())  # the whole stream, so the request is logged
    plain = client.chat.completions.with_raw_response.create(
        model="edge0", messages=question, max_tokens=2
    )
    assert plain.headers.get("x-edge0-warning") is None
    assert warning in server.log.read_text()


def _post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_what_mlx_lms_own_server_tests_ask_of_a_server(server):
    """The requests mlx-lm's server tests send (its model names, its sampling fields), written
    for edge0: each is answered, a seeded completion twice gives the same text, and
    `repetition_context_size` is mlx-lm's penalty window."""
    completion = {
        "model": "default_model", "prompt": "Once upon a time", "max_tokens": 10,
        "temperature": 0.5, "top_p": 0.9, "repetition_penalty": 1.1,
        "repetition_context_size": 20, "seed": 999, "stop": "stop sequence",
    }  # fmt: skip
    status, first = _post(server, "/v1/completions", completion)
    assert status == 200 and first["id"] and first["choices"][0]["text"]
    assert (
        _post(server, "/v1/completions", completion)[1]["choices"][0]["text"]
        == (first["choices"][0]["text"])
    )
    status, bad_window = _post(
        server, "/v1/completions", {**completion, "repetition_context_size": 0}
    )
    assert status == 400 and bad_window["error"]["param"] == "repetition_context_size"
    chat = {"model": "chat_model", "max_tokens": 10, "temperature": 0.7, "top_p": 0.85,
            "repetition_penalty": 1.2}  # fmt: skip
    conversations = [
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
         {"role": "user", "content": [{"type": "text", "text": "Hello!"}]}],
        [{"role": "user", "content": "what is 2+3?"},
         {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "id": "123",
          "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
         {"role": "tool", "content": "5", "tool_call_id": "123"}],
    ]  # fmt: skip
    for messages in conversations:
        status, reply = _post(server, "/v1/chat/completions", {**chat, "messages": messages})
        assert status == 200 and reply["id"] and reply["choices"][0]["message"], reply
    models = server.client().models.list()
    assert models.object == "list" and models.data
    assert all(m.id and m.object == "model" and m.created for m in models.data)
    stream = server.client().chat.completions.create(
        model="chat_model", messages=conversations[0], max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert chunks and all(len(c.choices) <= 1 for c in chunks)
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
