"""Check the tests' GGUF writer (tests/models/gguf_files.py) against llama.cpp's own
converter, once per architecture: same tensor names, shapes, dtypes and values, and
the same metadata keys and values.

Getting the converter: llama-cpp-python's source distribution ships it::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp
    python benchmarks/gguf_converter_check.py \\
        /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp

(any llama.cpp checkout works: the argument is the folder holding
``convert_hf_to_gguf.py`` and ``gguf-py``). For every GGUF case of
tests/models/test_gguf_architectures.py the script writes the tiny checkpoint,
runs the converter on it (``--outtype f32``, in a subprocess with the converter's
own ``gguf-py`` first on its path), writes the test GGUF, and prints per case
``match`` or what differs. The converter cannot convert the tiny checkpoints'
``WordLevel`` tokenizer: its ``set_vocab`` is replaced for the run by one writing a
stub vocabulary, and the tokenizer keys (``tokenizer.*``) and the free-form
``general.name`` / ``general.size_label`` are not compared.

Exit status 1 when any case differs. Takes ~1 minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs inside the converter's subprocess: argv = [llama.cpp dir, converter args...].
_RUNNER = r'''
import sys
conv = sys.argv[1]
sys.path.insert(0, conv)
sys.path.insert(1, conv + "/gguf-py")
import gguf, conversion

def set_vocab(self):     # the tiny WordLevel tokenizer is not a format it converts
    toks = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 512)]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_token_list(toks)
    self.gguf_writer.add_bos_token_id(1)
    self.gguf_writer.add_eos_token_id(2)

_get = conversion.get_model_class
def get_model_class(*a, **k):
    cls = _get(*a, **k)
    cls.set_vocab = set_vocab
    return cls

import convert_hf_to_gguf
convert_hf_to_gguf.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
'''

_SKIPPED_KEYS = ("general.name", "general.size_label")


def _read(path: pathlib.Path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    # (GGUF value types, value): an int32 is not a uint32
    fields = {k: ([int(t) for t in f.types], f.contents()) for k, f in r.fields.items()
              if not k.startswith(("GGUF.", "tokenizer.")) and k not in _SKIPPED_KEYS}
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape.tolist()),
                        np.array(t.data)) for t in r.tensors}
    return fields, tensors


def compare(reference: pathlib.Path, ours: pathlib.Path) -> list[str]:
    """What differs between two GGUF files (empty: they match)."""
    (rf, rt), (of, ot) = _read(reference), _read(ours)
    diffs = []
    for key in sorted(set(rf) | set(of)):
        if key not in of:
            diffs.append(f"key {key} missing (converter: {rf[key]!r})")
        elif key not in rf:
            diffs.append(f"key {key} extra ({of[key]!r})")
        elif rf[key] != of[key]:
            diffs.append(f"key {key}: converter {rf[key]!r}, ours {of[key]!r}")
    for name in sorted(set(rt) | set(ot)):
        if name not in ot:
            diffs.append(f"tensor {name} missing")
        elif name not in rt:
            diffs.append(f"tensor {name} extra")
        elif rt[name][:2] != ot[name][:2]:
            diffs.append(f"tensor {name}: converter {rt[name][:2]}, ours {ot[name][:2]}")
        elif not np.array_equal(rt[name][2], ot[name][2]):
            diffs.append(f"tensor {name}: values differ (max |d| "
                         f"{np.abs(rt[name][2] - ot[name][2]).max():.3g})")
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_cpp", help="folder with convert_hf_to_gguf.py and gguf-py")
    parser.add_argument("--cases", nargs="*", help="GGUF cases (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.models.conftest import save_tiny_checkpoint
    from tests.models.gguf_files import write_gguf
    from tests.models.test_gguf_architectures import GGUF_CASES

    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases or sorted(GGUF_CASES):
            config_class, overrides, _ = GGUF_CASES[case]
            ckpt = pathlib.Path(tmp) / case
            save_tiny_checkpoint(ckpt, config_class, **overrides)
            reference = pathlib.Path(tmp) / f"{case}.converter.gguf"
            env = dict(os.environ, PYTHONPATH="")
            run = subprocess.run([sys.executable, "-c", _RUNNER, args.llama_cpp, str(ckpt),
                                  "--outtype", "f32", "--outfile", str(reference)],
                                 env=env, capture_output=True, text=True)
            if run.returncode:
                print(f"{case}: converter failed\n{run.stderr[-2000:]}")
                failed += 1
                continue
            ours = write_gguf(ckpt, pathlib.Path(tmp) / f"{case}.ours.gguf")
            diffs = compare(reference, ours)
            print(f"{case}: " + ("match" if not diffs else "DIFFERS\n  " + "\n  ".join(diffs)),
                  flush=True)
            failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
