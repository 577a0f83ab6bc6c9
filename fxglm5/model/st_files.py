"""Reading a safetensors checkpoint's headers (single file or index + shards), writing shards, and writing any
output safely.

Only headers are read here: the 8-byte length, the JSON header and the file size. That is enough to
find every tensor's name, dtype and shape, to catch a truncated shard before ``safe_open`` memory-maps
it, and to check the index against the shards. Tensor data is read later, lazily, by the loader.

Every writer of the package writes through :func:`new_output_dir` (a checkpoint, a graph dump) or
:func:`new_output_file` (an artifact): into a temporary beside the target, renamed into place at the end, so a
full disk, a place that cannot be written, an interruption or a second writer of the same path leaves nothing
half-written and never mixes two writers' output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors.torch import save_file

from fxglm5.errors import CheckpointError
from fxglm5.model.layout import ST_DTYPES

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype_name: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype | None:
        return ST_DTYPES.get(self.dtype_name)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo of one .safetensors file; CheckpointError if it is malformed or truncated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        if size < 8 + n:
            raise CheckpointError(f"{path}: truncated safetensors file: header needs {8 + n} bytes, file has {size}")
        try:
            raw = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not a safetensors file (bad JSON header: {err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not an object)")
    out, spans = {}, []
    for name, meta in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            begin, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {meta!r}") from None
        if begin < 0 or end < begin or min(shape, default=0) < 0:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {meta!r} (negative offsets or "
                                  "sizes, or an end before its begin)")
        item = ST_DTYPES[dtype_name].itemsize if dtype_name in ST_DTYPES else None
        if item is not None and end - begin != math.prod(shape) * item:
            raise CheckpointError(
                f"{path}: tensor {name!r}: header says {end - begin} bytes for shape {list(shape)} {dtype_name}"
            )
        if 8 + n + end > size:
            raise CheckpointError(
                f"{path}: truncated shard: tensor {name!r} ends at byte {8 + n + end} but the file has {size} bytes"
            )
        out[name] = TensorInfo(path, dtype_name, shape)
        spans.append((begin, end, name))
    _check_tiling(path, sorted(spans), size - 8 - n)
    return out


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The sorted ``(begin, end, name)`` data spans must cover the data area exactly once, in order (the
    safetensors format: no overlap, no hole, no trailing bytes): two tensors sharing bytes would alias each
    other, and ``safe_open`` refuses such files anyway, with a message that names no tensor."""
    at, previous = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor "
                                  f"{previous!r}, which ends at {at}")
        if begin > at:
            after = f"after tensor {previous!r}" if previous else "at the start of the data"
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets begin at {begin}, leaving a hole of "
                                  f"{begin - at} bytes {after}")
        at, previous = end, name
    if at != data_bytes:
        raise CheckpointError(f"{path}: the tensors' data_offsets end at {at} but the file holds {data_bytes} data "
                              "bytes after its header")


def scan_checkpoint(directory: Path, wanted: Callable[[str], bool] | None = None) -> tuple[dict[str, TensorInfo], Path]:
    """All tensors of a checkpoint directory (only those whose name is ``wanted``) and the file errors about the
    whole set should name.

    Sharded (index + shards): every shard in the index must exist, every tensor the index lists must be
    in its shard, and every tensor of a shard must be listed (a shard the index does not describe means
    the two are out of sync). With ``wanted`` only the shards the index says hold a wanted tensor are opened
    and checked so; the others need not exist.
    """
    index_path, single = directory / INDEX, directory / SINGLE
    if index_path.is_file():
        return _scan_sharded(index_path, wanted), index_path
    if single.is_file():
        tensors = read_header(_inside(directory, SINGLE, str(single)))
        return (tensors if wanted is None else {n: i for n, i in tensors.items() if wanted(n)}), single
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    hint = f" (found {found} but no {INDEX})" if found else ""
    raise CheckpointError(f"{directory}: no {SINGLE} or {INDEX}{hint}")


def _inside(directory: Path, name: str, what: str) -> Path:
    """``directory / name``, refused (naming ``what``) where it leaves the checkpoint directory: an absolute
    path, a ``..`` component, or a symlink whose target lies elsewhere. The one exception is the Hugging Face
    hub cache, whose ``snapshots/<revision>/`` files are symlinks into the repository's ``blobs/`` directory."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{what}: the path leaves the checkpoint directory {directory}; shards must lie inside it")
    path, root = directory / rel, directory.resolve()
    roots = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    target = path.resolve()
    if not any(target.is_relative_to(r) for r in roots):
        raise CheckpointError(f"{what}: a symlink to {target}, outside the checkpoint directory {directory}; "
                              "shards must lie inside it")
    return path


def _scan_sharded(index_path: Path, wanted: Callable[[str], bool] | None) -> dict[str, TensorInfo]:
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index_path}: not valid JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: field 'weight_map' must map tensor names to shard file names")
    if wanted is not None:
        shards = {shard for name, shard in weight_map.items() if wanted(name)}
        weight_map = {name: shard for name, shard in weight_map.items() if shard in shards}
    headers: dict[str, dict[str, TensorInfo]] = {}
    for name, shard in weight_map.items():
        if shard not in headers:
            shard_path = _inside(index_path.parent, shard, f"{index_path}: weight_map entry {name!r} -> {shard!r}")
            if not shard_path.is_file():
                raise CheckpointError(f"{index_path}: shard {shard!r} (holding tensor {name!r}) is missing on disk")
            headers[shard] = read_header(shard_path)
        if name not in headers[shard]:
            raise CheckpointError(f"{index_path}: tensor {name!r} is listed in shard {shard!r}, which does not contain it")
    tensors: dict[str, TensorInfo] = {}
    for shard, header in headers.items():
        for name, info in header.items():
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{info.file}: tensor {name!r} is in this shard but the index does not list it here")
            if wanted is None or wanted(name):
                tensors[name] = info
    return tensors


def check_output_dir(directory: Path, empty: bool = False) -> None:
    """Refuse (CheckpointError) an output directory that exists as a file, lies under a file, or, with ``empty``,
    holds anything (a newly made checkpoint written there would overwrite or mix with what is stored); checked
    before the work starts, so a refusal costs nothing."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory; the output must be a directory")
    above = next((p for p in directory.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise CheckpointError(f"{directory}: {above} is a file, so no directory can be made under it")
    if above is not None and not directory.exists() and not os.access(above, os.W_OK | os.X_OK):
        raise CheckpointError(f"{directory}: {above} is not writable, so the output directory cannot be made there")
    if empty and directory.is_dir() and any(directory.iterdir()):
        raise CheckpointError(f"{directory}: exists and is not empty; a new checkpoint is written only into a new "
                              "or empty directory, so that nothing stored there is overwritten")


@contextlib.contextmanager
def new_output_dir(directory: Path, keep_on: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """A temporary directory beside ``directory`` (a new or empty one, checked first) to write a checkpoint into,
    renamed into place when the block ends without error, removed when it raises or is interrupted: a reader, a
    rerun or a concurrent run never sees a half-written checkpoint. The rename is atomic and does not replace a
    directory that holds anything, so of two runs into one new directory the second fails, naming it (both used
    to report success with only one checkpoint there). ``keep_on``: exceptions after which what was written is
    still put in place (a graph dump of a compile that failed is what one reads to see why)."""
    directory = Path(directory)
    check_output_dir(directory, empty=True)
    with writing(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        with writing(directory):
            try:
                yield tmp
            except keep_on:
                _into_place(tmp, directory)
                raise
            _into_place(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _into_place(tmp: Path, directory: Path) -> None:
    tmp.chmod(0o777 & ~_umask())
    try:
        os.rename(tmp, directory)
    except OSError as err:
        raise CheckpointError(f"{directory}: filled by another writer while this output was written "
                              f"({err.strerror}); nothing of this run was kept") from None


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OSError of the machine inside the block (a full disk, a read-only place, a path under a file) as one
    CheckpointError naming ``path``, the output it was writing."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as err:
        why = err.strerror or str(err)
        where = f"{err.filename}: " if err.filename and str(err.filename) != str(path) else ""
        raise CheckpointError(f"{path}: not written ({where}{why}); nothing of it was kept") from None


def check_output_file(path: Path, accept: Callable[[Path], bool], what: str) -> Path:
    """Refuse (CheckpointError, before the work) an output file whose directory is missing, is a file or cannot be
    written, a path that is a directory, and an existing file that ``accept`` does not take (``what``: the outputs
    it takes, e.g. "an fxglm5 artifact": an earlier run's output may be replaced, nothing else)."""
    path = Path(path)
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(f"{path}: {path.parent} is a file, so no file can be written under it")
    if not path.parent.is_dir():
        raise CheckpointError(f"{path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a file to write")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: {path.parent} is not writable")
    if path.exists() and not accept(path):
        raise CheckpointError(f"{path}: exists and is not {what}; it is replaced only by the output of the same "
                              "command, so that nothing else stored there is overwritten")
    return path


def _state(path: Path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def new_output_file(path: Path, accept: Callable[[Path], bool], what: str) -> Iterator[Path]:
    """A temporary file beside ``path`` (checked by :func:`check_output_file`) to write into, put in place when the
    block ends without error and removed whatever happens, so no half-written file is ever at ``path``. If another
    writer put a file at ``path`` meanwhile (or changed the one there), this one's is not kept: of two writers of one
    path at once exactly one succeeds, and what each reports is the file on disk. An OSError of the machine becomes
    one CheckpointError naming ``path``."""
    path = check_output_file(path, accept, what)
    before = _state(path)
    with writing(path):
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        with writing(path):
            yield tmp
            os.chmod(tmp, 0o666 & ~_umask())
            lock = os.open(path.parent, os.O_RDONLY)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time compares and renames
                if _state(path) != before:
                    raise CheckpointError(f"{path}: written by another writer while this one ran; nothing of this "
                                          "run was kept")
                os.replace(tmp, path)
            finally:
                os.close(lock)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (made if missing) for the block: processes that make one shared thing
    there (the demo's cached checkpoint) take turns, and the second finds what the first made."""
    directory = Path(directory)
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)
        handle = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_readable(path: Path, write: Callable[[str], None]) -> None:
    """``write(path)`` and make the file readable as ordinary files are (0666 less the umask; safetensors' writer
    leaves 0600, unlike the config.json beside it). safetensors' own error for a failed write (a full disk) is an
    OSError naming the file, as any other write's is."""
    from safetensors import SafetensorError

    try:
        write(str(path))
    except SafetensorError as err:
        raise OSError(errno.EIO, f"{err}".replace("Error while serializing: ", ""), str(path)) from None
    os.chmod(path, 0o666 & ~_umask())


@dataclasses.dataclass
class PlannedTensor:
    """A tensor to write: its size is known up front; ``make`` produces it when its shard is written."""

    name: str
    nbytes: int
    make: Callable[[], torch.Tensor]


def write_shards(directory: Path, tensors: Iterable[PlannedTensor], max_shard_bytes: int | None) -> list[str]:
    """Write ``tensors`` as one model.safetensors, or as shards + index when they exceed max_shard_bytes.

    Shards are filled greedily in order and each is materialised only while it is written, so writing a
    checkpoint never needs more memory than one shard. Returns the file names written.
    """
    check_output_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if max_shard_bytes is not None and groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    for stale in [directory / INDEX, directory / SINGLE, *directory.glob("model-*-of-*.safetensors")]:
        if stale.is_file():
            os.remove(stale)
    if len(groups) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        data = {t.name: t.make().contiguous() for t in group}
        write_readable(directory / fname, lambda path: save_file(data, path, metadata={"format": "pt"}))
        for t in group:
            weight_map[t.name] = fname
            total += t.nbytes
        del data
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names
