"""One training run at a time per ``--save`` directory.

Two jobs that save into one directory overwrite each other's iterations and move the
tracker file back and forth; the start-up check of ``--save`` only sees checkpoints
already written, so a second job started before the first one's first save went
unnoticed.  Global rank 0 of a training run therefore holds an exclusive ``flock`` on
the ``--save`` directory itself (no file is added to it) from start-up until the run
returns; the kernel drops it when the process ends, however it ends, so a killed run
leaves no stale lock.  A second run into the same directory stops with one line naming
the holder's pid (from /proc/locks, where readable) before its process group exists.

The same process may train into the directory again (a resume inside one Python
process); a file system without ``flock`` (some NFS mounts) gets a warning instead.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Dict

from megatron.errors import UserError

_held: Dict[str, int] = {}
"""realpath of a --save directory -> the descriptor holding its lock in this process."""


def lock_save_dir(save: str) -> bool:
    """Take the lock of ``save`` for this process; True if held now (False: the file
    system cannot lock, warned).  Raises ``UserError`` naming the holder when another
    process holds it."""
    import fcntl

    real = os.path.realpath(save)
    if real in _held:
        return True
    os.makedirs(real, exist_ok=True)
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder_pid(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = f"pid {holder}" if holder else "a live process holds its lock"
            raise UserError(
                f"--save {save} is in use by another training run ({who}): two runs saving "
                f"into one directory overwrite each other's checkpoints; wait for that run "
                f"to end, or choose another --save directory") from None
        print(f"warning: --save {save}: cannot lock the directory ({exc.strerror}); "
              f"another run saving into it at the same time would not be detected",
              file=sys.stderr, flush=True)
        return False
    _held[real] = fd
    return True


def release_save_dir(save: str) -> None:
    """Drop this process's lock of ``save`` (nothing if it holds none)."""
    fd = _held.pop(os.path.realpath(save), None)
    if fd is not None:
        import fcntl

        # LOCK_UN, not only close: forked DataLoader workers share the descriptor's open
        # file, which would keep the lock until they exit
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _holder_pid(fd: int) -> str:
    """The pid holding a flock on ``fd``'s file, from /proc/locks (Linux), or ''."""
    try:
        st = os.fstat(fd)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as fh:
            for line in fh:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF"
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key:
                    return fields[4]
    except (OSError, ValueError):
        pass
    return ""
