"""Shared fixtures of the rollout tests: a tiny random Qwen2 model built locally."""

from __future__ import annotations

import pytest

from rollout_testlib import build_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))
