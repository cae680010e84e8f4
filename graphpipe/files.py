"""Reading untrusted documents and writing outputs without clobbering what is not ours.

Reading (:func:`read_json_file`): a file larger than
:data:`MAX_DOCUMENT_BYTES` or nested deeper than :data:`MAX_DEPTH` is
refused with one line *before* the JSON parser sees it (the parser recurses
once per level; a 200,000-deep array is a ``RecursionError``, not a
document). The field checkers (:func:`number`, :func:`integer`,
:func:`string`, :func:`array`, :func:`mapping`) are what every document
parser uses to say which field is wrong: ``true`` is not a number and
``"0"`` is not a device id.

Writing (:func:`check_output`, then :func:`write_atomic`): outputs are
checked before any work starts (the folder exists and takes a file, the
suffix is one we can write, the target is a regular file or nothing), then
written to a temporary file beside the target and renamed over it. The
rename happens only over a regular file or nothing: a symlink, FIFO,
device node or folder at that path is refused, never replaced. The new file
keeps the mode of the file it replaces, or gets ``0666 & ~umask`` (what
``open(path, "w")`` gives). The temporary file is removed on every exit path
that runs Python code (an exception, Ctrl-C, SIGTERM through the CLI's
handler); one left by SIGKILL is removed by the next write to that folder
(its name carries the dead writer's pid).

JSON and text (:func:`write_json_atomic`, :func:`write_text_atomic`) go
further: the document is serialized in memory first (a failure there,
``MemoryError`` included, touches no file), then written to an *unnamed*
file in the target's folder (Linux ``O_TMPFILE``) that gets a name only
once complete, just before the rename. A process the kernel kills while
writing (the out-of-memory killer's SIGKILL, which runs no Python) leaves
nothing behind: the kernel frees an unnamed file with its last descriptor.
Where ``O_TMPFILE`` is missing (other systems, some file systems) the named
temporary file above is used.

Example
-------
>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> path = os.path.join(folder, "plan.json")
>>> check_output(path, "--out", (".json",))
>>> write_json_atomic(path, {"a": 1})
>>> read_json_file(path)
{'a': 1}
>>> integer(True, "stage 0 devices[0]")
Traceback (most recent call last):
...
graphpipe.errors.FormatError: stage 0 devices[0] must be an integer, got true
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import stat
from typing import Any, Callable, Sequence

from graphpipe.errors import FormatError, InputError

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_DEPTH",
    "read_json_file",
    "check_depth",
    "check_output",
    "write_atomic",
    "write_json_atomic",
    "write_bytes_atomic",
    "write_text_atomic",
    "number",
    "integer",
    "string",
    "array",
    "mapping",
    "pid_alive",
]

MAX_DOCUMENT_BYTES = 256 * 2**20
"""Largest document read (256 MiB): a plan of a 10,000-op graph on 1,024 devices is a few MiB."""
MAX_DEPTH = 64
"""Deepest nesting of arrays/objects read; graphpipe documents nest at most 5 levels."""

_TMP_MARK = ".graphpipe-tmp-"
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


# ----------------------------------------------------------------- reading
def check_depth(text: str, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON text nested deeper than ``limit`` (strings are skipped, so brackets in names do not count)."""
    if text.count("[") + text.count("{") <= limit:
        return
    depth = 0
    for match in _BRACKETS.finditer(_STRINGS.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                raise FormatError(f"{where}: nested deeper than {limit} levels; not a graphpipe document")
        else:
            depth -= 1


def read_json_file(path: str, what: str = "file") -> Any:
    """Load a JSON file; a missing file, a folder, a huge or deep file, bad JSON: one-line errors."""
    try:
        if not os.path.exists(path):
            raise InputError(f"no such {what}: {path}")
        if os.path.isdir(path):
            raise InputError(f"{path} is a directory, not a {what}")
        if not os.path.isfile(path):
            raise InputError(f"{path} is not a regular file (a device, FIFO or socket); give a JSON {what}")
        size = os.path.getsize(path)
        if size > MAX_DOCUMENT_BYTES:
            raise InputError(f"{path}: {size / 2**20:.0f} MiB is larger than the {MAX_DOCUMENT_BYTES // 2**20} MiB "
                             f"limit for a {what}")
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_DOCUMENT_BYTES + 1)
    except PermissionError:
        raise InputError(f"cannot read {path}: permission denied") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not a text (JSON) file") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    check_depth(text, path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # check_depth makes this unreachable; kept so no input can bypass the one line
        raise FormatError(f"{path}: nested too deeply") from None


# ------------------------------------------------------------ field checks
def number(value: Any, where: str, minimum: float | None = None) -> float:
    """A finite JSON number (``true``/``false`` and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(f"{where} must be a number, got {_show(value)}")
    if isinstance(value, int) and abs(value) > 2**63:
        raise FormatError(f"{where} is out of range: {_show(value)}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise FormatError(f"{where} must be a finite number{bound}, got {_show(value)}")
    return value


def integer(value: Any, where: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A JSON integer (``1.0``, ``"0"`` and ``true`` are not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FormatError(f"{where} must be <= {maximum}, got {_show(value)}")
    return value


def _of_type(value: Any, where: str, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise FormatError(f"{where} must be {name}, got {_show(value)}")
    return value


def string(value: Any, where: str) -> str:
    return _of_type(value, where, str, "a string")


def array(value: Any, where: str) -> list:
    return _of_type(value, where, list, "a JSON array")


def mapping(value: Any, where: str) -> dict:
    return _of_type(value, where, dict, "a JSON object")


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------- writing
def _refuse_kind(path: str, what: str) -> None:
    """Refuse an existing path that is not a regular file; nothing to do when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise InputError(f"{what} {path}: {_first_file(path)} is a file, not a folder") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise InputError(f"{what} {path} is a symbolic link; graphpipe replaces only regular files "
                         "(write to the link's target, or remove the link)")
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} {path} is a directory; give a file name inside it")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path} is a device, FIFO or socket, not a regular file; choose a file name")


def _first_file(path: str) -> str:
    """The first component of ``path`` that exists and is not a folder."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if os.path.exists(prefix) and not os.path.isdir(prefix):
            return prefix
    return os.path.dirname(path)


def check_output(path: str, what: str = "output", suffixes: Sequence[str] | None = None) -> None:
    """Refuse an output path before any work: bad suffix, missing or read-only folder, non-regular target.

    ``suffixes`` (lower case, with the dot) lists what we can write there;
    None accepts any. The folder is probed by creating and removing a
    temporary file in it, the one test that also holds for root and /proc.
    """
    if not isinstance(path, str) or not path or path.endswith(os.sep):
        raise InputError(f"{what} needs a file name, got {path!r}")
    _refuse_kind(path, what)
    if suffixes is not None:
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in suffixes:
            raise InputError(f"{what} {path}: cannot write {suffix or 'a file without a suffix'}; "
                             f"use one of {', '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):
        raise InputError(f"{what} {path}: folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise InputError(f"{what} {path}: {_first_file(path)} is a file, not a folder")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise InputError(f"{what} {path} is read-only; remove it or choose another name")
    probe = _tmp_name(path)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _tmp_name(path: str) -> str:
    folder, base = os.path.split(os.path.abspath(path))
    suffix = os.path.splitext(base)[1]  # kept: matplotlib picks the format from it
    return os.path.join(folder, f".{base}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def _remove_stale(path: str) -> None:
    """Remove temporary files of ``path`` left by writers that no longer run (SIGKILL mid-write)."""
    folder, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}{_TMP_MARK}"
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix):].partition("-")[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it the old way (briefly set, then restored)
    os.umask(mask)
    return mask


def write_atomic(path: str, write: Callable[[str], None], what: str = "output") -> None:
    """Call ``write(tmp_path)`` to produce the file, then rename it over ``path`` (a regular file or nothing).

    The temporary file is always removed when anything fails, and the target
    is re-checked just before the rename, so a FIFO or symlink put there
    while we worked is not replaced either.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _refuse_kind(path, what)
    _remove_stale(path)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        _install(tmp, path, what)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _install(tmp: str, path: str, what: str) -> None:
    """Rename the finished ``tmp`` over ``path`` with the mode ``path`` had (a new file: 0666 less the umask),
    re-checking first that ``path`` is still a regular file or nothing."""
    _refuse_kind(path, what)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_bytes_atomic(path: str, data: bytes, what: str = "output") -> None:
    """Put ``data`` at ``path`` through an unnamed temporary file (module docstring): a SIGKILL at any moment
    leaves either the old file or the new one, and no partial file under any name (but for the instant between
    naming the finished file and the rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _refuse_kind(path, what)
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666)
    except (AttributeError, OSError):  # no O_TMPFILE here: the named temporary file
        write_atomic(path, lambda tmp: _write_named(tmp, data), what)
        return
    _remove_stale(path)
    tmp = _tmp_name(path)
    try:
        try:
            _write_all(fd, data)
            named = _name_unnamed(fd, tmp)
        finally:
            os.close(fd)
        if not named:  # /proc missing or linkat refused: the named temporary file
            write_atomic(path, lambda t: _write_named(t, data), what)
            return
        _install(tmp, path, what)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _name_unnamed(fd: int, name: str) -> bool:
    """Give the ``O_TMPFILE`` file open as ``fd`` the name ``name``: ``linkat(AT_SYMLINK_FOLLOW)`` of
    ``/proc/self/fd/<fd>`` (passing a directory descriptor makes ``os.link`` call ``linkat``, not ``link``,
    which would try to link the /proc entry itself). False when this system cannot."""
    try:
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    except (OSError, NotImplementedError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EEXIST):
            raise
        return False
    finally:
        os.close(proc)
    return True


def _write_named(tmp: str, data: bytes) -> None:
    with open(tmp, "xb") as fh:
        fh.write(data)


def write_json_atomic(path: str, doc: Any) -> None:
    """Write JSON to ``path`` via :func:`write_bytes_atomic`: never half-written, never over a non-file."""
    write_bytes_atomic(path, (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode("utf-8"))


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))
