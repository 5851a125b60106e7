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


def core_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "qwen-jax-core"]


def test_a_launched_core_starts_before_the_front_reads_the_tokenizer(hybrid_dir, kit, monkeypatch):
    """(The server's tests run launched engines: tests/server/server_harness.py.)"""
    cores_at_tokenizer = []
    load_tokenizer = llm_module.load_tokenizer

    def recorded(path):
        cores_at_tokenizer.append([p.is_alive() for p in core_processes()])
        return load_tokenizer(path)

    monkeypatch.setattr(llm_module, "load_tokenizer", recorded)
    assert not core_processes()
    engine = AsyncLLM.from_engine_args(hybrid_dir, launch=True, **kit.ENGINE_ARGS)
    # it carries its name in `ps -e` / pgrep (the kernel's process name), set as it starts
    comm = f"/proc/{engine._cores[0].process.pid}/comm"
    deadline = time.monotonic() + 60
    while open(comm).read().strip() != "qwen-jax-core" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open(comm).read().strip() == "qwen-jax-core"
    asyncio.run(engine.shutdown())
    assert cores_at_tokenizer == [[True]] and not core_processes()


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
