"""Activation offload: chosen saved activations leave the device after forward and come back for backward.

Autograd keeps every tensor a backward formula needs until that backward runs. `ActivationOffload` installs
`saved_tensors_hooks` that hand the outputs of matmuls (policy "all") or of grouped expert matmuls (policy
"moe") to a store with an asynchronous copy, and keep only a small handle in the graph. When backward asks
for one, the store returns the bytes unchanged, and the next few handles in backward order are prefetched
so their copies overlap with compute. The numbers are identical: the same bytes, in the same layout.

Stores:
- `PinnedHostStore` (cuda): pinned host buffers, copies on a side stream, events to order them.
- `FileStore` (cpu): device memory is host memory here, so the target is a spill file written and read by
  a background thread (the kernel's page cache and the disk hold the bytes, not this process).
"""

from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

# autograd nodes that only change how a tensor is viewed: looking through them finds the op that made the data
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TransposeBackward0", "TBackward0",
          "PermuteBackward0", "SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0", "SelectBackward0",
          "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0", "AliasBackward0", "UnbindBackward0"}
_GROUPED = {"GroupedMMBackward", "GroupedMmBackward0"}
_MATMULS = {"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "MatmulBackward0",
            "LinearBackward0", "MvBackward0"} | _GROUPED


def producer(t: torch.Tensor) -> str | None:
    """Name of the autograd node that computed `t`'s data, looking through views."""
    node = t.grad_fn
    while node is not None and node.name() in _VIEWS:
        nexts = [n for n, _ in node.next_functions if n is not None]
        node = nexts[0] if nexts else None
    return node.name() if node is not None else None


def selected(t: torch.Tensor, policy: str) -> bool:
    """Whether `policy` offloads this saved tensor: matmul outputs ("all") or grouped expert matmul outputs ("moe")."""
    if policy == "none" or t.grad_fn is None or 0 in t.stride() or t.is_sparse:
        return False
    name = producer(t)
    return name in (_GROUPED if policy == "moe" else _MATMULS)


def _restore_layout(flat: torch.Tensor, like_size, like_stride) -> torch.Tensor:
    """The stored (contiguous) copy in the original strides: backward kernels then see what they saw."""
    dense = flat.view(like_size)
    if dense.stride() == tuple(like_stride):
        return dense
    out = torch.empty_strided(like_size, like_stride, dtype=flat.dtype, device=flat.device)
    return out.copy_(dense)


class _Entry:
    __slots__ = ("device", "done", "dtype", "loaded", "nbytes", "ready", "size", "slot", "stride")

    def __init__(self, t: torch.Tensor):
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.slot = None  # where the store keeps it
        self.ready = None  # completion of the outbound copy (Future or cuda Event)
        self.loaded = None  # Future / (tensor, event) of the inbound copy, set by prefetch
        self.done = False  # handed back to backward; its bytes are no longer needed


class FileStore:
    """Spills tensors to an unlinked temporary file with one background I/O thread.

    One thread serves both directions in order, so a read can never overtake the write of the same bytes.
    `os.pwrite` / `os.preadv` release the GIL: the copies really run beside forward and backward compute.
    """

    ALIGN = 4096

    def __init__(self, directory: str | None = None):
        fd, path = tempfile.mkstemp(prefix="onboard-offload-", dir=directory)
        os.unlink(path)  # nothing to clean up, even after SIGKILL
        self._fd = fd
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-io")
        self._end = 0
        self._lock = threading.Lock()
        self.bytes_out = 0

    def put(self, t: torch.Tensor) -> _Entry:
        entry = _Entry(t)
        with self._lock:
            entry.slot = self._end
            self._end += -(-entry.nbytes // self.ALIGN) * self.ALIGN
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)  # the thread holds it until written
        entry.ready = self._io.submit(self._write, data, entry.slot)
        self.bytes_out += entry.nbytes
        return entry

    def _write(self, data: torch.Tensor, offset: int) -> None:
        view = memoryview(data.numpy())
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _read(self, entry: _Entry) -> torch.Tensor:
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        view, offset = memoryview(buf.numpy()), entry.slot
        while view:
            n = os.preadv(self._fd, [view], offset)
            if n == 0:
                raise OSError(f"offload file ended early at byte {offset}")
            view, offset = view[n:], offset + n
        return buf

    def prefetch(self, entry: _Entry) -> None:
        if entry.loaded is None and not entry.done:
            entry.loaded = self._io.submit(self._read, entry)

    def get(self, entry: _Entry) -> torch.Tensor:
        self.prefetch(entry)
        flat = entry.loaded.result().view(entry.dtype)
        entry.loaded, entry.done = None, True
        return _restore_layout(flat, entry.size, entry.stride)

    def reset(self) -> None:
        """Reuse the file from its start (no entry may still be live)."""
        with self._lock:
            self._end = 0
        self._io.submit(os.ftruncate, self._fd, 0).result()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        os.close(self._fd)


class PinnedHostStore:
    """Copies to pinned host memory on a side stream; back to the device on the same stream when needed."""

    def __init__(self, device: torch.device | None = None):
        self.device = torch.device(device or "cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.bytes_out = 0

    def put(self, t: torch.Tensor) -> _Entry:
        entry = _Entry(t)
        src = t.detach().contiguous().reshape(-1)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t must be computed before we copy it
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # the allocator must not reuse src until the copy is done
            entry.ready = torch.cuda.Event()
            entry.ready.record(self.stream)
        entry.slot = host
        self.bytes_out += entry.nbytes
        return entry

    def prefetch(self, entry: _Entry) -> None:
        if entry.loaded is not None or entry.done:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(entry.ready)
            flat = entry.slot.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        entry.loaded = (flat, event)

    def get(self, entry: _Entry) -> torch.Tensor:
        self.prefetch(entry)
        flat, event = entry.loaded
        entry.loaded, entry.slot, entry.done = None, None, True
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        flat.record_stream(current)
        return _restore_layout(flat, entry.size, entry.stride)

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def default_store(device: torch.device, directory: str | None = None):
    return PinnedHostStore(device) if device.type == "cuda" else FileStore(directory)


class _Handle:
    """What autograd keeps in place of an offloaded tensor."""

    __slots__ = ("entries", "index", "value")

    def __init__(self, entries: list, index: int):
        self.entries, self.index = entries, index
        self.value = None  # the tensor once brought back; freed with the handle when backward is done with it


class ActivationOffload:
    """Context manager for one forward pass; the handles it leaves in the graph serve the later backward.

    `prefetch` handles ahead (in backward order, which is the reverse of forward order) are brought back
    while backward computes with the current one. Tensors under `min_bytes` stay where they are: their copy
    would cost more than it saves.
    """

    def __init__(self, policy: str, store=None, *, device: torch.device | None = None, prefetch: int = 2,
                 min_bytes: int = 4096, offload_dir: str | None = None):
        if policy not in ("none", "moe", "all"):
            raise ValueError(f"offload policy must be none, moe or all, got {policy!r}")
        self.policy = policy
        self.store = store if store is not None or policy == "none" else default_store(
            torch.device(device or "cpu"), offload_dir)
        self.prefetch_depth = prefetch
        self.min_bytes = min_bytes
        self._entries: list = []  # this forward's entries, in forward order
        self._hooks = None
        self.offloaded_bytes = 0

    def _pack(self, t: torch.Tensor):
        if t.numel() * t.element_size() < self.min_bytes or not selected(t, self.policy):
            return t
        entry = self.store.put(t)
        self.offloaded_bytes += entry.nbytes
        self._entries.append(entry)
        return _Handle(self._entries, len(self._entries) - 1)

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        if packed.value is None:  # a node may read its saved tensors more than once
            entries = packed.entries
            for i in range(packed.index - 1, max(packed.index - 1 - self.prefetch_depth, -1), -1):
                self.store.prefetch(entries[i])
            packed.value = self.store.get(entries[packed.index])
        return packed.value

    def __enter__(self):
        if self.policy == "none":
            return self
        if all(e.done for e in self._entries):  # the last forward's backward has run: reuse the space
            self.store.reset()
        self._entries = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
