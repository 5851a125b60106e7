"""The memory plan: which limit binds first (the weights, then the sequences' recurrent state, then one sequence's KV at
max_model_len), the message that names it with the value that fits, the sequence count chosen when none is given,
and a refusal before anything compiles.

The 35B-A3B's sizes come from its published config laid out over abstract meshes (no device); the device in the
engine tests is the CPU with its memory statistics faked.
"""

import dataclasses
import logging

import jax
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT
from jax.sharding import AbstractMesh
from support import shared_data

from qwen_jax.config import load_config
from qwen_jax.engine import replica as replica_module
from qwen_jax.engine.compilation import AUTOTUNE_ROOM, measure_working, working_bytes
from qwen_jax.engine.core import EngineCore, engine_args
from qwen_jax.engine.memory_plan import MAX_NUM_SEQS_CAP, Footprint, MemoryPlanError, engine_share, plan_memory
from qwen_jax.engine.programs import ProgramKey, ProgramTable, Shapes
from qwen_jax.engine.replica import UNMEASURED_ROOM, Replica
from qwen_jax.engine.sampler import table_bytes_per_slot
from sharding import rules
from sharding.mesh import AXES, replica_meshes

GiB = 2**30
H100 = 79.19 * GiB  # an H100 80 GB
BLOCK = 16
WORKING = 2.26 * GiB  # the largest forward's working memory (forward[8192] of 35B-A3B, measured on an H100)


def capacity(utilization: float, device: float = H100) -> float:
    """What this engine may take: gpu_memory_utilization of the device (vLLM's meaning)."""
    return device * utilization


@pytest.fixture(scope="module")
def big():
    """35B-A3B's footprint at tensor-parallel size 1, and the sizes 2, 4 and 8 a refusal may offer."""
    cfg = load_config(str(shared_data("configs", "Qwen3.5-35B-A3B.json")))

    def at(tp: int) -> Footprint:
        mesh = AbstractMesh((1, 1, tp), AXES)
        return Footprint(weights=rules.shard_bytes(rules.abstract_params(cfg, mesh)),
                         per_slot=rules.cache_bytes_per_device(cfg, mesh, 0, BLOCK, 1),
                         per_counts=table_bytes_per_slot(cfg.vocab_size),
                         per_block=rules.cache_bytes_per_device(cfg, mesh, 1, BLOCK, 0))

    one = at(1)
    assert 66 * GiB < one.weights < 66.2 * GiB and 61 * 2**20 < one.per_slot < 62 * 2**20  # MTP head included
    return one, [(tp, at(tp)) for tp in (2, 4, 8)]


def plan(big, utilization: float, max_num_seqs: int | None, max_model_len: int, **given):
    footprint, wider = big
    return plan_memory(capacity(utilization), footprint, block_size=BLOCK, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, keeps_snapshots=True, wider=lambda: wider, working=WORKING, **given)


def test_too_many_sequences_names_max_num_seqs_and_the_most_that_fit(big):
    """H100 at gpu_memory_utilization 0.9: 71.27 GiB for this engine, 2.88 GiB of it beside the weights (66.13 GiB)
    and the largest forward's working memory, 63.6 MiB a sequence's state and tables. The refusal names
    --max-num-seqs with the largest count the plan accepts (one more is refused), and -tp 2, where 64 fit."""
    with pytest.raises(MemoryPlanError) as refused:
        plan(big, 0.9, 64, 4096)
    assert refused.value.limit == "max_num_seqs" and refused.value.fits == 43
    assert str(refused.value) == (
        "recurrent state for 64 sequences needs 4.04 GiB (65 slots of 63.6 MiB), 2.88 GiB are free beside the "
        "weights and the programs' working memory: at most 43 sequences fit at max_model_len 4096 on this device; "
        "use --max-num-seqs 43, or -tp 2")
    assert plan(big, 0.9, 43, 4096).max_num_seqs == 43
    with pytest.raises(MemoryPlanError, match="or --max-num-seqs 43 to keep max_model_len 4096"):
        plan(big, 0.9, 44, 4096)  # 44 states fit, but not beside 4,096 tokens of KV
    footprint, wider = big
    assert plan_memory(capacity(0.9), dict(wider)[2], block_size=BLOCK, max_model_len=4096, max_num_seqs=64,
                       keeps_snapshots=True, working=WORKING).max_num_seqs == 64


def test_the_working_memory_is_held_free_beside_the_caches(big):
    """The caches take what the weights and the working memory leave, and the plan says what they leave of it: 1 GiB
    more working memory is 1 GiB less for the caches."""
    footprint, _ = big
    args = dict(block_size=BLOCK, max_model_len=4096, max_num_seqs=None, keeps_snapshots=True)
    more = plan_memory(capacity(0.97), footprint, working=WORKING + GiB, **args)
    assert plan(big, 0.97, None, 4096).max_num_seqs == 49 and more.max_num_seqs == 43
    for chosen, working in ((plan(big, 0.97, None, 4096), WORKING), (more, WORKING + GiB)):
        caches = ((chosen.max_num_seqs + 1) * (footprint.per_slot + footprint.per_counts)
                  + chosen.num_snapshots * footprint.per_slot + chosen.num_blocks * footprint.per_block)
        assert footprint.weights + working + caches + chosen.spare == pytest.approx(capacity(0.97))
        assert 0 <= chosen.spare < footprint.per_block + footprint.per_slot


LONGEST, KEEPS = 69664, 10  # beside 16 sequences' states: the longest max_model_len; the sequences that keep 81,920


def test_too_long_a_max_model_len_names_the_longest_that_fits(big):
    """16 sequences' states fit, but then one sequence of 81,920 tokens does not find its KV blocks: the refusal
    names the longest max_model_len that fits (one block more is refused) and the sequences that keep 81,920."""
    with pytest.raises(MemoryPlanError) as refused:
        plan(big, 0.9, 16, 81920)
    assert refused.value.limit == "max_model_len" and refused.value.fits == LONGEST
    assert str(refused.value) == (
        f"one sequence of max_model_len 81920 needs 5120 KV blocks of 16 tokens (1.72 GiB); {LONGEST // BLOCK} fit "
        f"beside the recurrent state of 16 sequences: the longest max_model_len that fits is {LONGEST}; use "
        f"--max-model-len {LONGEST}, or --max-num-seqs {KEEPS} to keep max_model_len 81920, or -tp 2")
    assert plan(big, 0.9, 16, LONGEST).num_blocks == 1 + LONGEST // BLOCK
    with pytest.raises(MemoryPlanError, match=f"longest max_model_len that fits is {LONGEST}"):
        plan(big, 0.9, 16, LONGEST + BLOCK)
    assert plan(big, 0.9, KEEPS, 81920).max_num_seqs == KEEPS
    with pytest.raises(MemoryPlanError, match=f"--max-num-seqs {KEEPS} to keep"):
        plan(big, 0.9, KEEPS + 1, 81920)


def test_weights_that_leave_no_room_name_the_smallest_tensor_parallel_size(big):
    """At 0.86 the weights (66.13 GiB) and the working memory leave no room for one sequence in the 68.10 GiB this
    engine may take: the refusal says so, whatever else is asked, and offers -tp 2; on a device too small for any
    offered size it offers none."""
    for max_num_seqs, max_model_len in [(None, 4096), (64, 262144)]:
        with pytest.raises(MemoryPlanError) as refused:
            plan(big, 0.86, max_num_seqs, max_model_len)
        assert refused.value.limit == "weights" and refused.value.fits == 2
        assert str(refused.value) == (
            "the weights take 66.13 GiB a device, the programs' working memory 2.26 GiB and the cache of one "
            "sequence at least 0.12 GiB more; this engine may take 68.10 GiB of this device at this "
            "--gpu-memory-utilization: use -tp 2")
    footprint, wider = big
    with pytest.raises(MemoryPlanError, match="use more devices") as refused:
        plan_memory(capacity(0.9, 8 * GiB), footprint, block_size=BLOCK, max_model_len=4096, max_num_seqs=None,
                    keeps_snapshots=True, wider=lambda: wider)
    assert refused.value.limit == "weights" and refused.value.fits is None


def test_the_checks_run_weights_then_sequences_then_max_model_len(big):
    """A configuration over every limit is refused for the first that binds: 64 sequences at 16,384 tokens name
    the weights at 0.86 and the sequences at 0.9 (where 38 fit at 16,384 tokens); at 262,144 tokens, where not one
    sequence of max_model_len fits, max_model_len, with the one sequence that may then run."""
    with pytest.raises(MemoryPlanError) as refused:
        plan(big, 0.86, 64, 16384)
    assert refused.value.limit == "weights"
    with pytest.raises(MemoryPlanError) as refused:
        plan(big, 0.9, 64, 16384)
    assert refused.value.limit == "max_num_seqs" and refused.value.fits == 38
    with pytest.raises(MemoryPlanError) as refused:
        plan(big, 0.9, 64, 262144)
    assert refused.value.limit == "max_model_len" and refused.value.fits == 122624
    assert "use --max-model-len 122624 --max-num-seqs 1, or -tp 2" in str(refused.value)
    assert plan(big, 0.9, 1, 122624).max_num_seqs == 1


def test_without_max_num_seqs_the_plan_takes_the_most_with_room_for_each_at_max_model_len(big):
    """The most sequences, up to 64, whose states fit with KV blocks for every one at max_model_len: one more would
    leave too few blocks; a device with room for more stays at 64; a long max_model_len still gets one sequence."""
    chosen = plan(big, 0.97, None, 4096)
    assert chosen.max_num_seqs == 49 and chosen.num_blocks - 1 >= 49 * 4096 // BLOCK
    assert plan(big, 0.97, 50, 4096).num_blocks - 1 < 50 * 4096 // BLOCK
    assert plan(big, 0.97, None, 8192).max_num_seqs == 30
    assert plan(big, 0.9, None, 4096, num_kv_blocks=3 * 4096 // BLOCK).max_num_seqs == 3
    h200 = plan_memory(capacity(0.9, 139.8 * GiB), big[0], block_size=BLOCK, max_model_len=8192,
                       max_num_seqs=None, keeps_snapshots=True, working=WORKING)
    assert h200.max_num_seqs == MAX_NUM_SEQS_CAP
    assert plan(big, 0.9, None, 122624).max_num_seqs == 1


@pytest.fixture
def tiny(hybrid_dir, monkeypatch):
    """The tiny hybrid model on one CPU device that reports `room` bytes free beside its weights (bytes_in_use set
    so): returns (config, mesh, footprint, set_room)."""
    cfg = load_config(hybrid_dir)
    mesh = replica_meshes(1)[0]
    weights = rules.shard_bytes(rules.abstract_params(cfg, mesh))
    footprint = Footprint(weights, rules.cache_bytes_per_device(cfg, mesh, 0, BLOCK, 1),
                          table_bytes_per_slot(cfg.vocab_size),
                          rules.cache_bytes_per_device(cfg, mesh, 1, BLOCK, 0))
    limit = 2**30  # the allocator's; the engine may take engine_share of it at gpu_memory_utilization 0.9

    def set_room(room: int, working: int = 0) -> None:
        """`room` bytes free beside the weights and `working` bytes of measured working memory."""
        in_use = int(engine_share({"bytes_limit": limit}, 0.9)) - weights - working - room
        monkeypatch.setattr(type(jax.devices()[0]), "memory_stats",
                            lambda self: {"bytes_limit": limit, "bytes_in_use": in_use})
        monkeypatch.setattr(replica_module, "measure_working", lambda shapes, mesh: working)

    return cfg, mesh, footprint, set_room


def test_an_engine_that_cannot_fit_is_refused_before_anything_compiles(hybrid_dir, tiny, monkeypatch):
    """8 sequences on a device with room for the states of 3 slots beside one sequence's 4 KV blocks (and the sink):
    the engine refuses at construction, naming --max-num-seqs 2, and nothing has compiled (the weights never
    load)."""
    _, _, footprint, set_room = tiny
    set_room(3 * (footprint.per_slot + footprint.per_counts) + 5 * footprint.per_block + 100)
    monkeypatch.setattr(replica_module, "measure_working", None)  # refused before the working memory is measured
    compiles = []
    listener = lambda name, seconds, **kwargs: compiles.append(name) if name == BACKEND_COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(MemoryPlanError) as refused:
            EngineCore(hybrid_dir, max_model_len=64, max_num_seqs=8, block_size=BLOCK, enable_prefix_caching=False)
        assert compiles == []
        jax.jit(lambda x: x + 1)(1)  # the listener sees a compile
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert refused.value.limit == "max_num_seqs" and refused.value.fits == 2
    assert "at most 2 sequences fit at max_model_len 64 on this device; use --max-num-seqs 2" in str(refused.value)
    assert compiles == [BACKEND_COMPILE_EVENT]


def test_a_replica_without_max_num_seqs_runs_the_most_that_fit_and_logs_it(tiny, caplog):
    """Room for 3 sequences' states and 4 KV blocks for each (plus the sinks), not for 4: the replica runs 3,
    holds their blocks, and the log says so."""
    cfg, mesh, footprint, set_room = tiny
    set_room(4 * (footprint.per_slot + footprint.per_counts) + 13 * footprint.per_block + 100)
    args = engine_args(dict(block_size=BLOCK, enable_prefix_caching=False, speculative_config="off"))
    with caplog.at_level(logging.INFO, logger="qwen_jax"):
        replica = Replica(0, cfg, rules.abstract_params(cfg, mesh), mesh, args, 64, [0], seed=0)
    assert replica.max_num_seqs == 3 and replica.slots.num_slots == 4 and replica.blocks.num_usable == 12
    assert any(r.getMessage().startswith("replica 0: max_num_seqs 3 (the most, up to 64, that fit with KV for each at "
                                         "max_model_len 64") for r in caplog.records)


def test_the_measured_working_memory_comes_out_of_the_caches(tiny):
    """The same device with one sequence's cache more of measured working memory runs one sequence fewer, and what
    the caches leave (held_back, the programs') holds that working memory."""
    cfg, mesh, footprint, set_room = tiny
    args = engine_args(dict(block_size=BLOCK, enable_prefix_caching=False, speculative_config="off"))
    room = 4 * (footprint.per_slot + footprint.per_counts) + 13 * footprint.per_block + 100
    one = footprint.per_slot + footprint.per_counts + 4 * footprint.per_block
    for working, seqs in ((0, 3), (one, 2)):
        set_room(room - working, working)  # the same memory in use
        replica = Replica(0, cfg, rules.abstract_params(cfg, mesh), mesh, args, 64, [0], seed=0)
        assert replica.max_num_seqs == seqs and working <= replica.held_back < working + one


def test_a_device_without_memory_statistics_runs_64_sequences(hybrid_dir):
    """The CPU reports no memory: without max_num_seqs the engine runs the cap, 64, as it always has there."""
    cfg = load_config(hybrid_dir)
    mesh = replica_meshes(1)[0]
    args = engine_args(dict(block_size=BLOCK, num_kv_blocks=14, speculative_config="off"))
    replica = Replica(0, cfg, rules.abstract_params(cfg, mesh), mesh, args, 64, [0], seed=0)
    assert replica.max_num_seqs == MAX_NUM_SEQS_CAP == 64 and replica.blocks.num_usable == 14


def test_the_largest_forwards_working_memory_is_measured_once_whatever_the_caches(hybrid_dir, tmp_path):
    """The plan holds free the largest forward's working memory, measured with the smallest caches before the caches
    are planned: XLA reports the same for the forward of the planned caches. The measurement is kept under the
    compilation cache, so the next start reads it without compiling."""
    cfg = load_config(hybrid_dir)
    mesh = replica_meshes(1)[0]
    small = Shapes(cfg=cfg, kernels="auto", tensor_parallel_size=1, enable_expert_parallel=False, num_blocks=2,
                   block_size=BLOCK, num_slots=2, num_snapshots=0, max_model_len=256, max_num_seqs=8,
                   max_num_batched_tokens=128)
    planned = dataclasses.replace(small, num_blocks=200, num_slots=9, num_snapshots=12)
    forward = ProgramKey("forward", 128)
    assert small.token_buckets[-1] == 128
    working = working_bytes(ProgramTable(planned, mesh).lower(forward).compile())
    assert working > 0
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compiles = []
    listener = lambda name, seconds, **kwargs: compiles.append(name) if name == BACKEND_COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert measure_working(small, mesh) == working and compiles == [BACKEND_COMPILE_EVENT]
        assert measure_working(small, mesh) == working and compiles == [BACKEND_COMPILE_EVENT]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_compilation_cache_dir", previous)


def test_programs_compile_before_the_weights_where_the_weights_leave_the_compile_workers_too_little(hybrid_dir,
                                                                                                    tiny, monkeypatch):
    """A core that compiles ahead compiles every program before its weights load when they would leave less than
    AUTOTUNE_ROOM of the device (XLA's autotuning runs candidate kernels on it), and while they load otherwise; there
    the caches leave so much that the largest forward's working memory is not measured before they are planned."""
    _, _, footprint, set_room = tiny
    args = dict(compile_ahead=(0, 1), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=4, block_size=BLOCK,
                enable_prefix_caching=False, speculative_config="off")
    set_room(8 * (footprint.per_slot + footprint.per_counts + 4 * footprint.per_block))
    core = EngineCore(hybrid_dir, **args)
    replica = core.replicas[0]
    assert replica.compile_before_weights and replica.compiler.jobs(replica.shapes.token_buckets) == []
    roomy = AUTOTUNE_ROOM + 2**30
    monkeypatch.setattr(type(jax.devices()[0]), "memory_stats",
                        lambda self: {"bytes_limit": 2 * roomy, "bytes_in_use": roomy})
    monkeypatch.setattr(replica_module, "measure_working", None)  # the caches leave UNMEASURED_ROOM: not measured
    core = EngineCore(hybrid_dir, **args)
    replica = core.replicas[0]
    assert not replica.compile_before_weights and replica.compiler.jobs(replica.shapes.token_buckets)
    assert replica.held_back > UNMEASURED_ROOM
