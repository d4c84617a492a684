"""What a process started from the checkout root imports for a name that both the
checkout and an installed distribution could claim (``kernels``, ``proto``).

Run as ``python -m tests.import_probe`` (or call :func:`probe`): it imports
``transformers.integrations.hub_kernels`` (which imports Hugging Face's
``kernels``), converts the default model's GGUF tokenizer (the path that first
met the shadowed ``kernels``; with an empty ``TANDEM_CACHE_DIR`` it is not
skipped), and prints one JSON line: where ``kernels`` and ``proto`` came from and
whether the checkout root was on ``sys.path`` at all (else the probe proved nothing).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe(convert_tokenizer: bool = True) -> dict:
    """Returns ``{"kernels": file, "proto": file or None, "root_on_path": bool,
    "tokens": [int] or None}``; raises what the imports raise."""
    on_path = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    importlib.import_module("transformers.integrations.hub_kernels")
    import kernels

    proto_spec = importlib.util.find_spec("proto")
    tokens = None
    if convert_tokenizer:
        from tandem.engine.model.model_files import resolve_model
        from tandem.engine.text.tokenizer import Tokenizer

        tokens = Tokenizer(resolve_model(None)).encode("hello world")
    return {"kernels": kernels.__file__,
            "proto": proto_spec.origin if proto_spec is not None else None,
            "root_on_path": ROOT in on_path, "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(probe()))
