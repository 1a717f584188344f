"""The prefix cache's disk tier (`--prefix-cache-dir`): full KV blocks kept across restarts.

Owns: the directory's layout and file format, the thread that writes blocks, the size limit.
A full, computed block the pool evicts (`BlockPool.on_evict`), and every keyed block at
`close`, is copied off the KV cache at once (the block is about to be overwritten) and
written by one background thread, so the step loop pays only the copy; a later request whose
cached run ends in memory continues it from disk (`Scheduler` asks `has` and `load`): the
block is read into a free block and registered, instead of recomputed.

Layout: `DIR/<namespace>/<key>.kvblock`, where `key` is the block's prefix-cache key (chained
over its tokens, the cache salt and the LoRA adapter: `block_pool.block_keys`) and
`namespace` a digest of everything that decides a block's bits: the checkpoint's files (path,
size, mtime), the load dtype and quantization, the weight format, the linear kernel, the KV
cache's dtype and block size, the model's shape, batch invariance, native kernels on or off,
the nanoserve version (`identity`). Two models, or one model under other settings, share a
directory without sharing a file; `identity.json` in each namespace says what it belongs to.
Each file starts with a header (magic, format version, namespace digest, key, payload length,
payload checksum) checked before any byte reaches the cache, so a corrupt, truncated or
foreign file is skipped with a log line (and deleted, where it sits under this namespace's
name) and its block computed as if it were not there: it is never loaded into the wrong model.

The size limit (`prefix_cache_dir_max_gb`) covers the whole directory, every namespace: least
recently used files are deleted first (a file's use: its write or its last load, as its mtime,
so the order survives a restart). Several processes may share a directory; each keeps its own
account of the size, so together they may overshoot until each one's next write.
Refuses: tensor parallelism (each rank holds a shard of every block) and a disabled prefix cache.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.errors import InvalidRequestError
from nanoserve.model.kv_cache import KVCache

log = logging.getLogger("nanoserve")

MAGIC = b"NSKVBLK\0"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
# A partial file older than this is a crashed write's leftover (younger: maybe another process's).
STALE_PARTIAL_S = 600.0
# magic, format version, namespace digest, block key, payload bytes, payload checksum
_HEADER = struct.Struct("<8sI32s32sQ32s")


def check_prefix_cache_dir(config: EngineConfig) -> None:
    """Refuse, by name, a prefix cache directory this engine could not keep."""
    if config.prefix_cache_dir is None:
        return
    if not config.enable_prefix_caching:
        raise InvalidRequestError("prefix_cache_dir keeps the prefix cache's blocks: it needs "
                                  "enable_prefix_caching", param="prefix_cache_dir")
    if config.tensor_parallel_size > 1:
        raise InvalidRequestError("prefix_cache_dir is not supported with tensor parallelism "
                                  "(tensor_parallel_size > 1): each rank holds a shard of every block",
                                  param="prefix_cache_dir")
    if not config.prefix_cache_dir_max_gb > 0:
        raise InvalidRequestError(f"prefix_cache_dir_max_gb must be > 0; got "
                                  f"{config.prefix_cache_dir_max_gb}", param="prefix_cache_dir_max_gb")
    root = Path(config.prefix_cache_dir)
    if root.exists() and not root.is_dir():
        raise InvalidRequestError(f"prefix_cache_dir {root} is not a directory", param="prefix_cache_dir")


def checkpoint_identity(files: list[Path]) -> list[list[object]]:
    """Each file that holds the model, by resolved path, size and modification time."""
    identity = []
    for file in files:
        stat = file.stat()
        identity.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    return identity


def namespace_of(identity: dict[str, object]) -> bytes:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


@dataclass(slots=True)
class _Pending:
    """A block copied off the cache, waiting for the writer: one tensor per layout entry."""

    key: bytes
    contents: list[torch.Tensor]


class PrefixStore:
    """The blocks of one namespace on disk, and the size of the whole directory."""

    def __init__(self, root: Path, identity: dict[str, object], max_bytes: int, kv_cache: KVCache) -> None:
        self.root = root
        self.namespace = namespace_of(identity)
        self.dir = root / self.namespace.hex()
        self.max_bytes = max_bytes
        self.kv_cache = kv_cache
        self._layout = kv_cache.block_layout()
        self._payload_bytes = sum(dtype.itemsize * _numel(shape) for dtype, shape in self._layout)
        self.loaded_blocks = 0  # blocks read back into the cache
        self.written_blocks = 0
        self.skipped_files = 0  # corrupt, truncated or foreign files met at a load
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # every block file, least recently used first
        self.total_bytes = 0  # of the files in `_files`
        self._on_disk: set[bytes] = set()  # this namespace's keys with a file
        self._pending: dict[bytes, _Pending] = {}
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "identity.json").write_text(json.dumps(identity, indent=1, sort_keys=True))
        self._scan()
        # The thread holds the store weakly, so an engine dropped unclosed is still collected.
        self._writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self._queue),
                                        name="nanoserve-prefix-store", daemon=True)
        self._writer.start()
        weakref.finalize(self, self._queue.put, None)
        self._closed = False
        # The blocks to write at close: the engine's pool's keyed blocks (set by the engine).
        self.keyed_blocks: Callable[[], list[tuple[int, bytes]]] = list
        atexit.register(_close_at_exit, weakref.ref(self))

    def _scan(self) -> None:
        """Index the directory's block files by last use; leftovers of an interrupted write go."""
        found, others = [], 0
        for path in self.root.glob(f"*/*{SUFFIX}*"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process's trim or rename, meanwhile
                continue
            if not path.name.endswith(SUFFIX):  # a write in progress, or one a crash left
                if time.time() - stat.st_mtime > STALE_PARTIAL_S:
                    path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, path, stat.st_size))
            key = _key_of(path)
            if path.parent == self.dir and key is not None:
                self._on_disk.add(key)
            else:
                others += 1
        for _, path, size in sorted(found):
            self._files[path] = size
            self.total_bytes += size
        log.info(f"prefix cache dir {self.root}: {len(self._on_disk)} blocks of this model and settings, "
                 f"{others} of other models or settings (not used here), {self.total_bytes / 1e9:.2f} GB "
                 f"of {self.max_bytes / 1e9:.2f}")
        self._trim()

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    # -- the step loop's side -----------------------------------------------------------------

    def has(self, key: bytes) -> bool:
        """Whether block `key` is on disk (or on its way there)."""
        with self._lock:
            return key in self._on_disk or key in self._pending

    def load(self, key: bytes, block_id: int) -> bool:
        """Read block `key` into cache block `block_id`; False (logged) when its file does not
        hold it whole: the caller computes the block instead."""
        with self._lock:
            pending = self._pending.get(key)
        contents = pending.contents if pending is not None else self._read(key)
        if contents is None:
            return False
        self.kv_cache.write_blocks([block_id], contents)
        self.loaded_blocks += 1
        return True

    def save(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy blocks not on disk yet off the cache and queue them for the writer (the pool's
        `on_evict`: the blocks are overwritten once this returns)."""
        with self._lock:
            new = [(block_id, key) for block_id, key in blocks
                   if key not in self._on_disk and key not in self._pending]
        if not new:
            return
        copies = self.kv_cache.read_blocks([block_id for block_id, _ in new])
        for index, (_, key) in enumerate(new):
            pending = _Pending(key, [copy[:, index:index + 1] for copy in copies])
            with self._lock:
                self._pending[key] = pending
            self._queue.put(pending)

    def close(self) -> None:
        """Queue every keyed block not on disk yet, then wait until all are written."""
        if self._closed:
            return
        self._closed = True
        self.save(self.keyed_blocks())
        self._queue.put(None)
        self._writer.join()
        log.info(f"prefix cache dir {self.root}: {self.written_blocks} blocks written, "
                 f"{self.loaded_blocks} read back, {self.skipped_files} files skipped")

    # -- reading ------------------------------------------------------------------------------

    def _read(self, key: bytes) -> list[torch.Tensor] | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # deleted since (the size limit, another process): a plain miss
            self._forget(path, key)
            return None
        problem = self._check(data, key)
        if problem is not None:
            log.warning(f"prefix cache dir: skipped {path}: {problem}; the block is computed instead")
            self.skipped_files += 1
            self._forget(path, key)
            path.unlink(missing_ok=True)
            return None
        self._touch(path)
        return self._tensors(data[_HEADER.size:])

    def _check(self, data: bytes, key: bytes) -> str | None:
        """What is wrong with a file's bytes as block `key` of this namespace, or None."""
        if len(data) < _HEADER.size:
            return f"truncated ({len(data)} bytes, shorter than its header)"
        magic, version, namespace, file_key, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION:
            return "not a nanoserve KV block file of this format version"
        if namespace != self.namespace:
            return "written by another model or under other settings (its header names another namespace)"
        if file_key != key:
            return "holds another block"
        if length != self._payload_bytes or len(data) - _HEADER.size != length:
            return (f"payload of {len(data) - _HEADER.size} bytes; its header says {length}, "
                    f"a block is {self._payload_bytes}")
        if _checksum(data[_HEADER.size:]) != checksum:
            return "payload checksum mismatch (corrupt)"
        return None

    def _tensors(self, payload: bytes) -> list[torch.Tensor]:
        tensors, offset = [], 0
        buffer = bytearray(payload)
        for dtype, shape in self._layout:
            size = dtype.itemsize * _numel(shape)
            tensors.append(torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset)
                           .view(dtype).view(shape))
            offset += size
        return tensors

    def _touch(self, path: Path) -> None:
        """A use: this file is now the most recently used, here and after a restart (its mtime)."""
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    def _forget(self, path: Path, key: bytes) -> None:
        with self._lock:
            self.total_bytes -= self._files.pop(path, 0)
            self._on_disk.discard(key)

    # -- the writer thread --------------------------------------------------------------------

    def write(self, pending: _Pending) -> None:
        """Write one queued block (the writer thread)."""
        try:
            self._write(pending)
        except OSError as error:  # a full or read-only disk costs the cache, never a request
            log.warning(f"prefix cache dir: could not write a block: {error}")
        with self._lock:
            self._pending.pop(pending.key, None)

    def _write(self, pending: _Pending) -> None:
        payload = b"".join(content.contiguous().view(torch.uint8).numpy().tobytes()
                           for content in pending.contents)
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.namespace, pending.key, len(payload),
                              _checksum(payload))
        path = self._path(pending.key)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(header + payload)
        os.replace(partial, path)  # a reader sees the whole file or none
        with self._lock:
            self.total_bytes += len(header) + len(payload) - self._files.get(path, 0)
            self._files[path] = len(header) + len(payload)
            self._files.move_to_end(path)
            self._on_disk.add(pending.key)
        self.written_blocks += 1
        self._trim()

    def _trim(self) -> None:
        """Delete the least recently used files until the directory fits its limit."""
        while True:
            with self._lock:
                if not self._files or self.total_bytes <= self.max_bytes:
                    return
                path, size = self._files.popitem(last=False)
                self.total_bytes -= size
                if path.parent == self.dir:
                    self._on_disk.discard(_key_of(path))
            path.unlink(missing_ok=True)


def _write_loop(store: weakref.ref[PrefixStore], blocks: queue.Queue[_Pending | None]) -> None:
    """The writer thread: queued blocks until the store closes or is collected."""
    while (pending := blocks.get()) is not None:
        alive = store()
        if alive is None:
            return
        alive.write(pending)
        del alive


def _key_of(path: Path) -> bytes | None:
    """The block key a file's name spells, or None where it spells none."""
    try:
        return bytes.fromhex(path.name.removesuffix(SUFFIX))
    except ValueError:
        return None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def _close_at_exit(store: weakref.ref[PrefixStore]) -> None:
    """At interpreter exit, write what an engine never closed holds (an `LLM` left open)."""
    alive = store()
    if alive is not None:
        alive.close()
