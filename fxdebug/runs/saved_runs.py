"""Saved runs: Records on disk, a JSON manifest and one file of raw tensor bytes.

A run is a folder::

    manifest.json   format version, the run's context (torch version, device, dtype, rank,
                    world size, step), then one entry per capture in execution order: key,
                    op, shape, dtype, file:line, statistics, where its bytes lie; the same
                    for the gradients (backward order) and the parameter gradients' stats
    tensors.bin     every captured tensor's bytes, contiguous, each at a 64-byte boundary

Loading runs no code from the files (JSON and raw bytes, never pickle) and
reads no tensor bytes: ``tensors.bin`` is memory-mapped privately
(``torch.UntypedStorage.from_file(..., shared=False)``), each tensor is a view
of that mapping, and its pages are read when the tensor is used. Writing to a
loaded tensor never changes the file.

>>> import os, tempfile, torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
>>> _ = gm(torch.ones(1, 3))
>>> path = fxdebug.save_records(fxdebug.records(gm), os.path.join(tempfile.mkdtemp(), "run"))
>>> rec = fxdebug.load_records(path)
>>> rec.keys(), torch.equal(rec["1"], fxdebug.records(gm)["1"])
(['0', '1'], True)
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from typing import Any

import torch

from ..errors import SavedRunError, renamed_arguments
from ..runtime.records import Record, Records
from ..stats.summary import Stats
from ..distributed.sharded import RANK_FOLDER, ShardedRecords, placement_entry, placement_of
from ..distributed.sharded_stats import local_shape

__all__ = ["save_records", "load_records", "SavedRecords", "RunFile", "record_entry",
           "run_context", "write_manifest", "manifest_of", "location_of", "run_folders",
           "FORMAT", "FORMAT_VERSION", "BEFORE_READING"]

FORMAT = "fxdebug-run"
FORMAT_VERSION = 2
"""2: ``std`` is Bessel-corrected (n - 1, as ``tensor.std()``). Runs of format 1 saved the
population std (divide by n); :func:`load_records` converts it, so every run reads the same."""
MANIFEST = "manifest.json"

BEFORE_READING: list = []
"""Callables ``f(path)`` that :func:`load_records` calls before it reads ``path``: the
streaming writer (:mod:`.run_writer`) puts its flush here, so a run this process is still
writing there is finished first (``gm(x); del gm; load_records(path)`` reads that run)."""
DATA = "tensors.bin"
ALIGN = 64  # every tensor starts at a multiple: any dtype can view its bytes
RUN_FOLDER = re.compile(r"^run-(\d{6,})$")


class SavedRecords(Records):
    """Records read from a saved run: the same reading API, plus where they came from.

    ``path`` is the run's folder, ``context`` what was recorded about the run
    (``torch``, ``device``, ``dtype``, ``rank``, ``world_size``, ``step``,
    ``written``). Tensors are read-only views of the memory-mapped data file
    (writes stay in memory). Parameter gradients are the statistics saved
    with the run.
    """

    def __init__(self, path: str, context: dict, grads_recorded: bool | None) -> None:
        super().__init__(grads_recorded)
        self.path = path
        self.context = context
        self._parameter_stats_saved: list[tuple[str, tuple[int, ...], Stats | None]] = []
        # (section, key) -> the global ranks of the mesh a shard sits on (see .sharded)
        self.mesh_ranks: dict[tuple[str, str], tuple[int, ...] | None] = {}
        # parameter name -> (summary, placement, mesh ranks) of its gradient (placement: of a
        # DTensor gradient's piece, else None)
        self.parameter_pieces: dict[str, tuple[torch.Tensor, Any, tuple[int, ...] | None]] = {}

    def note_mesh(self, section: str, entry: dict) -> None:
        if entry.get("placement"):
            self.mesh_ranks[(section, entry["key"])] = placement_of(entry["placement"])[1]

    def parameter_grads(self) -> list[tuple[str, tuple[int, ...], Stats | None]]:
        return list(self._parameter_stats_saved)

    def __repr__(self) -> str:
        step = self.context.get("step")
        return (f"SavedRecords({len(self)} tensors from {self.path}"
                f"{'' if step is None else f', step {step}'})")


# -- writing -----------------------------------------------------------------------------
class RunFile:
    """``tensors.bin`` being written: ``append(tensor)`` returns where its bytes went."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, DATA)
        self.handle = open(self.path, "wb")
        self.offset = 0

    def append(self, tensor: torch.Tensor) -> dict:
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().reshape(-1)
        nbytes = data.numel() * data.element_size()
        start = self.offset
        if nbytes:
            self.handle.write(data.view(torch.uint8).numpy().data)  # no copy: the array's buffer
        pad = -(start + nbytes) % ALIGN
        if pad:
            self.handle.write(b"\0" * pad)
        self.offset = start + nbytes + pad
        return {"offset": start, "nbytes": nbytes}

    def close(self) -> None:
        if not self.handle.closed:
            self.handle.flush()
            self.handle.close()


def record_entry(record: Record, location: str, data: RunFile | None) -> dict:
    """The manifest entry of ``record``; its tensor's bytes go to ``data`` (tensor mode)."""
    entry: dict[str, Any] = {
        "key": record.key, "op": record.op, "shape": list(record.shape),
        "dtype": str(record.dtype).replace("torch.", ""), "location": location,
        "via": record.via, "copied": bool(record.copied), "stale": False, "data": None,
        "summary": None if record.summary is None else record.summary.tolist(),
    }
    value = record.value
    if value is not None and record.placement is not None:  # a shard: this rank's piece
        value = record._local(value)
        entry["shape"] = list(value.shape)
    elif value is None and record.placement is not None and not record.placement.local \
            and record.placement.known:  # a DTensor's statistics: of this rank's piece
        entry["shape"] = list(local_shape(tuple(record.shape), record.placement.placements,
                                          tuple(n for _, n in record.placement.mesh_dims),
                                          record.placement.coordinate))
    if record.placement is not None:
        entry["placement"] = placement_entry(record.placement, tuple(entry["shape"]))
    if value is not None:
        entry["device"] = str(value.device)
        if record.stale:  # written in place after its capture: the bytes are not the capture's
            entry["stale"] = True
            return entry
        if value.layout != torch.strided or value.is_quantized:
            return entry | {"stats": list(record.stats), "unsaved": "not a dense tensor"}
        entry["data"] = data.append(value) if data is not None else None
    elif record.summary is not None:
        entry["device"] = str(record.summary.device)
    entry["stats"] = list(record.stats)
    return entry


def run_context(records: list[Record], step=None) -> dict:
    """What a saved run records about where it ran (rank and world size under torch.distributed):
    the device of its first capture, the dtype of its first floating capture."""
    device, dtype = "cpu", None
    for record in records:
        held = record.value if record.value is not None else record.summary
        if held is not None and device == "cpu":
            device = str(held.device)
        if dtype is None and record.dtype.is_floating_point:
            dtype = str(record.dtype).replace("torch.", "")
    context: dict[str, Any] = {"torch": torch.__version__, "device": device, "dtype": dtype,
                               "step": step}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    context["rank"] = torch.distributed.get_rank() if distributed else None
    context["world_size"] = torch.distributed.get_world_size() if distributed else None
    context["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return context


def write_manifest(folder: str, manifest: dict) -> None:
    """Write ``manifest.json`` whole or not at all (a reader never sees half of it)."""
    final = os.path.join(folder, MANIFEST)
    temporary = final + ".partial"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=0)
    os.replace(temporary, final)


def manifest_of(context: dict, entries: list, grads: list, data_bytes: int, *,
                grads_recorded: bool | None, parameters=(), notes=(), runs: int = 1) -> dict:
    """The manifest of a run whose entries are written (:func:`record_entry`)."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "context": context,
            "records": entries, "grads": grads, "grads_recorded": grads_recorded,
            "parameters": [_parameter_entry(*parameter) for parameter in parameters],
            "notes": list(notes), "runs": runs, "data_bytes": data_bytes}


def _parameter_entry(name: str, shape, stats, piece=None) -> list:
    """``[name, shape, stats]`` of a parameter's gradient, then ``{"summary"}`` and, for a
    DTensor gradient's piece, its ``"placement"`` (``load_records`` of a sharded run
    assembles the full gradient's statistics from them)."""
    entry: list[Any] = [name, list(shape), None if stats is None else list(stats)]
    if piece is not None:
        placement, summary = piece
        entry.append({"summary": summary.tolist()} if placement is None else
                     {"summary": summary.tolist(),
                      "placement": placement_entry(placement, tuple(shape))})
    return entry


@renamed_arguments({"path": "folder"})
def save_records(records: Records, folder: str | os.PathLike, step=None,
                 overwrite: bool = False) -> str:
    """Write ``records`` (and their gradients) to ``folder``; return the folder's path.

    ``step`` tags the run (a training step, an epoch; default: the step
    :func:`fxdebug.set_step` gave the run). Under torch.distributed with several ranks,
    every rank writes ``folder/rank-R`` (R: its global rank), each capture with its placement;
    :func:`load_records` of ``folder`` assembles the full values. An existing saved run
    in ``folder`` is kept unless ``overwrite=True``. Read it back with
    :func:`load_records`.

    >>> import os, tempfile, torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    >>> _ = gm(torch.tensor([-1.0, 2.0]))
    >>> path = fxdebug.save_records(fxdebug.records(gm), os.path.join(tempfile.mkdtemp(), "r"),
    ...                             step=7)
    >>> fxdebug.load_records(path).context["step"]
    7
    """
    if not isinstance(records, Records):
        raise TypeError(f"save_records expects fxdebug Records (fxdebug.records(gm)), got "
                        f"{type(records).__name__}.")
    top = folder = os.fspath(folder)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:  # every rank its own folder
        folder = os.path.join(folder, f"{RANK_FOLDER}{torch.distributed.get_rank()}")
    if os.path.exists(os.path.join(folder, MANIFEST)) and not overwrite:
        raise SavedRunError(f"{folder} already holds a saved run ({MANIFEST}); nothing was "
                            f"written. Choose another folder, or pass overwrite=True.")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise SavedRunError(f"{folder} is a file, not a folder: save_records writes a folder "
                            f"({MANIFEST} and {DATA}). Choose another path.")
    os.makedirs(folder, exist_ok=True)
    records._read_stats()
    locations = getattr(records, "locations", {})
    data = RunFile(folder)
    try:
        entries = [record_entry(r, location_of(locations, r.key), data)
                   for r in records.records()]
        grads = records._grads.records() if records._grads is not None else []
        grad_entries = [record_entry(r, location_of(locations, r.key), data) for r in grads]
    finally:
        data.close()
    step = getattr(records, "step", None) if step is None else step
    write_manifest(folder, manifest_of(run_context(records.records(), step), entries, grad_entries,
                                       data.offset, grads_recorded=records._grads_recorded,
                                       parameters=_parameters_of(records), notes=records.notes,
                                       runs=records.runs))
    return top


def _parameters_of(records: Records) -> list:
    """The parameter gradients to save: of the module's own parameters where bound (a DTensor
    gradient as its piece), else as the records give them."""
    return records.parameter_grad_pieces() or records.parameter_grads()


def location_of(locations: dict, key: str) -> str:
    """The file:line of ``key`` (a nested output ``blk/0``: its module's)."""
    return locations.get(key) or locations.get(key.split("/", 1)[0], "")


# -- reading -----------------------------------------------------------------------------
def run_folders(path: str) -> list[tuple[int, str]]:
    """``(number, folder)`` of every ``run-NNNNNN`` folder under ``path``, by number."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(path, name))
             for name in names if (m := RUN_FOLDER.match(name))]
    return sorted(found)


def _run_folder(path: str, run: int | None) -> str:
    if not os.path.exists(path):
        raise SavedRunError(f"no saved run at {path}: it does not exist. Save one with "
                            f"fxdebug.save_records(records, folder) or "
                            f"fxdebug.instrument(model, folder=folder).")
    if os.path.isfile(path) and os.path.basename(path) == MANIFEST:
        path = os.path.dirname(path) or "."
    runs = run_folders(path)
    if run is not None:
        for number, folder in runs:
            if number == run:
                return folder
        have = (f"it holds runs {runs[0][0]} to {runs[-1][0]}" if runs
                else "it holds no numbered runs")
        raise SavedRunError(f"no run {run} in {path}: {have}. Leave run= out for the latest.")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    finished = [folder for _, folder in runs if os.path.exists(os.path.join(folder, MANIFEST))]
    if finished:
        return finished[-1]
    if runs:
        raise SavedRunError(f"{path} holds {len(runs)} run folder(s) but none has its "
                            f"{MANIFEST} yet: the writer has not finished (call "
                            f"fxdebug.records(gm)) or the process stopped before it did.")
    raise SavedRunError(f"no saved run at {path}: it holds neither {MANIFEST} nor run-NNNNNN "
                        f"folders. Point at the folder given to save_records or instrument(folder=).")


@renamed_arguments({"path": "folder"})
def load_records(folder: str | os.PathLike, run: int | None = None
                 ) -> SavedRecords | ShardedRecords:
    """Open a saved run: a folder written by :func:`save_records`, or the latest run in an
    ``instrument(model, folder=)`` folder (``run=N`` for ``run-00000N``). Tensors are read when used. A folder
    of ``rank-R`` folders (saved by several ranks) gives
    :class:`~fxdebug.distributed.sharded.ShardedRecords`: full values, assembled when read.

    Raises :class:`~fxdebug.errors.SavedRunError` for a missing folder, a
    truncated or corrupt file, or a run written by a newer fxdebug.

    >>> import os, tempfile, torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> _ = gm(torch.ones(1, 2))
    >>> rec = fxdebug.load_records(fxdebug.save_records(fxdebug.records(gm),
    ...                                                 os.path.join(tempfile.mkdtemp(), "r")))
    >>> rec["0"].shape, rec.context["dtype"]
    (torch.Size([1, 2]), 'float32')
    """
    path = os.fspath(folder)
    for finish_writing in BEFORE_READING:
        finish_writing(path)
    ranks = _rank_folders(path)
    if ranks:
        return _load_sharded(path, ranks, run)
    return _load_one(path, run)


def _rank_folders(path: str) -> list[tuple[int, str]]:
    """``(rank, folder)`` of every ``rank-R`` folder of a run saved by several ranks."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST)):
        return []
    found = [(int(name[len(RANK_FOLDER):]), os.path.join(path, name))
             for name in os.listdir(path)
             if name.startswith(RANK_FOLDER) and name[len(RANK_FOLDER):].isdigit()]
    return sorted(found)


def _load_sharded(path: str, ranks: list[tuple[int, str]], run: int | None) -> ShardedRecords:
    if run is None:  # the latest run every rank finished
        numbered = [{n for n, f in run_folders(folder)
                     if os.path.exists(os.path.join(f, MANIFEST))} for _, folder in ranks]
        common = set.intersection(*numbered) if all(numbered) else set()
        run = max(common) if common else None
    loaded = {rank: _load_one(folder, run) for rank, folder in ranks}
    first = loaded[ranks[0][0]]
    context = dict(first.context, rank=None, ranks=[rank for rank, _ in ranks])
    return ShardedRecords(path, dict(loaded), context,
                          {rank: rec.mesh_ranks for rank, rec in loaded.items()})


def _load_one(path: str, run: int | None) -> SavedRecords:
    folder = _run_folder(path, run)
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = _read_manifest(manifest_path)
    version = manifest["version"]
    storage = _map_data(folder, manifest)
    records = SavedRecords(folder, manifest.get("context") or {}, manifest.get("grads_recorded"))
    try:
        for entry in manifest["records"]:
            records._records[entry["key"]] = _record(entry, storage, version)
            records.note_mesh("records", entry)
        if manifest.get("grads"):
            grads = records.grads
            for entry in manifest["grads"]:
                grads._records[entry["key"]] = _record(entry, storage, version)
                records.note_mesh("grads", entry)
        for name, shape, stats, *piece in manifest.get("parameters", []):
            records._parameter_stats_saved.append(
                (name, tuple(shape), None if stats is None else _saved_stats(stats, version)))
            if piece:  # its summary; a DTensor gradient's piece: its placement (distributed/sharded_stats.py)
                placement, mesh = (placement_of(piece[0]["placement"]) if "placement" in piece[0]
                                   else (None, None))
                records.parameter_pieces[name] = (
                    torch.tensor(piece[0]["summary"], dtype=torch.float64), placement, mesh)
        records.locations = {e["key"]: e["location"] for e in manifest["records"]
                             if e.get("location")}
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SavedRunError(f"{manifest_path} is corrupt ({type(exc).__name__}: {exc}): it "
                            f"does not describe the run's tensors. Save the run again.") from exc
    records.notes.extend(manifest.get("notes", []))
    records.runs = manifest.get("runs", 1)
    records.step = records.context.get("step")
    return records


def _read_manifest(manifest_path: str) -> dict:
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise SavedRunError(f"{manifest_path} is missing: the run was not finished. Save it "
                            f"again, or call fxdebug.records(gm) before reading.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SavedRunError(f"{manifest_path} is truncated or corrupt ({exc}); it cannot be "
                            f"read. Save the run again.") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SavedRunError(f"{manifest_path} is not an fxdebug saved run (no "
                            f"'format': {FORMAT!r}). Point load_records at a folder written by "
                            f"fxdebug.save_records or instrument(..., folder=).")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SavedRunError(f"{manifest_path} was written in saved-run format {version!r}, "
                            f"newer than this fxdebug reads ({FORMAT_VERSION}). Upgrade fxdebug "
                            f"(pip install -U fxdebug) to read it.")
    return manifest


def _map_data(folder: str, manifest: dict) -> torch.Tensor | None:
    """``tensors.bin`` as a uint8 tensor over a private memory map (nothing read yet)."""
    expected = manifest.get("data_bytes", 0)
    if not expected:
        return None
    data_path = os.path.join(folder, DATA)
    try:
        size = os.path.getsize(data_path)
    except OSError:
        raise SavedRunError(f"{data_path} is missing: the manifest refers to {expected} bytes "
                            f"of tensors there. Copy the whole run folder, or save it "
                            f"again.") from None
    if size < expected:
        raise SavedRunError(f"{data_path} is truncated: {size} bytes, the manifest expects "
                            f"{expected} (a disk that filled up, a copy or a process cut "
                            f"short). Save the run again.")
    storage = torch.UntypedStorage.from_file(data_path, shared=False, nbytes=expected)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (expected,),  # type: ignore[arg-type]
                                                  (1,))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _saved_stats(values: list, version: int) -> Stats:
    """Statistics as saved; format 1's population std made the n - 1 std every table shows.

    >>> _saved_stats([0.0, 1.0, -1.0, 1.0, 0.0, 0, 2], 1).std   # [-1, 1]: population std 1
    1.4142135623730951
    """
    stats = Stats(*values)
    if version < 2:
        count = stats.numel - stats.nonfinite
        std = stats.std * math.sqrt(count / (count - 1)) if count > 1 else float("nan")
        stats = stats._replace(std=std)
    return stats


def _record(entry: dict, data: torch.Tensor | None, format_version: int = FORMAT_VERSION) -> Record:
    dtype, shape = _dtype(entry["dtype"]), tuple(int(size) for size in entry["shape"])
    value, version = None, None
    where = entry.get("data")
    if where is not None:
        start, nbytes = int(where["offset"]), int(where["nbytes"])
        if nbytes == 0:
            value = torch.empty(shape, dtype=dtype)
        else:
            if data is None or start + nbytes > data.numel():
                raise ValueError(f"{entry['key']!r} lies beyond the data file")
            value = data[start:start + nbytes].view(dtype).view(shape)
    elif entry.get("stale"):  # never shown: rec[key] says it was stale when saved
        value, version = torch.empty(0, dtype=dtype), -1
    summary = entry.get("summary")
    stats = entry.get("stats")
    placement = placement_of(entry["placement"])[0] if entry.get("placement") else None
    return Record(entry["key"], entry["op"], shape, dtype, value, bool(entry.get("copied")),
                  placement=placement,
                  _stats=None if stats is None else _saved_stats(stats, format_version),
                  via=entry.get("via", "graph"),
                  summary=None if summary is None else torch.tensor(summary, dtype=torch.float64),
                  version=version)
