"""The linear-method registry: ``EngineConfig.quantization`` -> method factory.

Kept apart from :mod:`tandem.engine.model.linear` (the interface and the dense
method) because the factories import the quantized methods, which build on that
module: the interface imports none of them, so there is no import cycle.
"""

from __future__ import annotations

from typing import Callable

from tandem.engine.model.linear import LinearMethodBase, UnquantizedLinearMethod


def _gguf_method() -> LinearMethodBase:
    from tandem.engine.quantization.gguf_linear import GGUFLinearMethod
    return GGUFLinearMethod()


def _gptq_method() -> LinearMethodBase:
    from tandem.engine.quantization.gptq_linear import GPTQLinearMethod
    return GPTQLinearMethod()


def _awq_method() -> LinearMethodBase:
    from tandem.engine.quantization.awq_linear import AWQLinearMethod
    return AWQLinearMethod()


# Config string -> factory of the method. A quantized format's module is imported by
# its factory, so choosing ``none`` never loads one.
LINEAR_METHODS: dict[str, Callable[[], LinearMethodBase]] = {
    "none": UnquantizedLinearMethod,
    "gguf": _gguf_method,
    "gptq": _gptq_method,
    "awq": _awq_method,
}


def get_linear_method(name: str) -> LinearMethodBase:
    """The linear method for a ``quantization`` config string.

    Raises:
        ValueError: unknown name (the message names the field and the known names).
    """
    try:
        factory = LINEAR_METHODS[name]
    except KeyError:
        raise ValueError(f"quantization: unknown {name!r}, "
                         f"expected one of {', '.join(LINEAR_METHODS)}") from None
    return factory()
