"""Fixtures for the server tests: the built-in default model, and one real server on a free 127.0.0.1 port per session.

The server runs the real AsyncLLM under Hypercorn in a background thread; tests talk to it over HTTP only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from server_harness import MAX_NUM_SEQS, START_TIMEOUT_S, ServerThread, free_port, make_engine


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> str:
    from qwen_jax.default_model import ensure_default_model

    return ensure_default_model(str(tmp_path_factory.mktemp("qwen_jax_cache")))


@pytest.fixture(scope="session")
def compilation_cache_dir() -> str:
    from qwen_jax.default_model import default_cache_dir
    from server.__main__ import enable_compilation_cache

    return enable_compilation_cache(os.path.join(default_cache_dir(), "jax_compilation_cache"))


@pytest.fixture(scope="session")
def server(default_model_dir, compilation_cache_dir) -> Iterator[ServerThread]:
    from server.app import ServerConfig, create_app

    engine = make_engine(default_model_dir)
    app = create_app(engine, ServerConfig(served_model_names=("qwen-jax-test", "m"), max_num_seqs=MAX_NUM_SEQS,
                                          max_queue_len=512, max_body_bytes=256 * 1024))
    srv = ServerThread(app, "127.0.0.1", free_port())
    srv.engine = engine
    srv.state = app.extensions["qwen_jax"]
    srv.start(START_TIMEOUT_S)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)
