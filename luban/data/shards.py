"""The packed shard file: many documents' tokens in one large, checksummed file.

Packing many small documents into a few large files follows the HAI platform's data layer
(3FS / ffrecord: few big files, an offset index, per-block checksums) so that storage sees
large sequential files and readers get O(1) random access: one ``pread`` a read (a memory map
would do it too, but a file cut short under a map kills the reader with SIGBUS).

Layout, format version 2 (little-endian; docs/data.md has the table)::

    [0, 64)                 header: magic, version, dtype code, chunk size, token count,
                            document count, section offsets, tail CRC32, header CRC32
    [64, 64 + n*itemsize)   tokens (uint16 if the vocabulary fits, else uint32)
    [index_offset, ...)     document start offsets, uint64, one per document (8-aligned)
    [crc_offset, ...)       CRC32 of every chunk of ``chunk_tokens`` tokens, uint32
    [end - 4, end)          index CRC32: of the document index [index_offset, crc_offset)

The header's *tail CRC* (bytes 56-60) covers the tail [crc_offset, end): the chunk-CRC table and
the index CRC. So the header CRC still covers every byte of the file but the 0-7 zero padding
bytes between the tokens and the index (header -> chunk CRCs -> tokens, and header -> index CRC ->
document index; the padding is in no CRC: ``verify()`` checks it is zero), while opening reads only
the header and the tail: 64 + 4*chunks + 4 bytes, whatever the document count.

Format version 1 (still read) has no index CRC: its tail is [index_offset, end), the document
index and the chunk-CRC table, so opening it reads (and checks) all of its document index: 8 bytes
a document, ~120 GB for a 15-billion-document corpus, in every rank at start-up.

CRC policy: opening a shard checks the size, the header CRC and the tail CRC (version 1: also that
the document starts are in order within the tokens); a token chunk is verified the first time any
of its tokens is read (its CRC, then, for a reader given the vocabulary's size, its ids below it);
``document(i)`` checks its two index entries are in order within the tokens;
``verify()`` checks every chunk, that the padding is zero, and (version 2) the whole document index:
its CRC, then its order. A shard written since it was opened (its status-change time moved: an
in-place rewrite that keeps its size and header) has every chunk verified again as it is read. Any
failure raises ``LubanError`` naming the file and the byte offset; so does a shard cut short or
replaced since it was opened (``ShardReader._pread``, ``ShardReader._file``)
and an ``OSError`` reading it (EIO from a failing disk, ESTALE on NFS): "cannot read the shard".
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luban.data.atomic import AtomicFile
from luban.errors import LubanError

MAGIC = b"LUBANTOK"
FORMAT_VERSION = 2  # what ShardWriter writes
READ_VERSIONS = (1, 2)  # what ShardReader reads (version 1: docs/data.md)
HEADER = struct.Struct("<8sHHIQQQQQII")
HEADER_SIZE = HEADER.size  # 64
HEADER_CRC_OFFSET = HEADER_SIZE - 4
DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
DEFAULT_CHUNK_TOKENS = 1 << 16
MAX_CHUNK_TOKENS = (1 << 32) - 1  # the header stores chunk_tokens as a uint32: what a reader accepts
# What ``luban data build`` accepts (build.OPTIONS): the first read of a chunk reads it whole to check its
# CRC, so a 2**30-token chunk is a 2-4 GiB read and buffer for one sample's tokens; 2**24 tokens (32-64 MiB)
# is far above any useful chunk (the default is 2**16) and keeps that first read bounded.
MAX_BUILD_CHUNK_TOKENS = 1 << 24
# Bytes ``verify`` reads at a time, whatever the chunk size (a chunk larger than this is CRC'd in pieces):
# a fixed count of chunks would be 64 * (2**32 - 1) tokens at the largest chunk a header can store.
VERIFY_BYTES = 8 << 20
VERIFY_INDEX_ENTRIES = 1 << 20  # document index entries ``verify`` reads at a time (8 MiB)

_INDEX_DTYPE = np.dtype("<u8")
_CRC_DTYPE = np.dtype("<u4")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits (vocab_size <= 65536), else uint32."""
    return DTYPES[1] if vocab_size <= 1 << 16 else DTYPES[2]


def vocab_error(token: int, vocab_size: int) -> str:
    """What is wrong with a token id at or above the vocabulary (a reader's chunk check, ``luban data verify``)."""
    return f"token id {token} is outside the tokenizer's vocabulary ({vocab_size} ids)"


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, dt in DTYPES.items() if dt == np.dtype(dtype))


def _align8(offset: int) -> int:
    return (offset + 7) // 8 * 8


# Linux transfers at most 0x7ffff000 bytes per read/pread/preadv (read(2)), whatever is asked: a longer read
# of a regular file returns short, so every read here loops until it has all it asked for or gets 0 bytes.
def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes from ``offset``, fewer only at the end of the file (one ``pread`` of a regular
    file returns at most ~2 GiB)."""
    parts = []
    while size > 0:
        part = os.pread(fd, min(size, 1 << 30), offset)
        if not part:
            break
        parts.append(part)
        size -= len(part)
        offset += len(part)
    return b"".join(parts)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one committed shard. ``header_crc32`` covers the whole file but the
    0-7 zero padding bytes after the tokens (the header holds the tail CRC, which covers the chunk CRCs, which
    cover the tokens, and the index CRC, which covers the document index; ``verify`` checks the padding is
    zero): a shard swapped for another of the same size is told apart by it."""

    file: str
    tokens: int
    documents: int
    bytes: int
    header_crc32: int


class ShardWriter:
    """Streams documents into one shard; the file appears (atomically) only on ``close()``.

    Use as a context manager: an exception inside the block deletes the temp file.
    """

    def __init__(self, path: str | os.PathLike, dtype, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.chunk_tokens = int(chunk_tokens)
        if not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens = {chunk_tokens}: must be in [1, 2**32)")
        self._out = AtomicFile(path)
        self._out.file.write(bytes(HEADER_SIZE))
        self._doc_starts: list[int] = []
        self._chunk_crcs: list[int] = []
        self._crc = 0
        self._in_chunk = 0
        self.tokens = 0

    def add_document(self, tokens) -> None:
        """Append one document's token ids (the caller includes its end-of-document id)."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside {self.dtype} in {self._out.path}")
        data = memoryview(np.ascontiguousarray(arr, dtype=self.dtype)).cast("B")
        self._doc_starts.append(self.tokens)
        self._out.file.write(data)
        self.tokens += arr.size
        itemsize = self.dtype.itemsize
        while data:
            take = min(self.chunk_tokens - self._in_chunk, len(data) // itemsize)
            self._crc = zlib.crc32(data[: take * itemsize], self._crc)
            self._in_chunk += take
            data = data[take * itemsize :]
            if self._in_chunk == self.chunk_tokens:
                self._end_chunk()

    def _end_chunk(self) -> None:
        self._chunk_crcs.append(self._crc)
        self._crc = 0
        self._in_chunk = 0

    def close(self) -> ShardInfo:
        """Write the index, the chunk-CRC table, the index CRC and the header (format version 2), then
        rename the file into place."""
        if self._in_chunk:
            self._end_chunk()
        f = self._out.file
        tokens_end = HEADER_SIZE + self.tokens * self.dtype.itemsize
        index_offset = _align8(tokens_end)
        f.write(bytes(index_offset - tokens_end))
        index = np.asarray(self._doc_starts, dtype=_INDEX_DTYPE).tobytes()
        f.write(index)
        crc_offset = index_offset + len(index)
        tail = np.asarray(self._chunk_crcs, dtype=_CRC_DTYPE).tobytes() + struct.pack("<I", zlib.crc32(index))
        f.write(tail)
        head = HEADER.pack(
            MAGIC, FORMAT_VERSION, _dtype_code(self.dtype), self.chunk_tokens, self.tokens,
            len(self._doc_starts), HEADER_SIZE, index_offset, crc_offset, zlib.crc32(tail), 0,
        )[:HEADER_CRC_OFFSET]
        f.seek(0)
        f.write(head + struct.pack("<I", zlib.crc32(head)))
        self._out.commit()
        size = crc_offset + len(tail)
        return ShardInfo(self._out.path.name, self.tokens, len(self._doc_starts), size, zlib.crc32(head))

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is written in place: its status-change time (set by the kernel at every
    write, truncate or utime: a writer cannot set it back, as it can the modification time) with its
    inode and size. A verified chunk is trusted only while the shard's stamp is the one it was read under."""
    return st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size


class ShardReader:
    """Checksummed random access to one shard by ``pread`` (see the module's CRC policy)."""

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None):
        """``vocab_size``: the dataset's vocabulary (``open_split`` passes the manifest's): a chunk holding an
        id at or above it is refused when verified, as a CRC mismatch is (None: any id of the dtype)."""
        self.path = Path(path)
        self.vocab_size = vocab_size
        self._fd: int | None = None  # open while a stream reads it (``_file``)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LubanError(f"{self.path}: shard file is missing") from None
        except OSError as err:
            raise LubanError(f"{self.path}: cannot open the shard: {err.strerror}") from None
        try:  # the header, then the tail (version 2: the chunk CRCs and the index CRC; 1: the index too)
            st = os.fstat(fd)
            size, self._stamp = st.st_size, _stamp(st)
            self._parse_header(os.pread(fd, HEADER_SIZE, 0), size)
            tail = _pread_exact(fd, self.size - self._tail_offset, self._tail_offset)
        except OSError as err:  # EISDIR (a folder), EIO: one line, not a traceback
            raise LubanError(f"{self.path}: cannot read the shard: {err.strerror}") from None
        finally:
            os.close(fd)
        if len(tail) != self.size - self._tail_offset:  # cut short between the size check and the read
            end = self._tail_offset + len(tail)
            raise self._error(f"truncated: {end} bytes, the header says {self.size} (cut short while opened)", end)
        n_chunks = -(-self.tokens // self.chunk_tokens)
        if self.version == 1:
            if zlib.crc32(tail) != self._tail_crc:
                raise self._error(
                    f"index CRC mismatch (document index and chunk CRCs, bytes "
                    f"{self.index_offset}-{self.size - 1})", self.index_offset)
            n_index = self.documents * _INDEX_DTYPE.itemsize
            self._check_index(np.frombuffer(tail, _INDEX_DTYPE, self.documents).astype(np.int64))  # a temporary
            self._index_crc = None  # (version 1 has none: its index was checked here)
            crcs = np.frombuffer(tail, _CRC_DTYPE, n_chunks, offset=n_index)
        else:
            if zlib.crc32(tail) != self._tail_crc:
                raise self._error(
                    f"chunk-CRC table CRC mismatch (chunk CRCs and the document index's CRC, bytes "
                    f"{self.crc_offset}-{self.size - 1})", self.crc_offset)
            self._index_crc = struct.unpack("<I", tail[-4:])[0]  # checked by ``verify``
            crcs = np.frombuffer(tail, _CRC_DTYPE, n_chunks)
        # Only the chunk CRCs stay in memory (4 bytes per chunk); the document index (8 bytes per
        # document: 120 GB for a 15-billion-document corpus, in every rank) is read by ``document``
        # (two entries), which the loader never calls, and by ``verify`` (all of it).
        self._chunk_crcs = crcs.copy()
        self._verified = np.zeros(len(self._chunk_crcs), dtype=bool)

    def _file(self) -> int:
        """The shard's descriptor, opened on first read (``close`` gives it back), once the file at the
        path is seen to be the shard opened: its size and header CRC. A shard *replaced* by a rename (a
        rebuild of the dataset) while open is read on from the old file, which the descriptor keeps whole;
        once given back, the path is opened again and what is there now is refused if it is not the shard.
        (That is a local file system's guarantee: on NFS, a rename over the shard by another client can make
        the open descriptor's reads fail with ESTALE, "cannot read the shard: Stale file handle".)"""
        if self._fd is not None:
            return self._fd
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LubanError(f"{self.path}: shard file is missing") from None
        except OSError as err:  # EMFILE at the open-file limit, EACCES: one line, not a traceback
            raise LubanError(f"{self.path}: cannot open the shard: {err.strerror}") from None
        try:
            try:
                size = os.fstat(fd).st_size
                head = os.pread(fd, HEADER_SIZE, 0) if size >= self.size else b""
            except OSError as err:  # EIO, ESTALE (NFS): one line naming the shard, not a traceback
                raise self._unreadable(err, 0) from None
            if size < self.size:
                raise self._truncated(size)
            if head[HEADER_CRC_OFFSET:] != struct.pack("<I", self.header_crc) or size != self.size:
                raise self._error(f"replaced or changed since this process opened it ({size} bytes, header CRC "
                                  f"{head[HEADER_CRC_OFFSET:].hex()}; the shard opened had {self.size}, "
                                  f"{struct.pack('<I', self.header_crc).hex()}); shard files must not change "
                                  "during a run", 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _pread(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` read into a fresh array. Read with ``pread``, not a memory map: a
        page of a map past the end of a file cut short while mapped raises SIGBUS, which kills the
        process with no message ("Bus error"; Python cannot turn it into an exception), and no check
        before the copy closes the window. One ``preadv`` transfers at most 0x7ffff000 bytes (Linux), so
        a longer read loops into the rest of the buffer; a 0-byte return before the end is the truncation,
        said in one line. One system call a read costs about what a map's copy does (docs/data.md)."""
        out = np.empty(stop - start, self.dtype)
        view = memoryview(out).cast("B")
        fd, offset, done = self._file(), HEADER_SIZE + start * self.dtype.itemsize, 0
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as err:  # EIO (a failing disk), ESTALE (NFS): one line naming the shard
                raise self._unreadable(err, offset + done) from None
            if not got:
                raise self._truncated(self._current_size())
            done += got
        return out

    def _read_bytes(self, size: int, offset: int) -> bytes:
        """``size`` bytes of the shard from byte ``offset`` (the index, the padding), all of them or a
        ``LubanError``: a read cut short is the truncation, an ``OSError`` the one line "cannot read"."""
        try:
            raw = _pread_exact(self._file(), size, offset)
        except OSError as err:
            raise self._unreadable(err, offset) from None
        if len(raw) != size:
            raise self._truncated(self._current_size())
        return raw

    def _unchanged(self) -> bool:
        """Whether the shard is as it was when its verified chunks were read (``_stamp``); if it was
        written since — in place, keeping its size and header (what ``_file`` cannot see) — every chunk
        is verified again as it is read, so changed tokens are a CRC mismatch, not a silent read. One
        ``fstat`` a read."""
        try:
            now = _stamp(os.fstat(self._file()))
        except OSError as err:
            raise self._unreadable(err, 0) from None
        if now == self._stamp:
            return True
        self._stamp = now
        self._verified[:] = False
        return False

    def _current_size(self) -> int:
        """The size of the open file now (for the truncation message)."""
        try:
            return os.fstat(self._fd).st_size
        except OSError as err:
            raise self._unreadable(err, 0) from None

    def _unreadable(self, err: OSError, offset: int) -> LubanError:
        return self._error(f"cannot read the shard: {err.strerror or err}", offset)

    def _truncated(self, size: int) -> LubanError:
        return self._error(f"truncated: {size} bytes, the header says {self.size} (cut short since this "
                           "process opened it: shard files must not change during a run)", size)

    def close(self) -> None:
        """Give the descriptor back (the next read opens the file again; verified chunks stay verified).
        A process has a limit on open files, so a stream of many shards keeps few open."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:  # (EIO, NFS: the descriptor is gone all the same, and a read-only one lost nothing)
                pass

    def __getstate__(self) -> dict:
        """A copy (``copy.copy``, ``copy.deepcopy``, ``pickle``: all three come here) has no descriptor: it
        opens the path itself on its first read, through ``_file``'s checks. The raw descriptor number is
        this process's and this reader's: once the reader gives it back, the next ``open`` reuses the
        number, and a copy holding it would read that other file at the shard's offsets and close it."""
        state = dict(self.__dict__)
        state["_fd"] = None
        return state

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:  # (an __init__ that raised set none)
            self.close()

    def _parse_header(self, head: bytes, size: int) -> None:
        if len(head) < HEADER_SIZE:
            raise self._error(f"truncated: {size} bytes, the header alone needs {HEADER_SIZE}",
                              size)
        (magic, self.version, code, self.chunk_tokens, self.tokens, self.documents, tokens_offset,
         self.index_offset, self.crc_offset, self._tail_crc, self.header_crc) = HEADER.unpack(head)
        if magic != MAGIC:
            raise self._error(f"not a luban shard (magic {magic!r}, expected {MAGIC!r})", 0)
        if self.version not in READ_VERSIONS:
            raise self._error(f"format version {self.version}, this luban reads versions "
                              f"{' and '.join(map(str, READ_VERSIONS))}", 8)
        if zlib.crc32(head[:HEADER_CRC_OFFSET]) != self.header_crc:
            raise self._error(f"header CRC mismatch (header bytes 0-{HEADER_SIZE - 1})", 0)
        if code not in DTYPES or tokens_offset != HEADER_SIZE or self.chunk_tokens < 1:
            raise self._error(f"unsupported dtype code {code} or layout", 10)
        self.dtype = DTYPES[code]
        if (self.index_offset != _align8(HEADER_SIZE + self.tokens * self.dtype.itemsize)
                or self.crc_offset != self.index_offset + self.documents * _INDEX_DTYPE.itemsize):
            raise self._error(f"section offsets (index {self.index_offset}, CRC table {self.crc_offset}) "
                              f"disagree with {self.tokens} tokens and {self.documents} documents", 40)
        if self.version >= 2 and self.tokens and not self.documents:  # (version 1: ``_check_index``)
            raise self._error(f"{self.tokens} tokens but no documents", 24)
        n_chunks = -(-self.tokens // self.chunk_tokens)
        # The tail, read and checked at open: version 2, the chunk CRCs and the index CRC after them;
        # version 1, the document index and the chunk CRCs.
        self._tail_offset = self.crc_offset if self.version >= 2 else self.index_offset
        self.size = self.crc_offset + n_chunks * _CRC_DTYPE.itemsize + (4 if self.version >= 2 else 0)
        if size < self.size:
            raise self._error(f"truncated: {size} bytes, the header says {self.size}", size)
        if size > self.size:
            raise self._error(f"{size - self.size} trailing bytes after the end", self.size)

    def _check_index(self, starts: np.ndarray) -> None:
        """Document starts from 0, in order, within the tokens (a shard with tokens has documents)."""
        ok = (starts[0] == 0 and bool((np.diff(starts) >= 0).all()) and starts[-1] <= self.tokens
              if self.documents else self.tokens == 0)
        if not ok:
            raise self._error(f"document index out of order or outside the {self.tokens} tokens",
                              self.index_offset)

    def _verify_index(self) -> None:
        """The whole document index against its CRC, then in order (``_check_index``), read a bounded
        block at a time (a shard of 2**27 one-token documents has a 1 GiB index)."""
        crc, in_order, last = 0, True, 0
        step = VERIFY_INDEX_ENTRIES
        for first in range(0, self.documents, step):
            count = min(step, self.documents - first)
            raw = self._read_bytes(count * _INDEX_DTYPE.itemsize, self.index_offset + first * _INDEX_DTYPE.itemsize)
            crc = zlib.crc32(raw, crc)
            starts = np.frombuffer(raw, _INDEX_DTYPE)
            in_order = in_order and (bool(starts[0] == 0) if first == 0 else int(starts[0]) >= last)
            in_order = in_order and bool((starts[1:] >= starts[:-1]).all())
            last = int(starts[-1])
        if crc != self._index_crc:
            raise self._error(f"document index CRC mismatch (bytes {self.index_offset}-{self.crc_offset - 1})",
                              self.index_offset)
        if not (in_order and last <= self.tokens):  # (no documents, no tokens: checked at open)
            raise self._error(f"document index out of order or outside the {self.tokens} tokens",
                              self.index_offset)

    def _error(self, what: str, offset: int) -> LubanError:
        return LubanError(f"{self.path}: {what} at byte offset {offset}")

    def _verify(self, first: int, last: int, tokens: np.ndarray | None = None) -> None:
        """Check the CRCs of chunks ``first..last`` (inclusive) not verified yet; ``tokens``: those
        chunks' tokens, already read (else each is read)."""
        step = self.chunk_tokens
        for i in range(first, last + 1):
            if not self._verified[i]:
                chunk = (tokens[(i - first) * step : (i - first + 1) * step] if tokens is not None
                         else self._pread(i * step, min((i + 1) * step, self.tokens)))
                if zlib.crc32(chunk) != self._chunk_crcs[i]:
                    offset = HEADER_SIZE + i * step * self.dtype.itemsize
                    raise self._error(f"CRC mismatch in chunk {i}", offset)
                bad = self._bad_id(i * step, chunk)
                if bad:
                    raise self._vocab_error(i, bad)
                self._verified[i] = True

    def _bad_id(self, first: int, tokens: np.ndarray) -> tuple[int, int] | None:
        """``(token offset, id)`` of the first of ``tokens`` (``tokens[0]`` is token ``first``) at or above
        ``vocab_size``, or None. A shard whose CRCs agree but whose ids do not fit the vocabulary (another
        dataset's, a hand-made one, a uint32 shard under a uint16 manifest) would index past the model's
        embedding: a device-side assert on a GPU."""
        if self.vocab_size is None or not len(tokens) or int(tokens.max()) < self.vocab_size:
            return None
        at = int(np.argmax(tokens >= self.vocab_size))
        return first + at, int(tokens[at])

    def _vocab_error(self, i: int, bad: tuple[int, int]) -> LubanError:
        at, token = bad
        return self._error(f"{vocab_error(token, self.vocab_size)} in chunk {i} (rebuild the dataset with "
                           "`luban data build`)", HEADER_SIZE + at * self.dtype.itemsize)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as a fresh array, verifying the chunks they lie in: a chunk not yet
        verified is read whole with them, once."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"{self.path}: tokens [{start}, {stop}) outside [0, {self.tokens})")
        if stop == start:
            return np.zeros(0, self.dtype)
        first, last = start // self.chunk_tokens, (stop - 1) // self.chunk_tokens
        # the stamp is looked at after each read: a write between a check before it and the read (or
        # during the read: the kernel moves the status-change time as a write starts) is seen there
        if self._verified[first : last + 1].all():
            out = self._pread(start, stop)
            if self._unchanged():
                return out
        begin = first * self.chunk_tokens
        span = self._pread(begin, min((last + 1) * self.chunk_tokens, self.tokens))
        self._unchanged()  # written since its chunks were verified: none of them is any more
        self._verify(first, last, span)
        return span[start - begin : stop - begin].copy() if (start, stop) != (begin, begin + len(span)) else span

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (ending with its end-of-document id). Its two index entries are
        read from the file and checked to be in order within the tokens (document 0 from token 0);
        ``read`` checks the tokens' CRCs. Version 2 checks the index's CRC only in ``verify``: a damaged
        entry that stays in order gives another span of (CRC-checked) tokens; the loader never calls this."""
        if not 0 <= i < self.documents:
            raise IndexError(f"{self.path}: document {i} outside [0, {self.documents})")
        offset = self.index_offset + i * _INDEX_DTYPE.itemsize
        want = _INDEX_DTYPE.itemsize * (2 if i + 1 < self.documents else 1)
        raw = self._read_bytes(want, offset)  # (``_file``: the file is still the shard opened)
        starts = [int(v) for v in np.frombuffer(raw, _INDEX_DTYPE)] + [self.tokens]
        if not (0 <= starts[0] <= starts[1] <= self.tokens and (i or starts[0] == 0)):
            raise self._error(f"document index changed since the shard was opened (document {i})"
                              if self.version == 1 else
                              f"document index out of order or outside the {self.tokens} tokens (document {i}; "
                              "`luban data verify` checks the whole index)", offset)
        return self.read(starts[0], starts[1])

    def verify(self) -> None:
        """Check the document index (version 2: its CRC, then its order; version 1 checked both at
        open), that the padding after the tokens is zero, and every chunk's CRC (``luban data verify``),
        reading ``VERIFY_BYTES`` at a time. A descriptor this opened is given back at the end (a caller
        verifying every shard of a dataset holds none open)."""
        opened = self._fd is None
        try:
            self._unchanged()
            if self.version >= 2:
                self._verify_index()
            self._verify_padding()
            per_span = VERIFY_BYTES // (self.chunk_tokens * self.dtype.itemsize)
            if per_span >= 1:  # whole chunks, as many as fit in VERIFY_BYTES
                for first in range(0, len(self._verified), per_span):
                    last = min(first + per_span, len(self._verified)) - 1
                    span = self._pread(first * self.chunk_tokens, min((last + 1) * self.chunk_tokens, self.tokens))
                    self._verify(first, last, span)
            else:  # a chunk larger than VERIFY_BYTES: its CRC computed over pieces of it
                for i in range(len(self._verified)):
                    self._verify_in_pieces(i, VERIFY_BYTES // self.dtype.itemsize)
        finally:
            if opened:
                self.close()

    def _verify_in_pieces(self, i: int, piece: int) -> None:
        """Chunk ``i``'s CRC, reading ``piece`` tokens at a time."""
        if self._verified[i]:
            return
        begin, end = i * self.chunk_tokens, min((i + 1) * self.chunk_tokens, self.tokens)
        crc, bad = 0, None
        for start in range(begin, end, piece):
            part = self._pread(start, min(start + piece, end))
            crc, bad = zlib.crc32(part, crc), bad or self._bad_id(start, part)
        if crc != self._chunk_crcs[i]:
            raise self._error(f"CRC mismatch in chunk {i}", HEADER_SIZE + begin * self.dtype.itemsize)
        if bad:
            raise self._vocab_error(i, bad)
        self._verified[i] = True

    def _verify_padding(self) -> None:
        """The 0-7 bytes between the tokens and the document index are zero: no CRC covers them (the
        chunk CRCs end with the tokens, the index CRC starts at the index), so this is their check."""
        tokens_end = HEADER_SIZE + self.tokens * self.dtype.itemsize
        padding = self._read_bytes(self.index_offset - tokens_end, tokens_end) if self.index_offset > tokens_end else b""
        if any(padding):
            raise self._error(f"padding bytes {tokens_end}-{self.index_offset - 1} (between the tokens and the "
                              "document index) are not zero", tokens_end + len(padding) - len(padding.lstrip(b"\0")))
