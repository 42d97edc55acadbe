"""`vllm serve MODEL --attention-backend chunk` as users start it: it answers the
OpenAI-compatible endpoints with the offline engine's answers, refuses an
unsupported configuration at start with a clear message, and a bad request
fails alone."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_chunkattn.testing.e2e_runs import CONFIGS
from vllm_chunkattn.testing.models import ensure_model
from vllm_chunkattn.testing.server import ServerError, VllmServer
from vllm_chunkattn.testing.workload import CHAT_MAX_TOKENS, chat_conversations, shared_prefix_workload

pytestmark = pytest.mark.e2e

CONFIG = "float32-gqa-d64-block32-preempt"


def serve_args(config: str) -> list[str]:
    _, dtype, block_size, num_blocks, _, _ = CONFIGS[config]
    # The same engine settings as vllm_chunkattn.testing.workload.run_offline.
    return ["--attention-backend", "chunk", "--dtype", dtype, "--block-size", str(block_size),
            "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--num-gpu-blocks-override",
            str(num_blocks), "--max-model-len", str((num_blocks - 1) * block_size), "--enforce-eager",
            "--enable-prefix-caching", "--seed", "0"]


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ensure_model(CONFIGS[CONFIG][0])
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with VllmServer(model, serve_args(CONFIG), log_path=log) as srv:
        srv.model_path = model
        yield srv


def test_completions_equal_offline_engine(server, runs):
    offline = runs(CONFIG, "chunk")
    requests = shared_prefix_workload()

    def complete(req):
        body = {"model": server.model_path, "prompt": req.prompt, "max_tokens": req.max_tokens,
                "temperature": 0, "ignore_eos": True}
        return post(server.url, "/v1/completions", body)["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(complete, requests))
    assert texts == [r["text"] for r in offline["results"]]
    assert "Using CHUNK backend" in server.log_text()


def test_chat_completions_equal_offline_engine(server, runs):
    offline = runs(CONFIG, "chunk")
    answers = [
        post(server.url, "/v1/chat/completions",
             {"model": server.model_path, "messages": conv, "max_tokens": CHAT_MAX_TOKENS,
              "temperature": 0, "ignore_eos": True})["choices"][0]["message"]["content"]
        for conv in chat_conversations()
    ]
    assert answers == offline["chat"]


def test_bad_request_fails_alone(server):
    too_long = "river " * 5000
    with pytest.raises(urllib.error.HTTPError) as err:
        post(server.url, "/v1/completions", {"model": server.model_path, "prompt": too_long, "max_tokens": 4})
    assert err.value.code == 400
    ok = post(server.url, "/v1/completions", {"model": server.model_path, "prompt": "Hello river", "max_tokens": 4})
    assert ok["choices"][0]["text"]
    assert server.healthy()


def test_unsupported_block_size_is_refused_at_start(tmp_path):
    args = ["--attention-backend", "chunk", "--block-size", "16", "--dtype", "float32", "--enforce-eager"]
    with pytest.raises(ServerError) as err:
        VllmServer(ensure_model("tiny"), args, log_path=tmp_path / "server.log").start()
    assert "block size 16 (supported: 32, 64, 128)" in str(err.value) + (tmp_path / "server.log").read_text()
