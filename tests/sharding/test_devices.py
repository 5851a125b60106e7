"""The layout and device plumbing of replicas as processes: which devices each replica process sees, the layout
text a server takes, and the layout `--layout auto` picks; all without starting JAX on a GPU."""

import pytest

from sharding import devices


def test_each_replica_process_sees_only_its_own_gpus(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6,7")
    assert devices.visible_gpus() == ["2", "3", "4", "5", "6", "7"]
    assert devices.replica_environments(3, 2) == [{"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"},
                                                  {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert devices.replica_environments(2, None) == [{"CUDA_VISIBLE_DEVICES": "2,3,4"},
                                                     {"CUDA_VISIBLE_DEVICES": "5,6,7"}]
    with pytest.raises(ValueError, match="needs more than the 6 devices"):
        devices.replica_environments(4, 2)


def test_on_the_cpu_each_replica_process_gets_its_share_of_host_platform_devices(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
    assert devices.visible_gpus() == [] and devices.cpu_device_count() == 8
    assert devices.replica_environments(4, 2) == [
        {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2"}] * 4


def test_layout_text():
    assert devices.parse_layout("DP=2,TP=2") == (2, 2, False)
    assert devices.parse_layout("tp=4,ep") == (1, 4, True)
    assert devices.parse_layout("EP=4") == (1, 4, True)
    assert devices.parse_layout("dp=8") == (8, 1, False)
    for bad in ("DP", "XP=2", "TP=two", "DP=0"):
        with pytest.raises(ValueError, match="layout"):
            devices.parse_layout(bad)


def test_auto_layout_is_data_parallel_when_one_gpu_holds_the_weights_else_the_fewest_that_do():
    gib = 2**30
    assert devices.auto_layout(4, 67 * gib, 141 * gib) == (4, 1, False)
    assert devices.auto_layout(8, 67 * gib, None) == (8, 1, False)
    assert devices.auto_layout(3, 67 * gib, 141 * gib) == (3, 1, False)
    # 300 GB of weights: four H200s a replica (75 GB each, under 60% of one), experts split; two replicas on eight
    assert devices.auto_layout(8, 300 * 10**9, 141 * gib) == (2, 4, True)
    assert devices.auto_layout(8, 470 * 10**9, 141 * gib) == (1, 8, True)  # 235B in bf16: all eight
    assert devices.auto_layout(1, 67 * gib, 141 * gib) == (1, 1, False)
