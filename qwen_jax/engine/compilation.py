"""Compilation, kept apart from execution: every program of a replica's catalog (engine/programs.py), compiled ahead
several at once into its program table (each bucket run once on padding as soon as its programs are compiled) and
checked against the memory plan.

It never schedules a request and never builds a request's step. Once `warm_up(full=True)` has returned, the table
serves every program serving can run: its miss count stays 0 (tests/engine/test_engine_compile.py counts).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait
from typing import TYPE_CHECKING

import jax
import numpy as np

from qwen_jax.engine import step
from qwen_jax.engine.processes import COMPILE_WORKER, INHERITED_CONFIG, set_process_name
from qwen_jax.engine.programs import MODEL_SAMPLER_VARIANTS, WRITTEN_TABLES, ProgramKey, ProgramTable, Shapes

if TYPE_CHECKING:
    from qwen_jax.engine.runner import ModelRunner

log = logging.getLogger("qwen_jax")

# Programs compiled at once: in compile worker processes on a GPU (at most 8 a GPU: each lowers a program under
# its own GIL; H200 host, 35B-A3B: a forward lowers in ~5 s and compiles in 6-10 s), in threads elsewhere. An engine
# core of several on one host (data-parallel replicas as processes) gets its share of the cores from the front
# ($QWEN_JAX_COMPILE_THREADS).
COMPILE_THREADS = int(os.environ.get("QWEN_JAX_COMPILE_THREADS", "0")) or max(2, (os.cpu_count() or 2))
# $QWEN_JAX_COMPILE_WORKERS: compile workers on any backend (0: threads)
_WORKERS = os.environ.get("QWEN_JAX_COMPILE_WORKERS")
COMPILE_WORKERS = int(_WORKERS) if _WORKERS else max(1, min(COMPILE_THREADS - 1, 8))

# XLA's autotuning in the compile workers runs candidate kernels on the device (single buffers of up to ~14 GiB for
# 35B-A3B's LM head): where the weights would leave less than this of a device, the programs compile before the
# weights load (Compiler.compile_before_weights). An H200 beside 35B-A3B's weights (72 GiB left) compiled its 192
# programs in 132 s with 8 workers; an H100 (12.7 GiB left) ran out of memory on 60 of 184, each compiled again alone:
# 8 minutes.
AUTOTUNE_ROOM = 48 * 2**30

# How long a core whose own compile workers are done waits for the other cores' share of the programs before it
# compiles what is still missing itself.
OTHERS_GRACE_S = 60.0
# How a compile worker's out-of-device-memory failure reads (XLA's status code)
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"
# Threads that read and load stored programs at once (a restart loads every program from the store)
LOAD_THREADS = 8


def file_name(key: ProgramKey) -> str:
    """The file a compiled program is stored under in the program store."""
    return re.sub(r"[^A-Za-z0-9_.=,-]", "_", key.name) + ".bin"


def group(key: ProgramKey) -> tuple:
    """The programs that run once together (run_padding): a token bucket's, a request count's samplers, the programs
    of a count of sequences entering a batch."""
    if key.kind == "sampler":
        return ("sampler", key.size)
    if key.kind in ("forward", "stage", "stage_behind", "decode_steps", "draft", "verify"):
        return ("bucket", key.size)
    return ("rows", key.size)


def working_bytes(compiled: jax.stages.Compiled) -> int | None:
    """A compiled program's working memory (XLA's temp buffers), None when XLA does not say."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure_working(shapes: Shapes, mesh) -> int:
    """The working memory (XLA's temp buffers) of the largest forward of `shapes` on `mesh`: its largest token
    bucket's, compiled here (a few seconds; its record is kept under the compilation cache, so a restart reads it).
    The memory plan holds it free beside the caches."""
    key = ProgramKey("forward", shapes.token_buckets[-1])
    root = jax.config.jax_compilation_cache_dir
    record = os.path.join(root, "qwen_jax_working", programs_digest(shapes, mesh, key)) if root else None
    if record and os.path.exists(record):
        with open(record) as f:
            return int(f.read())
    began = time.perf_counter()
    working = working_bytes(ProgramTable(shapes, mesh).lower(key).compile()) or 0
    log.info("%s's working memory: %.2f GiB (measured in %.1fs)", key.name, working / 2**30,
             time.perf_counter() - began)
    if record:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record + f".{os.getpid()}.tmp", "w") as f:
            f.write(str(working))
        os.replace(record + f".{os.getpid()}.tmp", record)
    return working


def programs_digest(shapes: Shapes, mesh, *more) -> str:
    """A digest of everything programs of `shapes` on `mesh` depend on (and of `more`): the model, the shapes, the
    devices, JAX, XLA's flags and this package's source. Names what is kept of them under the compilation cache."""
    return hashlib.sha256(pickle.dumps((shapes, *more, dict(mesh.shape), mesh.devices.flat[0].device_kind,
                                        jax.__version__, os.environ.get("XLA_FLAGS", ""),
                                        source_digest()))).hexdigest()[:24]


@functools.cache
def source_digest() -> str:
    """A digest of this engine's source (qwen_jax, sharding, pallas_kernels): stored programs of other code are
    never loaded. Read once a process (a core asks for its program store when it starts its workers and again when
    it loads their programs)."""
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for package in ("qwen_jax", "sharding", "pallas_kernels"):
        for folder, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()


def compile_worker(task_path: str) -> None:
    """A compile worker process (`python -c`, started by Compiler._from_workers): read its task (the replica's
    Shapes, its mesh's sizes, the programs' keys, the store, the claims folder, JAX's settings) from `task_path`,
    build the program table of those shapes on this process's devices (the core's, inherited; nothing allocated),
    then take the programs in order, each one no other worker of the same start has claimed (`claim`): the workers
    share one queue, the largest programs first, so none idles while another still has several to do. Each is
    lowered, compiled and stored serialized in the store as soon as it is done (written whole, then renamed: a reader
    never sees half a file)."""
    with open(task_path, "rb") as f:
        shapes, keys, store, claims, jax_config = pickle.load(f)
    os.remove(task_path)
    set_process_name(COMPILE_WORKER)
    _exit_with(os.getppid())
    logging.basicConfig(level=os.environ.get("QWEN_JAX_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[compile]: %(message)s")
    for name, value in jax_config.items():
        jax.config.update(name, value)
    from jax.experimental import serialize_executable

    from sharding.mesh import make_mesh

    table = ProgramTable(shapes, make_mesh(shapes.tensor_parallel_size, 1, shapes.enable_expert_parallel))
    for key in keys:
        name = file_name(key)
        if os.path.exists(os.path.join(store, name)) or not claim(claims, name):
            continue
        began = time.perf_counter()
        try:
            lowered = table.lower(key)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
            log.info("%s: lowered in %.1fs, compiled in %.1fs", key.name, lowered_at - began,
                     time.perf_counter() - lowered_at)
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            stored = dict(payload=payload, in_tree=in_tree, out_tree=out_tree, working_bytes=working_bytes(compiled),
                          seconds=time.perf_counter() - began)
        except Exception as exc:  # the core retries it alone (out of memory) or reports it
            log.exception("compiling %s failed", key.name)
            stored = dict(error=f"{type(exc).__name__}: {exc}", out_of_memory=OUT_OF_MEMORY in str(exc))
        path = os.path.join(store, name)
        with open(path + f".{os.getpid()}.tmp", "wb") as f:
            pickle.dump(stored, f)
        os.replace(path + f".{os.getpid()}.tmp", path)


def claim(claims: str, name: str) -> bool:
    """Whether this process is the first to claim program `name` in the folder `claims` (one folder per start of
    workers): the claim file's creation is atomic, so exactly one worker compiles each program."""
    try:
        os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _exit_with(parent: int) -> None:
    """End this process when `parent` (its engine core) is gone: a core that dies or is killed leaves no worker
    compiling on, holding device memory."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="qwen-jax-parent-watch", daemon=True).start()


def uses_workers(mesh) -> bool:
    """Whether a runner on `mesh` compiles in worker processes: on a GPU of one host ($QWEN_JAX_COMPILE_WORKERS: on
    any backend; 0: never). Its device state is then allocated once they are done (ModelRunner's `lazy`): XLA's
    autotuning in the workers runs candidate kernels on the device meanwhile."""
    if _WORKERS is not None:
        return int(_WORKERS) > 0
    return mesh.devices.flat[0].platform == "gpu" and jax.process_count() == 1


class Compiler:
    """The compile and warm-up side of one replica: fills its runner's program table (runner.programs) with the
    catalog's programs (programs.Shapes.catalog) and runs each once."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.table: ProgramTable = runner.programs
        self.shapes: Shapes = runner.shapes
        self.working_bytes: dict[str, int] = {}  # program name -> its working (temp) memory, from XLA
        self.working_group: dict[str, tuple] = {}  # program name -> its group
        self.held_back: float | None = None  # device memory left beside the caches (None: not known)
        self.memory_checked = False
        self._workers: list[subprocess.Popen] = []  # this core's compile worker processes
        self._claims: list[str] = []  # their claims folders (compile_worker), removed once they are done
        # (its programs, workers) started by begin
        self._begun: tuple[list[ProgramKey], list[subprocess.Popen]] | None = None

    def jobs(self, sizes: list[int], full: bool = True) -> list[ProgramKey]:
        """The catalog's programs of the token buckets `sizes` not compiled yet (Shapes.catalog; `full` as there)."""
        return self.table.missing(self.shapes.catalog(sizes, full))

    # ---- compiling and first runs ------------------------------------------------------------------------------
    def compile(self, sizes: list[int] | None = None, run: bool = False, workers: int | None = None,
                part: tuple[int, int] = (0, 1), full: bool = True) -> None:
        """Compile every program of the token buckets `sizes` (default: all) not compiled yet, one log line per
        program: in `workers` compile processes (default: COMPILE_WORKERS on a GPU, none elsewhere: XLA:CPU
        programs loaded in another process than the one that compiled them crashed when run), or in COMPILE_THREADS
        threads of this process. Python's lowering of a program holds the GIL for seconds (its
        kernels' Triton code is built then), so one process lowers one program at a time however many threads
        compile; worker processes lower in parallel and hand each program over serialized (`compile_worker`).
        `part` (i, n): with workers, core i of n that share one store of programs (data-parallel replicas on one
        host) compiles only every n-th program from the i-th and loads the others as the other cores store them.
        `run`: check the memory plan, then run each bucket's programs once on padding (run_padding), the bucket of
        the program with the most working memory first (the allocator's first large region then holds every later
        program's). `full`: as in `jobs`."""
        r = self.runner
        sizes = list(self.shapes.token_buckets if sizes is None else sizes)
        jobs = self.jobs(sizes, full)
        if workers is None:
            workers = COMPILE_WORKERS if uses_workers(r.mesh) and r.executor == r.execute else 0
        start = time.perf_counter()
        pending: dict[tuple, int] = {}
        for key in jobs:
            pending[group(key)] = pending.get(group(key), 0) + 1
        # with workers, first runs wait for them all (they hold device memory while they compile); with threads,
        # they start once the programs with the most working memory are compiled
        critical = {key for key in jobs if workers or key.kind == "verify"
                    or key == ProgramKey("forward", max(sizes))}
        to_run = sorted(sizes) if run else []
        produced = self._from_workers(jobs, workers, part) if workers else self._from_threads(jobs)
        # closed here when a first run raises (the memory plan): else the generator, paused inside its pool, is
        # closed by whichever thread collects it, and a pool thread cannot join itself
        with contextlib.closing(produced):
            for done, (key, compiled, seconds, working) in enumerate(produced, 1):
                if working is not None:
                    self.working_bytes[key.name] = working
                    self.working_group[key.name] = group(key)
                self.table.compiled[key] = compiled
                pending[group(key)] -= 1
                critical.discard(key)
                log.info("compiled %s in %.1fs (%d of %d, %.1fs in all)", key.name, seconds, done, len(jobs),
                         time.perf_counter() - start)
                if to_run and not critical:
                    to_run = self._run_ready(to_run, pending)
        if to_run:
            self._run_ready(to_run, {})
        if jobs:
            log.info("compiled %d programs in %.1fs (%s)", len(jobs), time.perf_counter() - start,
                     f"{workers} worker processes" if workers else f"{COMPILE_THREADS} threads")

    def _from_threads(self, jobs: list[ProgramKey]):
        """(key, compiled, seconds, working bytes) of each program, compiled in threads of this process, as they
        finish."""
        def compile_one(key: ProgramKey):
            began = time.perf_counter()
            compiled = self.table.lower(key).compile()
            return key, compiled, time.perf_counter() - began, working_bytes(compiled)

        if not jobs:
            return
        pool = ThreadPoolExecutor(max(1, min(len(jobs), COMPILE_THREADS)), thread_name_prefix="qwen-jax-compile")
        try:
            for future in as_completed([pool.submit(compile_one, job) for job in jobs]):
                yield future.result()
        finally:  # a compile abandoned (closed early) drops the programs not started yet
            pool.shutdown(cancel_futures=True)

    def _from_workers(self, jobs: list[ProgramKey], workers: int, part: tuple[int, int]):
        """(key, compiled, seconds, working bytes) of each program (job) as compile worker processes store it,
        serialized, in the program store (program_store); this core's share of them is compiled by workers started
        here; LOAD_THREADS threads load the stored programs."""
        store = self.program_store()
        if self._begun is not None:  # started before the weights were read (begin)
            mine, processes = self._begun
            self._begun = None
        else:
            mine, processes = self._start_share(jobs, workers, part, store)
        left = {file_name(job): job for job in jobs}
        mine_files = {file_name(job) for job in mine}
        retry: list[ProgramKey] = []  # out of memory beside the other workers: compiled again alone
        retried: set[str] = set()
        loading: dict = {}  # future of a program being loaded -> its job
        loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="qwen-jax-load")
        try:
            waited = time.perf_counter()
            while left or loading:
                ready = [name for name in left if os.path.exists(os.path.join(store, name))]
                for name in ready:
                    loading[loader.submit(self._load, os.path.join(store, name))] = left.pop(name)
                loaded = [future for future in loading if future.done()]
                for future in loaded:
                    job = loading.pop(future)
                    name, stored = file_name(job), future.result()
                    if stored.get("out_of_memory") and name in mine_files and name not in retried:
                        # XLA's autotuning ran out of device memory beside the other workers: once they are done,
                        # compile it again in a worker of its own
                        log.warning("compiling %s ran out of device memory beside the other compile workers; it is "
                                    "compiled again alone once they are done", job.name)
                        os.remove(os.path.join(store, name))
                        left[name] = job
                        retried.add(name)
                        retry.append(job)
                        continue
                    if "error" in stored:
                        raise RuntimeError(f"compiling {job.name} failed in a compile worker: {stored['error']}")
                    yield job, stored["compiled"], stored["seconds"], stored["working_bytes"]
                    waited = time.perf_counter()
                if ready or loaded:
                    continue
                if loading:  # until one of them is loaded (or more programs may be stored)
                    wait(loading, timeout=0.05, return_when=FIRST_COMPLETED)
                    continue
                if retry and all(p.poll() is not None for p in processes):
                    processes = self._start_workers(retry, 1, store)
                    self._workers += processes
                    retry = []
                    waited = time.perf_counter()
                    continue
                dead = [p.returncode for p in processes if p.poll()]
                owed = mine_files & set(left) - {file_name(job) for job in retry}
                if dead and owed:
                    missing = left[min(owed)].name
                    raise RuntimeError(f"a compile worker exited with code {dead[0]} before storing {missing}")
                if not retry and all(p.poll() is not None for p in processes) and \
                        time.perf_counter() - waited > OTHERS_GRACE_S:
                    # the other cores' share is late (or they are gone): compile what is still missing here too
                    mine = list(left.values())
                    mine_files |= set(left)
                    processes = self._start_workers(mine, workers, store)
                    self._workers += processes
                    waited = time.perf_counter()
                time.sleep(0.05)
        finally:
            loader.shutdown(cancel_futures=True)
        for process in processes:
            process.wait()
        for claims in self._claims:
            shutil.rmtree(claims, ignore_errors=True)
        self._claims = []

    def _load(self, path: str) -> dict:
        """A program a compile worker stored at `path`, loaded onto this runner's devices (its `compiled`), or the
        worker's error. Run by several threads at once: XLA loads without Python's lock."""
        from jax.experimental import serialize_executable

        with open(path, "rb") as f:
            stored = pickle.load(f)
        if "error" not in stored:
            stored["compiled"] = serialize_executable.deserialize_and_load(
                stored.pop("payload"), stored["in_tree"], stored["out_tree"],
                execution_devices=list(self.runner.mesh.devices.flat))
        return stored

    def begin(self, part: tuple[int, int] = (0, 1)) -> None:
        """Start the compile workers on every program serving can run (this core's `part`, as in `compile`) now:
        they need only the runner's shapes, so they compile while the core reads the weights. The full warm-up's
        compile then waits for them. A no-op where programs are not compiled in workers."""
        r = self.runner
        if uses_workers(r.mesh) and r.executor == r.execute:
            jobs = self.jobs(list(self.shapes.token_buckets))
            self._begun = self._start_share(jobs, COMPILE_WORKERS, part, self.program_store())
            log.info("%d of %d programs to compile (the rest are stored): %d compile workers started",
                     len(self._begun[0]), len(jobs), len(self._begun[1]))

    def _start_share(self, jobs: list[ProgramKey], workers: int, part: tuple[int, int], store: str
                     ) -> tuple[list[ProgramKey], list[subprocess.Popen]]:
        """This core's share of `jobs` not in the store yet, and the worker processes started on it."""
        mine = [job for job in jobs[part[0]::part[1]] if not os.path.exists(os.path.join(store, file_name(job)))]
        self._workers = self._start_workers(mine, workers, store)
        return mine, self._workers

    def _start_workers(self, jobs: list[ProgramKey], workers: int, store: str) -> list[subprocess.Popen]:
        """Compile worker processes for `jobs`, sharing them as one queue in their order (compile_worker). Plain
        subprocesses (a daemonic core process may not start multiprocessing children), this package first on their
        path."""
        count = min(workers, len(jobs))
        jax_config = {name: getattr(jax.config, name) for name in INHERITED_CONFIG}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # the core's memory settings, but device memory is taken and given back as XLA's autotuning runs candidate
        # kernels (the default allocator keeps its peak: 8 workers beside 35B-A3B's weights filled an H200)
        env = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", **os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        claims = tempfile.mkdtemp(prefix=f"claims.{os.getpid()}.", dir=store)
        self._claims.append(claims)
        processes = []
        for w in range(count):
            task = os.path.join(store, f"task.{os.getpid()}.{time.monotonic_ns()}.{w}.pkl")
            with open(task, "wb") as f:
                pickle.dump((self.shapes, jobs, store, claims, jax_config), f)
            processes.append(subprocess.Popen(
                [sys.executable, "-c", f"from qwen_jax.engine.compilation import compile_worker; "
                                       f"compile_worker({task!r})"], env=env))
        return processes

    def program_store(self) -> str:
        """The folder compile workers store this runner's programs in: under the persistent compilation cache (a
        restart loads them without compiling or lowering), keyed by everything a program depends on: the model,
        the runner's shapes and drafts, the devices, JAX, XLA's flags and this package's source."""
        root = jax.config.jax_compilation_cache_dir or tempfile.gettempdir()
        store = os.path.join(root, "qwen_jax_programs", programs_digest(self.shapes, self.runner.mesh))
        os.makedirs(store, exist_ok=True)
        return store

    def _run_ready(self, sizes: list[int], pending: dict[tuple, int]) -> list[int]:
        """Run once each bucket of `sizes` whose programs (and samplers) are all compiled, the one of the program
        with the most working memory first (checked against the memory plan before anything runs); the others, to
        run later."""
        if not self.memory_checked:
            for process in self._workers:  # their device memory is free again
                process.wait()
            self.check_memory()
            known = self.held_back is not None
            self.runner.allocate(reserve=max(self.working_bytes.values(), default=0) if known else 0)
            stats = self.runner.mesh.devices.flat[0].memory_stats() or {}
            if known and "bytes_limit" in stats:
                log.info("device memory: %.2f GiB in use with the caches, of %.2f GiB", stats["bytes_in_use"] / 2**30,
                         stats["bytes_limit"] / 2**30)
            largest = max(self.working_bytes, key=self.working_bytes.__getitem__, default=None)
            first = self.working_group.get(largest, ())
            if first and first[0] == "bucket" and first[1] in sizes:
                sizes = [first[1], *(size for size in sizes if size != first[1])]
        later = []
        for size in sizes:
            if pending.get(("bucket", size)) or pending.get(("sampler", self.shapes.requests(size))):
                later.append(size)
            else:
                self.run_padding(size)
        return later

    def run_padding(self, size: int) -> None:
        """Run the programs of token bucket `size` once on padding only (no request: every write goes to the sinks,
        KV block 0, state slot 0) and wait for them: a program's first run costs the host far more than later ones
        (on a GPU: loading it, recording its CUDA graphs). Overwrites last_tokens: only while no sequence runs."""
        shapes = self.shapes
        buffer, layout = shapes.step_inputs(size)
        requests = shapes.requests(size)
        sampling, sampling_layout = shapes.padding_sampling(requests)
        batch = (buffer, layout, sampling, sampling_layout, 0, 0)
        self._first_run(ProgramKey("forward", size),
                        step.Forward(*batch, head=bool(shapes.num_speculative_tokens), behind=False))
        if size <= shapes.several_steps_rows:
            for path, top in MODEL_SAMPLER_VARIANTS:
                key = ProgramKey("decode_steps", size, shapes.decode_steps, path=path, top=top)
                if key in self.table.compiled:
                    self._first_run(key, step.DecodeSteps(buffer, layout, sampling, sampling_layout, path, top,
                                                          steps=shapes.decode_steps, behind=False))
        # a model that speculates: its verify programs, and each kind of step caught up on one (padding: no row is
        # behind, so nothing moves)
        for k, rounds in shapes.verify_variants(size) if shapes.num_speculative_tokens else ():
            for path, top in MODEL_SAMPLER_VARIANTS:
                key = ProgramKey("verify", size, rounds, k, path=path, top=top)
                if key in self.table.compiled:
                    self._first_run(key, step.Verify(*shapes.verify_inputs(size), sampling, sampling_layout, path,
                                                     top, draft_len=k, rounds=rounds, behind=True))
        if shapes.num_speculative_tokens:
            self._first_run(ProgramKey("forward", size), step.Forward(*batch, head=True, behind=True))
        if size == min(s for s in shapes.token_buckets if shapes.requests(s) == requests):
            self._run_samplers(requests)

    def _first_run(self, key: ProgramKey, op) -> None:
        """Run `op` (the program `key` and what it stages) once and wait for it. Out of device memory, the start ends
        with an error that names the program and what to lower."""
        try:
            jax.block_until_ready(self.runner.executor([op]))
        except Exception as exc:
            if OUT_OF_MEMORY not in str(exc):
                raise
            stats = self.runner.mesh.devices.flat[0].memory_stats() or {}
            held = f"; {stats['bytes_in_use'] / 2**30:.2f} of {stats['bytes_limit'] / 2**30:.2f} GiB in use" \
                if "bytes_limit" in stats else ""
            raise MemoryError(
                f"the step program {key.name} ran out of device memory on its first run at start-up (its working "
                f"memory: {self.working_bytes.get(key.name, 0) / 2**30:.2f} GiB{held}): lower "
                f"--gpu-memory-utilization (the caches then take less of the device), --max-num-batched-tokens or "
                f"--max-num-seqs") from exc

    def _run_samplers(self, requests: int) -> None:
        """Every compiled sampler variant of `requests` rows once, on zero logits."""
        r = self.runner
        sampling, _ = self.shapes.padding_sampling(requests)
        sampling = r.put(sampling)
        logits = r.put(np.zeros((requests, r.vocab_size), np.float32))
        for key, program in list(self.table.compiled.items()):
            if key.kind == "sampler" and key.size == requests:
                out, r.last_tokens, r.tables = program(logits, sampling, r.last_tokens, r.tables)
                jax.block_until_ready(out)

    def check_memory(self) -> None:
        """The memory plan at start-up, before any program runs: every program's working memory (XLA's temp
        buffers) must fit in what the caches leave of the engine's share of the device (`held_back`). Programs run
        one after another on one stream, so each reuses the memory of the one before it, and the first run
        (run_padding) is the largest's. Raises ValueError saying what to lower."""
        self.memory_checked = True
        held_back = self.held_back
        if held_back is None or not self.working_bytes:
            return
        name, need = max(self.working_bytes.items(), key=lambda item: item[1])
        log.info("working memory: at most %.2f GiB (%s); the caches leave %.2f GiB", need / 2**30, name,
                 held_back / 2**30)
        if need > held_back:
            raise ValueError(
                f"the step program {name} needs {need / 2**30:.2f} GiB of working memory, more than the "
                f"{held_back / 2**30:.2f} GiB the caches leave: lower --max-num-batched-tokens, "
                f"--max-num-seqs or --speculative-config's num_speculative_tokens, or lower --gpu-memory-utilization")

    def warm_up(self, full: bool, part: tuple[int, int] = (0, 1)) -> None:
        """Compile (several at once) and run once every program serving can run (`full`), or only those of the
        smallest and the largest token bucket and the programs of one sequence entering a batch (the rest are jitted
        when a step first needs them). Through the executor, so other hosts compile and run them too. `part`: this
        core's share of a compile shared with the other cores of one host (`compile`)."""
        r, shapes = self.runner, self.shapes
        buckets = shapes.token_buckets
        sizes = list(buckets) if full else sorted({buckets[0], buckets[-1]})
        if r.executor == r.execute:  # one host: first runs while the rest compiles
            self.compile(sizes, run=True, part=part, full=full)
        else:  # other hosts compile too, then every host runs each program in the same order
            r.executor([step.CompileBuckets(sizes)])
            self.check_memory()
            for size in sizes:
                self.run_padding(size)
        # the small programs of sequences entering a batch: snapshot copies, penalty-count resets and sampling-table
        # rows (nothing real: padding entries copy into the sinks, and name no row)
        longest = shapes.table_width * shapes.block_size
        nowhere = shapes.num_slots
        state = self.table.state["tables"]
        for n in shapes.row_counts(full):
            if shapes.has_snapshots:
                r.executor([step.RestoreSnapshots(*r.pairs([(0, 0)] * n)), step.SaveSnapshots(*r.pairs([(0, 0)] * n))])
            rows = np.full(n, nowhere, np.int32)
            r.executor([step.ResetPenalties(rows, np.zeros((n, longest), np.int32), np.zeros(n, np.int32),
                                            np.zeros(n, np.int32)),
                        *(step.WriteRows(table, rows, np.zeros((n, *getattr(state, table).shape[1:]),
                                                               getattr(state, table).dtype))
                          for table in WRITTEN_TABLES)])
        jax.block_until_ready((r.cache, r.tables))
        self.table.complete = full
