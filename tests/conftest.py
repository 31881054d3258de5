import os

# Keep tests deterministic and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402

from rollout_testlib import build_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 model built locally (tests of the engines, the stand-ins and the weight pushes)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))
