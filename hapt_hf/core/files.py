"""Writing a file so that a reader never sees half of it: a temporary file, then a rename."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["write_atomic", "replace_atomic", "new_file_mode"]


def new_file_mode() -> int:
    """The permissions ``open(path, "w")`` gives a new file (0o666 less the umask): a temporary
    file from ``tempfile.mkstemp`` is 0o600, which a rename would keep."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def replace_atomic(path: str | os.PathLike, write: Callable[[Path], None],
                   suffix: str = ".tmp") -> Path:
    """Make ``path`` by ``write(temporary)``, the temporary a file in the same directory (named
    ending in ``suffix``, for writers that read it), then ``os.replace``: a crash leaves the old
    file (or none), never a torn one, and no temporary. The file gets the permissions a plain
    ``open`` would give it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        os.chmod(tmp, new_file_mode())  # as open() would make it, not mkstemp's owner-only
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`replace_atomic`)."""
    return replace_atomic(path, lambda tmp: tmp.write_text(text))
