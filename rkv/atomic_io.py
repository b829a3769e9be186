"""Writing so that a failure never loses what was there: saves, checkpoints, results.

Both transactions write aside (a fresh temporary name in the target's folder), fsync, and only
then put the new version in place with one rename, so a reader sees the previous version or the
new one whole, whatever fails or kills the writer meanwhile:

- :func:`save_atomically`: a directory of files (``rkv.cache.save``, ``Pool.save``,
  ``rkv.sparse.save``); a previous save is swapped out by an atomic exchange where Linux offers
  one, and a directory holding anything besides a save of that kind is refused, not emptied.
- :func:`write_file_atomically`: one file (safetensors checkpoints, profiles, benchmark JSON).

Written here rather than taken from a package: ``atomicwrites``, the usual one, is unmaintained
since 2022 and writes single files only; the saves need the directory exchange, and every runtime
dependency has to travel to the GPU machines as a wheel.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO


def save_atomically(directory: str, write: Callable[[str], None], *, where: str, what: str,
                    kind: str, names: set[str]) -> None:
  """The transaction every rkv saver runs.

  Checks that ``directory`` is absent or holds nothing but files in ``names`` (it is replaced
  whole), has ``write`` fill a fresh temporary directory beside it, and installs that in one
  atomic step. An ``OSError`` becomes a ``ValueError`` starting with ``where`` that says the
  previous save is unchanged; the temporary directory is removed whatever happens (a killed
  writer leaves its ``.<name>.saving-*`` directory beside the target)."""
  target = os.path.realpath(directory)
  _check_replaceable(target, directory, where=where, kind=kind, names=names)
  parent, base = os.path.split(target)
  tmp = None
  try:
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.saving-", dir=parent)
    write(tmp)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a save is as readable as any new dir
    fsync_dir(tmp)  # the files' names, before the rename makes them the save
    install(tmp, target)
  except OSError as e:
    raise ValueError(f"{where}: could not save {what} to {directory!r} ({e}); the previous save "
                     f"there, if any, is unchanged") from e
  finally:
    if tmp is not None:  # the unfinished save, or the previous one after an exchange
      shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def write_file_atomically(path: str, *, binary: bool = False) -> Iterator[IO]:
  """``with write_file_atomically(path) as f: ...`` writes ``f`` to a fresh temporary file beside
  ``path`` and, when the block ends without an exception, fsyncs it and renames it onto ``path``
  (its folder made if missing). Otherwise the temporary file is removed and ``path`` keeps what
  it held. The file gets the mode a new file would (mkstemp makes 0600). A symlink at ``path``
  stays one: the file it points to is the one replaced, as a plain ``open(path, "w")`` would."""
  path = os.path.realpath(os.path.expanduser(path))
  folder, base = os.path.split(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{base}.writing-", dir=folder)
  try:
    with os.fdopen(fd, "wb" if binary else "w") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
    fsync_dir(folder)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def file_crc32(path: str, chunk: int = 1 << 26) -> int:
  """The CRC-32 of a file's bytes (what the saves' manifests record, checked on load)."""
  crc = 0
  with open(path, "rb") as f:
    while data := f.read(chunk):
      crc = zlib.crc32(data, crc)
  return crc


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def install(tmp: str, target: str) -> None:
  """Puts the finished save ``tmp`` at ``target`` in one atomic step; afterwards ``tmp`` is gone
  or holds the previous save (the caller removes it)."""
  for _ in range(8):  # concurrent savers may move target between the steps: try again
    try:
      os.rename(tmp, target)  # target absent, or an empty directory (POSIX replaces it)
      break
    except OSError as e:
      if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
        raise
    try:
      if _exchange(tmp, target):
        break
    except FileNotFoundError:
      continue  # another saver moved target away: the plain rename may work now
    # No atomic exchange here: move the previous save aside first. A crash between the two
    # renames leaves it in the aside directory, not at target.
    aside = tmp + ".previous"
    try:
      os.rename(target, aside)
    except FileNotFoundError:
      continue
    os.rename(tmp, target)
    os.rename(aside, tmp)  # the caller removes it
    break
  else:
    raise OSError(errno.EBUSY, "other saves kept replacing it", target)
  fsync_dir(os.path.dirname(target))


def _check_replaceable(target: str, directory: str, *, where: str, kind: str,
                       names: set[str]) -> None:
  """``target`` is absent, or a directory holding nothing but a save (it is replaced whole)."""
  if not os.path.lexists(target):
    return
  if not os.path.isdir(target):
    raise ValueError(f"{where}: directory {directory!r} exists and is not a directory")
  foreign = sorted(set(os.listdir(target)) - names)
  if foreign:
    raise ValueError(f"{where}: directory {directory!r} holds {foreign[:5]} besides {kind}; a "
                     f"save replaces the whole directory, so it refuses to delete them: save into "
                     f"a new or empty directory")


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps the directories ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``).

  False where that is not available (another OS, an old libc, a filesystem that refuses it)."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                        ctypes.c_uint]
  if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), b)
