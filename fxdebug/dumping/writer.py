"""Writing a dump folder: all of it or nothing, never a file fxdebug did not write.

::

    write_atomically(folder, files, overwrite, known)
      ├─ _Token(parent, name)          .NAME.T.lock in the parent, flock'ed while writing
      ├─ clean_leftovers(folder)       earlier writers that were killed: their .NAME.T.tmp
      │                                removed, an earlier dump left in .NAME.T.old put back
      ├─ check_replaceable(folder)     only a folder whose files are exactly its manifest's
      ├─ .NAME.T.tmp                   every file, then manifest.json (names, sizes, sha256)
      └─ rename folder -> .NAME.T.old, rename .NAME.T.tmp -> folder, remove .NAME.T.old

A writer holds an exclusive ``flock`` on its ``.NAME.T.lock`` from before it
creates ``.NAME.T.tmp`` until after it removed ``.NAME.T.old``; the kernel
drops the lock when the process dies, however it dies. So a ``.tmp``/``.old``
whose lock is gone or free belongs to a dead writer, and the next dump to the
same folder finishes its work: the temporary folder is removed (only the files a
dump writes), an earlier dump found only in ``.old`` (killed between the two
renames) is renamed back.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable

from ..errors import FxdebugError, FxdebugWarning
from ..tracing.locations import caller_stacklevel

__all__ = ["MANIFEST", "write_atomically", "prepare_destination", "clean_leftovers", "check_replaceable", "manifest_of"]

MANIFEST = "manifest.json"
_PYC = re.compile(r"^(?P<stem>[^.]+)\.[\w-]+(?:\.opt-\d)?\.pyc$")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_of(files: dict[str, bytes]) -> bytes:
    """manifest.json's bytes: every file the dump writes, with its size and sha256.

    >>> print(manifest_of({"a.txt": b"hi"}).decode())
    {
     "written_by": "fxdebug.dump",
     "files": {
      "a.txt": {"size": 2, "sha256": "8f434346648f6b96df89dda901c5176b10a6d83961dd3c1ac88b59b2dc327aa4"}
     }
    }
    <BLANKLINE>
    """
    return _manifest({name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()})


def _manifest(entries: dict[str, tuple[int, str]]) -> bytes:
    """manifest.json's bytes from ``{name: (size, sha256)}``."""
    rows = [f"  {json.dumps(name)}: " + json.dumps({"size": size, "sha256": sha256})
            for name, (size, sha256) in sorted(entries.items())]
    return ('{\n "written_by": "fxdebug.dump",\n "files": {\n' + ",\n".join(rows) + "\n }\n}\n").encode()


class _HashingFile:
    """A binary file that counts and hashes what is written (one pass: no copy kept in memory).

    A large block is hashed on ``hasher``'s thread while this one writes it
    (both release the GIL), and the write returns once both are done, so the
    caller may reuse its buffer and the blocks are hashed in order.
    """

    def __init__(self, handle, hasher: ThreadPoolExecutor | None = None) -> None:
        self.handle = handle
        self.size = 0
        self.digest = hashlib.sha256()
        self.hasher = hasher

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if self.hasher is None or view.nbytes < _PARALLEL_HASH_BYTES:
            self.digest.update(view)
            return self.handle.write(view)
        hashed = self.hasher.submit(self.digest.update, view)
        try:
            return self.handle.write(view)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.handle.flush()


_PARALLEL_HASH_BYTES = 1 << 20


def _write_file(path: str, data) -> tuple[int, str]:
    """Write ``data`` (bytes, or a function writing into a binary file) to ``path``: (size, sha256)."""
    with open(path, "wb") as handle:
        if callable(data):
            with ThreadPoolExecutor(1, thread_name_prefix="fxdebug-dump-hash") as hasher:
                hashing = _HashingFile(handle, hasher)
                data(hashing)
            return hashing.size, hashing.digest.hexdigest()
        handle.write(data)
    return len(data), hashlib.sha256(data).hexdigest()


def _bytecode_of(folder: str, listed) -> list[str]:
    """The ``__pycache__`` entries Python wrote for ``listed`` .py files (run.py, load() make them)."""
    cache = os.path.join(folder, "__pycache__")
    if not os.path.isdir(cache) or os.path.islink(cache):
        return []
    stems = {name[:-3] for name in listed if name.endswith(".py")}
    return sorted(entry for entry in os.listdir(cache)
                  if (m := _PYC.match(entry)) and m.group("stem") in stems
                  and os.path.isfile(os.path.join(cache, entry)))


def _foreign(folder: str, allowed) -> list[str]:
    """Entries of ``folder`` (recursively, relative) that are neither ``allowed`` nor their bytecode."""
    found = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry == "__pycache__" and os.path.isdir(path) and not os.path.islink(path):
            ours = set(_bytecode_of(folder, allowed))
            found += [f"__pycache__/{e}" for e in sorted(os.listdir(path)) if e not in ours]
        elif entry not in allowed or not os.path.isfile(path) or os.path.islink(path):
            found.append(entry)
    return found


def check_replaceable(folder: str, hashes: bool = True) -> None:
    """Raise unless ``folder`` is empty or holds exactly what its manifest.json lists, unchanged.

    ``hashes=False`` compares sizes only (the quick check before a dump starts).
    """
    if not os.path.isdir(folder) or os.path.islink(folder):
        raise FxdebugError(f"refusing to overwrite {folder!r}: it is not an fxdebug dump (it is "
                           f"not a folder). Remove it yourself or choose another folder.")
    if not os.listdir(folder):
        return
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as handle:
            listed = json.load(handle)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        foreign = _foreign(folder, ())
        raise FxdebugError(
            f"refusing to overwrite {folder!r}: it is not an fxdebug dump (no readable "
            f"{MANIFEST} listing what a dump wrote there) nor an empty folder; overwriting would "
            f"delete {_names(foreign)}. Remove it yourself or choose another folder.") from None
    foreign = _foreign(folder, set(listed) | {MANIFEST})
    if foreign:
        raise FxdebugError(
            f"refusing to overwrite {folder!r}: it holds files the dump did not write: "
            f"{_names(foreign)}. Move them out (or remove them) to replace the dump, or dump "
            f"to another folder.")
    changed = []
    for name, entry in listed.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue  # a missing file deletes nothing
        if os.path.getsize(path) != entry.get("size") or (hashes and _sha256(path) != entry.get("sha256")):
            changed.append(name)
    if changed:
        raise FxdebugError(
            f"refusing to overwrite {folder!r}: {_names(changed)} changed since it was dumped "
            f"(size or sha256 differ from {MANIFEST}). Copy your changes elsewhere or dump to "
            f"another folder.")


def _names(entries: list[str]) -> str:
    shown = ", ".join(entries[:8])
    return shown + (f" and {len(entries) - 8} more" if len(entries) > 8 else "") if entries else "nothing"


def _remove_ours(path: str, known) -> list[str]:
    """Delete the files a dump writes (and their bytecode) from ``path``, then the folder; return what is left."""
    if not os.path.isdir(path) or os.path.islink(path):
        return [path]
    for entry in _bytecode_of(path, known):
        os.unlink(os.path.join(path, "__pycache__", entry))
    cache = os.path.join(path, "__pycache__")
    if os.path.isdir(cache) and not os.listdir(cache):
        os.rmdir(cache)
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry in known and os.path.isfile(full) and not os.path.islink(full):
            os.unlink(full)
    left = sorted(os.listdir(path))
    if not left:
        os.rmdir(path)
    return left


class _Token:
    """``.NAME.T.lock`` in the parent folder, held with ``flock`` while this process writes."""

    def __init__(self, parent: str, name: str) -> None:
        try:
            fd, self.lock = tempfile.mkstemp(prefix=f".{name}.", suffix=".lock", dir=parent)
        except OSError as exc:
            raise FxdebugError(f"cannot write dump folder {os.path.join(parent, name)!r}: creating "
                               f"a file in {parent!r} failed ({exc.strerror}). Choose a folder "
                               f"whose parent is writable.") from exc
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        stem = self.lock[:-len(".lock")]
        self.tmp, self.old = stem + ".tmp", stem + ".old"

    def release(self) -> None:
        try:
            os.unlink(self.lock)
        except FileNotFoundError:
            pass
        os.close(self.fd)


def _leftover_tokens(parent: str, name: str) -> list[str]:
    pattern = re.compile(re.escape(f".{name}.") + r"([A-Za-z0-9_]+)\.(?:lock|tmp|old)$")
    return sorted({m.group(1) for entry in os.listdir(parent) if (m := pattern.match(entry))})


def _owner_is_dead(lock: str) -> bool:
    """Whether the writer of ``lock`` is gone (no lock file, or its flock is free)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass
    os.close(fd)
    return True


def clean_leftovers(folder: str, known) -> list[str]:
    """Finish the work of killed writers of ``folder``; return what was done, one line each.

    Their temporary folders are removed (only files a dump writes, see ``known``);
    an earlier dump left in ``.NAME.T.old`` goes back to ``folder`` if that is
    missing, and is removed if a newer dump took its place.
    """
    parent, name = os.path.dirname(folder), os.path.basename(folder)
    done = []
    for token in _leftover_tokens(parent, name):
        stem = os.path.join(parent, f".{name}.{token}")
        if not _owner_is_dead(stem + ".lock"):
            continue  # another process is writing this folder right now
        tmp, old = stem + ".tmp", stem + ".old"
        holder = None
        if (os.path.isdir(old) and not os.path.islink(old) and os.listdir(old) == [name]
                and os.path.isdir(os.path.join(old, name))):
            holder, old = old, os.path.join(old, name)  # fxdebug before manifests: .old/NAME
        if os.path.lexists(old):
            if not os.path.lexists(folder):
                os.rename(old, folder)
                done.append(f"restored the earlier dump {folder!r} from {old!r}, where a killed "
                            f"dump had left it")
            else:
                left = _remove_ours(old, known)
                if left:
                    warnings.warn(f"fxdebug.dump: {old!r}, left by a killed dump, holds files a "
                                  f"dump does not write ({_names(left)}); it was kept.",
                                  FxdebugWarning, stacklevel=caller_stacklevel())
        if holder is not None and not os.listdir(holder):
            os.rmdir(holder)
        if os.path.lexists(tmp):
            left = _remove_ours(tmp, known)
            if left:
                warnings.warn(f"fxdebug.dump: {tmp!r}, left by a killed dump, holds files a dump "
                              f"does not write ({_names(left)}); it was kept.",
                              FxdebugWarning, stacklevel=caller_stacklevel())
            else:
                done.append(f"removed {tmp!r}, left by a killed dump")
    return done


def _permission_error(folder: str, exc: OSError) -> FxdebugError:
    where = exc.filename or folder
    return FxdebugError(f"cannot replace the earlier dump {folder!r}: {exc.strerror} ({where}). "
                        f"Make it writable (chmod -R u+w {folder}) or remove it, or dump to "
                        f"another folder; nothing was changed.")


def prepare_destination(folder: str, overwrite: bool, known, hashes: bool = True) -> list[str]:
    """Clean up after killed writers, then raise unless ``folder`` may be (over)written.

    Returns what the clean-up did (see :func:`clean_leftovers`).
    """
    parent, name = os.path.dirname(folder), os.path.basename(folder)
    try:
        done = clean_leftovers(folder, known)
    except OSError as exc:
        raise FxdebugError(f"cannot clean up after a killed dump of {folder!r}: {exc.strerror} "
                           f"({exc.filename}). Remove the hidden .{name}.* entries of "
                           f"{parent!r} yourself.") from exc
    if os.path.lexists(folder):
        restored = "".join(f" ({line})" for line in done if line.startswith("restored"))
        if not overwrite:
            raise FxdebugError(f"cannot dump into {folder!r}: it already exists{restored}. Pass "
                               f"overwrite=True (--overwrite) to replace it, or choose another "
                               f"folder.")
        check_replaceable(folder, hashes)
        for path in [folder, os.path.join(folder, "__pycache__")]:
            if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
                raise _permission_error(folder, PermissionError(13, "Permission denied", path))
    return done


def write_atomically(folder: str, files: dict[str, bytes | Callable[[BinaryIO], Any]],
                     overwrite: bool, known) -> None:
    """Write ``files`` (and manifest.json) as ``folder``, replacing an earlier dump if ``overwrite``.

    ``files``: name -> bytes, or a function writing the file into the binary file
    it is given (a large file is then never held in memory whole).

    ``known``: every file name a dump may write (what leftovers may hold).
    """
    parent, name = os.path.dirname(folder), os.path.basename(folder)
    known = set(known) | set(files) | {MANIFEST}
    token = _Token(parent, name)
    try:
        prepare_destination(folder, overwrite, known)
        os.mkdir(token.tmp)
        entries: dict[str, tuple[int, str]] = {}
        for filename, data in list(files.items()) + [(MANIFEST, None)]:
            try:
                entries[filename] = _write_file(os.path.join(token.tmp, filename),
                                                _manifest(entries) if data is None else data)
            except OSError as exc:
                raise FxdebugError(f"cannot write dump folder {folder!r}: writing {filename} "
                                   f"failed ({exc.strerror}); nothing was written. Free disk "
                                   f"space or choose another folder.") from exc
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(token.tmp, 0o777 & ~umask)
        moved = False
        if os.path.lexists(folder):
            try:
                os.rename(folder, token.old)
            except PermissionError as exc:
                raise _permission_error(folder, exc) from exc
            moved = True
        try:
            os.rename(token.tmp, folder)
        except OSError as exc:
            if moved:
                os.rename(token.old, folder)
            raise FxdebugError(f"cannot write dump folder {folder!r}: renaming the finished "
                               f"temporary folder failed ({exc.strerror}).") from exc
        if moved:
            try:
                left = _remove_ours(token.old, known)
            except PermissionError as exc:
                raise _permission_error(folder, exc) from exc
            if left:
                warnings.warn(f"fxdebug.dump: the earlier dump, moved to {token.old!r}, gained "
                              f"files while being replaced ({_names(left)}); they were kept there.",
                              FxdebugWarning, stacklevel=caller_stacklevel())
    except BaseException:
        if os.path.lexists(token.tmp):
            _remove_ours(token.tmp, known)
        raise
    finally:
        token.release()
