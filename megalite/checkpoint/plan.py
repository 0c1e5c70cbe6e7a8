"""The write plan: which slices each coordinate writes, and the payload (tensors + manifest records) it builds.

Live saves, `split` and `reshard` all ask `plan_writes`, so they agree on the tree. A payload is what one
rank hands the commit protocol: per file {key: tensor}, one manifest record per slice, and its state.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from ..parallel.data import SPACE_BUFFER, dp_pieces
from ..parallel.grid import Coord, Layout
from ..parallel.partition import Box, Partition, partition_of, tp_box, tp_replica, tp_replicas, valid_view
from .manifest import MOMENTS, TensorEntry, dtype_name
from .optimizer import optimizer_state
from .tree import MODEL_FILE, OPTIM_FILE


@dataclass(frozen=True)
class WriteItem:
    """One slice a coordinate writes: which tensor, which part of it, into which file under which key."""
    name: str  # global parameter name
    kind: str  # "model" | "buffer" (in the manifest's model section) | "exp_avg" | "exp_avg_sq" | "optim.<key>"
    file: str  # MODEL_FILE or OPTIM_FILE
    box: Box  # the region of the global tensor
    flat: Optional[tuple] = None  # a piece: elements [a, b) of the box, row-major (None: the whole box)

    @property
    def key(self) -> str:
        return self.name if self.kind in ("model", "buffer") else f"{self.name}.{self.kind}"

    def state(self, kind: str, shape: Optional[tuple] = None) -> "WriteItem":
        """The same slice of this parameter's optimizer state `kind`: same box, same piece, same writer; with
        `shape` (a state tensor of another shape than its parameter's), the whole of it."""
        if shape is not None:
            return WriteItem(self.name, kind, OPTIM_FILE, Box.whole(shape))
        return WriteItem(self.name, kind, OPTIM_FILE, self.box, self.flat)


def replicated_writer(tensors: Iterable[tuple[str, Partition]], tp: int) -> dict[str, int]:
    """Which replica writes each tensor that several tp ranks hold alike (`tp_replica`: tp-replicated tensors,
    kv heads shared by tp/n_kv_head ranks): the i-th by global name is written by replica i mod (its replica
    count), so these small tensors spread over the tp ranks. A tp-replicated tensor's replica index is its tp
    rank."""
    tensors = list(tensors)
    names = sorted(n for n, p in tensors if tp_replicas(p, tp) > 1 and not p.tied_to)
    parts = dict(tensors)
    return {n: i % tp_replicas(parts[n], tp) for i, n in enumerate(names)}


def plan_writes(tensors: Iterable[tuple[str, Partition]], coord: Coord, layout: Layout,
                optimizer: bool = True, buffers: frozenset = frozenset(), per_tensor: bool = False,
                shard: int = 0) -> list[WriteItem]:
    """Everything the coordinate `coord` writes, given the (name, partition) of the tensors its pipeline
    stage holds (with `optimizer`, the AdamW moments of each model slice too).

    The stage's tp slice is cut over the dp x cp ranks that hold it as the ZeRO-1 optimizer cuts it
    (`parallel.data.dp_pieces`: one flat space of the tensors sorted by name, dp*cp equal contiguous ranges):
    the rank with `layout.replica(coord)` = d (dp rank * cp + cp rank; the dp rank when cp = 1) writes range d,
    i.e. the weights and both moments of the piece of each tensor that range overlaps (`flat`, or the whole box
    when the range covers the tensor). So every dp and cp rank of a stage writes the same bytes (± one element
    per range), nothing is written twice, with or without ZeRO-1, and a ZeRO-1 rank writes its moments exactly
    as it holds them.
    A tensor several tp ranks hold alike is written by one of them (`replicated_writer`); tied copies are never written
    (they load from their source). The names in `buffers` (a module's buffers: no optimizer state) are cut
    in a flat space of their own, so the parameters' cut stays the ZeRO-1 optimizer's. `per_tensor` (a ZeRO-2 or
    3 run's live save): each tensor is cut on its own (`dp_pieces(per_tensor=True)`), as those ranks hold their
    gradients, moments and (3) weights; a reader takes any cut, since every slice says its box and piece. `shard`
    (hybrid sharding, parallel.dp_shard = N): the cut is over N ranks, and the first group of N writes it.
    """
    tensors = sorted(tensors)
    boxes = {n: tp_box(p, coord.tp, layout.tp) for n, p in tensors}
    cut = shard or layout.replicas
    if layout.replica(coord) >= cut:  # hybrid: another shard group holds (and writes) the same chunks
        return []
    pieces = dp_pieces([(n, boxes[n].numel, SPACE_BUFFER if n in buffers else bool(p.tied_to))
                        for n, p in tensors], layout.replica(coord), cut, per_tensor)
    writer = replicated_writer(tensors, layout.tp)
    items = []
    for name, part in tensors:
        a, b = pieces[name]
        if part.tied_to or a == b or writer.get(name, 0) != tp_replica(part, coord.tp, layout.tp):
            continue
        box = boxes[name]
        buffer = name in buffers
        it = WriteItem(name, "buffer" if buffer else "model", MODEL_FILE, box,
                       None if (a, b) == (0, box.numel) else (a, b))
        items.append(it)
        if optimizer and not buffer:
            items += [it.state(kind) for kind in MOMENTS]
    return items


@dataclass
class Payload:
    """What one rank writes: tensors per file (key -> tensor), their manifest records, and its state.json."""
    files: dict = field(default_factory=dict)  # file name -> {key: tensor}
    records: list = field(default_factory=list)  # (TensorEntry without slices, WriteItem) per slice
    state: Optional[object] = None  # a state.StepState (None: a payload for sizing buffers only)
    step_files: dict = field(default_factory=dict)  # other small files of the folder, name -> bytes (rank 0:
    # the run's tokenizer.json), written with files.write_new and listed/checksummed in the manifest like state.json

    def model_slices(self) -> list:
        """(partition, WriteItem) of every planned model slice: where an optimizer puts its state beside."""
        return [(proto.partition, it) for proto, it in self.records if it.kind == "model"]


def collect(params, optimizer, grid, state=None, buffers: frozenset = frozenset()) -> Payload:
    """This coordinate's share of the live state: its planned model slices, then the same slices of the
    optimizer's state (`optimizer`: megalite's ShardedAdamW, a torch.optim optimizer, None, or the
    optimizer.OptimizerState of one). `params` may hold buffers too (the names in `buffers`). Tensors are
    views (an async save holds them or copies them to host buffers, see async_save.py)."""
    c, L = grid.coord, grid.layout
    live, owner = dict(params), optimizer_state(optimizer)
    pay = Payload(files={MODEL_FILE: {}, OPTIM_FILE: {}}, state=state)
    for it in plan_writes([(n, partition_of(p)) for n, p in params], c, L, optimizer=False, buffers=buffers,
                          per_tensor=owner.per_tensor, shard=owner.shard):
        part, t = partition_of(live[it.name]), owner.weight(it)  # ZeRO-3: the rank's chunk, as held
        if t is None:
            t = valid_view(live[it.name].detach(), part, c.tp, L.tp).reshape(-1)
            t = t[it.flat[0]:it.flat[1]] if it.flat else t.view(it.box.shape)
        add(pay, it, part, t)
    for it, part, t in owner.slices(params, pay.model_slices(), grid):
        add(pay, it, part, t)
    return pay


def add(pay: Payload, it: WriteItem, part: Partition, tensor) -> None:
    """Put one planned slice into the payload, with its manifest record (the tensor's real dtype)."""
    pay.files.setdefault(it.file, {})[it.key] = tensor
    kind = "model" if it.kind == "buffer" else it.kind  # buffers live in the manifest's model section
    proto = TensorEntry(it.key, kind, dtype_name(tensor.dtype), tuple(part.global_shape), part)
    pay.records.append((proto, it))
