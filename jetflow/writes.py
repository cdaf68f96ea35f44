"""Writing a run's files when the machine misbehaves: a full disk (ENOSPC), a read-only file system
(EROFS), an I/O error (EIO), a quota. Every writer (checkpoints, metrics, the final model, exports,
the report, summary.json) goes through `guarded`, which turns the failure into one line, `WriteError`,
naming the file and the cause, after the writer's own partial output is removed. The previous
checkpoint is never touched by a failed write, so the same command with run.resume=true continues
once the cause is fixed.

Some writers do not say why they failed: torch.save ends in `RuntimeError: [enforce fail at
inline_container.cc] unexpected pos` or `basic_ios::clear: iostream error` on a full disk; the cause is
then read from the file system itself (`diagnose`).

`check_free_space` warns before a checkpoint when the disk has less room than the previous
checkpoint took (the estimate of the next one), or less than room for two more.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from safetensors import SafetensorError

from jetflow.errors import UserError

# what a writer raises when the disk fails it: OSError, safetensors' error (its text has the OS error),
# torch.save's RuntimeError (its text does not)
WRITE_FAILURES = (OSError, SafetensorError, RuntimeError)
LOW_SPACE_BYTES = 1 << 20  # less free than this after a failed write: the disk is full
HINTS = {
    errno.ENOSPC: "free space on that disk (or set run.out_dir to another)",
    errno.EDQUOT: "free space within your quota (or set run.out_dir to another disk)",
    errno.EROFS: "make that file system writable (or set run.out_dir to another)",
    errno.EACCES: "make that directory writable for this user (or set run.out_dir to another)",
    errno.EIO: "the disk reported an I/O error: check it (dmesg) or set run.out_dir to another",
}


class WriteError(UserError):
    """A file of the run could not be written; the message names it, the cause and the fix."""


def diagnose(error: BaseException, path: Path) -> tuple[int | None, str]:
    """(errno or None, cause in words) of a failed write of `path`."""
    code = getattr(error, "errno", None)
    if isinstance(error, OSError) and code:
        return code, f"{os.strerror(code)} [{errno.errorcode.get(code, code)}]"
    text = " ".join(str(error).split())
    for code in (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT):  # safetensors: "... (os error 28)"
        if f"os error {code})" in text:
            return code, f"{os.strerror(code)} [{errno.errorcode[code]}]"
    directory = _existing_parent(path)
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return errno.EROFS, f"{os.strerror(errno.EROFS)} [EROFS]"
        if shutil.disk_usage(directory).free < LOW_SPACE_BYTES:
            return errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} [ENOSPC]"
    except OSError:
        pass
    return None, f"{type(error).__name__}: {text}"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _remove(path: Path | None) -> None:
    if path is None:
        return
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def write_error(error: BaseException, path: Path, what: str, after: str = "") -> WriteError:
    code, cause = diagnose(error, path)
    hint = HINTS.get(code, "fix the cause")
    return WriteError(f"cannot write {what} {path}: {cause}; {hint}{'; ' + after if after else ''}")


@contextmanager
def guarded(path: str | Path, what: str, partial: str | Path | Callable[[], None] | None = None,
            after: str = "") -> Iterator[Path]:
    """Write `path` (the file or directory named in the error) inside the block; on a failure of the
    disk, remove `partial` (a path, or a function that removes the writer's partial output; default:
    nothing), then raise WriteError: "cannot write <what> <path>: <cause>; <how to fix>; <after>"."""
    path = Path(path)

    def remove_partial() -> None:
        partial() if callable(partial) else _remove(Path(partial) if partial is not None else None)
    try:
        yield path
    except WriteError:  # a write inside this one failed (and named its file): this one's output goes too
        remove_partial()
        raise
    except WRITE_FAILURES as e:
        if isinstance(e, RuntimeError) and not _is_io(e):
            raise  # a bug or a collective fault, not the disk
        remove_partial()
        raise write_error(e, path, what, after) from None


def _is_io(error: RuntimeError) -> bool:
    """A torch.save RuntimeError from its file writer (not another RuntimeError raised in the block)."""
    text = str(error)
    return any(s in text for s in ("inline_container", "iostream", "PytorchStreamWriter", "file write failed",
                                   "unexpected pos"))


def atomic_write_text(path: Path, text: str, what: str, after: str = "") -> None:
    """Replace `path` with `text` via a temporary sibling; a failure leaves `path` as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with guarded(path, what, tmp, after):
        tmp.write_text(text)
        os.replace(tmp, path)


def append_text(path: Path, text: str, what: str, after: str = "") -> None:
    """Append `text` to `path`; a failure cuts the file back to its size before (no partial line)."""
    size = path.stat().st_size if path.is_file() else 0

    def cut() -> None:
        try:
            os.truncate(path, size)
        except OSError:
            pass
    with guarded(path, what, cut, after):
        with open(path, "a") as f:
            f.write(text)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_free_space(directory: Path, need_bytes: int, what: str, basis: str = "as large as the previous one") -> None:
    """Warn when `directory`'s disk has less free space than `need_bytes` (the next write will likely
    fail) or than twice that (room for one more). `basis`: how `need_bytes` was estimated."""
    try:
        free = shutil.disk_usage(_existing_parent(directory)).free
    except OSError:
        return
    if need_bytes <= 0 or free >= 2 * need_bytes:
        return
    if free < need_bytes:
        status = f"the next {what} (about {_mib(need_bytes)}, {basis}) will likely not fit"
    else:
        status = f"room for one more {what} (about {_mib(need_bytes)} each)"
    print(f"[jetflow] warning: {directory} has {_mib(free)} free: {status}; free space now, or the run stops "
          f"when the disk is full (it resumes with run.resume=true)", file=sys.stderr)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class LockHeld(UserError, RuntimeError):
    """A live process holds the lock file (`take_lock`): its pid and host."""

    def __init__(self, path: Path, pid: object, host: object):
        super().__init__(f"{path} is held by pid {pid} on {host}")
        self.pid, self.host = pid, host


@contextmanager
def lock_file(path: Path, what: str) -> Iterator[Path]:
    """Hold the lock file `path` inside the block (take_lock, then release_lock however the block ends)."""
    take_lock(path, what)
    try:
        yield path
    finally:
        release_lock(path)


def take_lock(path: Path, what: str) -> None:
    """Create the lock file `path` naming its owner (pid, host). A lock whose process is gone from this
    host (a killed run) is taken over with a warning; a live owner, or one on another host, raises
    LockHeld; a disk that cannot hold the file, WriteError (`what` names it)."""
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text())
            except (OSError, ValueError):
                owner = {"pid": -1, "host": me["host"]}  # torn by a kill between create and write
            if owner.get("host") == me["host"] and not _alive(int(owner.get("pid", -1))):
                print(f"[jetflow] warning: taking over {path} from pid {owner.get('pid')}, which is gone",
                      file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            raise LockHeld(path, owner.get("pid"), owner.get("host")) from None
        except OSError as e:  # a read-only or full disk
            raise write_error(e, path, what) from None
        with guarded(path, what, partial=path):
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
        return


def release_lock(path: Path) -> None:
    """Remove the lock file `path` if this process holds it (a no-op for any other process)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
