"""Calls to the engine's process (jetflow.run.engine_process) whose tensors travel in shared memory: a weight
update's bytes are copied once, when the call is made, into one anonymous shared-memory file (Linux memfd), and
only the call's structure (names, versions, the tensors' places in that file) is pickled; the file's descriptor
crosses the pipe beside it (SCM_RIGHTS), and the engine maps the file and reads the tensors in place.

Why this way and not torch.multiprocessing's tensor reductions: those move a tensor's own storage into shared
memory (the trainer's live parameters: no snapshot) and share every storage separately, hundreds per update, each a
descriptor passed through a connection of its own (`file_descriptor`, bounded by the descriptor limit) or a named
file in /dev/shm that a killed process leaves behind (`file_system`). Here an update is one descriptor, the copy
is made at the call (the trainer may go on changing its weights), and the file has no name: the kernel frees it
when its last descriptor and mapping are gone, whoever dies first, so neither a killed engine nor a killed trainer
leaves anything in /dev/shm, and /dev/shm's size (64 MiB in a default Docker container) does not bound it.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import torch

ALIGN = 64  # every tensor's offset in the file: a multiple of any element size (a byte view reinterprets it)


class _Pickler(pickle.Pickler):
    """Pickles a call with each tensor replaced by its place in the shared file: (offset, dtype, shape, device)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int]] = []  # (tensor, offset)
        self.size = 0
        self._places: dict[int, tuple] = {}  # id(tensor) -> its place: a tensor met twice is copied once

    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self._places:
            place = (self.size, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), str(obj.device))
            self.tensors.append((obj, self.size))
            self.size += -(-obj.numel() * obj.element_size() // ALIGN) * ALIGN
            self._places[id(obj)] = place
        return self._places[id(obj)]


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, buffer: torch.Tensor | None):
        super().__init__(io.BytesIO(data))
        self.buffer = buffer

    def persistent_load(self, place: tuple) -> torch.Tensor:
        offset, dtype_name, shape, device = place
        dtype = getattr(torch, dtype_name)
        count = 1
        for n in shape:
            count *= n
        if count == 0 or self.buffer is None:
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        t = self.buffer[offset:offset + nbytes].view(dtype).view(shape)
        return t if device == "cpu" else t.to(device)


def pack(call: Any) -> tuple[bytes, int | None]:
    """(the call's message, the descriptor of the shared file holding its tensors, or None without tensors). The
    tensors are copied now; the descriptor is the caller's to close (`send` does, once it has crossed). Where the
    system has no memfd (not Linux), the tensors are pickled into the message itself."""
    if not hasattr(os, "memfd_create"):
        return pickle.dumps((0, pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))), None
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(call)
    size = pickler.size
    fd = None
    if size:
        fd = os.memfd_create("jetflow-engine-call", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            for t, offset in pickler.tensors:
                _write_at(fd, t, offset)
        except BaseException:
            os.close(fd)
            raise
    return pickle.dumps((size if fd is not None else 0, out.getvalue()), protocol=pickle.HIGHEST_PROTOCOL), fd


def _write_at(fd: int, t: torch.Tensor, offset: int) -> None:
    """The tensor's bytes into the file at `offset`: one copy, by the kernel (faster than filling a fresh mapping,
    whose every page faults)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
    done = 0
    while done < len(raw):
        done += os.pwrite(fd, raw[done:], offset + done)


def send(conn, message: bytes, fd: int | None) -> None:
    """Write a packed call to the pipe (a socket pair: the descriptor crosses beside the message) and close this
    process's descriptor of its file, sent or not."""
    try:
        conn.send_bytes(message)
        if fd is not None:
            send_handle(conn, fd, None)  # the pid is Windows's; Unix passes the descriptor itself
    finally:
        if fd is not None:
            os.close(fd)


def receive(conn) -> Any:
    """The next call from the pipe, its tensors views of the shared file (mapped here, freed with its last view).
    EOFError or OSError: the pipe closed (the parent is gone)."""
    size, data = pickle.loads(conn.recv_bytes())
    buffer = None
    if size:
        try:
            fd = recv_handle(conn)
        except RuntimeError as e:  # the message came without its descriptor: the parent died between the two
            raise EOFError(str(e)) from e
        try:
            buffer = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # the tensor keeps the mapping
        finally:
            os.close(fd)
    return _Unpickler(data, buffer).load()
