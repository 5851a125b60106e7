"""One host of the 2-process serving test: host 0 runs an LLMEngine whose TP 8 mesh spans both processes and drives
a few requests, host 1 follows it. Run by test_multihost_serving.py only (which calls `drive` for its reference)."""

from __future__ import annotations

import json
import sys

# The tiny hybrid MoE of sharding_tiny_models, float32, from a random checkpoint (each host reads its own shards).
# max_model_len / block_size / 8 = 2 blocks, the smallest table width, covers every sequence (<= 16 tokens), so each
# step shape compiles once.
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_kv_blocks=32,
                   num_snapshots=4, seed=0, enable_prefix_caching=True)
# A 10-token prompt prefills in two chunks, cut at its snapshot boundary (token 8: a "save" op), then decodes. Once
# it has finished, the same prompt arrives again and restores that snapshot (a "restore" op before its prefill).
# Every step is a prefill [1, 16] or a decode [1, 1]: two compiled shapes.
PROMPT = [(7 * i + 3) % 256 for i in range(10)]
MAX_TOKENS = 5


def drive(engine) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens of each request and the number of engine steps."""
    from qwen_jax.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, steps = {}, 0
    for rid in ("first", "late"):
        engine.add_request(rid, PROMPT, greedy)
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            steps += 1
    assert engine.stats()["prefix_cache_hits"] >= 1, "the late request must restore the first one's snapshot"
    return tokens, steps


def main(host_index: int, port: int, model_dir: str, out: str) -> None:
    from qwen_jax.engine.llm_engine import LLMEngine

    engine = LLMEngine(model_dir, num_hosts=2, host_index=host_index, coordinator_address=f"127.0.0.1:{port}",
                       tensor_parallel_size=8, **ENGINE_ARGS)
    if engine.is_leader:
        tokens, steps = drive(engine)
        engine.shutdown()
        result = {"tokens": tokens, "steps": steps, "messages": engine.steps.messages,
                  "bytes": engine.steps.bytes, "send_seconds": engine.steps.seconds}
    else:
        result = {"steps": engine.follow()}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
