import pytest

from m2po_char_tokenizer import build_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()
