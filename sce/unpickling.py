"""Pickles read without running any of their code, within a bound on what they build: CIFAR's python batches
(sce.layouts, with numpy's arrays of plain numbers) and torch zips (sce.torchzip: checkpoints of other codes).

A pickle is first scanned op by op (nothing built): more ops than MAX_OBJECTS, or a memo index beyond them, is refused
before anything is built, so a file of a few hundred bytes cannot make millions of objects. Then it is unpickled by
Reader: the names a pickle calls are looked up in `built` (stand-ins that check their arguments); the names of data
classes (INERT: omegaconf's containers, typing.Any, ...) give an inert placeholder that records what the pickle gave it
and runs nothing; any other name (os.system, builtins.eval, ...) is refused before it could be called."""
import _compat_pickle
import pickle
import pickletools

import numpy as np

MAX_OBJECTS = 4_000_000  # CIFAR-100's train batch: ~300,000 ops; a ResNet-50 Lightning checkpoint: ~50,000


class Refused(pickle.UnpicklingError):
    """A pickle refused before it built or called what it names (code, more objects than the bound)."""


def scan(f, limit=None, rewind=True):
    """Every op of the pickle in `f` read, none run: Refused past `limit` (MAX_OBJECTS) ops, at a memo index beyond
    it (the C unpickler would size its memo to it), or where its tuples, their shared references expanded, would hold
    more than `limit` items (what hashing a dict's key walks: 60 tuples of two references to the one before, 2**60);
    then `f` is rewound (rewind=False: left after the pickle's STOP). A cut or damaged pickle raises ValueError."""
    start, limit = f.tell(), limit or MAX_OBJECTS
    stack, memo, expanded = [], {}, 0
    for count, (op, arg, _) in enumerate(pickletools.genops(f), 1):
        if count > limit:
            raise Refused(f"it would build more than {limit:,} objects (nothing was built)")
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and int(arg) > limit:
            raise Refused(f"its memo index {arg} is beyond the {limit:,} objects it may build (nothing was built)")
        expanded += _expand(op, arg, stack, memo)
        if expanded > limit:
            raise Refused(f"its tuples, their shared references expanded, would hold more than {limit:,} items "
                          "(nothing was built)")
    if rewind:
        f.seek(start)


_MARK = object()


def _expand(op, arg, stack, memo):
    """`op` played on `stack` of sizes (each object's items, its shared references expanded: a tuple's theirs
    summed, any other object 1; the memo's alike): the size it fetched from the memo (a shared reference), else 0.
    A tuple's size is at most the ops plus these, so their sum bounds what hashing or comparing tuples walks."""
    if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
        memo[len(memo) if arg is None else arg] = stack[-1] if stack and stack[-1] is not _MARK else 1
        return 0
    if op.name in ("GET", "BINGET", "LONG_BINGET", "DUP"):  # DUP: a reference to the object on top
        stack.append(memo.get(arg, 1) if op.name != "DUP" else stack[-1] if stack and stack[-1] is not _MARK else 1)
        return stack[-1]
    if op.name == "MARK":
        stack.append(_MARK)
        return 0
    popped = []
    if pickletools.stackslice in op.stack_before:  # the objects above the last mark, then the mark
        while stack and stack[-1] is not _MARK:
            popped.append(stack.pop())
        stack[-1:] = []
        before = op.stack_before.index(pickletools.markobject)
    else:
        before = len(op.stack_before)
    for _ in range(before):
        popped.append(stack.pop() if stack and stack[-1] is not _MARK else 1)
    size = 1 + sum(popped) if op.name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "FROZENSET") else 1
    stack.extend([size] * len(op.stack_after))
    return 0


class Inert:
    """An object of a class that is never built: the pickle's arguments, state, items and elements recorded."""
    module = name = ""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state, self.items, self.elements = args, None, {}, []
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items[key] = value

    def append(self, value):
        self.elements.append(value)

    def extend(self, values):
        self.elements.extend(values)

    def __repr__(self):
        return f"<{self.module}.{self.name}, not built>"


_PLACEHOLDERS = {}


def placeholder(module, name):
    """The Inert class standing for `module.name` (a type: a pickle's NEWOBJ needs one)."""
    key = (module, name)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = type(name, (Inert,), {"module": module, "name": name})
    return _PLACEHOLDERS[key]


def inert_fields(obj):
    """The fields of an Inert: its state where it is a dict (BUILD), else its items (SETITEMS)."""
    if isinstance(obj, Inert):
        return obj.state if isinstance(obj.state, dict) else obj.items
    return obj if isinstance(obj, dict) else {}


# data classes the checkpoints of other codes pickle (their hyper-parameters, args, loops' state), and those codes'
# own (eztorch, solo-learn, hydra): placeholders stand for them; a name outside these (and outside `built`) is refused
# as a pickle that runs code
INERT_MODULES = ("omegaconf", "typing", "pathlib", "argparse", "numpy", "torch", "pytorch_lightning", "lightning",
                 "lightning_fabric", "enum", "datetime", "decimal", "fractions", "collections", "eztorch", "solo",
                 "hydra")
INERT_NAMES = {("builtins", n) for n in ("dict", "list", "set", "frozenset", "tuple", "object", "int", "float", "str",
                                         "bytes", "bytearray", "bool", "complex", "slice", "type", "NoneType")}
INERT_NAMES.add(("copyreg", "_reconstructor"))


def latin1(text, encoding="latin1"):
    """_codecs.encode as a pickle of protocol 2 calls it for bytes, for latin-1 alone."""
    if not (isinstance(encoding, str) and encoding in ("latin1", "latin-1") and isinstance(text, str)):
        shown = repr(encoding)[:40] if isinstance(encoding, str) else f"a {type(encoding).__name__}"  # not repr's
        raise Refused(f"it would call _codecs.encode(..., {shown})")  # expansion of a pickle's shared references
    return text.encode("latin1")


def inert(module, name):
    return module.split(".")[0] in INERT_MODULES or (module, name) in INERT_NAMES


class Reader(pickle.Unpickler):
    """find_class: `built`'s stand-in for a name, or a placeholder where `placeholders` allows one (inert), else
    Refused. Every placeholder's name is kept in `self.placeholders`."""

    def __init__(self, f, built, placeholders=None, **kwargs):
        super().__init__(f, **kwargs)
        self.built, self.allows, self.placeholders = built, placeholders, set()

    def find_class(self, module, name):
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2's names, as pickle's own find_class maps them
            module, name = _compat_pickle.NAME_MAPPING[module, name]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in self.built:
            return self.built[module, name]
        if self.allows and self.allows(module, name):
            self.placeholders.add(f"{module}.{name}")
            return placeholder(module, name)
        raise Refused(f"it would call {module}.{name} (a pickle that runs code; nothing was run)")


# ---------------------------------------------------------------- numpy's arrays of plain numbers (CIFAR's batches)

def _plain_key(args, state):
    """numpy.dtype's arguments and state as a pickle gives them (Python 2's files: 0 and 1 for False and True); None
    unless both are tuples of scalars (repr would expand a pickle's shared references: 2**60 items of 60 lists)."""
    if not all(type(v) is tuple and all(type(x) in (str, int, bool, type(None)) for x in v) for v in (args, state)):
        return None
    return repr((tuple(int(a) if type(a) is bool else a for a in args), state))


# the dtypes a batch's arrays may have, by what their pickle holds: plain numbers in either byte order, no fields,
# no sub-arrays, no objects (a forged state, an object field inside a void dtype, crashes numpy, exit 139)
PLAIN = {_plain_key(*d.__reduce__()[1:]): d for name in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8")
         for d in (np.dtype(name).newbyteorder(order) for order in "<>")}


class _DType:
    """numpy.dtype(...) as a pickle calls it, then its state (BUILD): numpy's own built by real() once both are those
    of a plain dtype (PLAIN), never from a forged state."""

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state):
        self.state = state

    def real(self):
        key = _plain_key(self.args, self.state)
        found = PLAIN.get(key)
        if found is None:
            named = self.args and type(self.args[0]) is str
            shown = key[:80] if key else f"{self.args[0][:20]!r} of a state with fields or objects" if named else \
                "of forged arguments"
            raise Refused(f"its arrays would be of the dtype {shown}, not of plain numbers (nothing was built)")
        return found


def _real(dtype):
    if not isinstance(dtype, _DType):
        raise Refused(f"its arrays would be of a {type(dtype).__name__}, not of a dtype (nothing was built)")
    return dtype.real()


class _Array(np.ndarray):
    """An array as a pickle rebuilds it: numpy's __setstate__ given the plain dtype its _DType stands for."""

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) != 5:
            raise Refused("its arrays' state is not numpy's (nothing was built)")
        super().__setstate__(state[:2] + (_real(state[2]),) + state[3:])


_NDARRAY = object()  # numpy.ndarray in a pickle: _reconstruct's argument, nothing a pickle may call


def _array_builders():
    """What a pickle of numpy arrays calls, under each module path numpy 1 or 2 writes (the release's files: numpy
    1's numpy.core.multiarray._reconstruct), and protocol 2's bytes: each a stand-in taking plain dtypes alone."""
    def reconstruct(cls, shape, typecode):  # an empty array, then its state: _Array.__setstate__
        if cls is not _NDARRAY:
            raise Refused("it would rebuild another type than numpy.ndarray")
        return np.ndarray.__new__(_Array, (0,), np.uint8)

    def frombuffer(buffer, dtype, shape, order):  # protocol 5's arrays
        return np.frombuffer(buffer, dtype=_real(dtype)).reshape(shape, order=order)
    names = {("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _DType, ("_codecs", "encode"): latin1}
    for path in ("numpy.core", "numpy._core"):
        names[f"{path}.multiarray", "_reconstruct"] = reconstruct
        names[f"{path}.numeric", "_frombuffer"] = frombuffer
    return names


NUMPY_BUILT = _array_builders()
