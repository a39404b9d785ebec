"""dsv4 from Python: the DeepSeek V4 attention layer's engine, its plan, config and weight
loading, and operations on numpy arrays and torch tensors (docs/python.md).

    import dsv4
    config = dsv4.Config.preset("tiny-v4.1")
    engine = dsv4.Engine(config, dsv4.Weights.random(config), max_sequences=8, max_context=4096)
"""

from . import errors
from ._dsv4 import C_API_VERSION
from ._dsv4 import has_cuda as _has_cuda
from ._dsv4 import version as _version
from .core import Config, Engine, LayerPlan, Plan, Weights, plan, preset_names
from .errors import (BadHandleError, DeviceError, DTypeError, Error, InternalError, InvalidArgumentError,
                     LayoutError, LoadError, PoolExhaustedError, ShapeError, UnsupportedError)
from . import ops

try:  # torch.ops.dsv4.* when torch is installed
    import torch as _torch  # noqa: F401
except ImportError:
    _torch = None
if _torch is not None:
    from . import torch_ops  # noqa: F401  (registers torch.ops.dsv4)

__version__ = _version()
has_cuda = _has_cuda()

__all__ = ["Config", "Engine", "LayerPlan", "Plan", "Weights", "plan", "preset_names", "ops", "errors", "Error",
           "InvalidArgumentError", "BadHandleError", "ShapeError", "DTypeError", "DeviceError", "LayoutError",
           "PoolExhaustedError", "LoadError", "UnsupportedError", "InternalError", "has_cuda", "C_API_VERSION"]
