"""Download IDX files (MNIST, Fashion-MNIST) into a cache directory, checksum-verified."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import tempfile
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from hetfair.errors import DataError

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


def is_cached(cache_dir: Path, checksums: Mapping[str, str]) -> bool:
    """True when every file of ``checksums`` is in ``cache_dir`` with that SHA-256."""
    return all((cache_dir / name).is_file() and _sha256(cache_dir / name) == sha256
               for name, sha256 in checksums.items())


def fetch_files(cache_dir: Path, mirrors: Sequence[str], checksums: Mapping[str, str], timeout: float = 30.0) -> Path:
    """Make sure every file of ``checksums`` is in ``cache_dir`` with that SHA-256; return ``cache_dir``.

    Files already there with the right checksum are kept. Each download goes to
    a temporary file in ``cache_dir`` and is renamed into place only once its
    checksum matches, so processes sharing the cache never see partial files.
    Directories created for a download that then fails are removed again.
    """
    cache_dir = Path(cache_dir).expanduser()
    created = [parent for parent in (cache_dir, *cache_dir.parents) if not parent.exists()]
    try:
        for name, sha256 in checksums.items():
            target = cache_dir / name
            if target.is_file() and _sha256(target) == sha256:
                continue
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DataError(f"cannot create the cache directory {cache_dir}: {exc.strerror or exc}") from exc
            failures = _download_from_mirrors(name, sha256, target, mirrors, timeout)
            if failures:
                raise DataError(f"could not download {name} into {cache_dir} ({'; '.join(failures)})")
    except BaseException:
        _remove_empty(created)
        raise
    return cache_dir


def _remove_empty(directories: list[Path]) -> None:
    """Remove those of ``directories`` (deepest first) that are empty; leave the others."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (another process's download?) or not ours to remove: keep it and its parents


def _download_from_mirrors(name: str, sha256: str, target: Path, mirrors: Sequence[str], timeout: float) -> list[str]:
    """Try each mirror until one yields the right file; return why each failed (empty on success)."""
    failures = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + name
        logger.debug("downloading %s", url)
        try:
            got = _download(url, target, sha256, timeout)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            failures.append(f"{url}: {exc}")
            continue
        if got == sha256:
            return []
        failures.append(f"{url}: checksum mismatch (sha256 {got}, expected {sha256})")
    return failures or ["no mirror given"]


def _download(url: str, target: Path, sha256: str, timeout: float) -> str:
    """Fetch ``url`` into a temp file, rename it to ``target`` if its SHA-256 is ``sha256``; return the SHA-256."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() == sha256:
            os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
