"""Export the default model's GGUF file to a dense Hugging Face checkpoint directory.

Peers such as vLLM load a Hugging Face checkpoint (config.json + safetensors +
tokenizer), not the GGUF file Tandem serves by default. This writes one from the
same GGUF: transformers dequantizes the weights on load (Q4_1/Q8_0 -> ``--dtype``),
the state dict is saved with safetensors minus ``lm_head.weight`` (the embeddings are
tied), the config without its ``quantization_config``, and the tokenizer with its
chat template. ``save_pretrained`` refuses a GGUF-loaded model, hence the pieces.

    .venv/bin/python benchmarks/export_hf.py --out .peers/smollm2-hf --dtype float32

Tandem loads the result too (``tandem serve --model DIR``), with the same weights as
from the GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def export(out: str, dtype: str, gguf_path: str | None = None) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.model.model_files import default_model_path

    path = gguf_path or default_model_path()
    directory, name = os.path.dirname(path), os.path.basename(path)
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    os.makedirs(out, exist_ok=True)

    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = dtype
    config["tie_word_embeddings"] = True
    if not config.get("architectures"):            # a GGUF-loaded config leaves it empty
        config["architectures"] = [type(model).__name__]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    args = p.parse_args(argv)
    out = export(args.out, args.dtype, args.gguf)
    print(f"wrote {out}: {sorted(os.listdir(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
