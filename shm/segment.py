"""A named POSIX shared-memory segment under /dev/shm, mapped with mmap.

We avoid multiprocessing.shared_memory because its resource tracker unlinks or warns about
segments that other processes still use; here the creator alone unlinks, explicitly.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


class Segment:
    """Owns one mapping. `create` makes the file (fails if it exists); `attach` opens an existing one."""

    def __init__(self, name: str, size: int, create: bool):
        assert "/" not in name, name
        self.name = name
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        return cls(name, size, create=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        return cls(name, 0, create=False)

    def close(self) -> None:
        """Unmap. numpy views must be dropped first, or mmap refuses (BufferError) and we leave
        the mapping to be released at process exit."""
        try:
            self.buf.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def remove_stale_segments(prefix: str, directory: Path = SHM_DIR) -> list[str]:
    """Unlink files `<prefix><pid>-...` (shm segments, or zmq ipc socket files when `directory` is
    the temp dir) whose creating process is gone (a crashed launcher).

    A live server's files are never touched: its launcher pid still exists.
    """
    removed = []
    for name in sorted(p.name for p in directory.glob(f"{prefix}*")):
        pid_text = name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        if _pid_alive(int(pid_text)):
            continue
        try:
            (directory / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
