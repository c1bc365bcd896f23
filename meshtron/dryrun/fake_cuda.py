"""The CUDA runtime a dry run on fake CUDA devices answers itself (``MESHTRON_DEVICE=cuda python -m
meshtron.train --dry-run N`` with a CUDA build of torch, no GPU needed).

Fake tensors on ``cuda:i`` need no driver; the runtime the step calls around them does, on three levels,
each answered here: Python's ``torch.cuda`` functions (stand-ins inside :func:`fake_cuda`), torch's C++
device guard (:data:`_GUARD`) and the driver queries made before any Python runs (a preloaded library,
:func:`driver_environment`). See docs/planner.md#on-fake-cuda-devices.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from meshtron.torch_private import PIN_MEMORY, TorchDispatchMode
from meshtron.watch.syncs import not_a_caller, record

not_a_caller(__file__)  # it waits on behalf of the code it traces or checks


def cuda_build() -> bool:
    """Whether this torch was built with CUDA (it can then make fake CUDA tensors without a GPU)."""
    return torch.version.cuda is not None


def refusal() -> str:
    """The one line a CPU build of torch answers a CUDA dry run with."""
    return (
        f"a dry run on CUDA (MESHTRON_DEVICE=cuda) needs a CUDA build of torch, this one is {torch.__version__}: "
        "make a separate environment with one (python3 -m venv /work/venv-cuda && /work/venv-cuda/bin/pip install "
        "torch==2.14.1; benchmarks/cuda_dry_run.sh does it) and run the dry run with its python"
    )


# Where the two native parts are built, once per torch version.
CACHE = Path(os.environ.get("MESHTRON_CACHE", Path.home() / ".cache" / "meshtron")) / f"fake_cuda-{torch.__version__}"

# The CUDA runtime calls answered before Python runs or below it: how many devices (torch's accelerator
# detection), whether one has a context (none; autograd asks), the current device and its properties
# (SDPA's kernel choice reads the compute capability): an H100 SXM's, the device the planner's
# figures assume (meshtron.plan.speed.Hardware).
_DRIVER = """
#include <string.h>
#include <driver_types.h>

int meshtron_device = 0;  /* set by meshtron.dryrun.fake_cuda.fake_cuda */

cudaError_t cudaGetDeviceCount(int *count) { *count = %d; return cudaSuccess; }
cudaError_t cudaGetDevice(int *device) { *device = meshtron_device; return cudaSuccess; }
int cuDevicePrimaryCtxGetState(int device, unsigned int *flags, int *active) { *flags = 0; *active = 0; return 0; }

cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp *prop, int device) {
  memset(prop, 0, sizeof(*prop));
  strcpy(prop->name, "NVIDIA H100 80GB HBM3 (meshtron dry run)");
  prop->totalGlobalMem = 85520809984ULL;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerBlock = 49152;
  prop->sharedMemPerBlockOptin = 232448;
  prop->sharedMemPerMultiprocessor = 233472;
  prop->regsPerBlock = 65536;
  prop->l2CacheSize = 52428800;
  prop->memoryBusWidth = 5120;
  prop->pciDeviceID = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  return cudaGetDeviceProperties_v2(prop, device);
}
"""

_HOST_DEFINES = """
#define __device_builtin__
#define __builtin_align__(a) __attribute__((aligned(a)))
#define __cudart_builtin__
#define __host__
#define __device__
#define CUDARTAPI
#define __dv(v)
#define __inline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __location__(a)
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
"""

# torch's device guard for CUDA over fake devices: the current device per thread, one stream per device,
# events always complete (nothing runs on a fake device).
_GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
using namespace c10;
using namespace c10::impl;

struct FakeCudaGuard final : public DeviceGuardImplInterface {
  DeviceIndex count = 1;
  static thread_local DeviceIndex current;
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override { Device old = getDevice(); setDevice(d); return old; }
  Device getDevice() const override { return Device(DeviceType::CUDA, current); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.index() >= 0 && d.index() < count, "invalid device ordinal ", int(d.index()),
                " (the dry run's node has ", int(count), " devices)");
    current = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override { current = d.index(); }
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getNewStream(Device d, int) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override { return s; }
  DeviceIndex deviceCount() const noexcept override { return count; }
  void record(void**, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const DataPtr&, const Stream&) const override {}
};
thread_local DeviceIndex FakeCudaGuard::current = 0;

static FakeCudaGuard fake;
static const DeviceGuardImplInterface* original = nullptr;

void install(int64_t devices, int64_t index) {
  fake.count = devices;
  FakeCudaGuard::current = index;
  if (original == nullptr) original = getDeviceGuardImpl(DeviceType::CUDA);
  DeviceGuardImplRegistrar(DeviceType::CUDA, &fake);
}

void restore() {
  if (original != nullptr) DeviceGuardImplRegistrar(DeviceType::CUDA, original);
  original = nullptr;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("restore", &restore);
}
"""


def driver_environment(devices: int) -> dict[str, str]:
    """Environment variables a rank process of a CUDA dry run starts with: the driver library that
    answers ``devices`` devices, preloaded (built on first use with the system's C compiler)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    library = CACHE / f"driver{devices}" / "libcuda.so.1"
    if not library.exists():
        library.parent.mkdir(exist_ok=True)
        source = library.parent / "driver.c"
        source.write_text(_DRIVER % devices)
        # cudaDeviceProp's layout from the toolkit's header shipped with torch; the compiler macros it
        # expects from nvcc's headers (not shipped) defined empty.
        headers = next(Path(torch.__file__).parent.parent.glob("nvidia/*/include/driver_types.h")).parent
        (library.parent / "crt").mkdir(exist_ok=True)
        (library.parent / "crt" / "host_defines.h").write_text(_HOST_DEFINES)
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-I", str(library.parent), "-I", str(headers), "-o", str(library), str(source)],
            check=True,
        )
    preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
    return {
        "LD_PRELOAD": preload,
        "LD_LIBRARY_PATH": ":".join(filter(None, [str(library.parent), os.environ.get("LD_LIBRARY_PATH")])),
    }


def _set_driver_device(index: int) -> None:
    """The current device the preloaded runtime reports (torch's C++ asks it for SDPA's choice)."""
    import ctypes

    ctypes.c_int.in_dll(ctypes.CDLL(None), "meshtron_device").value = index


@functools.cache
def guard():
    """The fake device guard's extension, compiled on first use and cached (docs/planner.md)."""
    from torch.utils.cpp_extension import load_inline

    directory = CACHE / "guard"
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline("meshtron_fake_cuda_guard", cpp_sources=[_GUARD], build_directory=str(directory))


class FakeEvent:
    """A CUDA event that is always complete: nothing runs on a fake device."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ):
        self.enable_timing = enable_timing

    def record(self, stream: FakeStream | None = None) -> None:
        pass

    def wait(self, stream: FakeStream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        record("Event.synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """A CUDA stream of one fake device: waits between streams order nothing (no kernel runs)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cuda", _runtime.index(device))
        self.priority = priority

    def wait_stream(self, stream: FakeStream) -> None:
        pass

    def wait_event(self, event: FakeEvent) -> None:
        pass

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        return event or FakeEvent()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        record("Stream.synchronize")

    def __enter__(self) -> FakeStream:
        self._previous = _runtime.set_stream(self)
        return self

    def __exit__(self, *exc) -> None:
        _runtime.set_stream(self._previous)


class _Runtime:
    """The fake devices' state: how many there are, the current one, each one's default and current stream."""

    def __init__(self):
        self.count, self.current = 1, 0
        self.defaults: dict[int, FakeStream] = {}
        self.streams: dict[int, FakeStream] = {}

    def default_stream(self, device=None) -> FakeStream:
        index = self.index(device)
        if index not in self.defaults:
            self.defaults[index] = FakeStream(index)
        return self.defaults[index]

    def current_stream(self, device=None) -> FakeStream:
        index = self.index(device)
        return self.streams.get(index) or self.default_stream(index)

    def index(self, device) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        index = torch.device(device).index
        return self.current if index is None else index

    def set_device(self, device) -> None:
        index = self.index(device)
        if not 0 <= index < self.count:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal {index} (the dry run's node has {self.count} devices)"
            )
        self.current = index

    def set_stream(self, stream: FakeStream | None) -> FakeStream:
        previous = self.current_stream()
        if stream is not None:
            self.streams[stream.device.index] = stream
        return previous

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[FakeStream | None]:
        if stream is None:
            yield None
            return
        with stream:
            yield stream


_runtime = _Runtime()


def _memory_statistic(device=None) -> int:
    """Bytes the caching allocator reports: none, the fake tensors have no storage (the dry run's memory
    tracker measures what they would hold)."""
    return 0


# What torch.cuda.get_device_properties answers for each fake device: the preloaded driver's H100 (_DRIVER).
_H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (meshtron dry run)",
    major=9,
    minor=0,
    total_memory=85520809984,
    multi_processor_count=132,
    warp_size=32,
    L2_cache_size=52428800,
    is_integrated=False,
    is_multi_gpu_board=False,
)


def _stand_ins() -> dict[str, object]:
    """``torch.cuda`` attribute -> what answers it in a dry run."""
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: _runtime.count,
        "current_device": lambda: _runtime.current,
        # An H100's, as the preloaded driver answers C++ (c10d's broadcast asks it from Python; torch's Triton
        # check, which transformers' import of torchao runs, asks for the properties).
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": lambda device=None: _H100,
        "set_device": _runtime.set_device,
        "Stream": FakeStream,
        "Event": FakeEvent,
        "current_stream": _runtime.current_stream,
        "default_stream": _runtime.default_stream,
        "set_stream": _runtime.set_stream,
        "stream": _runtime.stream,
        "synchronize": lambda device=None: record("torch.cuda.synchronize"),
        "memory_allocated": _memory_statistic,
        "max_memory_allocated": _memory_statistic,
        "memory_reserved": _memory_statistic,
        "max_memory_reserved": _memory_statistic,
        "reset_peak_memory_stats": lambda device=None: None,
        # Seeding: torch.manual_seed seeds every CUDA generator, of which a driverless torch has none
        # (fake tensors draw no random numbers).
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }


@contextlib.contextmanager
def fake_cuda(devices: int, local_rank: int) -> Iterator[None]:
    """Within: ``torch.cuda``'s runtime calls answered for a node of ``devices`` fake GPUs whose current
    one is ``local_rank``; torch's own functions restored after."""
    if not cuda_build():
        raise RuntimeError(refusal())
    stand_ins = _stand_ins()
    originals = {name: getattr(torch.cuda, name) for name in stand_ins}
    saved = vars(_runtime).copy()
    _runtime.__init__()
    _runtime.count = devices
    for name, value in stand_ins.items():
        setattr(torch.cuda, name, value)
    guard().install(devices, local_rank)
    _set_driver_device(local_rank)
    try:
        torch.cuda.set_device(local_rank)
        yield
    finally:
        guard().restore()
        for name, value in originals.items():
            setattr(torch.cuda, name, value)
        vars(_runtime).update(saved)


class _FakeFactories(TorchDispatchMode):
    """Without a driver no real CUDA tensor can exist: an op outside the fake mode that would make one
    (FSDP2's empty buffers, made when it wraps the meta model) makes a fake one instead. Pinning host
    memory (FSDP2's ``CPUOffloadPolicy`` pins each offloaded shard) is answered with a copy of the same
    bytes: fake tensors have no memory to pin (the fake mode raises "NYI: aten._pin_memory")."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is PIN_MEMORY:
            return args[0].clone()
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            with self.fake_mode:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def fake_factories(fake_mode) -> TorchDispatchMode:
    """Within: tensors created on CUDA devices outside ``fake_mode`` are made in it."""
    return _FakeFactories(fake_mode)


__all__ = [
    "FakeEvent",
    "FakeStream",
    "cuda_build",
    "driver_environment",
    "fake_cuda",
    "fake_factories",
    "guard",
    "refusal",
]
