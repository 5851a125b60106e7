"""The minimal engine's call patterns end to end (create_engine, prefill / decode / remove of named requests) on the
hybrid model: every returned logit row matches the HF model run one request at a time with its own cache.

Covers block and state-slot reuse after removal; HF parity across architectures lives in tests/models.
"""

import numpy as np
import pytest
import torch

from qwen_jax import create_engine

RTOL = 1e-4  # float32 engine vs float32 HF: max |diff| / max |logit|


class Trace:
    """Drives the engine and an HF reference side by side; decode feeds each request's reference argmax."""

    def __init__(self, engine, hf_model, kit):
        self.engine, self.hf, self.kit = engine, hf_model, kit
        self.caches: dict = {}
        self.next_token: dict = {}
        self.seed = 0

    def _check(self, rids, logits, ref) -> None:
        ours = np.asarray(logits, np.float32)
        assert ours.shape == (len(rids), self.kit.HYBRID_VOCAB)
        for rid, row, want in zip(rids, ours, ref):
            err = np.abs(row - want).max() / np.abs(want).max()
            assert err < RTOL, f"request {rid}: relative error {err:.2e}"
            self.next_token[rid] = int(want.argmax())

    @torch.no_grad()
    def prefill(self, rids, length: int) -> None:
        prompts = []
        for _ in rids:
            self.seed += 1
            prompts.append(np.asarray(self.kit.prompt(length, seed=700 + self.seed), np.int32))
        ref = []
        for rid, p in zip(rids, prompts):
            out = self.hf(torch.as_tensor(p, dtype=torch.long)[None], use_cache=True)
            self.caches[rid] = out.past_key_values
            ref.append(out.logits[0, -1].numpy())
        self._check(rids, self.engine.prefill(rids, prompts), ref)

    @torch.no_grad()
    def decode(self, rids, steps: int) -> None:
        for _ in range(steps):
            tokens = np.array([self.next_token[r] for r in rids], np.int32)
            ref = []
            for rid, t in zip(rids, tokens):
                out = self.hf(torch.tensor([[int(t)]]), past_key_values=self.caches[rid], use_cache=True)
                self.caches[rid] = out.past_key_values
                ref.append(out.logits[0, -1].numpy())
            self._check(rids, self.engine.decode(rids, tokens), ref)

    def remove(self, rids) -> None:
        self.engine.remove(rids)
        for rid in rids:
            del self.caches[rid], self.next_token[rid]

    def assert_empty(self) -> None:
        e = self.engine
        assert not e.requests and e.blocks.num_free == e.blocks.num_usable and not any(e.blocks.ref_counts)
        assert e.slots.num_free == e.slots.num_slots - 1 and not e.slots.in_use


@pytest.fixture(scope="module")
def trace(models, kit):
    directory, hf_model = models["hybrid"]
    engine = create_engine(None, directory, device="cpu", max_num_seqs=8, max_model_len=144)
    return Trace(engine, hf_model, kit)


def test_prefill_4x128_then_remove(trace):
    rids = [f"long-{i}" for i in range(4)]
    trace.prefill(rids, 128)
    assert len(trace.engine.slots.in_use) == 4 and trace.engine.blocks.num_usable - trace.engine.blocks.num_free == 32
    trace.remove(rids)
    trace.assert_empty()


def test_8_prompts_of_32_then_16_decode_steps(trace):
    rids = [f"short-{i}" for i in range(8)]
    trace.prefill(rids, 32)
    trace.decode(rids, 16)
    trace.remove(rids)
    trace.assert_empty()


def test_mixed_trace_with_removal_and_reuse(trace):
    first = [f"mix-{i}" for i in range(4)]
    trace.prefill(first, 64)
    trace.decode(first, 2)
    second = ["mix-4", "mix-5"]
    trace.prefill(second, 128)
    trace.decode(first + second, 6)
    trace.remove(["mix-1", "mix-4"])  # frees a slot and blocks in the middle of the live set
    third = [f"mix-{i}" for i in range(6, 10)]
    trace.prefill(third, 32)  # reuses the freed slots and blocks; must start from a clean state
    live = ["mix-0", "mix-2", "mix-3", "mix-5"] + third
    trace.decode(live, 2)
    trace.remove(live)
    trace.assert_empty()
