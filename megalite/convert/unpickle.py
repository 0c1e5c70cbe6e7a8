"""Reading another trainer's pickles as data, without running them: an allow-list unpickler.

A pickle is a small program. GLOBAL names any importable callable and REDUCE calls it, so `pickle.load`
on a file from elsewhere runs whatever the file names (`os.system` included). DCP keeps its checkpoint
index (`.metadata`) as such a pickle, and Megatron-LM its training arguments (`common.pt`).

Here every global the file names is looked up in a table of our own (`Allow`) and nothing else:

  * a class on the list becomes an inert `Record` subclass named after it. Building one (REDUCE, NEWOBJ,
    BUILD) only stores the arguments and the state: no module of the file's is imported and no code of its
    classes runs. The caller reads records' fields and checks their types.
  * a value on the list (a torch dtype) is returned as that value; it cannot be called.
  * any other global is refused, one line naming it, before anything of the file's is called.

Persistent ids (a torch.save file's tensor storages) are refused unless the caller names what stands in
for them, and then they are inert records too: their bytes are never read.

Before any of that, the pickle's claims are checked against its own size (limits.check_pickle: memo indices,
integer widths, nesting depth), so a few bytes cannot cost gigabytes or a SIGSEGV while it is read.
"""
from __future__ import annotations

import io
import pickle
from typing import Callable, Optional

import torch

from ..base import limits
from ..base.errors import MegaliteError


class Record:
    """An object of an allow-listed class, as data: `kind` ("module.Name"), the arguments it was built with
    (`args`) and the state pickle set on it (`state`: a dict, a tuple, or None)."""

    kind = "?"

    def __new__(cls, *args):  # NEWOBJ calls cls.__new__(cls, *args); REDUCE calls cls(*args): both end here
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args):
        pass

    def __setstate__(self, state):  # BUILD
        self.state = state

    def fields(self) -> dict:
        """The object's attributes: a dataclass's state dict, or {} when it has none."""
        if isinstance(self.state, dict):
            return self.state
        if isinstance(self.state, tuple) and len(self.state) == 2 and isinstance(self.state[0], dict):
            return self.state[0]  # (dict, slots)
        return {}

    def __repr__(self):  # bounded: a message never prints a whole (or deeply nested) foreign value
        return f"<{self.kind} args={limits.describe(self.args)} state={limits.describe(self.state)}>"


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class OverBudget(MegaliteError, pickle.UnpicklingError):
    """The pickle claims more than its size can back (limits.check_pickle): the message says what."""


class Allow:
    """What a pickle may name: `records` (module -> class names that become inert Records), `values`
    ((module, name) -> the object returned as is: never a callable of any consequence), and `prefixes`
    (module prefixes whose every name becomes an inert Record, e.g. a trainer's own enums)."""

    def __init__(self, records: dict[str, tuple[str, ...]], values: Optional[dict] = None,
                 prefixes: tuple[str, ...] = ()):
        self.records = {(m, n) for m, names in records.items() for n in names}
        self.values = dict(values or {})
        self.prefixes = prefixes
        self._classes: dict[tuple[str, str], type] = {}

    def resolve(self, module: str, name: str):
        key = (module, name)
        if key in self.values:
            return self.values[key]
        if key in self.records or any(module == p or module.startswith(p + ".") for p in self.prefixes):
            if key not in self._classes:
                self._classes[key] = type(name, (Record,), {"kind": f"{module}.{name}", "__module__": __name__})
            return self._classes[key]
        raise RefusedGlobal(f"{module}.{name}")


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, allow: Allow, persistent: Optional[Callable]):
        super().__init__(f)
        self.allow, self.persistent = allow, persistent

    def find_class(self, module, name):  # GLOBAL, STACK_GLOBAL, INST, OBJ and the EXT opcodes all come here
        return self.allow.resolve(module, name)

    def persistent_load(self, pid):
        if self.persistent is None:
            raise pickle.UnpicklingError("the pickle refers to a persistent id (external data), which this "
                                         "file must not have")
        return self.persistent(pid)


def load(data: bytes, allow: Allow, persistent: Optional[Callable] = None):
    """The pickled object as plain Python values and Records. Raises OverBudget for a pickle whose claims
    pass its size (limits.check_pickle), RefusedGlobal naming a global that is not allowed, or
    pickle.UnpicklingError / ValueError / ... for a malformed pickle (callers turn each into a one-line error
    naming their file)."""
    limits.check_pickle(data, "the pickle", OverBudget)
    return _Unpickler(io.BytesIO(data), allow, persistent).load()


DTYPES = {("torch", n): getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}

_DCP = "torch.distributed.checkpoint"
# Every global a DCP `.metadata` written by torch 2.x or by megatron-core's planner names (as found in real
# files); megatron adds its save plans (`all_local_plans`).
DCP_METADATA = Allow(
    records={f"{_DCP}.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                   "_MEM_FORMAT_ENCODING"),
             f"{_DCP}.filesystem": ("_StorageInfo",),
             f"{_DCP}.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
             "torch": ("Size",), "torch.serialization": ("_get_layout",),
             "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
    values={**DTYPES, ("collections", "OrderedDict"): dict})

# Megatron-LM's common.pt: the training arguments (an argparse.Namespace of numbers, strings, dtypes and
# megatron's own enums), the iteration, and small states; tensors in it stay unread records.
MEGATRON_COMMON = Allow(
    records={"argparse": ("Namespace",),
             "torch": ("Size", "UntypedStorage", "FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage",
                       "LongStorage", "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"),
             "torch._utils": ("_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_tensor"),
             "pathlib": ("PosixPath", "PurePosixPath")},
    values={**DTYPES, ("collections", "OrderedDict"): dict},
    prefixes=("megatron",))
