"""The compiler's plumbing that needs no GPU: the program store's key (shared by the data-parallel replicas of one
host, changed by anything a program depends on), what a compile worker is handed, and a lazy runner, whose device
state is allocated only once its programs are compiled (compile workers need the device meanwhile)."""

import os
import pickle

import jax

from qwen_jax import LLM, SamplingParams
from qwen_jax.engine import compilation
from qwen_jax.engine import replica as replica_module


def compiler_of(llm: LLM):
    return llm.engine.replicas[0].compiler


def test_the_program_store_is_one_for_every_replica_and_another_for_other_shapes(hybrid_mtp_dir, kit):
    first = compiler_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)).program_store()
    # another replica's sampling seed (seed * dp + i) is an input of its programs, not part of them
    other_seed = compiler_of(LLM(hybrid_mtp_dir, **dict(kit.ENGINE_ARGS, seed=7))).program_store()
    assert other_seed == first and os.path.basename(os.path.dirname(first)) == "qwen_jax_programs"
    more_rows = compiler_of(LLM(hybrid_mtp_dir, **dict(kit.ENGINE_ARGS, max_num_seqs=2))).program_store()
    no_drafts = compiler_of(LLM(hybrid_mtp_dir, speculative_config="off", **kit.ENGINE_ARGS)).program_store()
    assert len({first, more_rows, no_drafts}) == 3


def test_a_compile_worker_is_handed_picklable_shapes_and_every_program_has_its_own_file(hybrid_mtp_dir, kit):
    """A worker gets the replica's Shapes (plain values: no runner, no device state) and the programs' keys; a table
    it builds from them lowers the very programs the core's table would."""
    from qwen_jax.engine.programs import ProgramTable

    compiler = compiler_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS))
    shapes = pickle.loads(pickle.dumps(compiler.shapes))
    assert shapes == compiler.shapes and shapes.max_num_seqs == kit.ENGINE_ARGS["max_num_seqs"]
    jobs = pickle.loads(pickle.dumps(compiler.jobs(shapes.token_buckets)))
    names = [compilation.file_name(key) for key in jobs]
    assert len(set(names)) == len(names) and all("/" not in n for n in names)
    assert {key.kind for key in jobs} == {"forward", "stage", "stage_behind", "draft", "verify",
                                          "sampler", "restore", "save", "penalties", "table"}
    twin = ProgramTable(shapes, compiler.runner.mesh)
    key = next(key for key in jobs if key.kind == "verify")
    assert twin.lower(key).as_text() == compiler.table.lower(key).as_text()


def test_a_lazy_runner_allocates_its_state_at_its_first_step_with_the_same_tokens(hybrid_mtp_dir, kit, monkeypatch):
    prompt, params = kit.prompt(20, seed=1300), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS).generate([prompt], params)[0].token_ids
    monkeypatch.setattr(replica_module, "uses_workers", lambda mesh: True)
    llm = LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)
    runner = llm.engine.replicas[0].runner
    assert not runner.allocated and runner.cache is None
    assert llm.generate([prompt], params)[0].token_ids == expected
    assert runner.allocated and all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(runner.cache))


def test_a_program_whose_compile_ran_out_of_device_memory_is_compiled_again_by_a_worker_alone(
        hybrid_mtp_dir, kit, monkeypatch, tmp_path):
    """The core's side of the worker protocol, with this process standing in for the workers (XLA:CPU programs must
    be loaded where they were compiled): the first try of one program stores an out-of-memory error, as XLA's
    autotuning beside other workers can; once the others are done, that program alone goes to a single worker."""
    from jax.experimental import serialize_executable

    monkeypatch.setattr(compilation.Compiler, "program_store", lambda self: str(tmp_path))
    compiler = compiler_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS))
    size = min(compiler.shapes.token_buckets)
    jobs = [key for key in compiler.jobs([size], full=False) if key.kind == "forward"]
    starts = []

    def stand_in_workers(self, given, workers, store):
        starts.append(([job.name for job in given], workers))
        for job in given:
            if len(starts) == 1:
                stored = dict(error="JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
                              out_of_memory=True)
            else:
                payload, in_tree, out_tree = serialize_executable.serialize(self.table.lower(job).compile())
                stored = dict(payload=payload, in_tree=in_tree, out_tree=out_tree, working_bytes=1, seconds=0.0)
            with open(os.path.join(store, compilation.file_name(job)), "wb") as f:
                pickle.dump(stored, f)
        return [compilation.subprocess.Popen(["true"])]

    monkeypatch.setattr(compilation.Compiler, "_start_workers", stand_in_workers)
    produced = list(compiler._from_workers(jobs, workers=4, part=(0, 1)))
    assert starts == [([jobs[0].name], 4), ([jobs[0].name], 1)]
    assert [job.name for job, *_ in produced] == [jobs[0].name]


def test_a_compile_error_other_than_out_of_memory_stops_the_start(hybrid_mtp_dir, kit, monkeypatch, tmp_path):
    monkeypatch.setattr(compilation.Compiler, "program_store", lambda self: str(tmp_path))
    compiler = compiler_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS))
    jobs = compiler.jobs([min(compiler.shapes.token_buckets)], full=False)[:1]

    def failing_workers(self, given, workers, store):
        for job in given:
            with open(os.path.join(store, compilation.file_name(job)), "wb") as f:
                pickle.dump(dict(error="ValueError: no such layout", out_of_memory=False), f)
        return [compilation.subprocess.Popen(["true"])]

    monkeypatch.setattr(compilation.Compiler, "_start_workers", failing_workers)
    try:
        list(compiler._from_workers(jobs, workers=2, part=(0, 1)))
    except RuntimeError as exc:
        assert "no such layout" in str(exc) and jobs[0].name in str(exc)
    else:
        raise AssertionError("a compile error must stop the start")


def test_compile_workers_start_before_the_weights_are_read_and_the_warmed_core_gives_the_same_tokens(
        hybrid_mtp_dir, kit, monkeypatch, tmp_path):
    """A core that compiles ahead (a full warm-up) starts its compile workers on the runner's shapes, before it
    reads the weights; its warm-up then takes their programs, and it serves the tokens of an engine that compiled
    nothing ahead. This process stands in for the workers (XLA:CPU programs must be loaded where compiled)."""
    from jax.experimental import serialize_executable

    from qwen_jax import EngineCore
    events, compiled = [], {}

    def stand_in_workers(self, given, workers, store):
        events.append(("workers", len(given), self.runner.abstract))
        for job in given:  # (XLA:CPU cannot serialize every program: the store's entry names it here)
            name = compilation.file_name(job)
            compiled[name] = self.table.lower(job).compile()
            with open(os.path.join(store, name), "wb") as f:
                pickle.dump(dict(payload=name, in_tree=None, out_tree=None, working_bytes=1, seconds=0.0), f)
        return [compilation.subprocess.Popen(["true"])]

    load_params = EngineCore._load_params

    def recorded_load(self, *args):
        events.append(("weights",))
        return load_params(self, *args)

    prompt, params = kit.prompt(20, seed=1301), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # few programs to compile: one request at a time, 4-token steps, no drafts
    args = dict(kit.ENGINE_ARGS, max_num_seqs=1, max_num_batched_tokens=4, speculative_config="off")
    expected = LLM(hybrid_mtp_dir, **args).generate([prompt], params)[0].token_ids
    for module in (compilation, replica_module):
        monkeypatch.setattr(module, "uses_workers", lambda mesh: True)
    monkeypatch.setattr(compilation.Compiler, "program_store", lambda self: str(tmp_path))
    monkeypatch.setattr(compilation.Compiler, "_start_workers", stand_in_workers)
    monkeypatch.setattr(EngineCore, "_load_params", recorded_load)
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", lambda name, *_, **__: compiled[name])
    core = EngineCore(hybrid_mtp_dir, compile_ahead=(0, 1), **args)
    replica = core.replicas[0]
    jobs = replica.compiler.jobs(replica.shapes.token_buckets)
    assert events == [("workers", len(jobs), True), ("weights",)]
    core.warmup(full=True)
    table = replica.runner.programs
    assert events[2:] == [] and not table.missing(jobs) and table.misses == 0
    core.add_request("r", prompt, params)
    tokens = []
    while core.has_unfinished:
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert tokens == expected


def test_a_compile_worker_ends_when_its_core_is_gone():
    """A core that dies (or is killed) mid-compile leaves no worker behind holding device memory."""
    import subprocess
    import sys
    import time

    worker = ("import os, time; from qwen_jax.engine.compilation import _exit_with; _exit_with(os.getppid()); "
              "print(os.getpid(), flush=True); time.sleep(120)")
    core = ("import subprocess, sys, time; "
            f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE); "
            "print(w.stdout.readline().decode().strip(), flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", core], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return "\nState:\tZ" not in f.read()  # a zombie has exited (an orphan's reaper may be slow)
        except FileNotFoundError:
            return False

    assert running(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child)


def test_the_compile_workers_of_one_start_share_their_programs_as_one_queue(tmp_path):
    """Every worker of a start is handed every program, largest first, and compiles those it claims first: each
    program is claimed once per start (its claims folder), so no worker idles while another has several left."""
    from concurrent.futures import ThreadPoolExecutor

    from qwen_jax.engine.compilation import claim

    names = [f"forward[{size}].bin" for size in (8, 4, 2, 1)]
    first, later = tmp_path / "claims.1", tmp_path / "claims.2"
    first.mkdir(), later.mkdir()
    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(lambda _: [name for name in names if claim(str(first), name)], range(4)))
    assert sorted(name for mine in taken for name in mine) == sorted(names)
    assert claim(str(later), names[0]) and not claim(str(later), names[0])
