"""Host memory the GPU reads in place: ``cudaHostRegister`` (mapped) over a replay segment.

A table's storage is one POSIX shared-memory segment (``SharedStorage``),
mapped by every process that uses it. Registering that mapping with
``cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable)``
pins its pages and maps them into the device address space: kernels then read
rows straight out of the segment over PCIe / NVLink-C2C (zero-copy), with no
staging buffer and no ``cudaMemcpy``. ``Portable`` makes the registration
valid in every CUDA context of the process, not only the current device's.

Page rules, checked here (``ValueError`` naming the argument):

* the address must be page-aligned (``mmap.PAGESIZE``) and ``nbytes`` a
  positive multiple of the page size. CUDA pins whole pages: an unaligned
  range would silently pin (and map) the neighbouring bytes of its first and
  last page too, and a later registration of a range that shares one of those
  pages fails with ``cudaErrorHostMemoryAlreadyRegistered``. A whole mmap of a
  segment is page-aligned by construction, and ``SharedStorage`` sizes are
  multiples of 4096 (every block 4 KiB aligned), so :func:`register_storage`
  always passes.
* the range must stay mapped until :meth:`HostRegistration.close`: unmapping
  registered memory first is undefined behaviour in CUDA. Close the
  registration, then the storage.

Device pointer: ``cudaHostGetDevicePointer`` when this CuPy exposes it
(``cupy.cuda.runtime.hostGetDevicePointer``), otherwise the
``devicePointer`` of ``cudaPointerGetAttributes`` (``runtime.pointerGetAttributes``),
which is the same address. On 64-bit Linux with unified addressing it is
usually the host address itself (device attribute
``canUseHostPointerForRegisteredMem``), but kernels are always given the
pointer CUDA returned.

Example::

    cupy = require_cupy("zero-copy replay gather")
    with register_storage(cupy, storage) as reg:           # pins the whole segment
        obs_ptr = reg.device_pointer(storage.column_offsets["obs"])   # row 0 of "obs"
        CudaGather(cupy).gather_rows(obs_ptr, 28224, rows, out, num_rows=P * S)
        cupy.cuda.get_current_stream().synchronize()       # before unregistering
"""

from __future__ import annotations

import mmap
from typing import Any

from gearflow.native.cuda_backend import check_int

PAGE_SIZE = mmap.PAGESIZE
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped
DEFAULT_FLAGS = HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE
DEV_ATTR_CAN_MAP_HOST_MEMORY = 19  # cudaDevAttrCanMapHostMemory

__all__ = ["HostRegistration", "MappedArea", "buffer_address", "register_host", "register_storage"]


class HostRegistration:
    """A registered, mapped host range; :meth:`close` (or ``with``) unregisters it once.

    ``host_ptr`` / ``nbytes``: the host range; ``device_ptr``: its address for
    kernels. Keep the memory mapped until :meth:`close`, and let work queued on
    it finish first (synchronize the streams that read it).
    """

    def __init__(self, runtime: Any, host_ptr: int, nbytes: int, device_ptr: int, flags: int) -> None:
        self._runtime = runtime
        self.host_ptr = host_ptr
        self.nbytes = nbytes
        self.device_ptr = device_ptr
        self.flags = flags
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def device_pointer(self, offset: int = 0) -> int:
        """Device address of byte ``offset`` of the range (e.g. a column's offset in a segment)."""
        if self._closed:
            raise ValueError("the host registration is closed")
        offset = check_int("offset", offset, minimum=0)
        if offset >= self.nbytes:
            raise ValueError(f"offset {offset} is outside the registered {self.nbytes} bytes")
        return self.device_ptr + offset

    def close(self) -> None:
        """``cudaHostUnregister`` (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._runtime.hostUnregister(self.host_ptr)

    def __enter__(self) -> HostRegistration:  # noqa: PYI034 - no typing_extensions dependency
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"device 0x{self.device_ptr:x}"
        return f"HostRegistration(host 0x{self.host_ptr:x}, {self.nbytes} bytes, {state})"


def buffer_address(buffer: Any) -> int:
    """Address of the first byte of a writable buffer (an ``mmap``, a numpy array, a bytearray)."""
    import numpy as np

    view = np.frombuffer(buffer, dtype=np.uint8)  # a view: no copy; dropped before returning
    return int(view.ctypes.data)


def _device_pointer(runtime: Any, host_ptr: int) -> int:
    get = getattr(runtime, "hostGetDevicePointer", None)
    if get is not None:
        return int(get(host_ptr, 0))
    return int(runtime.pointerGetAttributes(host_ptr).devicePointer)


def register_host(cupy: Any, address: int, nbytes: int, *, flags: int = DEFAULT_FLAGS) -> HostRegistration:
    """Pin and map ``nbytes`` of host memory at ``address`` for the current device.

    ``address`` is a host address (e.g. :func:`buffer_address` of an mmap),
    page-aligned; ``nbytes`` a positive multiple of the page size (see the
    module docstring for why). ``flags`` must include ``cudaHostRegisterMapped``.
    Raises ``ValueError`` for bad arguments or a device that cannot map host
    memory, and CuPy's ``CUDARuntimeError`` if CUDA refuses (for example
    ``cudaErrorHostMemoryAlreadyRegistered`` for an overlapping range).
    """
    address = check_int("address", address, minimum=1)
    nbytes = check_int("nbytes", nbytes, minimum=1)
    flags = check_int("flags", flags, minimum=0)
    if address % PAGE_SIZE:
        raise ValueError(
            f"address 0x{address:x} is not page-aligned ({PAGE_SIZE} bytes): CUDA pins whole pages, "
            "so register the whole mapping (its base address)"
        )
    if nbytes % PAGE_SIZE:
        raise ValueError(
            f"nbytes={nbytes} is not a multiple of the page size ({PAGE_SIZE}): CUDA would pin the "
            "rest of the last page too; register whole pages"
        )
    if not flags & HOST_REGISTER_MAPPED:
        raise ValueError("flags must include cudaHostRegisterMapped (0x02): kernels read the memory in place")
    runtime = cupy.cuda.runtime
    device = runtime.getDevice()
    attr = getattr(runtime, "cudaDevAttrCanMapHostMemory", DEV_ATTR_CAN_MAP_HOST_MEMORY)
    if not runtime.deviceGetAttribute(attr, device):
        raise ValueError(f"CUDA device {device} cannot map host memory (cudaDevAttrCanMapHostMemory is 0)")
    runtime.hostRegister(address, nbytes, flags)
    try:
        device_ptr = _device_pointer(runtime, address)
    except BaseException:
        runtime.hostUnregister(address)
        raise
    return HostRegistration(runtime, address, nbytes, device_ptr, flags)


def register_storage(cupy: Any, storage: Any, *, flags: int = DEFAULT_FLAGS) -> HostRegistration:
    """Register a whole ``SharedStorage`` segment; column ``c``'s row 0 is then at
    ``reg.device_pointer(storage.column_offsets[c])``.

    The segment's base is the address of its header (offset 0 of the mapping,
    page-aligned). Its size ``storage.nbytes`` is a multiple of 4096; where the
    page is larger (64 KiB on some aarch64 kernels) the range is rounded up to
    the end of the last page, which the mapping covers anyway (an mmap maps
    whole pages).
    """
    header = getattr(storage, "header", None)
    if header is None:
        raise ValueError("storage must be an open SharedStorage (its header is gone: closed?)")
    nbytes = -(-int(storage.nbytes) // PAGE_SIZE) * PAGE_SIZE
    return register_host(cupy, int(header.ctypes.data), nbytes, flags=flags)


class MappedArea:
    """A small host area the device reads and writes in place: an anonymous mmap (whole pages),
    registered mapped (:func:`register_host`) on the current device. The device replay keeps its
    batches' status words and its ingest staging in such areas: a kernel writes a status word
    straight into host memory (the host reads it after the batch's event) and reads staged
    entries without a copy (an upload from pageable memory would first wait for the stream).

    ``host``: the bytes (numpy uint8, a view valid until :meth:`ensure` grows the area or
    :meth:`close`); ``device_ptr``: their device address. Grow only when no queued kernel uses the
    area any more (its owner waits for that first).

        area = MappedArea(cupy, 32)
        status = area.host[:32].view(np.int64)      # int64[4], written by a kernel at area.device_ptr
    """

    def __init__(self, cupy: Any, nbytes: int) -> None:
        self.cupy, self.nbytes = cupy, 0
        self._mm: mmap.mmap | None = None
        self._reg: HostRegistration | None = None
        self.host: Any = None
        self.device_ptr = 0
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> None:
        """At least ``nbytes`` (whole pages; its bytes are not kept when it grows)."""
        nbytes = check_int("nbytes", nbytes, minimum=1)
        if nbytes <= self.nbytes:
            return
        import numpy as np

        self.close()
        size = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        mm = mmap.mmap(-1, size)
        host = np.frombuffer(mm, dtype=np.uint8)
        try:
            reg = register_host(self.cupy, int(host.ctypes.data), size)
        except BaseException:
            del host
            mm.close()
            raise
        self._mm, self._reg, self.host, self.nbytes, self.device_ptr = mm, reg, host, size, reg.device_ptr

    def close(self) -> None:
        """Unregister and unmap (once its queued users are done)."""
        if self._reg is not None:
            self._reg.close()
            self._reg = None
        self.host, self.nbytes, self.device_ptr = None, 0, 0
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of it is still referenced: unmapped when that goes
                pass
            self._mm = None
