"""The tiny preset's tokenizer as the gateway loads it (through `tokenizers`), for the OpenAI endpoint's pure parts."""

from __future__ import annotations

import pytest

from loraplex.api.openai.tokenizer import GatewayTokenizer
from loraplex.models.tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> GatewayTokenizer:
    folder = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer().save_pretrained(folder)
    return GatewayTokenizer.load(str(folder))
