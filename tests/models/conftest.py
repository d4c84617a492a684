"""Tiny random-weight checkpoints that transformers itself writes, and its greedy
reference, for the architecture tests.

Each checkpoint is ``from_config`` of the architecture's own config class (hidden
64, 2 layers, vocab 512), seeded, saved with ``save_pretrained`` beside a 512-word
``WordLevel`` tokenizer. transformers initialises biases to 0 and norm weights to 1,
which would let a model that drops them pass: those are redrawn at random before
saving, so every tensor the architecture has matters to the tokens. Weights are
drawn 10x wider than transformers' default (``initializer_range`` 0.2): at 0.02 the
attention scores are so flat that the tokens barely depend on positions, and
RoPE scaling ignored would go unseen.
"""

from __future__ import annotations

import pathlib

import torch

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False, initializer_range=0.2)


def save_tiny_tokenizer(path: pathlib.Path) -> None:
    """A whitespace ``WordLevel`` tokenizer: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then
    ``w3`` ... ``w511``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>").save_pretrained(path)


def save_tiny_checkpoint(path: pathlib.Path, config_class: str, **overrides):
    """Build ``transformers.<config_class>(**BASE | overrides)``'s model with seed 0,
    redraw its biases and norm weights, save it and the tokenizer to ``path``;
    returns the float32 model (eval mode)."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**(BASE | overrides))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers' ``generate`` (EOS ignored)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
