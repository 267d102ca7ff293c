"""Where a capture of a sharded model sits on its device mesh, and its full value.

Under tensor or sequence parallelism a module's output is a ``DTensor`` (its placements
and mesh are exact) or, where the ParallelStyle was given ``use_local_output=True``, a plain
tensor holding this rank's piece. For those the style's own forward hook says what the piece
is (:func:`fxdebug.base.torch_compat.parallel_output_layout`): ColwiseParallel hands on
``Shard(-1)`` (its ``output_layouts``), RowwiseParallel ``Replicate()`` after its
all-reduce, SequenceParallel ``Shard(sequence_dim)``. Any other plain capture of a
tensor-parallel model is "local, placement unknown", never guessed::

    Capture pass      plan_layouts(gm, keys)   key -> the layout of a ParallelStyle module's
                                               output, or why none is known; None for a model
                                               without tensor parallelism (zero cost)
    Records.add       dtensor_placement(t)     a DTensor: its placements (only for tensors
                                               that are not plain torch.Tensor)
                      planned_placement(...)   a plain tensor of a tensor-parallel model
    Records.full      full_value(...)          a collective: the DTensor's full_tensor(),
                                               a local piece assembled on its mesh

>>> Placement(("S(1)",), (("tp", 2),), None, True, "ColwiseParallel(use_local_output=True)",
...           (0,)).text
'S(1)@tp'
>>> Placement((), (), None, True, "no ParallelStyle output", ()).text
'local?'
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from ..errors import FxdebugError
from ..base import torch_compat
from ..stats.summary import stats_from_summary, summarize

__all__ = ["Placement", "dtensor_placement", "planned_placement", "plan_layouts", "local_value",
           "full_value", "assemble", "same_tensor", "agreement_text", "parameter_pieces",
           "grad_layouts", "UNKNOWN_PLACEMENT"]

UNKNOWN_PLACEMENT = "local?"


@dataclasses.dataclass
class Placement:
    """A capture's place on a device mesh.

    ``placements``: per mesh dim, ``"S(d)"`` (sharded along tensor dim ``d``), ``"R"``
    (replicated) or ``"P"`` (a pending sum; ``"P(max)"`` for another reduction); empty when
    not known. ``mesh_dims``: ``(name, size)`` per mesh dim (name ``""`` where the mesh has
    none). ``global_shape``: the full tensor's shape (None where a local piece's is not known
    before :meth:`Records.full` gathers it). ``local``: the value held is this rank's plain
    tensor, not a DTensor. ``source``: ``"DTensor"``, the ParallelStyle that produced it, or
    why the placement is unknown. ``coordinate``: this rank's coordinate on the mesh.
    ``known``: False for "local, placement unknown". ``mesh`` (the DeviceMesh, for
    :meth:`Records.full`) is not pickled. ``assembled``: the Record holds the full value
    assembled from every rank's piece (a sharded run loaded from disk), not this rank's piece.
    """

    placements: tuple[str, ...]
    mesh_dims: tuple[tuple[str, int], ...]
    global_shape: tuple[int, ...] | None
    local: bool
    source: str
    coordinate: tuple[int, ...]
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    assembled: bool = False

    @property
    def known(self) -> bool:
        return bool(self.placements)

    @property
    def sharded(self) -> bool:
        """Whether ranks of the mesh hold different data (a shard or a pending sum)."""
        return not self.known or any(p != "R" for p in self.placements)

    @property
    def text(self) -> str:
        """Compact: ``"S(1)@tp"``, ``"R"``, ``"P@tp"``, ``"S(0)@dp,S(1)@tp"``, ``"local?"``."""
        if not self.known:
            return UNKNOWN_PLACEMENT
        parts = [f"{p}@{name or f'dim{i}'}" for i, (p, (name, _)) in
                 enumerate(zip(self.placements, self.mesh_dims)) if p != "R"]
        return ",".join(parts) or "R"

    def describe(self) -> str:
        """One phrase for a Record's repr."""
        if not self.known:
            return f"local, placement unknown ({self.source})"
        mesh = "x".join(f"{name or f'dim{i}'}={size}" for i, (name, size) in
                        enumerate(self.mesh_dims))
        shape = "" if self.global_shape is None else " of " + "x".join(map(str, self.global_shape))
        return (f"{'local ' if self.local else ''}{self.text}{shape} on mesh {mesh}"
                f"{self.stats_scope()}")

    def stats_scope(self) -> str:
        """What a Record's statistics describe, where not the full tensor: ``""`` for a
        replicated or assembled value.

        >>> Placement(("P",), (("tp", 2),), (4,), True, "RowwiseParallel", (0,)).stats_scope()
        "; statistics of this rank's term of the pending sum"
        """
        if self.assembled or not self.sharded:
            return ""
        if not self.known:
            return "; statistics of this rank's tensor"
        if any(p.startswith("P") for p in self.placements):
            return "; statistics of this rank's term of the pending sum"
        return "; statistics of this rank's piece"

    def replica_class(self) -> tuple | None:
        """The mesh coordinates along which copies differ: ranks with equal classes must hold
        equal data (None: unknown, nothing to compare)."""
        if not self.known:
            return None
        return tuple((dim, self.coordinate[dim]) for dim, p in enumerate(self.placements)
                     if p != "R" and dim < len(self.coordinate))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["mesh"] = None  # a DeviceMesh belongs to this process's groups
        return state


def _placement_text(placement, ndim: int) -> str | None:
    if placement.is_shard():
        dim = placement.dim
        return f"S({dim + ndim if dim < 0 else dim})"
    if placement.is_replicate():
        return "R"
    if placement.is_partial():
        op = getattr(placement, "reduce_op", "sum")
        return "P" if op == "sum" else f"P({op})"
    return None


def _mesh_facts(mesh) -> tuple[tuple[tuple[str, int], ...], tuple[int, ...]]:
    names = getattr(mesh, "mesh_dim_names", None) or ("",) * mesh.ndim
    return (tuple((str(name), int(size)) for name, size in zip(names, mesh.shape)),
            tuple(int(c) for c in (mesh.get_coordinate() or ())))


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def dtensor_placement(tensor: torch.Tensor) -> Placement | None:
    """A DTensor's placement (exact), None for any other tensor.

    >>> dtensor_placement(torch.ones(1)) is None
    True
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return None
    mesh = tensor.device_mesh
    dims, coordinate = _mesh_facts(mesh)
    texts = [_placement_text(p, tensor.ndim) for p in tensor.placements]
    if any(t is None for t in texts):
        odd = ", ".join(str(p) for p, t in zip(tensor.placements, texts) if t is None)
        return Placement((), dims, tuple(tensor.shape), False,
                         f"a DTensor placed {odd}, which fxdebug cannot describe", coordinate, mesh)
    return Placement(tuple(t for t in texts if t is not None), dims, tuple(tensor.shape), False,
                     "DTensor", coordinate, mesh)


def plan_layouts(root: torch.nn.Module, module_of: dict[str, str | None]) -> dict | None:
    """``{key: layout or why none is known}`` for the captures of a tensor-parallel model
    (``module_of``: capture key -> the path of the module whose output it is, or None);
    None for a model without tensor parallelism.

    >>> plan_layouts(torch.nn.Linear(2, 2), {"": ""}) is None
    True
    """
    if not any(torch_compat.distribute_module_applied(m) for m in root.modules()):
        return None
    layouts: dict[str, Any] = {}
    for key, path in module_of.items():
        module = None if path is None else root.get_submodule(path) if path else root
        layout = None if module is None else torch_compat.parallel_output_layout(module)
        if layout is not None:
            layouts[key] = layout
        elif module is not None and torch_compat.distribute_module_applied(module):
            layouts[key] = (f"{type(module).__name__} {path!r} was parallelized with a style "
                            f"whose output fxdebug cannot read")
        else:
            layouts[key] = "not the output of a ParallelStyle module"
    return layouts


def planned_placement(layout, tensor: torch.Tensor) -> Placement:
    """The placement of a plain tensor a tensor-parallel model computed: from its module's
    ParallelStyle (``layout``, see :func:`plan_layouts`) where certain, else unknown."""
    if not isinstance(layout, torch_compat.ParallelLayout) or not layout.use_local_output:
        why = layout if isinstance(layout, str) else "not the output of a ParallelStyle module"
        return Placement((), (), None, True, why, ())
    dims, coordinate = _mesh_facts(layout.mesh)
    texts = tuple(_placement_text(p, tensor.ndim) for p in layout.placements)
    if len(texts) != len(dims) or any(t is None for t in texts):
        return Placement((), dims, None, True, f"{layout.style} output placed "
                         f"{layout.placements}, which fxdebug cannot describe", coordinate)
    known = tuple(t for t in texts if t is not None)
    shape = tuple(tensor.shape) if all(t == "R" or t.startswith("P") for t in known) else None
    return Placement(known, dims, shape, True, f"{layout.style}(use_local_output=True)",
                     coordinate, layout.mesh)


def grad_layouts(layouts: dict | None) -> dict | None:
    """The layouts of the gradients of a tensor-parallel model's captures (``layouts``: the
    captures', see :func:`plan_layouts`): a plain local tensor's gradient is placed as its
    value (``DTensor.to_local`` declares it so), a pending sum's as replicated (what
    ``DTensor.from_local``'s backward hands on).

    >>> grad_layouts(None) is None
    True
    """
    if layouts is None:
        return None
    out: dict[str, Any] = {}
    for key, layout in layouts.items():
        if isinstance(layout, torch_compat.ParallelLayout) and any(
                getattr(p, "is_partial", lambda: False)() for p in layout.placements):
            from torch.distributed.tensor import Replicate
            placements = tuple(Replicate() if p.is_partial() else p for p in layout.placements)
            layout = torch_compat.ParallelLayout((layout[0], placements, *layout[2:]))
        out[key] = layout
    return out


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece; any other tensor itself.

    >>> local_value(torch.ones(2)).shape
    torch.Size([2])
    """
    if type(tensor) is not torch.Tensor and dtensor_placement(tensor) is not None:
        return cast(Any, tensor).to_local()
    return tensor


def _torch_placement(text: str):
    from torch.distributed.tensor import Partial, Replicate, Shard
    if text == "R":
        return Replicate()
    if text.startswith("S("):
        return Shard(int(text[2:-1]))
    return Partial() if text == "P" else Partial(text[2:-1])


def _combine(parts: list[torch.Tensor], text: str, masks: bool) -> torch.Tensor:
    if text.startswith("S("):
        return torch.cat(parts, dim=int(text[2:-1]))
    if masks:  # which elements a rank holds: any copy or term holds them
        return torch.stack(parts).any(dim=0)
    if text == "R":
        return parts[0]
    stacked = torch.stack(parts)
    op = "sum" if text == "P" else text[2:-1]
    if op == "sum":
        return stacked.sum(dim=0)
    if op == "avg":
        return stacked.mean(dim=0)
    if op in ("max", "min"):
        return stacked.amax(dim=0) if op == "max" else stacked.amin(dim=0)
    raise ValueError(f"a pending reduction {text!r} that fxdebug cannot assemble")


def assemble(pieces: dict[tuple[int, ...], torch.Tensor], placements: tuple[str, ...],
             masks: bool = False) -> torch.Tensor:
    """The full tensor from one piece per mesh coordinate (every coordinate present), mesh
    dims taken last to first (a DTensor shards along mesh dim 0 first).

    >>> pieces = {(0,): torch.tensor([1., 2.]), (1,): torch.tensor([3.])}
    >>> assemble(pieces, ("S(0)",))
    tensor([1., 2., 3.])
    >>> assemble({(0,): torch.ones(2), (1,): torch.ones(2)}, ("P",))
    tensor([2., 2.])
    """
    current = dict(pieces)
    for dim in reversed(range(len(placements))):
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coordinate in sorted(current):
            groups.setdefault(coordinate[:dim], []).append(current[coordinate])
        current = {rest: _combine(parts, placements[dim], masks) for rest, parts in groups.items()}
    return current[()]


def full_value(key: str, value: torch.Tensor, placement: Placement | None,
               mesh_ranks: tuple[int, ...] | None = None) -> torch.Tensor:
    """The full tensor of a capture: a collective every rank of its mesh calls (where its
    DeviceMesh was not kept, a run read back from disk, every rank of the default group:
    ``mesh_ranks``, the global ranks of its mesh, say which pieces are its)."""
    if placement is None:
        return value
    if not placement.local and placement.mesh is not None:
        return cast(Any, value).full_tensor()
    if placement.known and placement.mesh is None:
        return _gathered_full(key, local_value(value), placement, mesh_ranks)
    if not placement.known:
        return _same_on_every_rank(key, value, placement)
    from torch.distributed.tensor import DTensor
    mesh = placement.mesh
    shape = list(value.shape)
    for dim in reversed(range(len(placement.placements))):
        text = placement.placements[dim]
        if text.startswith("S("):
            along = int(text[2:-1])
            sizes: list = [None] * mesh.size(dim)
            torch.distributed.all_gather_object(sizes, shape[along], group=mesh.get_group(dim))
            shape[along] = sum(sizes)
    placement.global_shape = tuple(shape)
    stride = torch.empty(shape, device="meta").stride()
    placed = DTensor.from_local(value.detach(), mesh, [_torch_placement(t) for t in
                                                       placement.placements],
                                run_check=False, shape=torch.Size(shape), stride=stride)
    return placed.full_tensor()


def agreement_text(values: dict[int, Any], equal) -> str:
    """Which ranks hold which value: ``"ranks 0, 2 | rank 1"`` (ranks holding one value
    grouped, groups in order of their first rank).

    >>> agreement_text({0: 1, 1: 2, 2: 1}, lambda a, b: a == b)
    'ranks 0, 2 | rank 1'
    """
    groups: list[list[int]] = []
    for rank in sorted(values):
        for group in groups:
            if equal(values[group[0]], values[rank]):
                group.append(rank)
                break
        else:
            groups.append([rank])
    return " | ".join(("rank " if len(g) == 1 else "ranks ") + ", ".join(map(str, g))
                      for g in groups)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same values (NaN where the other has NaN).

    >>> same_tensor(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    True
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return (a.is_floating_point() or a.is_complex()) and bool(
        torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _same_on_every_rank(key: str, value: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A local tensor whose placement is unknown: its value where every rank of the default
    group holds the same bits (a replicated activation), else an error naming which ranks hold
    which value (a collective: every rank calls it)."""
    import torch.distributed as dist
    held = value.detach()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sent: list = [None] * dist.get_world_size()
        dist.all_gather_object(sent, held.cpu())
        if all(same_tensor(piece, sent[0]) for piece in sent[1:]):
            return value
        held_text = agreement_text(dict(enumerate(sent)), same_tensor)
        raise FxdebugError(
            f"records.full({key!r}): the capture is this rank's local tensor, its placement is "
            f"unknown ({placement.source}), and the ranks hold "
            f"{held_text.count(' | ') + 1} different values ({held_text}), so no one full value "
            f"can be assembled without a guess. Compare it "
            f"with a run of the unsharded model instead, fxdebug.compare_runs(unsharded_records, "
            f"records), which tests every layout the pieces could have against the full value; "
            f"or give the ParallelStyle that produces it use_local_output=False, so that its "
            f"output is a DTensor whose placement fxdebug reads exactly.")
    return value


def _gathered_full(key: str, piece: torch.Tensor, placement: Placement,
                   mesh_ranks: tuple[int, ...] | None) -> torch.Tensor:
    """A known placement whose mesh was not kept: every rank's piece gathered over the default
    process group, this mesh's pieces assembled by their coordinates."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise FxdebugError(
            f"records.full({key!r}): the capture is this rank's piece ({placement.text}) of a run "
            f"read back without its process group, so no other rank can send its piece. Load "
            f"every rank's folder in one process instead: fxdebug.load_records(path)[{key!r}] "
            f"assembles the full value from path/rank-R.")
    world = dist.get_world_size()
    sent: list = [None] * world
    dist.all_gather_object(sent, (tuple(placement.coordinate), mesh_ranks,
                                  piece.detach().cpu()))
    pieces = {coordinate: held for coordinate, ranks, held in sent if ranks == mesh_ranks}
    needed = 1
    for _, size in placement.mesh_dims:
        needed *= size
    if len(pieces) != needed:
        raise FxdebugError(
            f"records.full({key!r}): its mesh {placement.describe()} needs {needed} pieces, and "
            f"the ranks of the default group sent {len(pieces)} for it (ranks "
            f"{mesh_ranks}): call records.full({key!r}) on every rank, with the Records of the "
            f"same run.")
    return assemble(pieces, placement.placements).to(piece.device)


def parameter_pieces(named_parameters) -> list[tuple[str, tuple[int, ...], Any, Any]]:
    """``(name, shape, Stats or None, piece)`` of every parameter's ``.grad``, without any
    collective: a DTensor gradient (FSDP2, tensor parallelism) gives its local piece's
    statistics and shape; ``piece`` = ``(placement or None, summary)`` (None without a
    gradient), for :func:`~fxdebug.load_records` to assemble the full gradient's statistics
    from every rank's.

    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([1.0, 3.0])
    >>> [(n, s, stats.mean, piece[0]) for n, s, stats, piece in parameter_pieces([("w", p)])]
    [('w', (2,), 2.0, None)]
    """
    found: list[tuple[str, tuple[int, ...], Any, Any]] = []
    for name, parameter in named_parameters:
        grad = parameter.grad
        if grad is None:
            found.append((name, tuple(parameter.shape), None, None))
            continue
        placement: Placement | None = None
        if type(grad) is not torch.Tensor:
            placement = dtensor_placement(grad)
        piece = local_value(grad) if placement is not None else grad
        summary = summarize(piece.detach(), one_pass=False)
        found.append((name, tuple(piece.shape), stats_from_summary(summary), (placement, summary)))
    return found
