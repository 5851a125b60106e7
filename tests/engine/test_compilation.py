"""The compiler's plumbing that needs no GPU: the program store's key (shared by the data-parallel replicas of one
host, changed by anything a program depends on), what a compile worker is handed, and a lazy runner, whose device
state is allocated only once its programs are compiled (compile workers need the device meanwhile)."""

import os
import pickle

import jax

from qwen_jax import LLM, SamplingParams
from qwen_jax.engine import replica as replica_module


def runner_of(llm: LLM):
    return llm.engine.replicas[0].runner


def test_the_program_store_is_one_for_every_replica_and_another_for_other_shapes(hybrid_mtp_dir, kit):
    first = runner_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)).compiler.program_store()
    # another replica's sampling seed (seed * dp + i) is an input of its programs, not part of them
    other_seed = runner_of(LLM(hybrid_mtp_dir, **dict(kit.ENGINE_ARGS, seed=7))).compiler.program_store()
    assert other_seed == first and os.path.basename(os.path.dirname(first)) == "qwen_jax_programs"
    more_rows = runner_of(LLM(hybrid_mtp_dir, **dict(kit.ENGINE_ARGS, max_num_seqs=2))).compiler.program_store()
    no_drafts = runner_of(LLM(hybrid_mtp_dir, speculative_config="off", **kit.ENGINE_ARGS)).compiler.program_store()
    assert len({first, more_rows, no_drafts}) == 3


def test_a_compile_worker_is_handed_a_picklable_spec_and_every_program_has_its_own_file(hybrid_mtp_dir, kit):
    compiler = runner_of(LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)).compiler
    spec = pickle.loads(pickle.dumps(compiler.worker_spec()))
    assert spec["runner"]["max_num_seqs"] == kit.ENGINE_ARGS["max_num_seqs"] and spec["tensor_parallel_size"] == 1
    jobs = compiler.jobs(spec["sizes"])
    names = [job.file_name for job in jobs]
    assert len(set(names)) == len(names) and all("/" not in n for n in names)
    kinds = {job.name.split("[")[0] for job in jobs}
    assert kinds == {"forward", "draft", "verify", "sampler"}


def test_a_lazy_runner_allocates_its_state_at_its_first_step_with_the_same_tokens(hybrid_mtp_dir, kit, monkeypatch):
    prompt, params = kit.prompt(20, seed=1300), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS).generate([prompt], params)[0].token_ids
    monkeypatch.setattr(replica_module, "uses_workers", lambda mesh: True)
    llm = LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)
    runner = runner_of(llm)
    assert not runner.allocated
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(runner.cache))
    assert llm.generate([prompt], params)[0].token_ids == expected
    assert runner.allocated and all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(runner.cache))
