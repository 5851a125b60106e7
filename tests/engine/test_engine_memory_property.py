"""Property: any interleaving of add / abort / step keeps the KV-block and state-slot books exact and, once every
request has finished or been aborted, leaves every reference count at 0 and every block and slot free.

The model step is replaced by a stub (the books are host-side), so hypothesis can try many schedules quickly; the
pool is tiny so that prefix sharing, snapshot eviction, chunked prefill and preemption all happen.
"""

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen_jax.engine.core import EngineCore
from qwen_jax.engine.sampler import SampleOutput
from qwen_jax.engine.sequence import Status
from qwen_jax.sampling_params import SamplingParams

EOS = 514
BASE = list(range(100, 124))  # prompts of one variant share prefixes of BASE; variants differ from the first token


def stub_execute(rows):
    """Deterministic fake tokens (some EOS) in the runner's output format, for the rows the stubbed prepare
    passes through (the step is never run: the books are the runner's caller's)."""
    tokens = np.array([EOS if zlib.crc32(f"{r.seq.request_id}:{r.seq.num_requested}".encode()) % 8 == 0
                       else 7 + r.seq.num_requested for r in rows], np.int32)
    return SampleOutput(tokens, np.zeros(len(rows), np.float32), np.zeros((len(rows), 0), np.int32),
                        np.zeros((len(rows), 0), np.float32))


@pytest.fixture(scope="module")
def engine(hybrid_dir):
    engine = EngineCore(hybrid_dir, max_model_len=24, max_num_seqs=3, max_num_batched_tokens=12, block_size=4,
                        num_kv_blocks=7, num_snapshots=2, enable_prefix_caching=True)
    runner = engine.replicas[0].runner
    runner.prepare, runner.executor, runner.fetch = (lambda rows, head=False, in_flight=(): list(rows), stub_execute,
                                                     lambda out: out)
    return engine


def check_books(engine: EngineCore) -> None:
    """Every reference count equals the number of live sequences holding the block; the free list is exactly the
    unreferenced blocks; slots in use are exactly those of running sequences; the prefix index is a bijection."""
    core = engine.replicas[0]
    sched, blocks = core.scheduler, core.blocks
    live = list(sched.running) + list(sched.waiting)
    holders = [0] * blocks.num_blocks
    for seq in live:
        for b in seq.block_table:
            holders[b] += 1
    assert blocks.ref_counts == holders
    assert set(blocks.free) == {b for b in range(1, blocks.num_blocks) if holders[b] == 0}
    assert core.slots.in_use == {s.slot for s in sched.running}
    assert all(s.slot is None and s.status == Status.WAITING for s in sched.waiting)
    assert len(sched.running) <= core.max_num_seqs
    cache = core.prefix_cache
    assert {b: h for h, b in cache.block_of.items()} == cache.hash_of
    assert 0 not in cache.hash_of


add = st.tuples(st.just("add"), st.integers(1, 20), st.integers(0, 3), st.integers(1, 4), st.booleans())
abort = st.tuples(st.just("abort"), st.integers(0, 30))
step = st.tuples(st.just("step"), st.integers(1, 4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(add, abort, step), min_size=1, max_size=30))
def test_random_add_abort_step_never_leaks(engine, ops):
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, variant, max_tokens, ignore_eos = op
            prompt = [200 + variant] + BASE[1:length]
            rid = f"r{len(added)}-{zlib.crc32(repr(ops).encode())}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
            added.append(rid)
        elif op[0] == "abort" and added:
            engine.abort([added[op[1] % len(added)]])  # may already be finished: then a no-op
        else:
            for _ in range(op[1]):
                for out in engine.step():
                    assert len(out.new_token_ids) <= 1 and out.finish_reason != "error", out
        check_books(engine)
    for _ in range(3):  # let some finish on their own, abort the rest
        assert all(out.finish_reason != "error" for out in engine.step())
        check_books(engine)
    engine.abort(added)
    engine.step()  # reads back the step still in flight
    check_books(engine)
    assert not engine.has_unfinished and not engine.seqs
    core = engine.replicas[0]
    assert not any(core.blocks.ref_counts) and core.blocks.num_free == core.blocks.num_usable
    assert core.slots.num_free == core.slots.num_slots - 1
    stats = engine.stats()
    assert (stats["kv_blocks_used"], stats["state_slots_used"], stats["num_running"]) == (0, 0, 0)
