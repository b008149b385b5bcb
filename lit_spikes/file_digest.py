"""Whether a checkpoint as torch read it back is what was saved. A zip record's CRC-32
checked with Python's ``zipfile`` says the bytes on disk are the bytes written; torch
reads the archive with a reader of its own, which a damaged header can lead elsewhere (a
flipped byte in a record's external attributes loaded AdamW's ``step`` 4.0 as 2.9e-38,
uninitialized memory, while every CRC passed). So two checks hold what torch returned:

- each tensor's storage, as loaded, has the CRC-32 the archive records for one of its
  ``data/`` records: torch's writer computes it at save, for free, and a storage torch
  read wrong matches none (files saved with checksums off record 0: nothing to check);
- the rest (keys, numbers, strings, each tensor's dtype, shape, strides), a SHA-256 that
  ``AtomicCheckpointIO`` computes from what it hands torch and writes as the archive's
  comment, which zip readers skip, checked against what torch unpickled. It reads no
  tensor's bytes (nothing is copied off a GPU for it), and a file re-saved by anything
  else (a user's surgery with ``torch.save``) has no comment: its tensors are checked.

Rationale and cost: docs/survives.md ("A damaged file").
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import torch

COMMENT = b"lit-spikes structure sha256 "
"""The archive comment's start; ``structure_digest`` follows it, in hex."""
_END = 22
"""The length of a zip archive's end record with no comment; its last 2 bytes are the
comment's length (the zip format's own layout, zip64 archives included)."""
_DATA_RECORD = re.compile(r"^[^/]+/data/[^/]+$")
_TAGS: dict[type, str] = {torch.dtype: "d", torch.device: "v"}


def structure_digest(value: Any) -> str:
    """A SHA-256 of everything in ``value`` but its tensors' bytes (their dtype, shape,
    strides and offset are in it); the same before ``torch.save`` and after ``torch.load``
    (a set's order, which a new process may iterate otherwise, is not)."""
    digest = hashlib.sha256()
    for chunk in _chunks(value):
        digest.update(chunk)
    return digest.hexdigest()


def _chunks(value: Any) -> Iterator[bytes]:
    if isinstance(value, torch.Tensor):
        stride = value.stride() if value.layout == torch.strided else ()
        offset = value.storage_offset() if value.layout == torch.strided else 0
        yield f"T{value.dtype}{tuple(value.shape)}{stride}{offset};".encode()
    elif isinstance(value, Mapping):
        yield f"{{{len(value)}:".encode()
        for key, item in value.items():
            yield from _chunks(key)
            yield from _chunks(item)
    elif isinstance(value, list | tuple):
        yield f"[{len(value)}:".encode()
        for item in value:
            yield from _chunks(item)
    elif isinstance(value, set | frozenset):
        yield f"<{len(value)}:".encode()
        yield from sorted(structure_digest(item).encode() for item in value)
    elif isinstance(value, bool) or value is None:
        yield {True: b"b1", False: b"b0", None: b"n"}[value]
    elif isinstance(value, int):
        yield f"i{int(value)};".encode()
    elif isinstance(value, float):
        yield f"f{float(value).hex()};".encode()
    elif isinstance(value, bytes):
        yield f"y{len(value)}:".encode() + value
    elif isinstance(value, str | torch.dtype | torch.device):
        text = str.__str__(value) if isinstance(value, str) else str(value)
        data = text.encode("utf-8", "surrogatepass")
        yield f"{_TAGS.get(type(value), 's')}{len(data)}:".encode() + data
    else:  # a class a user allowed for weights_only loads: its kind only, no repr
        yield f"o{type(value).__module__}.{type(value).__qualname__};".encode()


def save_with_digest(checkpoint: Any, handle: BinaryIO) -> None:
    """``torch.save(checkpoint, handle)``, the archive's comment its ``structure_digest``
    (``handle`` is a new file, open for reading too)."""
    digest = structure_digest(checkpoint)
    torch.save(checkpoint, handle)
    handle.seek(-_END, os.SEEK_END)
    end = handle.read(_END)
    if end[:4] != b"PK\x05\x06" or end[-2:] != b"\0\0":
        return  # not the end record torch writes: left as it is
    comment = COMMENT + digest.encode()
    handle.seek(-2, os.SEEK_END)
    handle.write(len(comment).to_bytes(2, "little") + comment)


def misread(loaded: Any, archive: zipfile.ZipFile) -> str | None:
    """What of ``loaded`` (``torch.load``'s result of the file ``archive`` reads) is not
    what was saved, or None."""
    comment, infos = archive.comment, archive.infolist()
    if comment.startswith(COMMENT) and comment[len(COMMENT) :].decode(errors="replace") != (
        structure_digest(loaded)
    ):
        return "its contents as torch read them are not what was saved (their digest differs)"
    recorded = Counter(
        info.CRC for info in infos if _DATA_RECORD.match(info.filename) and info.file_size
    )
    if not recorded or 0 in recorded:
        return None  # saved without checksums
    unmatched = sorted(Counter(_storage_crcs(loaded)) - recorded)
    if unmatched:
        return (
            f"{len(unmatched)} tensor(s) as torch read them match no record of the file "
            f"(CRC-32 {unmatched[0]:08x})"
        )
    return None


def _storage_crcs(loaded: Any) -> Iterator[int]:
    seen: set[tuple[int, int]] = set()
    for tensor in _tensors(loaded):
        if tensor.layout != torch.strided or tensor.is_quantized:
            continue
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        yield zlib.crc32(data.data)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _tensors(item)
