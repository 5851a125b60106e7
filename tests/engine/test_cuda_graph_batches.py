"""cuda_graph_max_batch: decode batches of up to that many rows run every decoder layer as one compiled program (on
a GPU XLA launches it as CUDA graphs); prefill steps and larger batches keep one program per layer. Same tokens."""

import pytest

import qwen_jax.engine.runner as runner
from qwen_jax.llm import LLM
from qwen_jax.sampling_params import SamplingParams

PROMPTS = [list(range(5, 40)), [3, 4, 9], [7]]


@pytest.fixture(scope="module")
def runs():
    """(greedy tokens, the (rows, length, layers) of every program of layers run) for cuda_graph_max_batch 0 and 4."""
    out = {}
    real = runner._layers
    for max_batch in (0, 4):
        calls = []

        def spy(x, ps, cs, batch, calls=calls, **static):
            calls.append((x.shape[0], x.shape[1], len(ps)))
            return real(x, ps, cs, batch, **static)

        llm = LLM(None, max_num_seqs=4, max_model_len=64, dtype="float32", cuda_graph_max_batch=max_batch)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(runner, "_layers", spy)
            tokens = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))]
        out[max_batch] = tokens, calls
    return out


def test_small_decode_batches_run_every_layer_in_one_program(runs):
    _, calls = runs[4]
    num_layers = max(n for _, _, n in calls)
    decode = [c for c in calls if c[1] == 1]
    prefill = [c for c in calls if c[1] > 1]
    assert decode and all(rows <= 4 and n == num_layers > 1 for rows, _, n in decode)
    assert prefill and all(n == 1 for _, _, n in prefill)


def test_without_it_every_program_runs_one_layer(runs):
    _, calls = runs[0]
    assert calls and all(n == 1 for _, _, n in calls)


def test_one_program_gives_the_same_greedy_tokens(runs):
    assert runs[4][0] == runs[0][0] and all(len(t) == 6 for t in runs[0][0])
