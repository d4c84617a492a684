"""Weight quantization: producing quantized checkpoints and serving them.

- :mod:`~tandem.engine.quantization.rtn`: round-to-nearest asymmetric int quantization
  in groups along the input dimension;
- :mod:`~tandem.engine.quantization.gptq`: GPTQ (Frantar et al. 2022), the same format
  with second-order error feedback from calibration activations;
- :mod:`~tandem.engine.quantization.packing`: the AutoGPTQ checkpoint layout
  (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and exact (un)packing;
- :mod:`~tandem.engine.quantization.quantize`: ``tandem quantize``: the layer-by-layer
  calibration pass over a model and the checkpoint writer;
- :mod:`~tandem.engine.quantization.gptq_linear`: the ``gptq`` linear method that
  serves such checkpoints, and :mod:`~tandem.engine.quantization.checkpoint`, which
  picks it from a checkpoint's ``quantization_config``.

Importing this package registers the ``gptq`` linear method in
:data:`~tandem.engine.model.linear.LINEAR_METHODS` (re-exported here).
"""

from tandem.engine.model.linear import LINEAR_METHODS
from tandem.engine.quantization.gptq_linear import GPTQLinearMethod

__all__ = ["GPTQLinearMethod", "LINEAR_METHODS"]
