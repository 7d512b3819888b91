"""The GGUF files of a models directory (``--models-dir``): which files are models, under which
names, which multimodal projector goes with each, and the check a name-based load passes
before llama.cpp opens anything.

Projectors (``mmproj*.gguf``, any file whose name holds ``mmproj``) are never models, as in
llama-server's models directory. A model ``NAME.gguf`` reads images through
``mmproj-NAME.gguf`` (or ``NAME-mmproj.gguf``, ``NAME.mmproj.gguf``) beside it, and a
directory of one model and one projector pairs them whatever their names (``projector_for``).

Invariant: a listed model is a regular file (never a symlink) directly inside the directory,
named ``*.gguf``; a model split into parts (``x-00001-of-00003.gguf``) is listed once, as its
first part, under the name without the part suffix; of two files of one id the first by
name is listed, and a warning names the other. ``checked_path`` refuses, at load time, a
file that has since become a symlink or moved out of the directory, so a name can only ever
open a file the directory holds: the model, every other part of a split one (``parts``) and
its projector are each checked so. ``pinned`` then opens each of them once, without following
a symlink, and llama.cpp reads the files so opened, through paths that name the open files
(``/proc/self/fd/N``), never the directory's names again: a file swapped for a symlink between
the check and llama.cpp's open (found by review) is not what it reads. (Loads by path are an
admin's, and are not restricted here.)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvwarm.errors import ModelLoadError, NotAModelError

log = logging.getLogger("kvwarm.server")

_PART = re.compile(r"^(?P<stem>.+)-(?P<n>\d{5})-of-\d{5}$")


def scan(directory: Path) -> dict[str, Path]:
    """``{model id: path}`` of the directory's models, sorted by file name."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        log.warning("cannot list models_dir %s: %s", directory, exc.strerror or exc)
        return {}
    found: dict[str, Path] = {}
    for entry in entries:
        if not entry.name.lower().endswith(".gguf") or _is_projector(entry.name):
            continue
        if not entry.is_file(follow_symlinks=False):
            log.debug("models_dir: skipping %s (not a regular file)", entry.name)
            continue
        if not is_utf8(entry.name):
            # Found by review: the id held a lone surrogate (os.fsdecode's), which no JSON
            # response encodes: /health and /v1/models answered 500 while the file was there.
            _say_once(
                directory,
                entry.name,
                "models_dir: skipping %r: its name is not UTF-8, so no request can name it",
                entry.name,
            )
            continue
        stem = entry.name[: -len(".gguf")]
        part = _PART.match(stem)
        if part is not None:
            if int(part["n"]) != 1:
                continue  # llama.cpp finds the other parts from the first
            stem = part["stem"]
        if stem in found:
            _said_hidden(directory, entry.name, found[stem].name, stem)
            continue
        found[stem] = directory / entry.name
    return found


#: (directory, file) already warned of: a scan runs on every request for a name the
#: registry does not know, and each warning is said once.
_WARNED: set[tuple[str, str]] = set()


def _say_once(directory: Path, name: str, message: str, *args: object) -> None:
    key = (str(directory), name)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


def is_utf8(name: str) -> bool:
    """Whether ``name`` (``os.fsdecode``'s, perhaps with lone surrogates) is UTF-8 text."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _said_hidden(directory: Path, name: str, served: str, model_id: str) -> None:
    """Warn, once per file, that ``name`` is not served: ``served`` has its model id. Found
    by review: ``x.gguf`` beside a split ``x-00001-of-00002.gguf`` (or ``x.GGUF``) was
    neither listed nor loadable, without a word."""
    _say_once(
        directory,
        name,
        "models_dir: %s is not served: model %r is %s (rename one to serve both)",
        name,
        model_id,
        served,
    )


def _is_projector(name: str) -> bool:
    return "mmproj" in name.lower()


def projector_for(directory: Path, model: Path, models: int) -> Path | None:
    """The projector beside ``model`` in ``directory`` (a regular file named for it, or the
    only one of a directory holding ``models`` == 1 model), None if there is none."""
    stem = model.name[: -len(".gguf")]
    part = _PART.match(stem)
    if part is not None:
        stem = part["stem"]
    try:
        names = {
            e.name: e
            for e in os.scandir(directory)
            if e.name.lower().endswith(".gguf")
            and _is_projector(e.name)
            and e.is_file(follow_symlinks=False)
            and is_utf8(e.name)  # a model's meta names it: JSON must encode it
        }
    except OSError:
        return None
    for name in (f"mmproj-{stem}.gguf", f"{stem}-mmproj.gguf", f"{stem}.mmproj.gguf"):
        if name in names:
            return directory / name
    if models == 1 and len(names) == 1:
        return directory / next(iter(names))
    return None


def checked_path(directory: Path, path: Path) -> Path:
    """``path`` if it is still a regular file directly inside ``directory``."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ModelLoadError(f"{path.name} is no longer in models_dir: {exc.strerror}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ModelLoadError(
            f"{path.name} in models_dir is not a regular file (symlinks are refused)"
        )
    if path.resolve().parent != directory.resolve():
        raise ModelLoadError(f"{path} is outside models_dir {directory}")
    return path


#: Where this system names an open file descriptor as a path (Linux; ``/dev/fd`` elsewhere).
_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


@contextmanager
def pinned(directory: Path, paths: Sequence[Path]) -> Iterator[dict[Path, Path]]:
    """Each of ``paths`` (files directly inside ``directory``) opened now, relative to the
    directory and without following a symlink, and ``{path: a path to the opened file}``
    for the ``with`` block: a private directory of links, each of the file's own name (a
    split model's first part finds its other parts beside it by name), to the open
    descriptor. Whatever the directory's names point to later, these paths read the files
    opened here. ``ModelLoadError`` for a name that is gone, a symlink or not a regular
    file; everything is closed and removed at the block's end."""
    with ExitStack() as stack:
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ModelLoadError(f"cannot open models_dir {directory}: {exc.strerror}") from exc
        stack.callback(os.close, dir_fd)
        links = Path(tempfile.mkdtemp(prefix="kvwarm-pinned-"))  # 0700, this process's
        stack.callback(shutil.rmtree, links, True)
        out: dict[Path, Path] = {}
        for path in paths:
            fd = _open_inside(dir_fd, directory, path)
            stack.callback(os.close, fd)
            link = links / path.name
            os.symlink(f"{_FD_DIR}/{fd}", link)
            out[path] = link
        yield out


def _open_inside(dir_fd: int, directory: Path, path: Path) -> int:
    """``path``'s file, opened by its name in the directory open as ``dir_fd``; never
    through a symlink (``O_NOFOLLOW``), never blocking on a FIFO (``O_NONBLOCK``)."""
    if path.parent.resolve() != directory.resolve() or path.name in ("", ".", ".."):
        raise ModelLoadError(f"{path} is outside models_dir {directory}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path.name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if os.path.islink(path):
            raise ModelLoadError(
                f"{path.name} in models_dir is not a regular file (symlinks are refused)"
            ) from exc
        raise ModelLoadError(f"{path.name} is no longer in models_dir: {exc.strerror}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelLoadError(f"{path.name} in models_dir is not a regular file")
    return fd


def parts(path: Path) -> list[Path]:
    """The other parts of the split model whose first part is ``path`` (llama.cpp opens them
    by name, beside it); none for a model in one file."""
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    match = re.match(r"^(?P<stem>.+)-00001-of-(?P<n>\d{5})$", stem)
    if match is None:
        return []
    n = int(match["n"])
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(2, n + 1)]


GGUF_MAGIC = b"GGUF"


def check_gguf_magic(path: str | Path) -> None:
    """``NotAModelError`` (a 400) unless ``path`` starts with the 4-byte GGUF magic; checked
    before llama.cpp sees the file (``/etc/passwd`` or a garbage ``.gguf`` was a 503 that
    degraded health). A file that cannot be opened is left to the loader's own error.

    Opened without blocking (found by review: it runs on the server's event loop, and a file
    swapped for a FIFO after the caller's ``is_file`` had ``open`` wait for a writer, and the
    whole server with it): what is no regular file by then is no model either."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAModelError(
                f"{Path(path).name!r} is not a GGUF model file (not a regular file)", param="path"
            )
        try:
            head = f.read(4)
        except OSError:
            return
    if head != GGUF_MAGIC:
        raise NotAModelError(
            f"{Path(path).name!r} is not a GGUF model file (no GGUF magic)", param="path"
        )
