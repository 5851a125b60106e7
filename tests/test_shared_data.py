"""The shared test data is found through $QWEN_JAX_TEST_DATA (else ../shared/data beside the checkout), and a path
missing there is an error that says where it looked and what to set, never a skip."""

import pytest
from support import DATA_ENV, REPO_ROOT, shared_data


def test_the_data_folder_comes_from_the_environment_first(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "model.json").write_text("{}")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert shared_data("configs", "model.json") == tmp_path / "configs" / "model.json"
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/configs/other.json.*QWEN_JAX_TEST_DATA"):
        shared_data("configs", "other.json")


def test_without_the_environment_the_data_is_beside_the_checkout(monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    try:
        found = shared_data()
    except FileNotFoundError as exc:
        assert str(REPO_ROOT.parent / "shared" / "data") in str(exc)
    else:
        assert found == REPO_ROOT.parent / "shared" / "data"
