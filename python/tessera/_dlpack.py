"""DLPack hand-off between Python tensors and tessera._C (internal).

Rules, kept deliberately simple:

* torch.Tensor (checked first): used as is. ``to_capsule`` calls ``torch.utils.dlpack.to_dlpack`` on it (on a
  detached alias if it requires grad); that does no stream synchronization, which is right because tessera runs
  on the caller's current stream.
* Any other object with ``__dlpack__``: turned into a torch.Tensor once, zero-copy, with ``torch.from_dlpack``
  (which follows the DLPack stream protocol for the producer). Everything downstream then works on torch tensors.
* fp8 tensors (torch.float8_e4m3fn / float8_e5m2) travel as ``torch.uint8`` views. tessera's C++ ``from_dlpack``
  only knows the DLPack fp8 codes when built against a DLPack >= 1.0 header, so the binding re-labels the uint8
  view (see python/src/bindings.cpp): permute's fp8 outputs and the fp8 inputs of the grouped GEMM.

The capsule is never consumed by tessera: the caller keeps the tensor alive across the (synchronous launch) call,
and the capsule's own deleter releases its reference when the capsule is collected.

torch is imported here when it is installed; without it tessera still imports (tessera.dlpack needs no torch).
"""

__all__ = ["FALLBACK", "torch_module", "torch_ops", "fast_entry", "as_tensor", "as_optional_tensor",
           "to_capsule", "cuda_device", "cuda_device_of", "launch", "stream_arg"]


try:
    import torch as _torch  # optional: only the torch layer needs it
except ImportError:  # pragma: no cover - depends on the environment
    _torch = None


def torch_module():
    """torch (ImportError with a clear message when it is missing). A plain global read, so that torch.compile
    traces through it."""
    if _torch is None:
        raise ImportError("tessera's torch layer needs PyTorch (pip install torch); without it, use tessera.dlpack")
    return _torch


_Tensor = _torch.Tensor if _torch is not None else None
# Every fp8 dtype this torch has (the torch layer's dtype checks), and the one tessera computes with.
FP8_DTYPES = () if _torch is None else tuple(
    getattr(_torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(_torch, n))
E4M3 = getattr(_torch, "float8_e4m3fn", None)


def as_tensor(obj, op, arg):
    """obj as a torch.Tensor: torch tensors as is, other DLPack producers through torch.from_dlpack."""
    if _Tensor is not None and isinstance(obj, _Tensor):  # the common case first: this runs on every call
        return obj
    torch = torch_module()
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(
            f"{op}: '{arg}' must be a torch.Tensor or an object with __dlpack__, got {type(obj).__name__}")
    return torch.from_dlpack(obj)


def as_optional_tensor(obj, op, arg):
    if obj is None or (_Tensor is not None and isinstance(obj, _Tensor)):
        return obj
    return as_tensor(obj, op, arg)


_to_dlpack = None


def to_capsule(tensor):
    """A legacy ("dltensor") DLPack capsule aliasing a torch tensor; None stays None."""
    global _to_dlpack
    if tensor is None:
        return None
    if _to_dlpack is None:
        torch = torch_module()
        import torch.utils.dlpack

        _to_dlpack = torch.utils.dlpack.to_dlpack
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype in FP8_DTYPES:
        t = t.view(_torch.uint8)
    return _to_dlpack(t)


def cuda_device(device=None):
    """The torch.device a .cuda(device) call means: None the current CUDA device, an int that CUDA index, anything
    else (torch.device or str) as given."""
    torch = torch_module()
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    return device


def cuda_device_of(tensor, op, arg):
    """The tensor's torch.device; ValueError naming the argument when it is not a CUDA tensor. A meta tensor passes
    (shapes only: the op's fake implementation runs for it, as the eager entries route it)."""
    if not (tensor.is_cuda or tensor.is_meta):
        raise ValueError(f"{op}: '{arg}' must be a CUDA tensor, got a tensor on device '{tensor.device}'")
    return tensor.device


_ops = None
_eager = None
_ops_error = "tessera's PyTorch operators are not registered (torch is not installed)"


def bind_ops(module):
    """Called once by tessera/__init__.py with tessera._torch_ops (schemas registered, kernels loaded or not)."""
    global _ops, _eager, _ops_error
    if module.available():
        _ops = module.ops
        _eager = module.eager
    else:
        _ops_error = module.load_error


def torch_ops():
    """The kernels to call: torch.ops.tessera under torch.compile (traced as custom operators), else the same C++
    functions bound directly (tessera._torch_C), which skip the dispatcher's host cost. RuntimeError with the
    reason when they are not built."""
    if _ops is None:
        torch_module()
        raise RuntimeError(_ops_error)
    # Traced code, and any active dispatch mode (FakeTensorMode, a TorchDispatchMode), must see the operator.
    if _torch.compiler.is_compiling() or _torch._C._len_torch_dispatch_stack():
        return _ops
    return _eager


# pybind11's TypeError for arguments it cannot convert (nothing ran); the eager entries raise it too for symbolic
# sizes. Only that TypeError sends a call to the checked path: any other (say, from a dispatch mode's handler the
# call already reached) propagates, so an op never runs twice.
FALLBACK = "incompatible function arguments"


def fast_entry(stream):
    """tessera._torch_C where an op's eager fast path applies, else None (stream= given, under torch.compile, the
    operators not built). The fast path is one crossing into C++ (its <op>_eager entry) that checks, allocates the
    outputs and launches; on its TypeError for an argument it cannot convert (pybind11's phrase, FALLBACK: nothing
    ran; python/src/fastcall.h) the caller takes its checked path. The entries route fake, meta and subclass tensors, and calls under a dispatch mode, to
    torch.ops.tessera themselves. Every op calls it inline (no helper frame, *args tuple or getattr: ~0.3 us a call):

        entry = fast_entry(stream)
        if entry is not None:
            try:
                return entry.<op>_eager(...)
            except TypeError as e:
                if FALLBACK not in str(e):
                    raise
        return _<op>_checked(...)   # a module-level function: a closure here would cost its cells on every call
    """
    if stream is not None or _eager is None or _torch.compiler.is_compiling():
        return None
    return _eager


def stream_arg(op, stream, device):
    """The stream= argument for an op on `device` (a torch.device), checked: None, a torch.cuda.Stream
    (ExternalStream too) or a CUDA torch.Stream of that device, or a raw cudaStream_t int on it (0: the device's
    legacy default stream)."""
    if stream is None:
        return None
    torch = torch_module()
    if not isinstance(stream, torch.cuda.Stream) and isinstance(stream, getattr(torch, "Stream", ())) and \
            getattr(stream, "device_type", None) == 1:
        # A generic torch.Stream of CUDA (torch.accelerator.current_stream() gives one): the same stream as a
        # torch.cuda.Stream (its stream_id is torch's id of the stream, not the cudaStream_t).
        stream = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                   device_type=stream.device_type)
    if isinstance(stream, torch.cuda.Stream):
        if stream.device != device:
            raise ValueError(f"{op}: 'stream' must be a stream of the tensors' device {device}, got one of "
                             f"{stream.device}")
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream == 0:  # torch would read 0 as "no stream"; DLPack and CUDA mean the legacy default stream
            return torch.cuda.default_stream(device)
        return torch.cuda.ExternalStream(stream, device=device)
    raise TypeError(f"{op}: 'stream' must be None, a torch.cuda.Stream (or a CUDA torch.Stream) or a cudaStream_t "
                    f"as an int, got {type(stream).__name__}")


def launch(stream, fn):
    """fn() on the caller's current stream (stream None), or with `stream` made current around it, so that the
    outputs fn allocates and the op's launch both belong to that stream."""
    if stream is None:
        return fn()
    with torch_module().cuda.stream(stream):
        return fn()
