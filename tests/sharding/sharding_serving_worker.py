"""One host of the 2-process serving test: host 0 runs an EngineCore whose TP 8 mesh spans both processes and drives
a few requests, host 1 follows it. Run by test_multihost_serving.py only (which calls `drive` for its reference)."""

from __future__ import annotations

import json
import sys

# The tiny hybrid MoE of sharding_tiny_models, float32, from a random checkpoint (each host reads its own shards).
# max_model_len / block_size / 8 = 2 blocks, the smallest table width, covers every sequence (<= 16 tokens).
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_kv_blocks=32,
                   num_snapshots=4, seed=0, enable_prefix_caching=True)
# A 10-token prompt prefills in two chunks, cut at its snapshot boundary (token 8: a "save" op), then decodes. Once
# it has finished, the same prompt arrives again and restores that snapshot (a "restore" op before its prefill).
# Every step is one request of 8, 2 or 1 tokens: three token buckets.
PROMPT = [(7 * i + 3) % 256 for i in range(10)]
MAX_TOKENS = 5
# The step() calls of `drive`. Each round issues 6 steps ("first": chunk of 8, chunk of 2 that samples token 1,
# decodes of tokens 2..5) or 5 ("late": the restored tail that samples token 1, 4 decodes); a step() issues the next
# step before it reads the last one back, so each round ends with one more call that only reads token 5.
DRIVE_STEPS, DRIVE_ISSUED = 7 + 6, 6 + 5


def drive(engine) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens of each request (its CoreOutputs' tokens over the steps) and the number of step() calls."""
    from qwen_jax.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, steps = {}, 0
    for rid in ("first", "late"):
        engine.add_request(rid, PROMPT, greedy)
        tokens[rid] = []
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            steps += 1
    assert engine.stats()["prefix_cache_hits"] >= 1, "the late request must restore the first one's snapshot"
    return tokens, steps


# Four prompts added at once: with 4 replicas each gets one (the least busy replica takes a new request).
REPLICA_PROMPTS = [[(5 * i + 11 * n + 1) % 256 for i in range(6 + n)] for n in range(4)]


def drive_replicas(engine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens of REPLICA_PROMPTS, all in flight together, and the replica each request ran on."""
    from qwen_jax.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for n, prompt in enumerate(REPLICA_PROMPTS):
        engine.add_request(f"r{n}", prompt, greedy)
    replica = {rid: r.index for rid, r in engine._replica_of.items()}
    tokens = {rid: [] for rid in replica}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, replica


def main(host_index: int, port: int, model_dir: str, out: str, data_parallel_size: int) -> None:
    """data_parallel_size 1: one TP 8 replica over both hosts; 4: TP 2 replicas, two on each host."""
    from qwen_jax.engine.core import EngineCore

    engine = EngineCore(model_dir, num_hosts=2, host_index=host_index, coordinator_address=f"127.0.0.1:{port}",
                        tensor_parallel_size=8 // data_parallel_size, data_parallel_size=data_parallel_size,
                        **ENGINE_ARGS)
    if not engine.is_leader:
        result = {"steps": engine.follow()}
    elif data_parallel_size == 1:
        tokens, steps = drive(engine)
        engine.shutdown()
        result = {"tokens": tokens, "steps": steps, "messages": engine.steps.messages,
                  "bytes": engine.steps.bytes, "send_seconds": engine.steps.seconds}
    else:
        tokens, replica = drive_replicas(engine)
        engine.shutdown()
        result = {"tokens": tokens, "replica": replica, "replica_hosts": engine.replica_hosts,
                  "messages": {i: c.messages for i, c in engine.channels.items()}}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
