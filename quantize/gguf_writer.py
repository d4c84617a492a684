"""Requantize a GGUF file to another GGUF type (Q8_0, Q6_K, Q5_0, Q4_K, Q4_0, Q4_1,
F16, F32) or to the Q4_K_M mix.

:func:`requantize_gguf` reads a GGUF file with ``gguf.GGUFReader`` and writes a new
one with ``gguf.GGUFWriter``:

- every metadata key/value field is copied with its stored value type (strings as
  their raw bytes, arrays with their element type), except ``general.file_type``,
  which names the new type (``gguf.LlamaFileType``);
- the projection matrices (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``,
  ``ffn_gate``, ``ffn_up``, ``ffn_down``) and, unless ``keep_embedding``, the
  embedding and output matrices (``token_embd``, ``output``) are dequantized with
  ``gguf.quants.dequantize`` and quantized to the new type with
  ``gguf.quants.quantize`` (Q4_K and Q6_K, which gguf-py cannot write, with
  :mod:`~tandem.quantize.kquants`), row by row; the rows stay in the order the file stores
  them (``attn_q`` / ``attn_k`` in llama.cpp's permuted order, which a row-wise
  requantization keeps), so the result is read exactly as the source is. A tensor
  already stored in the target type is copied as stored (requantizing it could only
  add rounding);
- the experts of a mixture-of-experts file (``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``: one 3-D tensor ``[E, out, in]`` per projection and layer) are
  requantized like the projections, each expert's rows in place, and so are
  Qwen2-MoE's shared-expert projections (``ffn_*_shexp``); the routers
  (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) are copied as stored, as
  ``llama-quantize`` keeps them;
- 1-D tensors (the norms) are written as F32; other tensors are copied as stored.

As ``llama-quantize`` does, the output matrix (``output.weight``, or the token
embedding when the output is tied to it) is written in Q6_K for every target below
8 bits (:func:`target_type`), since the logits are the most sensitive product.

K-quant rows must hold whole 256-weight super-blocks. A tensor whose rows do not
(SmolLM2-135M's hidden size is 576) takes llama.cpp's fallback type instead
(:data:`KQUANT_FALLBACK`: Q4_K -> Q5_0, Q6_K -> Q8_0), as ``llama-quantize`` does.
``Q4_K_M`` is llama.cpp's mix of that name (:func:`q4_k_m_type`): Q4_K, with Q6_K for
the output matrix (the token embedding when the output is tied to it) and for
``attn_v`` / ``ffn_down`` of the first and last eighth of the layers and every third
layer between (``ffn_down_exps`` and ``ffn_down_shexp`` count as ``ffn_down``, as
llama.cpp matches them by name). Not reproduced: llama.cpp's extra bits for 8-expert
models in this mix (``attn_v`` in Q8_0, ``attn_output`` in Q5_K, which this writer
does not produce).

Tensors are written one at a time (the output's layout is planned from the shapes
first), so memory holds one tensor's float32 copy at a time, not the model.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader

#: Targets :func:`requantize_gguf` writes: ``gguf.GGMLQuantizationType`` names, and the
#: ``Q4_K_M`` mix.
REQUANTIZE_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q4_K", "Q4_K_M", "Q4_0", "Q4_1", "F16", "F32")

#: ggml type name -> the type llama.cpp uses for rows that are not whole super-blocks.
KQUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}

#: Bumped whenever the same source and target give different bytes (caches of
#: requantized files key on it): 2 = the output matrix in Q6_K below 8 bits.
REQUANTIZE_VERSION = 2

# Targets whose output matrix llama.cpp keeps in Q6_K (all below 8 bits).
_LOW_BIT = ("Q6_K", "Q5_0", "Q4_K", "Q4_K_M", "Q4_0", "Q4_1")

#: GGUF tensor-name stems of the projection matrices (``blk.{i}.<stem>.weight``).
PROJECTION_STEMS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                    "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
#: GGUF tensor-name stems of the stacked expert matrices ``[E, out, in]``.
EXPERT_STEMS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: GGUF tensor names of the embedding and the output (LM head) matrices.
EMBEDDING_NAMES = ("token_embd.weight", "output.weight")

QT_K_BLOCK = 256     # weights per K-quant super-block

# Fields the reader synthesises from the file header; the writer writes its own.
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def tensor_kind(name: str, n_dims: int) -> str:
    """The role of a GGUF tensor, as :func:`requantize_gguf` reports and treats it.

    Returns:
        ``"projection"`` (``blk.{i}.attn_q.weight``, ... see :data:`PROJECTION_STEMS`),
        ``"expert"`` (``blk.{i}.ffn_up_exps.weight``, ... see :data:`EXPERT_STEMS`),
        ``"embedding"`` (:data:`EMBEDDING_NAMES`), ``"norm"`` (any 1-D tensor) or
        ``"other"``.
    """
    if n_dims == 1:
        return "norm"
    if name in EMBEDDING_NAMES:
        return "embedding"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
        if parts[2] in PROJECTION_STEMS:
            return "projection"
        if parts[2] in EXPERT_STEMS and n_dims == 3:
            return "expert"
    return "other"


def _file_type(target: str) -> int:
    """``general.file_type`` of a file requantized to ``target`` (plain Q4_K files are
    llama.cpp's ``Q4_K_S``, the mix without the Q6_K layers)."""
    from gguf import LlamaFileType as FT

    return int({"F32": FT.ALL_F32, "F16": FT.MOSTLY_F16, "Q4_0": FT.MOSTLY_Q4_0,
                "Q4_1": FT.MOSTLY_Q4_1, "Q5_0": FT.MOSTLY_Q5_0, "Q8_0": FT.MOSTLY_Q8_0,
                "Q4_K": FT.MOSTLY_Q4_K_S, "Q4_K_M": FT.MOSTLY_Q4_K_M,
                "Q6_K": FT.MOSTLY_Q6_K}[target])


def _use_more_bits(layer: int, num_layers: int) -> bool:
    # llama.cpp's choice of the layers that get more bits in its _M mixes.
    return (layer < num_layers // 8 or layer >= 7 * num_layers // 8
            or (layer - num_layers // 8) % 3 == 2)


def q4_k_m_type(name: str, num_layers: int, has_output: bool) -> str:
    """The ggml type name the ``Q4_K_M`` mix gives matrix ``name`` (before the
    fallback for rows that are not whole super-blocks).

    Args:
        name: GGUF tensor name (``blk.{i}.attn_v.weight``, ``output.weight``, ...).
        num_layers: the model's decoder layers.
        has_output: whether the file stores an ``output.weight`` (else the output
            projection is the token embedding).
    """
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "Q6_K"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" \
            and (parts[2] == "attn_v" or parts[2].startswith("ffn_down")) \
            and _use_more_bits(int(parts[1]), num_layers):
        return "Q6_K"
    return "Q4_K"


def field_value(field) -> tuple[Any, Any, Any]:
    """``(value, value_type, element_type)`` of one ``gguf.ReaderField``, exactly as
    stored, in the form ``GGUFWriter.add_key_value`` writes back byte for byte.

    Strings are ``bytes`` (not decoded, so any byte sequence survives), numbers
    python ``int`` / ``float`` / ``bool`` of the stored width, arrays python lists with
    ``element_type`` their ``GGUFValueType`` (None for a scalar or string).

    Raises:
        ValueError: an empty array or an array of arrays (``GGUFWriter`` cannot
            write the first; ``GGUFReader`` flattens the second).
    """
    from gguf import GGUFValueType as VT

    vtype = field.types[0]
    if vtype == VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype != VT.ARRAY:
        return field.parts[field.data[0]][0].item(), vtype, None
    if len(field.types) != 2:
        kind = "an empty array" if len(field.types) == 1 else "an array of arrays"
        raise ValueError(f"GGUF field {field.name!r} is {kind}, which cannot be copied")
    etype = field.types[1]
    if etype == VT.STRING:
        return [bytes(field.parts[i]) for i in field.data], vtype, etype
    return [field.parts[i][0].item() for i in field.data], vtype, etype


def target_type(name: str, target: str, num_layers: int, has_output: bool,
                row_len: int) -> str:
    """The ggml type name requantizing matrix ``name`` to ``target`` gives it.

    ``Q4_K_M``: :func:`q4_k_m_type`. Other targets below 8 bits: Q6_K for the output
    matrix (``output.weight``, or ``token_embd.weight`` when the file has no output
    matrix), the target otherwise. Then a K-quant whose rows (``row_len`` weights)
    are not whole 256-weight super-blocks takes :data:`KQUANT_FALLBACK`'s type.
    """
    if target == "Q4_K_M":
        out = q4_k_m_type(name, num_layers, has_output)
    elif target in _LOW_BIT and (name == "output.weight"
                                 or (name == "token_embd.weight" and not has_output)):
        out = "Q6_K"
    else:
        out = target
    if out in KQUANT_FALLBACK and row_len % QT_K_BLOCK:
        out = KQUANT_FALLBACK[out]
    return out


def _plan(reader, target: str, keep_embedding: bool
          ) -> list[tuple[Any, str, Any, tuple[int, ...], int]]:
    """Per source tensor: ``(tensor, kind, out_type, numpy shape, out_nbytes)``.

    Raises:
        ValueError: a row length not a multiple of the target type's block size.
    """
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quant_shape_to_byte_shape

    names = {t.name for t in reader.tensors}
    num_layers = 1 + max((int(n.split(".")[1]) for n in names
                          if n.startswith("blk.") and n.split(".")[1].isdigit()), default=-1)
    plan = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))   # GGUF lists fastest dim first
        kind = tensor_kind(t.name, len(shape))
        if kind == "norm":
            out_type = QT.F32
        elif kind in ("projection", "expert") or (kind == "embedding" and not keep_embedding):
            out_type = QT[target_type(t.name, target, num_layers, "output.weight" in names,
                                      shape[-1])]
        else:
            out_type = t.tensor_type
        if out_type == t.tensor_type:
            nbytes = int(t.n_bytes)
        else:
            try:
                nbytes = int(np.prod(quant_shape_to_byte_shape(shape, out_type)))
            except ValueError as exc:
                raise ValueError(f"tensor {t.name!r} {list(shape)}: {exc}") from None
        plan.append((t, kind, out_type, shape, nbytes))
    return plan


def _converted(t, out_type, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``t``'s data in ``out_type``: as stored if the type is unchanged, else
    dequantized to float32 and quantized (``gguf.quants``, or :mod:`.kquants` for the
    K-quants)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize

    from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k

    if out_type == t.tensor_type:
        return np.ascontiguousarray(t.data)
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    kquant = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}.get(out_type)
    return np.ascontiguousarray(quantize(w, out_type) if kquant is None else kquant(w))


def requantize_gguf(src: str | os.PathLike | GGUFReader, dst: str | os.PathLike, qtype: str,
                    *, keep_embedding: bool = False) -> dict:
    """Write ``dst``: the GGUF file ``src`` with its matrices requantized to ``qtype``.

    See the module docstring for what is converted and what is copied. The output
    is written to a temporary file beside ``dst`` and renamed into place once
    complete, so ``dst`` never holds a partial file.

    Args:
        src: the source ``.gguf`` file: its path (``str`` or ``os.PathLike``), or a
            ``gguf.GGUFReader`` already open on it (opening one parses every metadata
            field, the tokenizer's vocabulary element by element: seconds). Its
            converted tensors may be of any type ``gguf.quants`` can dequantize.
        dst: path of the file to write (replaced if it exists); must differ from ``src``.
        qtype: the target, one of :data:`REQUANTIZE_TYPES` (a K-quant falls back per
            tensor as the module docstring says).
        keep_embedding: copy ``token_embd`` / ``output`` as stored instead of
            requantizing them.

    Returns:
        Statistics: ``{"qtype": str, "file_type": int, "tensors": int,
        "kinds": {kind: {"count": int, "bytes_before": int, "bytes_after": int,
        "types_before": [str], "types_after": [str]}}, "tensor_bytes_before": int,
        "tensor_bytes_after": int, "file_bytes_before": int, "file_bytes_after":
        int}``, kinds as :func:`tensor_kind` names them, bytes the tensors' data sizes
        (file sizes for ``file_bytes_*``).

    Raises:
        ValueError: ``qtype`` not one of :data:`REQUANTIZE_TYPES`; ``dst`` is ``src``;
            ``src`` has no ``general.architecture``, is of the other byte order, or
            has a metadata field that cannot be copied (:func:`field_value`); a
            converted tensor's row length is not a multiple of the target's block
            size; ``src`` is not a GGUF file.
        NotImplementedError: a converted tensor's type ``gguf.quants`` cannot
            dequantize.
        OSError: ``src`` cannot be read or ``dst`` written.
    """
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.constants import GGML_QUANT_VERSION, Keys

    if qtype not in REQUANTIZE_TYPES:
        raise ValueError(f"qtype: {qtype!r} is not one of {', '.join(REQUANTIZE_TYPES)}")
    reader = src if isinstance(src, GGUFReader) else GGUFReader(src)
    src_path = reader.data.filename     # the reader's np.memmap
    if reader.byte_order != "I":
        raise ValueError(f"{src_path}: a GGUF file of the other byte order than this "
                         f"machine's is not supported")
    if os.path.exists(dst) and os.path.samefile(src_path, dst):
        raise ValueError(f"dst: {dst!r} is the source file")
    arch_field = reader.fields.get(Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{src_path}: no {Keys.General.ARCHITECTURE} field")
    arch = arch_field.contents()
    plan = _plan(reader, qtype, keep_embedding)

    out_dir = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, arch)
        for key, field in reader.fields.items():
            if key in _HEADER_FIELDS or key == Keys.General.ARCHITECTURE:
                continue
            if key == Keys.General.FILE_TYPE:
                writer.add_key_value(key, _file_type(qtype), field.types[0])
                continue
            value, vtype, etype = field_value(field)
            writer.add_key_value(key, value, vtype, sub_type=etype)
        if Keys.General.FILE_TYPE not in reader.fields:
            writer.add_key_value(Keys.General.FILE_TYPE, _file_type(qtype), GGUFValueType.UINT32)
        if (Keys.General.QUANTIZATION_VERSION not in reader.fields
                and qtype not in ("F32", "F16")):
            writer.add_quantization_version(GGML_QUANT_VERSION)
        writer.data_alignment = int(reader.alignment)
        for t, _, out_type, shape, nbytes in plan:
            writer.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=out_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, _, out_type, shape, nbytes in plan:
            data = _converted(t, out_type, shape)
            if data.nbytes != nbytes:   # the plan and gguf.quants disagree: a bug, not a user error
                raise AssertionError(f"{t.name}: {data.nbytes} bytes written, {nbytes} planned")
            writer.write_tensor_data(data)
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)       # mkstemp's file is 0600: a file as open() makes
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

    kinds: dict[str, dict] = {}
    for t, kind, out_type, _, nbytes in plan:
        k = kinds.setdefault(kind, {"count": 0, "bytes_before": 0, "bytes_after": 0,
                                    "types_before": set(), "types_after": set()})
        k["count"] += 1
        k["bytes_before"] += int(t.n_bytes)
        k["bytes_after"] += nbytes
        k["types_before"].add(t.tensor_type.name)
        k["types_after"].add(QT(out_type).name)
    for k in kinds.values():
        k["types_before"], k["types_after"] = sorted(k["types_before"]), sorted(k["types_after"])
    return {
        "qtype": qtype,
        "file_type": _file_type(qtype),
        "tensors": len(plan),
        "kinds": kinds,
        "tensor_bytes_before": sum(k["bytes_before"] for k in kinds.values()),
        "tensor_bytes_after": sum(k["bytes_after"] for k in kinds.values()),
        "file_bytes_before": os.path.getsize(src_path),
        "file_bytes_after": os.path.getsize(dst),
    }
