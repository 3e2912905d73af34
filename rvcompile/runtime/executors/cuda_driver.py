"""The CUDA driver API as the H100 runtime uses it: cuda-python's `cuda.bindings.driver` and
numpy only (no torch, no NVRTC). Every call's CUresult is checked; a failure raises CudaError
naming the call. Kernel arguments are packed by hand into a void** array.

Every kernel is launched (cuLaunchKernelEx) with programmatic stream serialization: it may start
while the kernel before it in the stream is still running, and stream capture records that as a
programmatic graph edge. That is safe only because every kernel of the h100 target begins with
griddepcontrol.wait (kernels/common.cuh pdl_wait), which blocks until its predecessor has
completed and flushed its writes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from rvcompile.runtime.executor_api import DeviceError


class CudaError(DeviceError):
    """A CUDA driver call that failed; the message names the call and the error. A DeviceError:
    in a step, after the executor checked its arguments, a failed launch or copy leaves the
    context unusable (most launch errors are sticky)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # cuda-python is the H100 runtime's one dependency beyond numpy
        raise CudaError("cuda-python is not installed (pip install 'rvcompile[h100]')") from e
    return driver


def check(result, call: str):
    """Unpack a cuda-python return tuple, raising on any error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        drv = _driver()
        _, name = drv.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if name else int(err)}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def pack_args(args: list[ctypes._SimpleCData]):
    """(void* array of the args' addresses, the args): what cuLaunchKernel's kernelParams takes;
    keep the pair alive while it may be launched."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args]), args


@dataclass
class DeviceBuffer:
    ptr: int
    nbytes: int


class CudaContext:
    """The primary context of one device, with module loading, memory and launches."""

    def __init__(self, ordinal: int = 0):
        self.cu = cu = _driver()
        try:
            initialized = cu.cuInit(0)
        except RuntimeError as e:  # cuda-python raises when it finds no libcuda (no driver)
            raise CudaError(f"cuInit failed: {e}") from None
        check(initialized, "cuInit")
        self.device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        self.compute_capability = (
            check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                          self.device), "cuDeviceGetAttribute"),
            check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                          self.device), "cuDeviceGetAttribute"))
        self.sm_count = check(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device), "cuDeviceGetAttribute")

    def make_current(self) -> None:
        """Bind this context to the calling thread (each thread that calls the driver must)."""
        check(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def load_function(self, cubin: bytes, name: str):
        return self.get_function(self.load_module(cubin), name)

    def load_module(self, cubin: bytes):
        return check(self.cu.cuModuleLoadData(cubin), "cuModuleLoadData")

    def unload_module(self, module) -> None:
        check(self.cu.cuModuleUnload(module), "cuModuleUnload")

    def get_function(self, module, name: str):
        return check(self.cu.cuModuleGetFunction(module, name.encode()),
                     f"cuModuleGetFunction({name})")

    def driver_version(self) -> int:
        """e.g. 13000 for a driver that supports CUDA 13.0."""
        return int(check(self.cu.cuDriverGetVersion(), "cuDriverGetVersion"))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device bytes."""
        free, total = check(self.cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def device_name(self) -> str:
        name = check(self.cu.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        return name.split(b"\0", 1)[0].decode()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a uint8 array (freed with free_pinned)."""
        ptr = int(check(self.cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def free_pinned(self, host: np.ndarray) -> None:
        check(self.cu.cuMemFreeHost(host.ctypes.data), "cuMemFreeHost")

    def copy_to_device(self, dst: int, host: np.ndarray, stream=0) -> None:
        """Async when `host` is pinned."""
        check(self.cu.cuMemcpyHtoDAsync(dst, host.ctypes.data, host.nbytes, stream),
              "cuMemcpyHtoDAsync")

    def copy_to_host(self, host: np.ndarray, src: int, stream=0) -> None:
        check(self.cu.cuMemcpyDtoHAsync(host.ctypes.data, src, host.nbytes, stream),
              "cuMemcpyDtoHAsync")

    def memset_range(self, ptr: int, nbytes: int, stream=0) -> None:
        check(self.cu.cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")

    def stream_synchronize(self, stream) -> None:
        check(self.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event_synchronize(self, ev) -> None:
        check(self.cu.cuEventSynchronize(ev), "cuEventSynchronize")

    def set_max_dynamic_smem(self, fn, nbytes: int) -> None:
        attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(self.cu.cuFuncSetAttribute(fn, attr, nbytes), "cuFuncSetAttribute")

    def alloc(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(int(check(self.cu.cuMemAlloc(nbytes), "cuMemAlloc")), nbytes)

    def free(self, buf: DeviceBuffer) -> None:
        check(self.cu.cuMemFree(buf.ptr), "cuMemFree")

    def upload(self, host: np.ndarray) -> DeviceBuffer:
        host = np.ascontiguousarray(host)
        buf = self.alloc(host.nbytes)
        check(self.cu.cuMemcpyHtoD(buf.ptr, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")
        return buf

    def download(self, buf: DeviceBuffer, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype)
        check(self.cu.cuMemcpyDtoH(out.ctypes.data, buf.ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def memset(self, buf: DeviceBuffer, byte: int) -> None:
        check(self.cu.cuMemsetD8(buf.ptr, byte, buf.nbytes), "cuMemsetD8")

    def launch(self, fn, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
               args: list[ctypes._SimpleCData], stream=0) -> None:
        """`args` are ctypes values in kernel-parameter order (c_uint64 for pointers)."""
        self.launch_configured(fn, self.launch_config(grid, block, smem, stream), pack_args(args))

    def launch_config(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                      stream=0):
        """The CUlaunchConfig of one launch on `stream`, programmatic stream serialization on."""
        cu = self.cu
        serialization = cu.CUlaunchAttribute()
        ids = cu.CUlaunchAttributeID
        serialization.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        serialization.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = smem
        config.hStream = stream
        config.attrs = [serialization]
        config.numAttrs = 1
        return config

    def launch_configured(self, fn, config, packed) -> None:
        """`config`: launch_config's result; `packed`: pack_args' result. Both may be built once
        and reused; the caller keeps `packed` alive while it may be launched."""
        check(self.cu.cuLaunchKernelEx(config, fn, ctypes.addressof(packed[0]), 0),
              "cuLaunchKernelEx")

    def synchronize(self) -> None:
        check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def event(self):
        return check(self.cu.cuEventCreate(0), "cuEventCreate")

    def record(self, ev, stream=0) -> None:
        check(self.cu.cuEventRecord(ev, stream), "cuEventRecord")

    def stream(self, non_blocking: bool = False):
        """A new stream; `non_blocking`: one that never waits on the legacy default stream (so
        its copies may run while another thread captures a graph)."""
        flags = int(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING) if non_blocking else 0
        return check(self.cu.cuStreamCreate(flags), "cuStreamCreate")

    def destroy_stream(self, stream) -> None:
        check(self.cu.cuStreamDestroy(stream), "cuStreamDestroy")

    def destroy_event(self, ev) -> None:
        check(self.cu.cuEventDestroy(ev), "cuEventDestroy")

    def event_without_timing(self):
        """An event for ordering only (cheaper to record and wait on)."""
        flags = int(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return check(self.cu.cuEventCreate(flags), "cuEventCreate")

    def copy_device(self, dst: int, src: int, nbytes: int, stream=0) -> None:
        check(self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def capture(self, stream, record, *, thread_local: bool = False) -> object:
        """Run `record()` (launches on `stream`) under stream capture; returns the instantiated
        CUDA graph. `thread_local`: only this thread's calls are checked against the capture, so
        other threads may go on copying on their own non-blocking streams meanwhile."""
        modes = self.cu.CUstreamCaptureMode
        mode = (modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL if thread_local
                else modes.CU_STREAM_CAPTURE_MODE_GLOBAL)
        check(self.cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        record()
        graph = check(self.cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        return check(self.cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def destroy_graph(self, graph_exec) -> None:
        check(self.cu.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")

    def graph_upload(self, graph_exec, stream) -> None:
        """Put an instantiated graph's work on the device ahead of its first launch (runs
        nothing)."""
        check(self.cu.cuGraphUpload(graph_exec, stream), "cuGraphUpload")

    def graph_launch(self, graph_exec, stream) -> None:
        check(self.cu.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")

    def elapsed_ms(self, start, end) -> float:
        check(self.cu.cuEventSynchronize(end), "cuEventSynchronize")
        return float(check(self.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))
