"""The vLLM-compatible surface: every flag has help and a default; a bad command line (a hub id not in the local
cache, a port in use) is one line on stderr before anything loads; a server started from a hub id in the local
Hugging Face cache with --tokenizer, --chat-template, --max-logprobs, --trust-remote-code and --disable-access-log
honours each; /version, /v1/models/{name}, /detokenize and the access log.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from server_harness import free_port, http_json, server_command, wait_for, wait_until_healthy

from server.__main__ import build_parser
from server.version import version

REPO = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hi"}]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_every_flag_has_help_that_states_its_default():
    for action in build_parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help and "default" in action.help % {"default": action.default}, action.option_strings


def test_help_groups_the_flags_as_vllm_serve_does():
    groups = {group.title: {a.option_strings[0] for a in group._group_actions if a.option_strings}
              for group in build_parser()._action_groups}
    assert {"Frontend", "ModelConfig", "LoadConfig", "ParallelConfig", "CacheConfig", "SchedulerConfig",
            "SpeculativeConfig"} <= set(groups)
    assert "--port" in groups["Frontend"] and "--max-model-len" in groups["ModelConfig"]
    assert "--tensor-parallel-size" in groups["ParallelConfig"] and "--block-size" in groups["CacheConfig"]
    assert "--max-num-seqs" in groups["SchedulerConfig"] and "--download-dir" in groups["LoadConfig"]


def test_version_flag_prints_the_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"qwen-jax {version()}"


@pytest.mark.parametrize("model", [["--model", "Qwen/Qwen3.5-4B"], ["Qwen/Qwen3.5-4B"]], ids=["flag", "positional"])
def test_a_hub_id_missing_from_the_local_cache_is_one_line_and_a_non_zero_exit(tmp_path, model):
    result = run_cli(*model, "--port", str(free_port()), env={"HF_HOME": str(tmp_path)})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "'Qwen/Qwen3.5-4B' is not a local path and not in the Hugging Face cache" in lines[0]
    assert str(tmp_path) in lines[0]


def test_a_model_directory_without_a_config_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = run_cli("--model", str(tmp_path), "--port", str(free_port()))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"python -m server: error: {tmp_path} has no config.json: a model "
                                                  f"directory holds a Hugging Face config.json (and its "
                                                  f"*.safetensors, unless --load-format dummy)"]


def test_a_port_in_use_is_one_line_before_the_model_loads(default_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--model", default_model_dir, "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines == [f"python -m server: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("args,message", [
    (["--max-logprobs", "21"], "--max-logprobs must be in [0, 20]"),
    (["--chat-template", "no-such-template.jinja"], "is neither a file nor a Jinja template"),
    (["--tokenizer", "./no/such/dir"], "is neither a local path nor a Hugging Face hub id"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "--speculative-config: method"),
    (["--layout", "XP=2"], "--layout 'XP=2': expected parts like DP=2, TP=2, EP or EP=2"),
    (["--layout", "DP=2", "-tp", "2"], "--layout DP=2 and -tp both set the layout: give one"),
    (["--quantization", "fp8"], "--quantization is not supported: weights stay in BF16"),
    (["--tool-call-parser", "mistral"], "invalid choice: 'mistral'"),
    (["--hf-overrides", "[1]"], "expected a JSON object"),
    (["--allowed-origins", "http://a"], "expected a JSON list of strings"),
])
def test_bad_flags_are_one_line(args, message):
    result = run_cli(*args, "--port", str(free_port()))
    assert result.returncode == 2 and message in result.stderr
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("python -m server: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported"),
    (["--enable-lora"], "--enable-lora is not supported: no LoRA adapters"),
    (["--lora-modules", "a=/x"], "--lora-modules is not supported: no LoRA adapters"),
    (["--limit-mm-per-prompt", '{"image": 1}'], "--limit-mm-per-prompt is not supported: text only"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported"),
    (["--model", "{model}", "--hf-overrides", '{"num_hidden_layers": "many"}'], "--hf-overrides {'num_hidden_layers': "
                                                                                "'many'} make an invalid config"),
    (["--ssl-keyfile", "no/such/key.pem", "--ssl-certfile", "no/such/cert.pem"], "--ssl-keyfile 'no/such/key.pem' is "
                                                                                 "not a file"),
    (["--generation-config", "no/such/dir"], "--generation-config: generation_config 'no/such/dir': no "
                                             "generation_config.json there"),
    (["--override-generation-config", '{"sample": true}'], "--override-generation-config: override_generation_config "
                                                           "must be a dict of temperature"),
])
def test_vllm_flags_for_what_this_engine_does_not_do_are_refused_before_anything_loads(args, message,
                                                                                       default_model_dir):
    """(The same UsageError as --quantization's above, which the real command line turns into one line, exit 2.)"""
    from server.__main__ import UsageError, build_parser, check_args

    with pytest.raises(UsageError, match=re.escape(message)):
        check_args(build_parser().parse_args([a.replace("{model}", default_model_dir) for a in args]))


def assert_cors(url: str) -> None:
    """--allowed-origins '["http://a.example"]' --allow-credentials: that origin's preflight and requests are
    allowed (the origin named, credentials allowed), another origin's preflight is refused."""
    import urllib.error
    import urllib.request

    def call(method: str, origin: str, preflight: bool):
        headers = {"Origin": origin, **({"Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type"}
                                        if preflight else {})}
        request = urllib.request.Request(url + "/v1/models", method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, resp.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers

    status, headers = call("OPTIONS", "http://a.example", preflight=True)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://a.example"
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert call("OPTIONS", "http://b.example", preflight=True)[0] == 400
    status, headers = call("GET", "http://a.example", preflight=False)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://a.example"
    status, headers = call("GET", "http://b.example", preflight=False)
    assert status == 200 and headers["Access-Control-Allow-Origin"] is None


@pytest.fixture
def hub_cache(tmp_path, default_model_dir) -> Path:
    """A Hugging Face cache ($HF_HOME) holding the default model as the hub id qwen-jax/tiny."""
    repo = tmp_path / "hf" / "hub" / "models--qwen-jax--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    shutil.copytree(default_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    return tmp_path / "hf"


def test_a_server_from_a_cached_hub_id_honours_its_flags(tmp_path, hub_cache, compilation_cache_dir):
    template = tmp_path / "template.jinja"
    template.write_text("{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(port, "qwen-jax/tiny", compilation_cache_dir, "--tokenizer", "qwen-jax/tiny",
                             "--chat-template", str(template), "--max-logprobs", "3", "--trust-remote-code",
                             "--served-model-name", "org/tiny", "tiny", "--disable-log-requests",
                             # Qwen's published vllm serve flags, and others vLLM users pass
                             "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser",
                             "qwen3", "--block-size", "8", "--enable-chunked-prefill", "--kv-cache-dtype", "auto",
                             "--disable-log-stats", "--revision", "main", "--download-dir", str(hub_cache / "hub"),
                             "--response-role", "bot", "--return-tokens-as-token-ids",
                             "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
                             "--allowed-origins", '["http://a.example"]', "--allow-credentials")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:  # (the model is found through --download-dir, not $HF_HOME)
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env={k: v for k, v in os.environ.items() if k != "HF_HOME"})
    try:
        wait_until_healthy(server, url, log_path)
        status, _, body = http_json("POST", url + "/tokenize", {"messages": USER,
                                                                "chat_template_kwargs": {"greeting": "Hello"}})
        assert status == 200
        status, _, text = http_json("POST", url + "/detokenize", {"tokens": body["tokens"]})
        assert text["prompt"] == "Hello<user>hi"  # the --chat-template file, with a variable only it knows
        status, _, body = http_json("POST", url + "/v1/chat/completions",
                                    {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 3})
        assert status == 200 and len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
        assert body["choices"][0]["message"]["role"] == "bot"  # --response-role
        first = body["choices"][0]["logprobs"]["content"][0]
        assert first["token"].startswith("token_id:")  # --return-tokens-as-token-ids
        assert all(top["token"].startswith("token_id:") for top in first["top_logprobs"])
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        assert_cors(url)
        status, _, body = http_json("POST", url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 4})
        assert status == 400 and body["error"]["param"] == "logprobs" and "--max-logprobs" in body["error"]["message"]
        status, _, body = http_json("GET", url + "/v1/models/org/tiny")
        assert status == 200 and body["id"] == "org/tiny"
        assert [card["id"] for card in http_json("GET", url + "/v1/models")[2]["data"]] == ["org/tiny", "tiny"]
        status, _, body = http_json("POST", url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert status == 200 and body["model"] == "org/tiny"  # an alias; responses carry the first name
        status, _, body = http_json("POST", url + "/v1/completions", {"model": "tiny/other", "prompt": "x"})
        assert status == 404 and body["error"]["message"] == "The model `tiny/other` does not exist."
    finally:
        server.terminate()
        server.wait(60)
    text = log_path.read_text()
    assert "--trust-remote-code is not needed" in text
    assert "hub/models--qwen-jax--tiny/snapshots/0123456789abcdef" in text  # the model came from the cache
    assert "qwen_jax.access" not in text  # --disable-log-requests
    assert "blocks x 8 tokens" in text  # --block-size
    assert "Traceback" not in text


def test_version_model_card_and_detokenize(server, tokenizer):
    status, _, body = http_json("GET", server.url + "/version")
    assert (status, body) == (200, {"version": version()})
    status, _, card = http_json("GET", server.url + "/v1/models/qwen-jax-test")
    assert status == 200 and card["id"] == "qwen-jax-test" and card["object"] == "model"
    status, _, body = http_json("GET", server.url + "/v1/models/someone-else")
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    ids = tokenizer.encode("Once upon a time")
    status, _, body = http_json("POST", server.url + "/detokenize", {"tokens": ids})
    assert (status, body) == (200, {"prompt": "Once upon a time"})
    for bad in (-1, 517, 2 ** 31):
        status, _, body = http_json("POST", server.url + "/detokenize", {"tokens": [1, bad]})
        assert status == 400 and body["error"]["param"] == "tokens[1]"
    status, _, body = http_json("POST", server.url + "/tokenize", {"prompt": ids, "return_token_strs": True})
    assert body["tokens"] == ids and body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


def test_each_request_gets_an_access_log_line(server, caplog):
    probe = f"/v1/models/probe-{uuid.uuid4().hex}"  # a path no other request uses

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "qwen_jax.access" and probe in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="qwen_jax.access"):
        http_json("GET", server.url + probe)
        http_json("POST", server.url + probe, {"x": 1})
        wait_for(lambda: len(lines()) == 2, 10, "two access-log lines")  # written once the last byte is sent
    get, post = lines()
    assert get.startswith("127.0.0.1:") and f'"GET {probe} HTTP/1.1" 404 ' in get and get.endswith(" ms")
    assert f'"POST {probe} HTTP/1.1" 405 ' in post


def test_cross_origin_requests_are_allowed_by_default_as_in_vllm(server):
    import urllib.request

    headers = {"Origin": "http://any.example", "Access-Control-Request-Method": "POST"}
    preflight = urllib.request.Request(server.url + "/v1/chat/completions", method="OPTIONS", headers=headers)
    with urllib.request.urlopen(preflight, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
    with urllib.request.urlopen(urllib.request.Request(server.url + "/health", headers={"Origin": "http://x"}),
                                timeout=30) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"


def test_without_served_model_name_the_server_answers_to_the_model_as_given(tmp_path):
    """A client written for vLLM names the model by --model as given: a directory is served under its folder's name
    (first, as before) and the path as given; a hub id (resolved to a snapshot folder) under the hub id alone; the
    built-in model under its folder's name."""
    import argparse
    from types import SimpleNamespace

    from server.__main__ import default_model_names

    folder = tmp_path / "Qwen3.5-tiny"
    folder.mkdir()
    engine = SimpleNamespace(model_name="Qwen3.5-tiny")
    assert default_model_names(argparse.Namespace(model_as_given=str(folder)), engine) == ("Qwen3.5-tiny",
                                                                                           str(folder))
    snapshot = SimpleNamespace(model_name="0123abcd")
    assert default_model_names(argparse.Namespace(model_as_given="Qwen/Qwen3.5-4B"), snapshot) == ("Qwen/Qwen3.5-4B",)
    assert default_model_names(argparse.Namespace(model_as_given=None), engine) == ("Qwen3.5-tiny",)
