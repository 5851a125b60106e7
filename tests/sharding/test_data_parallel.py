"""Data-parallel replicas inside one engine core: data_parallel_size=2 x tensor_parallel_size=2 and
data_parallel_size=4 generate the single-replica greedy tokens, spread requests over replicas that each hold their
own weights and cache on their own devices, issue every replica's step before reading any back, free an aborted
request's memory on its replica, and report stats summed over replicas.

Tiny float32 HF checkpoints (a hybrid Qwen3.5-MoE: GDN + attention, 8 experts top-2 + shared expert; a LLaMA) are
built once; engines are built once per (model, layout)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from qwen_jax import LLM, SamplingParams
from qwen_jax.engine.core import EngineCore
from sharding import rules

LAYOUTS = {"dp1": (1, 1), "dp2xtp2": (2, 2), "dp4": (4, 1)}  # (data_parallel_size, tensor_parallel_size)
# Prompts of at most 12 tokens plus 4 new ones fit one 16-token block and prefill in one chunk, so each replica
# compiles one prefill and one decode token bucket (compiling is what this test spends its time on; 4 replicas
# compile 4x).
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=128, block_size=16, num_kv_blocks=8,
                   num_snapshots=4, seed=0, enable_prefix_caching=True)
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(2, 128, n)]
           for seed, n in enumerate((5, 12, 9, 3, 11, 7))]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)


def _hybrid_moe() -> transformers.PreTrainedModel:
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=128, initializer_range=0.1, eos_token_id=1, attn_implementation="eager"))


def _llama() -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=64, max_position_embeddings=128, initializer_range=0.1, eos_token_id=1))


MODELS = {"qwen3_5_moe": _hybrid_moe, "llama": _llama}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, build in MODELS.items():
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp("data_parallel") / name
        build().float().save_pretrained(directory)
        config_file = directory / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": name}))
        dirs[name] = str(directory)
    return dirs


@pytest.fixture(scope="module")
def engines(model_dirs):
    """engines(model, layout) -> an LLM, built once per module."""
    made: dict[tuple[str, str], LLM] = {}

    def get(model: str, layout: str) -> LLM:
        if (model, layout) not in made:
            dp, tp = LAYOUTS[layout]
            made[model, layout] = LLM(model_dirs[model], data_parallel_size=dp, tensor_parallel_size=tp,
                                      **ENGINE_ARGS)
        return made[model, layout]

    return get


def _generate(engine: EngineCore, tag: str) -> tuple[dict, list[int], list[list[tuple[str, int]]]]:
    """Run PROMPTS to completion: ({request: (tokens, logprobs)} in prompt order, requests per replica after adding
    them all, and for each step() call the replicas' device calls in order: ("issue", i) when replica i's step went
    to its devices, ("fetch", i) when the host waited for the step it had issued before)."""
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, prompt, GREEDY)
    per_replica = [replica.num_unfinished for replica in engine.replicas]
    calls: list[list[tuple[str, int]]] = []
    originals = [(replica.runner, replica.runner.executor) for replica in engine.replicas]
    for i, (runner, execute) in enumerate(originals):
        runner.executor = lambda ops, i=i, execute=execute: (calls[-1].append(("issue", i)), execute(ops))[1]
        runner.fetch = lambda out, i=i, fetch=runner.fetch: (calls[-1].append(("fetch", i)), fetch(out))[1]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    try:
        while engine.has_unfinished:
            calls.append([])
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
    finally:
        for runner, execute in originals:
            runner.executor = execute
            del runner.fetch
    return {rid: (tokens[rid], logprobs[rid]) for rid in ids}, per_replica, calls


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", ["dp2xtp2", "dp4"])
def test_replicas_generate_the_single_replica_tokens(engines, model, layout):
    reference, per_replica, _ = _generate(engines(model, "dp1").engine, f"ref-{layout}")
    assert per_replica == [6]
    engine = engines(model, layout).engine
    dp, tp = LAYOUTS[layout]
    outputs, per_replica, calls = _generate(engine, layout)
    # Least-busy routing: 6 requests over 2 replicas are 3 + 3, over 4 replicas 2 + 2 + 1 + 1.
    assert per_replica == {2: [3, 3], 4: [2, 2, 1, 1]}[dp]
    # The replicas never wait for each other: a step() issues every busy replica's next step before it reads any
    # replica's previous one back, and the first issues all of them at once.
    for events in calls:
        kinds = [kind for kind, _ in events]
        assert kinds == sorted(kinds, key=lambda kind: kind == "fetch"), events
    assert calls[0] == [("issue", i) for i in range(dp)]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outputs.values(), reference.values(), strict=True):
        assert tokens == ref_tokens and len(tokens) == GREEDY.max_tokens
        got, want = np.array(logprobs), np.array(ref_logprobs)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), f"{layout}: logprobs differ"
    _assert_replica_layout(engine, dp, tp)


def _assert_replica_layout(engine: EngineCore, dp: int, tp: int) -> None:
    """Replica i holds its own copy of the weights (equal to replica 0's) and its own cache, on devices
    [i*tp, (i+1)*tp) only."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert len(engine.replicas) == dp
    first = [np.asarray(a) for a in jax.tree.leaves(engine.replicas[0].runner.params)]
    for i, replica in enumerate(engine.replicas):
        own = set(devices[i * tp:(i + 1) * tp])
        assert set(replica.mesh.devices.flat) == own and replica.mesh.size == tp
        assert set(rules.bytes_per_device(replica.runner.params)) == own
        assert set(rules.bytes_per_device(replica.runner.cache)) == own
        for a, b in zip(jax.tree.leaves(replica.runner.params), first, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_abort_frees_memory_on_its_replica_and_stats_sum(engines):
    engine = engines("qwen3_5_moe", "dp2xtp2").engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, GREEDY)
    assert [engine._replica_of[f"abort-{i}"].index for i in range(6)] == [0, 1, 0, 1, 0, 1]
    # Each replica admits its three requests and issues their prefill (the step shape the test above compiled);
    # nothing is read back yet, so no token has come out.
    assert engine.step() == []
    replica0, replica1 = engine.replicas
    stats = engine.stats()
    for key in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "state_slots_used",
                "state_slots_total", "prefix_cache_queries", "prefix_cache_hits"):
        assert stats[key] == replica0.stats()[key] + replica1.stats()[key], key
    assert (stats["num_running"], stats["kv_blocks_used"], stats["state_slots_used"]) == (6, 6, 6)
    assert (stats["kv_blocks_total"], stats["state_slots_total"]) == (2 * 8, 2 * 8)  # num_kv_blocks, max_num_seqs
    before = replica0.stats()
    seq = engine.seqs["abort-1"]
    assert seq.block_table and seq.slot is not None
    (out,) = engine.abort(["abort-1"])
    # Its first token is still on the device (the prefill was issued, not read back): the abort carries no token.
    assert (out.request_id, out.finish_reason, out.new_token_ids) == ("abort-1", "abort", [])
    after = replica1.stats()
    assert (after["num_running"], after["kv_blocks_used"], after["state_slots_used"]) == (2, 2, 2)
    assert seq.slot is None and not seq.block_table and "abort-1" not in engine._replica_of
    assert replica0.stats() == before  # the other replica is untouched
    engine.add_request("abort-6", PROMPTS[0], GREEDY)  # replica 1 now has the fewest unfinished requests
    assert engine._replica_of["abort-6"].index == 1
    engine.abort(list(engine.seqs))
    for replica in engine.replicas:
        s = replica.stats()
        assert (s["num_running"], s["num_waiting"], s["kv_blocks_used"], s["state_slots_used"]) == (0, 0, 0, 0)
        assert replica.blocks.num_free == replica.blocks.num_usable and not any(replica.blocks.ref_counts)
    # The prefill issued above is still in flight: the next step() reads it back and drops the aborted requests'
    # tokens, and then nothing is left.
    assert engine.has_unfinished
    assert engine.step() == []
    assert not engine.has_unfinished and not engine.seqs and not engine._replica_of


def test_dummy_weights_are_identical_replicas(model_dirs):
    engine = EngineCore(model_dirs["llama"], load_format="dummy", data_parallel_size=2, **ENGINE_ARGS)
    _assert_replica_layout(engine, 2, 1)
    assert engine.stats()["kv_blocks_total"] == 2 * ENGINE_ARGS["num_kv_blocks"]


def test_gpu_kernels_run_in_tensor_parallel_replicas(engines, model_dirs):
    """kernels="gpu" (interpreted on the CPU) in 2 replicas of TP 2: each device of a replica runs the attention
    kernel on its query heads; the replicas give the jnp single-replica tokens."""
    reference, _, _ = _generate(engines("llama", "dp1").engine, "ref-kernels")
    engine = EngineCore(model_dirs["llama"], kernels="gpu", data_parallel_size=2, tensor_parallel_size=2,
                        **ENGINE_ARGS)
    outputs, per_replica, _ = _generate(engine, "kernels")
    assert per_replica == [3, 3]
    for (tokens, _), (ref_tokens, _) in zip(outputs.values(), reference.values(), strict=True):
        assert tokens == ref_tokens


def test_server_cli_passes_data_parallel_size():
    from server.__main__ import build_parser, engine_args

    args = engine_args(build_parser().parse_args(["--data-parallel-size", "2", "-tp", "2", "--max-num-seqs", "8"]))
    assert (args["data_parallel_size"], args["tensor_parallel_size"], args["max_num_seqs"]) == (2, 2, 8)
