"""RESULTS.json entries are portable and clean: no machine paths in the command, no entry of a dirty tree in the
repository's file."""

import os

import pytest

from qwen_jax.bench import results


def test_command_paths_become_repo_relative_or_file_names():
    inside = os.path.join(results.REPO_ROOT, ".devdata", "m", "config.json")
    argv = ["python", "-m", "x", "--results", "/root/out/RESULTS.json", "--model-config", inside,
            f"--tokenizer={inside}", "--label", "a/b", "--levels-out=/tmp/l.json"]
    assert results.portable_command(argv) == ["python", "-m", "x", "--results", "RESULTS.json", "--model-config",
                                              ".devdata/m/config.json", "--tokenizer=.devdata/m/config.json",
                                              "--label", "a/b", "--levels-out=l.json"]


def test_the_repository_file_refuses_a_dirty_or_unknown_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "DEFAULT_RESULTS", str(tmp_path / "RESULTS.json"))
    for commit in ("abc1234+dirty", None):
        with pytest.raises(ValueError, match="not appending"):
            results.append_result({"commit": commit}, results.DEFAULT_RESULTS)
    assert not (tmp_path / "RESULTS.json").exists()
    results.append_result({"commit": "abc1234+dirty"}, str(tmp_path / "scratch.json"))  # elsewhere: kept
    results.append_result({"commit": "abc1234"}, results.DEFAULT_RESULTS)
    assert (tmp_path / "scratch.json").exists() and (tmp_path / "RESULTS.json").exists()
