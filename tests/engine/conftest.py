"""Fixtures for the engine tests: a tiny float32 hybrid Qwen3.5-MoE (also with an MTP head) and a tiny LLaMA, each
saved once per session as an HF directory (tests/tiny_models.py builds them), and engines built once per configuration.

Every engine of one model uses the same cache geometry (ENGINE_ARGS) so that all of them share compiled step programs.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from tiny_models import (
    EOS,
    EOS_PROMPT,
    EOS_STEP,
    HYBRID_VOCAB,
    LLAMA_VOCAB,
    add_copy_mtp_head,
    build_hybrid,
    build_llama,
)

from qwen_jax import LLM
from qwen_jax.engine import step

BLOCK = 16
# One cache geometry for every engine of a model: 14 usable blocks of 16 tokens, 4 sequences of <= 64 tokens. Four
# sequences at full length need 16 blocks, so a workload that fills every row preempts.
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=BLOCK, num_kv_blocks=14,
                   num_snapshots=8, seed=0)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """name -> (checkpoint directory, float32 HF module)."""
    root = tmp_path_factory.mktemp("engine_models")
    return {"hybrid": (str(root / "hybrid"), build_hybrid(root / "hybrid")),
            "llama": (str(root / "llama"), build_llama(root / "llama"))}


@pytest.fixture(scope="session")
def hybrid_dir(models) -> str:
    return models["hybrid"][0]


@pytest.fixture(scope="session")
def hybrid_mtp_dir(models, tmp_path_factory) -> str:
    """The hybrid model with a head that drafts often right (tiny_models.add_copy_mtp_head)."""
    return add_copy_mtp_head(models["hybrid"][0], tmp_path_factory.mktemp("hybrid_mtp") / "model")


@pytest.fixture(scope="session")
def llama_dir(models) -> str:
    return models["llama"][0]


@pytest.fixture(scope="session")
def engines(models):
    """(model name, prefix caching on) -> LLM, built on first use and shared by every test of the session."""
    made: dict[tuple[str, bool], LLM] = {}

    def get(name: str, prefix_caching: bool = True) -> LLM:
        key = (name, prefix_caching)
        if key not in made:
            made[key] = LLM(models[name][0], enable_prefix_caching=prefix_caching, **ENGINE_ARGS)
        return made[key]

    return get


def prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    """Deterministic random token ids below the added tokens of the hybrid vocabulary."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


def assert_idle(llm: LLM) -> None:
    """Nothing running or waiting, no block or slot held, every reference count back to 0."""
    engine = llm.engine
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert (stats["kv_blocks_used"], stats["state_slots_used"]) == (0, 0)
    for replica in engine.replicas:
        assert replica.blocks.num_free == replica.blocks.num_usable
        assert not any(replica.blocks.ref_counts)
        assert replica.slots.num_free == replica.slots.num_slots - 1 and not replica.slots.in_use
    assert not engine.seqs and not engine.has_unfinished and not llm.output.requests


def compile_counts(llm: LLM) -> dict[str, int]:
    """Programs compiled so far: the programs compiled into `llm`'s tables, and the entries in the compile caches of
    every step program (the tables' fallbacks)."""
    jitted = (step.forward, step.sample_step, step.decode_steps, step.verify_step, step.draft_step, step.stage_inputs,
              step.stage_behind, step.restore_snapshots, step.save_snapshots, step.reset_penalties, step.write_table)
    return {"compiled": sum(len(r.runner.programs.compiled) for r in llm.engine.replicas),
            **{fn.__name__: fn._cache_size() for fn in jitted}}


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The constants and helpers above for test modules (conftest modules are not importable by name)."""
    return SimpleNamespace(ENGINE_ARGS=ENGINE_ARGS, BLOCK=BLOCK, EOS=EOS, EOS_PROMPT=EOS_PROMPT, EOS_STEP=EOS_STEP,
                           HYBRID_VOCAB=HYBRID_VOCAB, LLAMA_VOCAB=LLAMA_VOCAB, prompt=prompt,
                           assert_idle=assert_idle, compile_counts=compile_counts,
                           fake_memory=fake_memory)


def fake_memory(monkeypatch, model_dir: str, args: dict, held_back: float, working: int = 0) -> None:
    """Fake device memory statistics and a measured working memory (`working`, the largest forward's) under which a
    replica of `model_dir` with engine `args` (its caches' sizes all given) has `held_back` bytes of its share of the
    device beside its weights and caches: found from a replica planned on an empty device (memory in use moves what is
    left one for one)."""
    from qwen_jax.config import load_config
    from qwen_jax.engine import replica as replica_module
    from qwen_jax.engine.core import engine_args
    from sharding import rules
    from sharding.mesh import replica_meshes

    device = type(jax.devices()[0])
    monkeypatch.setattr(replica_module, "measure_working", lambda shapes, mesh: working)
    monkeypatch.setattr(device, "memory_stats", lambda self: {"bytes_limit": 2**30, "bytes_in_use": 0})
    cfg, mesh = load_config(model_dir), replica_meshes(1)[0]
    empty = replica_module.Replica(0, cfg, rules.abstract_params(cfg, mesh), mesh, engine_args(args),
                                   args["max_model_len"], [0], seed=0).held_back
    in_use = int(empty - held_back)
    monkeypatch.setattr(device, "memory_stats", lambda self: {"bytes_limit": 2**30, "bytes_in_use": in_use})
