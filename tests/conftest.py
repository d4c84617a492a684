"""Shared fixtures: the real default model, its tokenizer, and the Hugging Face reference."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_files():
    from tandem.engine.model.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def f32_weights():
    """The default model loaded once in float32 (a small cache): test modules build
    their engines on its weights (``LLM(..., weights_from=f32_weights)``) instead of
    loading the file again."""
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=16)


@pytest.fixture(scope="session")
def gguf_source(model_files):
    """A ``gguf.GGUFReader`` open on the default model's file (parsing its fields
    takes seconds: opened once for the tests that read or requantize it)."""
    from gguf import GGUFReader

    return GGUFReader(model_files.path)


@pytest.fixture(scope="session")
def tokenizer(model_files):
    from tandem.engine.text.tokenizer import Tokenizer

    return Tokenizer(model_files)


@pytest.fixture(scope="session")
def hf_model(model_files):
    """Hugging Face transformers' Llama on the same GGUF file, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_files.directory, gguf_file=os.path.basename(model_files.path), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """``hf_greedy(prompt_ids, n) -> list[int]``: n greedy tokens from transformers,
    ignoring EOS (a plain argmax loop over its KV-cached forward).

    Per prompt, the loop's state (the tokens so far, transformers' KV cache and the
    last position's logits) is kept, so a later call for more tokens of the same
    prompt continues the same loop where it stopped, and one for fewer takes the
    first n: the same forwards in the same order as a loop run from scratch for n,
    so the same tokens (tests/test_engine_parity.py wants 48 tokens of the prompts
    tests/serving/test_serving_e2e.py wanted 24 of)."""
    state: dict[tuple, tuple[list[int], object, torch.Tensor]] = {}

    @torch.inference_mode()
    def run(prompt_ids: list[int], n: int) -> list[int]:
        key = tuple(prompt_ids)
        if key not in state:
            out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
            # The last position's logits only: the prompt's whole [L, vocab] is large.
            state[key] = ([], out.past_key_values, out.logits[0, -1].clone())
            del out
        ids, past, logits = state[key]
        while len(ids) < n:
            t = int(logits.argmax())
            out = hf_model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            ids.append(t)
            past, logits = out.past_key_values, out.logits[0, -1].clone()
            state[key] = (ids, past, logits)
        return ids[:n]

    return run


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A test CA, a server certificate for 127.0.0.1 and client certificates (tests/tls_certs.py)."""
    from tests.tls_certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
