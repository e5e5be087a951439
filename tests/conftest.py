"""Shared pytest setup: a per-test seed, and the `gpu` marker skipping cleanly without CUDA."""
from __future__ import annotations

import zlib

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    # Different random inputs in every test, the same ones on every run of that test.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
