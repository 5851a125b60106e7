"""The decode-step memory roofline and prefill FLOPs, checked against arithmetic written out by hand from the
Qwen3.5-35B-A3B and Qwen3.5-4B config.json numbers (not from param_shapes)."""

import os

import pytest
from support import shared_data

from qwen_jax.bench.roofline import (
    decode_bytes,
    expected_distinct_experts,
    format_ratio,
    main,
    prefill_flops_per_token,
    roofline_ratio,
)
from qwen_jax.config import load_config

CONFIGS = str(shared_data("configs"))

# Qwen3.5-35B-A3B: hidden 2048, vocab 248320, 40 layers = 30 Gated DeltaNet + 10 gated attention, all MoE.
H, V = 2048, 248320
ATTN = (H * 16 * 256      # q: 16 heads x 256
        + H * 16 * 256    # output gate, same shape as q
        + H * 2 * 256     # k: 2 kv heads
        + H * 2 * 256     # v
        + 16 * 256 * H    # o
        + 256 + 256)      # q_norm, k_norm
GDN = (H * 16 * 128 * 2       # q, k: 16 key heads x 128
       + H * 32 * 128 * 2     # v, z: 32 value heads x 128
       + H * 32 * 2           # b, a
       + 4 * (2 * 16 * 128 + 32 * 128)  # depthwise conv, kernel 4, over q, k, v channels
       + 32 * 128 * H         # out
       + 128)                 # gated norm
GDN_F32 = 32 + 32             # A_log, dt_bias
EXPERT = 3 * H * 512          # gate, up, down of one routed expert
MOE_FIXED = H * 256 + 3 * H * 512 + H  # router, shared expert, shared-expert gate
NORMS = 2 * H


def hand_weight_bytes(batch: int, experts_touched: float) -> float:
    params = (10 * (ATTN + NORMS + MOE_FIXED) + 30 * (GDN + NORMS + MOE_FIXED)
              + 40 * experts_touched * EXPERT + H + H * V + batch * H)  # final norm, LM head, embedding rows
    return 2 * params + 4 * 30 * GDN_F32


def test_35b_a3b_reads_5_9_gb_of_weights_per_decode_step_at_batch_1():
    cfg = load_config(os.path.join(CONFIGS, "Qwen3.5-35B-A3B.json"))
    d = decode_bytes(cfg, 1, 0)
    assert d.weights == pytest.approx(hand_weight_bytes(1, 8), rel=1e-12)
    assert 5.89e9 < d.weights < 5.90e9
    assert d.lm_head == 2 * H * V
    assert d.routed_experts == pytest.approx(2 * 40 * 8 * EXPERT)
    # Recurrent state: 30 layers x fp32 [32, 128, 128], read and written; conv window: 3 x 8192 bf16, both ways.
    assert d.recurrent_state == 2 * 30 * 32 * 128 * 128 * 4
    assert d.conv_state == 2 * 30 * 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert d.kv_cache == 10 * 2 * 2 * 256 * 2  # only the new token's K and V at context 0


def test_35b_a3b_kv_and_state_scale_with_batch_and_context():
    cfg = load_config(os.path.join(CONFIGS, "Qwen3.5-35B-A3B.json"))
    for batch, experts in ((16, 101.96), (64, 222.44)):
        assert expected_distinct_experts(256, 8, batch) == pytest.approx(experts, abs=0.01)
        d = decode_bytes(cfg, batch, 2048)
        assert d.weights == pytest.approx(hand_weight_bytes(batch, 256 * (1 - (1 - 8 / 256) ** batch)), rel=1e-12)
        assert d.kv_cache == batch * 10 * 2 * 2 * 256 * 2 * (2048 + 1)
        assert d.recurrent_state == batch * 2 * 30 * 32 * 128 * 128 * 4
    mixed = decode_bytes(cfg, 2, [100, 300])
    assert mixed.kv_cache == 10 * 2 * 2 * 256 * 2 * (100 + 300 + 2)
    with pytest.raises(ValueError):
        decode_bytes(cfg, 3, [1, 2])


def test_distinct_experts_limits():
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert expected_distinct_experts(0, 0, 5) == 0.0


def test_4b_dense_tied_reads_8_4_gb_at_batch_1():
    cfg = load_config(os.path.join(CONFIGS, "Qwen3.5-4B.json"))
    h, v, i = 2560, 248320, 9216
    attn = h * 16 * 256 * 2 + h * 4 * 256 * 2 + 16 * 256 * h + 512
    gdn = h * 16 * 128 * 2 + h * 32 * 128 * 2 + h * 32 * 2 + 4 * 8192 + 32 * 128 * h + 128
    params = 8 * attn + 24 * gdn + 32 * (3 * h * i + 2 * h) + h + h * v  # tied: the embedding is the LM head
    d = decode_bytes(cfg, 1, 0)
    assert d.weights == 2 * params + 4 * 24 * 64
    assert d.shared_experts == 0 and d.routed_experts == 0
    assert 8.40e9 < d.weights < 8.42e9


def test_prefill_flops_per_token_matches_hand_count():
    cfg = load_config(os.path.join(CONFIGS, "Qwen3.5-35B-A3B.json"))
    matmul = 10 * (ATTN - 512) + 30 * (GDN - 128) + 40 * (MOE_FIXED - H + H + 8 * EXPERT)
    L = 2048
    expected = (2 * matmul + 10 * 4 * 16 * 256 * (L + 1) / 2 + 30 * 6 * 32 * 128 * 128 + 2 * H * V / L)
    assert prefill_flops_per_token(cfg, L) == pytest.approx(expected, rel=1e-12)
    assert 5.0e9 < expected < 5.3e9  # about 2 x 2.4 B active weights plus attention


def test_ratio_of_measured_time_to_roofline():
    assert roofline_ratio(2 * 5.9e9 / 4.3e12, 5.9e9, 4.3) == pytest.approx(2.0)
    assert roofline_ratio(5.9e9 / 3.0e12, 5.9e9, 3.0) == pytest.approx(1.0)
    line = format_ratio(2.744e-3, 5.9e9, 4.3)
    assert "1.372 ms" in line and "2.00x" in line


def test_cli_prints_a_row_per_batch(capsys):
    main(["--config", os.path.join(CONFIGS, "Qwen3.5-35B-A3B.json"), "--batch", "1,16", "--context", "2048",
          "--measured-ms", "2.82"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "16")]
    assert [r[0] for r in rows] == ["1", "16"]
    assert rows[0][1] == "5.893"  # weights GB at batch 1
    assert "GFLOP per token" in out and "x" in out.splitlines()[-1]
