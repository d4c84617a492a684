"""The model-file cache: a GGUF's converted tokenizer and its dequantized weights are
saved once and loaded from the cache afterwards, and equal the conversion exactly."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tandem.engine.model.model_files import cache_dir, derived_path
from tandem.engine.model.loader import gguf_checkpoint
from tandem.engine.text.tokenizer import Tokenizer

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


def test_an_empty_cache_dir_turns_the_cache_off(model_files, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", "")
    assert cache_dir() is None and derived_path(model_files, "weights") is None
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert cache_dir() == "/x/tandem"


def test_cached_weights_equal_the_dequantized_gguf(model_files, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    cfg, tensors = gguf_checkpoint(model_files)            # parses, dequantizes, saves
    converted = dict(tensors)
    [entry] = os.listdir(tmp_path / "weights")
    assert entry.startswith(model_files.name + "-") and entry.endswith(".safetensors")
    cached_cfg, cached = gguf_checkpoint(model_files)      # from the cache
    cached = dict(cached)
    assert cached_cfg == cfg and cfg.num_layers == 30
    assert sorted(cached) == sorted(converted) and len(converted) == 2 + 9 * cfg.num_layers
    for name, t in converted.items():
        assert t.dtype == cached[name].dtype == torch.float32
        assert torch.equal(t, cached[name]), name
