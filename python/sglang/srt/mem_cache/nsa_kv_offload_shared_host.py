"""Host memory the attention-TP ranks of one node share (decode NSA KV offload).

With attention TP every rank stores the same MLA latent KV, so the group holds
one copy: rank 0 creates an anonymous ``memfd_create`` file (no tmpfs cap,
nothing left by a crash), the others map it through rank 0's
``/proc/<pid>/fd/<fd>`` while rank 0 holds it open, and each rank page-locks
its own mapping (its GPU reads over its own PCIe link). Once all have mapped
it rank 0 closes the descriptor. Only rank 0 writes rows
(``SparseCacheController(host_writer=...)``; docs/MULTI_GPU.md). A header
records the layout; a rank whose layout differs refuses, and every rank of
the group fails with the reason.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol

import torch

HEADER_BYTES = 4096
_MAGIC = b"SGLNSAKV"
_VERSION = 1
# magic, version, layer_num, num_rows, row_bytes
_HEADER = struct.Struct("<8sIqqq")
# Host page size of the per-rank prefault.
_PAGE_BYTES = 4096


@dataclass(frozen=True)
class SharedHostLayout:
    """Shape of the host KV rows: ``(layer_num, num_rows, row_bytes)`` uint8."""

    layer_num: int
    num_rows: int
    row_bytes: int

    @property
    def shape(self):
        return (self.layer_num, self.num_rows, self.row_bytes)

    @property
    def data_bytes(self) -> int:
        return self.layer_num * self.num_rows * self.row_bytes


class HostPoolGroup(Protocol):
    """What the rendezvous needs of sglang's ``GroupCoordinator`` (the
    attention-TP group; its ``all_gather_object`` runs on the CPU group)."""

    rank_in_group: int
    world_size: int

    def all_gather_object(self, obj: Any) -> List[Any]: ...


class SharedHostSegment:
    """One mapping of the shared host KV rows: :meth:`create` (rank 0),
    :meth:`attach` (the others), or :func:`open_shared_host_segment`."""

    def __init__(
        self,
        mapping: mmap.mmap,
        layout: SharedHostLayout,
        path: str,
        fd: Optional[int] = None,
    ):
        self._mapping = mapping
        self.layout = layout
        # Where another process of this host opens it while ``fd`` is open.
        self.path = path
        self._fd = fd
        self._tensor: Optional[torch.Tensor] = None

    @property
    def is_owner(self) -> bool:
        """Whether this mapping still holds the descriptor others attach to."""
        return self._fd is not None

    @classmethod
    def create(cls, layout: SharedHostLayout) -> "SharedHostSegment":
        """A new zero-filled segment of ``layout``, held open for others."""
        fd = os.memfd_create("sglang-nsa-kv-offload", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + layout.data_bytes)
            mapping = mmap.mmap(fd, HEADER_BYTES + layout.data_bytes)
        except OSError:
            os.close(fd)
            raise
        mapping[: _HEADER.size] = _HEADER.pack(
            _MAGIC, _VERSION, layout.layer_num, layout.num_rows, layout.row_bytes
        )
        return cls(mapping, layout, f"/proc/{os.getpid()}/fd/{fd}", fd)

    @classmethod
    def attach(cls, path: str, layout: SharedHostLayout) -> "SharedHostSegment":
        """Map the segment another process created at ``path``; its header must
        match ``layout``."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + layout.data_bytes:
                raise ValueError(
                    f"shared host KV at {path} has {size} bytes, expected "
                    f"{HEADER_BYTES + layout.data_bytes} for {layout}"
                )
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, *shape = _HEADER.unpack_from(mapping)
        if magic != _MAGIC or version != _VERSION or tuple(shape) != layout.shape:
            mapping.close()
            raise ValueError(
                f"shared host KV at {path} holds {magic!r} v{version} rows "
                f"{tuple(shape)}, expected {layout.shape}"
            )
        return cls(mapping, layout, path)

    def tensor(self) -> torch.Tensor:
        """The rows, ``layout.shape`` uint8, viewing the shared memory."""
        if self._tensor is None:
            flat = torch.frombuffer(
                self._mapping,
                dtype=torch.uint8,
                count=self.layout.data_bytes,
                offset=HEADER_BYTES,
            )
            self._tensor = flat.view(self.layout.shape)
        return self._tensor

    def prefault(self, rank: int, world_size: int) -> None:
        """Touch this rank's share of the pages (zeros over zeros): the pages
        are allocated by several ranks at once, each where it runs."""
        flat = self.tensor().view(-1)
        share = -(-flat.numel() // (world_size * _PAGE_BYTES)) * _PAGE_BYTES
        flat[rank * share : (rank + 1) * share : _PAGE_BYTES].zero_()

    def seal(self) -> None:
        """Close the descriptor others attach through (once they have)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Close the descriptor and, once no tensor views it, the mapping."""
        self.seal()
        self._tensor = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # still viewed: unmapped when the last view is freed


def open_shared_host_segment(
    layout: SharedHostLayout, group: HostPoolGroup, prefault: bool = True
) -> SharedHostSegment:
    """The segment of ``layout`` every rank of ``group`` maps: rank 0 creates
    it, the others attach. Collective over the group; if any rank fails, all
    raise the reasons (none is left waiting)."""
    rank = group.rank_in_group
    segment, error = None, None
    if rank == 0:
        try:
            segment = SharedHostSegment.create(layout)
        except OSError as e:
            error = f"rank 0 could not create {layout.data_bytes} bytes: {e}"
    path, error = group.all_gather_object(
        (segment.path if segment is not None else None, error)
    )[0]
    if rank != 0 and error is None:
        try:
            segment = SharedHostSegment.attach(path, layout)
        except (OSError, ValueError) as e:
            error = f"rank {rank}: {e}"
    if segment is not None and prefault:
        segment.prefault(rank, group.world_size)
    # Everyone has mapped it (or failed): rank 0 may drop its descriptor.
    errors = sorted({e for e in group.all_gather_object(error) if e is not None})
    if segment is not None:
        segment.seal()
    if errors:
        if segment is not None:
            segment.close()
        raise RuntimeError(
            "NSA KV offload: the attention-TP ranks could not share one host pool: "
            + "; ".join(errors)
        )
    return segment
