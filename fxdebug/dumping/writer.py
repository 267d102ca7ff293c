"""Writing a dump folder: all of it or nothing, by a rename in the same parent folder."""

from __future__ import annotations

import os
import shutil
import tempfile

from ..errors import FxdebugError

__all__ = ["looks_like_dump", "write_atomically"]


def looks_like_dump(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "breakpoints.json"))
            and os.path.isfile(os.path.join(path, "run.py"))) or not os.listdir(path)


def write_atomically(folder: str, files: dict[str, bytes], overwrite: bool) -> None:
    parent = os.path.dirname(folder)
    name = os.path.basename(folder)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise FxdebugError(f"cannot write dump folder {folder!r}: creating a folder in "
                           f"{parent!r} failed ({exc.strerror}). Choose a folder whose parent is "
                           f"writable.") from exc
    old = None
    try:
        for filename, data in files.items():
            try:
                with open(os.path.join(tmp, filename), "wb") as handle:
                    handle.write(data)
            except OSError as exc:
                raise FxdebugError(f"cannot write dump folder {folder!r}: writing {filename} "
                                   f"failed ({exc.strerror}); nothing was written. Free disk "
                                   f"space or choose another folder.") from exc
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.lexists(folder):
            old = tempfile.mkdtemp(prefix=f".{name}.", suffix=".old", dir=parent)
            os.rename(folder, os.path.join(old, name))
        try:
            os.rename(tmp, folder)
        except OSError as exc:
            if old is not None:
                os.rename(os.path.join(old, name), folder)
            raise FxdebugError(f"cannot write dump folder {folder!r}: renaming the finished "
                               f"temporary folder failed ({exc.strerror}).") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
