"""numpy arrays and torch tensors as DLPack capsules for the extension module, and outputs
allocated like the inputs (numpy in, numpy out; torch in, torch out on the same device)."""

import numpy as np


def is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def capsule(x):
    """A DLPack capsule borrowing x's memory (None stays None). torch tensors go through
    torch.utils.dlpack.to_dlpack, which neither copies nor synchronizes a stream."""
    if x is None:
        return None
    if is_torch(x):
        from torch.utils import dlpack
        return dlpack.to_dlpack(x)
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:  # numpy cannot export read-only arrays through DLPack
            x = x.copy()
        return x.__dlpack__()
    if hasattr(x, "__dlpack__"):
        return x.__dlpack__()
    raise TypeError(f"dsv4: expected a numpy array or a torch tensor, got {type(x).__name__}")


def stream_of(x):
    """The stream a call on x is queued on: torch's current stream of x's CUDA device (as an
    integer cudaStream_t), 0 for everything on the CPU."""
    if is_torch(x) and x.device.type == "cuda":
        import torch
        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def on_cuda(x):
    return is_torch(x) and x.device.type == "cuda"


def contiguous(x):
    """x as a compact row-major array or tensor (no copy when it already is one); lists become
    numpy arrays."""
    if x is None:
        return None
    if is_torch(x):
        return x.contiguous()
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(np.asarray(x))


_TORCH_DTYPES = {}


def _torch_dtype(np_dtype):
    import torch
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
                              np.dtype(np.int64): torch.int64, np.dtype(np.uint8): torch.uint8})
    return _TORCH_DTYPES[np.dtype(np_dtype)]


def empty_like(like, shape, dtype):
    """An uninitialized output of `shape` and numpy dtype `dtype`, of like's kind and device."""
    if is_torch(like):
        import torch
        return torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device=like.device)
    return np.empty(tuple(shape), dtype=dtype)


def as_index(x, like, dtype):
    """x (an array, a tensor, a list or None) as a contiguous index array of `dtype` beside `like`."""
    if x is None:
        return None
    if is_torch(like) and not is_torch(x):
        import torch
        return torch.as_tensor(np.asarray(x, dtype=dtype), device=like.device)
    if is_torch(x):
        return x.to(_torch_dtype(dtype)).contiguous()
    return np.ascontiguousarray(np.asarray(x, dtype=dtype))
