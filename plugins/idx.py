"""Read IDX files, the format of MNIST and Fashion-MNIST, plain or gzipped.

An IDX file is ``00 00 <type code> <ndim>``, then ``ndim`` big-endian uint32
dimensions, then the data in row-major, big-endian order.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from hetfair.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"

# IDX type code -> big-endian numpy dtype.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """The array stored in the IDX file ``path``, in native byte order.

    The file is gunzipped when it starts with the gzip magic bytes, whatever its
    name. Any malformed content raises :class:`DataError` naming the file.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[:2] != b"\x00\x00":
        raise DataError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'}, expected 0000TTNN)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in IDX_DTYPES:
        raise DataError(f"{path}: unknown IDX data type code 0x{type_code:02x}")
    dtype = IDX_DTYPES[type_code]
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, expected {header_size} for {ndim} dims)")
    shape = struct.unpack(f">{ndim}I", raw[4:header_size])
    count = math.prod(shape)
    expected, found = count * dtype.itemsize, len(raw) - header_size
    if found != expected:
        problem = "truncated" if found < expected else "trailing bytes"
        raise DataError(
            f"{path}: {problem}: shape {'x'.join(map(str, shape))} of {dtype.name} needs {expected} data bytes, "
            f"found {found}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header_size)
    return data.astype(dtype.newbyteorder("=")).reshape(shape)


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt gzip data: {exc}") from exc
