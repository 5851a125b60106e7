"""The package's public names (what the server and users import) each resolve to the object of the module behind
it, and an unknown name is an AttributeError, as for any module."""

import importlib

import pytest

import qwen_jax


def test_every_public_name_resolves_to_its_module_object():
    for name in qwen_jax.__all__:
        module = importlib.import_module(qwen_jax._PUBLIC[name])
        assert getattr(qwen_jax, name) is getattr(module, name), name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        qwen_jax.Engine  # noqa: B018
