"""A DLPack capsule over host memory built with ctypes, so the binding's C++ argument checks run without torch."""
import ctypes
import math

DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT = 0, 1, 2, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class HostCapsule:
    """Owns 64-byte aligned host memory and a DLManagedTensor; .capsule is a 'dltensor' capsule without a
    destructor (the object keeps the memory alive)."""

    def __init__(self, shape, code, bits):
        nbytes = max(1, math.prod(shape) * bits // 8)
        self.buf = (ctypes.c_uint8 * (nbytes + 64))()
        base = ctypes.addressof(self.buf)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = ctypes.c_void_p(base + (-base) % 64)
        t.device = _DLDevice(1, 0)  # kDLCPU
        t.ndim = len(shape)
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = self.shape
        t.strides = None
        t.byte_offset = 0
        self.capsule = _PyCapsule_New(ctypes.addressof(self.managed), b"dltensor", None)
