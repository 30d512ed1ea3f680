"""The collectives of a tensor-parallel group; the one module that moves data between ranks.

- ShmGroup: the ranks of one host on the CPU, through a shared-memory segment and the C++ exchange of
  kernels/collectives.cpp (a decode step's all-reduce takes microseconds; through gloo's sockets, hundreds).
- TorchGroup: torch.distributed's collectives (gloo between hosts, or where the C++ kernels are unavailable; NCCL
  on GPUs).

Every rank calls the same collectives in the same order: rank 0 sends each step's inputs (send), every rank
all-reduces its partial sums (all_reduce) and rank 0 gathers the head's columns (gather_columns).
"""

from __future__ import annotations

import os
import pickle
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from tokenmill import backend

LINE = 64  # bytes a flag takes: a cache line each, so that ranks publishing at once do not share one
SLOT_BYTES = 16 << 20  # each rank's slot of each buffer; a larger tensor moves in pieces
# Ranks in one step meet within milliseconds (they do the same work; rank 0's own between steps, the others wait out
# with no limit): one that has not answered in this long hangs.
STEP_TIMEOUT_S = 10.0


class Group(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None: ...
    def send(self, obj: object) -> None: ...
    def receive(self, alive: Callable[[], bool]) -> Any: ...
    def abort(self, rank: int) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class GroupSpec:
    """What a rank needs to join the group: the shared segment's path (one host), torch.distributed's address."""

    size: int
    init_method: str
    shm_path: str | None


def new_spec(size: int, shm: bool, master_addr: str = "127.0.0.1", master_port: int | None = None) -> GroupSpec:
    """A group's spec, made by rank 0 (a fresh segment under /dev/shm where shm)."""
    port = master_port or _free_port()
    path = None
    if shm:
        path = f"/dev/shm/tokenmill-tp-{os.getpid()}-{secrets.token_hex(4)}"
        # This user's alone: the segment carries requests' hidden states and logits
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _segment_bytes(size))
        finally:
            os.close(fd)
    return GroupSpec(size, f"tcp://{master_addr}:{port}", path)


def join(spec: GroupSpec, rank: int, device: torch.device, shared_gpus: bool = False) -> Group:
    """Join the group as `rank`: torch.distributed (the control plane, and the data plane without shm) first; NCCL
    between GPUs, unless ranks share them (shared_gpus), gloo otherwise."""
    backend = "nccl" if device.type == "cuda" and spec.shm_path is None and not shared_gpus else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.size,
                            timeout=timedelta(minutes=5))
    if spec.shm_path is not None:
        return ShmGroup(spec.shm_path, rank, spec.size)
    return TorchGroup(rank, spec.size, device)


def agree_min(value: int) -> int:
    """The smallest of every rank's value (torch.distributed's control plane)."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _segment_bytes(size: int) -> int:
    return (1 + size) * LINE + 2 * size * SLOT_BYTES


class ShmGroup:
    def __init__(self, path: str, rank: int, size: int) -> None:
        if not backend.cpu_kernels(torch.device("cpu")):
            raise RuntimeError("shared-memory collectives need tokenmill's C++ kernels, unavailable here")
        self.rank, self.size, self.path = rank, size, path
        segment = torch.from_file(path, shared=True, size=_segment_bytes(size), dtype=torch.uint8)
        flag_bytes = (1 + size) * LINE
        self.flags = segment[:flag_bytes].view(torch.int64)  # [0]: the abort code; line 1 + r: rank r's generation
        self.slots = segment[flag_bytes:].view(2, size, SLOT_BYTES)
        self.generation = 0

    def _exchange(self, timeout_s: float = STEP_TIMEOUT_S) -> bool:
        """The next exchange; False (none) after timeout_s, raises where a rank is gone."""
        self.generation += 1
        ok = torch.ops.tokenmill.shm_exchange(self.flags, self.rank, self.size, self.generation, timeout_s)
        if not ok:
            self.generation -= 1  # try again: the same generation
        return bool(ok)

    def _step_exchange(self) -> None:
        if not self._exchange():
            raise TimeoutError(f"tensor-parallel rank {self.rank}: a rank did not answer in {STEP_TIMEOUT_S} s")

    def _slot(self, rank: int) -> torch.Tensor:
        """rank's slot of the last exchange's buffer."""
        return self.slots[self.generation % 2, rank]

    def _next_slot(self, rank: int) -> torch.Tensor:
        """rank's slot of the next exchange's buffer."""
        return self.slots[(self.generation + 1) % 2, rank]

    def take_exchanges(self, count: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int, float]:
        """For the fused decode layer, which runs `count` all-reduces itself (kernels/layer.cpp): the segment, this
        rank, the ranks, the generation they follow, and how long a rank may keep the others waiting."""
        generation = self.generation
        self.generation += count
        return self.slots, self.flags, self.rank, self.size, generation, STEP_TIMEOUT_S

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank adds in rank order: the same bits everywhere)."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        for piece in flat.split(SLOT_BYTES // flat.element_size()):
            self.generation += 1
            torch.ops.tokenmill.shm_all_reduce(piece, self.slots, self.flags, self.rank, self.size, self.generation,
                                               STEP_TIMEOUT_S)
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's x [rows, widths[rank]] side by side, [rows, sum(widths)]; others: None."""
        rows, itemsize = x.shape[0], x.element_size()
        step = max(1, SLOT_BYTES // (max(widths) * itemsize))
        out = torch.empty(rows, sum(widths), dtype=x.dtype) if self.rank == 0 else None
        starts = [sum(widths[:r]) for r in range(self.size)]
        for first in range(0, max(rows, 1), step):
            part = x[first:first + step].contiguous()
            self._next_slot(self.rank)[:part.numel() * itemsize].copy_(part.view(-1).view(torch.uint8))
            self._step_exchange()
            if out is None:
                continue
            for r, (start, width) in enumerate(zip(starts, widths, strict=True)):
                data = self._slot(r)[:part.shape[0] * width * itemsize].view(x.dtype).view(part.shape[0], width)
                out[first:first + part.shape[0], start:start + width] = data
        return out

    def send(self, obj: object) -> None:
        """Rank 0: obj to every other rank (a pickle, in as many exchanges as its size takes)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        room = SLOT_BYTES - 8
        for at in range(0, max(len(data), 1), room):
            piece = data[at:at + room]
            slot = self._next_slot(0)
            slot[:8].view(torch.int64)[0] = len(data)
            slot[8:8 + len(piece)].numpy()[:] = np.frombuffer(piece, dtype=np.uint8)
            self._step_exchange()

    def receive(self, alive: Callable[[], bool]) -> Any:
        """What rank 0 sends next; waits as long as alive() (checked every second) says rank 0 is there."""
        data = bytearray()
        while True:
            while not self._exchange(1.0):
                if not alive():
                    raise ConnectionError("tensor-parallel rank 0 is gone")
            slot = self._slot(0)
            total = int(slot[:8].view(torch.int64)[0])
            data += slot[8:8 + min(SLOT_BYTES - 8, total - len(data))].numpy().tobytes()
            if len(data) >= total:
                return pickle.loads(bytes(data))

    def abort(self, rank: int) -> None:
        """Wake every waiting rank with an error naming `rank` (it is gone)."""
        self.flags[0] = rank + 1

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchGroup:
    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        # An idle replica's workers wait in a collective for the next step: hours, not the start's few minutes.
        self.group = dist.new_group(list(range(size)), timeout=timedelta(hours=24))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        padded = torch.zeros(x.shape[0], max(widths), dtype=x.dtype, device=x.device)
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in widths] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def send(self, obj: object) -> None:
        dist.broadcast_object_list([obj], src=0, group=self.group)

    def receive(self, alive: Callable[[], bool]) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def abort(self, rank: int) -> None:
        pass  # gloo's and NCCL's collectives fail by themselves when a peer's connection closes

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
