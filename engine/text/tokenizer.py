"""Tokenizer, special tokens and chat template, read from the model's own files.

Built with Hugging Face ``transformers`` (which converts a GGUF file's embedded
BPE vocabulary, merges and chat template into a fast ``tokenizers`` tokenizer),
so Tandem tokenizes exactly as the reference does.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Sequence

from tandem.engine.model.model_files import ModelFiles, derived_path, publish

logger = logging.getLogger(__name__)


def _gguf_tokenizer(files: ModelFiles, auto_tokenizer):
    """The GGUF file's tokenizer, converted once per file and library version.

    Converting the GGUF's vocabulary and merges (``transformers``' GGUF reader walks
    every array element) takes seconds, every worker start; the converted fast
    tokenizer is saved with ``save_pretrained`` in the model-file cache
    (:func:`~tandem.engine.model.model_files.derived_path`: keyed by the
    file's path, size and mtime and the library versions) and loaded from there
    next time. Writes are atomic (a rename), so concurrent workers may race; a cache
    that cannot be written is skipped.
    """
    import tokenizers
    import transformers

    target = derived_path(files, "tokenizers", transformers.__version__, tokenizers.__version__)
    if target is not None and os.path.isfile(os.path.join(target, "tokenizer.json")):
        return auto_tokenizer.from_pretrained(target)
    tok = auto_tokenizer.from_pretrained(files.directory, gguf_file=os.path.basename(files.path))
    if target is not None:
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
            tok.save_pretrained(tmp)
            publish(tmp, target)
        except OSError as exc:
            logger.debug("tokenizer cache %s not written: %s", target, exc)
    return tok


class Tokenizer:
    """Text <-> token ids for one model.

    Attributes:
        eos_token_id: end-of-sequence id (int).
        bos_token_id: beginning-of-sequence id, or None.
        vocab_size: number of ids the tokenizer knows (may be < the model's vocab).
    """

    def __init__(self, files: ModelFiles):
        from transformers import AutoTokenizer  # heavy import, kept off module import

        if files.format == "gguf":
            self._tok = _gguf_tokenizer(files, AutoTokenizer)
        else:
            self._tok = AutoTokenizer.from_pretrained(files.path)
        self.eos_token_id: int = int(self._tok.eos_token_id)
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.vocab_size: int = len(self._tok)
        self.has_chat_template: bool = bool(getattr(self._tok, "chat_template", None))

    @property
    def hf_tokenizer(self):
        """The underlying ``transformers`` tokenizer (for detokenization helpers)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(token_ids))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) under
        the model's chat template.

        ``tools`` (OpenAI ``{"type": "function", "function": {...}}`` objects) go to the
        template as its ``tools`` variable; a template that does not use it ignores them.

        Raises:
            ValueError: no messages, a message without role/content, or the model
                has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template")
        if not messages:
            raise ValueError("messages: must contain at least one message")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not m.get("role"):
                raise ValueError(f"messages[{i}].role: must be a non-empty string")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content: must be a string")
        text = self._tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None)
        # The template writes its own special tokens; do not add a second BOS.
        return self.encode(text, add_special_tokens=False)
