"""The GGUF tokenizer cache: the converted tokenizer is saved once and loaded from the
cache afterwards, and it tokenizes, templates and decodes exactly as the conversion."""

from __future__ import annotations

import os
import random

import pytest

from tandem.engine.text.tokenizer import Tokenizer, cache_dir

pytestmark = pytest.mark.slow

TEXTS = ["Hello world", "  leading spaces\n\ttabs", "你好，世界 🎉👍🏽🇯🇵\n" * 3,
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2\n", "ÄÖÜß naïve café", ""]


def test_cached_tokenizer_equals_the_conversion(model_files, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == str(tmp_path)
    converted = Tokenizer(model_files)                 # converts and saves
    [entry] = os.listdir(tmp_path / "tokenizers")
    assert entry.startswith(model_files.name + "-")
    assert sorted(os.listdir(tmp_path / "tokenizers" / entry))[-1] == "tokenizer_config.json"
    cached = Tokenizer(model_files)                    # from the cache
    a, b = converted.hf_tokenizer, cached.hf_tokenizer
    assert a.name_or_path != b.name_or_path and b.name_or_path.startswith(str(tmp_path))
    for text in TEXTS:
        for special in (True, False):
            assert converted.encode(text, special) == cached.encode(text, special), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert converted.apply_chat_template(msgs) == cached.apply_chat_template(msgs)
    assert (converted.eos_token_id, converted.bos_token_id, converted.vocab_size) == \
           (cached.eos_token_id, cached.bos_token_id, cached.vocab_size)
    assert a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(converted.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert converted.decode(ids, skip) == cached.decode(ids, skip)


def test_an_empty_cache_dir_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", "")
    assert cache_dir() is None
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert cache_dir() == "/x/tandem"
