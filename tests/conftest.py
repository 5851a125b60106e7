"""Session-wide settings for the CPU test suite."""

import os
from pathlib import Path

import pytest

# Triton kernels (pallas_kernels/moe_triton.py) run in Triton's interpreter here. triton.jit reads this when it
# decorates, including Triton's own library functions when triton is first imported: set before any test module
# (or library it loads) imports triton, or interpreted kernels fail calling compiled-mode helpers.
os.environ.setdefault("TRITON_INTERPRET", "1")

from support import shared_data  # noqa: E402  (after the Triton setting)


@pytest.fixture(scope="session", name="shared_data")
def shared_data_fixture() -> Path:
    """The shared test data's folder (support.shared_data)."""
    return shared_data()
