"""A launched AsyncLLM (the server's: `launch=True`) starts its core process before the front reads the tokenizer,
so the core loads and compiles meanwhile; start() then only waits. A core that fails before start() is called has
its failure kept for start() to raise."""

import asyncio
import multiprocessing
import os
import shutil
import time

import pytest

from qwen_jax import llm as llm_module
from qwen_jax.llm import AsyncLLM, EngineDead
from qwen_jax.sampling_params import SamplingParams


def core_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "qwen-jax-core"]


def test_a_launched_core_starts_before_the_front_reads_the_tokenizer(hybrid_dir, kit, monkeypatch):
    """The core compiles, says ready and sends its counters while the front still reads the tokenizer (held here
    until then); the engine then starts and serves. (The server's tests run launched engines:
    tests/server/server_harness.py.)"""
    cores_at_tokenizer = []
    messages: list[str] = []
    load_tokenizer, on_message = llm_module.load_tokenizer, AsyncLLM._on_message

    def recorded(path):
        cores_at_tokenizer.append([p.is_alive() for p in core_processes()])
        deadline = time.monotonic() + 300
        while messages[-1:] != ["outputs"] and time.monotonic() < deadline:  # counters sent after "ready"
            time.sleep(0.05)
        return load_tokenizer(path)

    def record(self, core, message):
        messages.append(message[0])
        on_message(self, core, message)

    monkeypatch.setattr(llm_module, "load_tokenizer", recorded)
    monkeypatch.setattr(AsyncLLM, "_on_message", record)
    assert not core_processes()
    engine = AsyncLLM.from_engine_args(hybrid_dir, launch=True, **kit.ENGINE_ARGS)
    assert cores_at_tokenizer == [[True]] and messages[:2] == ["ready", "outputs"]
    # it carries its name in `ps -e` / pgrep (the kernel's process name), set as it starts
    assert open(f"/proc/{engine._cores[0].process.pid}/comm").read().strip() == "qwen-jax-core"

    async def serve() -> list[int]:
        await engine.start()
        params = SamplingParams(max_tokens=3, temperature=0)
        try:
            outputs = await asyncio.wait_for(_collect(engine.generate([1, 2, 3], params, "r")), 120)
        finally:
            await engine.shutdown()
        return outputs[-1].token_ids

    assert len(asyncio.run(serve())) == 3
    assert not core_processes()


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_a_launched_core_that_fails_before_start_is_awaited_fails_the_start(hybrid_dir, kit, tmp_path):
    broken = tmp_path / "no_weights"
    shutil.copytree(hybrid_dir, broken, ignore=shutil.ignore_patterns("*.safetensors*"))

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(str(broken), launch=True, **kit.ENGINE_ARGS)
        for _ in range(600):  # the core reports its failure before start() has an event loop to hand it to
            if not engine._cores[0].process.is_alive():
                break
            await asyncio.sleep(0.1)
        with pytest.raises(EngineDead, match="failed to start"):
            await engine.start()
        await engine.shutdown()

    asyncio.run(run())
    assert not core_processes()
    assert os.listdir(broken)
