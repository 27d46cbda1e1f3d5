"""torch.save's zip read without torch.load and without running any of its pickle's code (sce.unpickling): torch's
tensor rebuilds get stand-ins that check their arguments and leave each tensor unread (Stored: its shape known, its
data read on demand by `tensors`, to the CPU whatever device saved it); other data classes are inert placeholders."""
import collections
import io
import math
import zipfile

import torch

from sce.unpickling import Reader, Refused, inert, latin1, scan

MAX_PICKLE_BYTES = 2 ** 30
STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                  "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                  "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                  "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
                  "ComplexDoubleStorage": torch.complex128, "UntypedStorage": torch.uint8}


class StorageType:
    """torch.FloatStorage and its kin as a pickle names them: the dtype of the storages it types."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __setstate__(self, state):  # BUILD on it would retype every storage of every file read after (itemsize 0)
        raise Refused("it would change how torch's storages are typed (nothing was built)")


class Storage:
    """A storage of the zip not read yet: its record (data/KEY), dtype and number of elements; where it was saved
    (a GPU's) is ignored, it is read to the CPU."""

    def __init__(self, archive, key, dtype, numel):
        self.archive, self.key, self.dtype, self.numel = archive, key, dtype, numel


class Stored:
    """A tensor of the zip not read yet (its shape known): `tensors` reads it."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    @property
    def shape(self):
        return torch.Size(self.size)

    @property
    def dtype(self):
        return self.storage.dtype


def _ints(values):
    return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2's stand-in: a Stored, its arguments checked (a view inside its storage)."""
    if not (isinstance(storage, Storage) and type(offset) is int and offset >= 0 and _ints(size) and _ints(stride)
            and len(size) == len(stride) <= 64):
        raise Refused("its tensors are not rebuilt as torch's are (nothing was built)")
    if math.prod(size) > storage.numel:  # a view of stride 0: 2**40 rows of one, expanded by whatever copies it
        raise Refused(f"a tensor of it has more elements than its storage ({math.prod(size)} of {storage.numel})")
    extent = 0 if 0 in size else offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if extent > storage.numel:
        raise Refused(f"a tensor of it reaches past its storage ({extent} of {storage.numel} elements)")
    return Stored(storage, offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    """torch._utils._rebuild_parameter's stand-in: its tensor (a Parameter's data)."""
    if not isinstance(data, Stored):
        raise Refused("its tensors are not rebuilt as torch's are (nothing was built)")
    return data


_TENSOR_TYPES = object()  # torch.Tensor, torch.nn.Parameter: the types _rebuild_from_type_v2 names


def _rebuild_from_type(func, new_type, args, state):
    if func not in (_rebuild_tensor, _rebuild_parameter) or new_type is not _TENSOR_TYPES or type(args) is not tuple:
        raise Refused("its tensors are not rebuilt as torch's are (nothing was built)")
    return func(*args)


TORCH_BUILT = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
               ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
               ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
               ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
               ("torch", "Tensor"): _TENSOR_TYPES, ("torch.nn.parameter", "Parameter"): _TENSOR_TYPES,
               ("collections", "OrderedDict"): collections.OrderedDict, ("_codecs", "encode"): latin1,
               **{("torch", name): StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()}}


class Archive:
    """A torch.save zip: its records under one top folder (data.pkl, data/KEY, byteorder)."""

    def __init__(self, path):
        self.path = path
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise Refused("it is a zip but not one of torch.save (no single data.pkl)")
            self.prefix = pickles[0][:-len("data.pkl")]
            if any(info.compress_type != zipfile.ZIP_STORED for info in z.infolist()):  # a zip bomb, not torch's
                raise Refused("it holds compressed records, which torch.save never writes")
            order = self.prefix + "byteorder"
            if order in names and z.read(order).strip() not in (b"", b"little"):
                raise Refused("it was written on a big-endian machine, which this reader does not convert")
            self.sizes = {n: z.getinfo(n).file_size for n in names}
        if self.sizes[pickles[0]] > MAX_PICKLE_BYTES:  # the structure alone: the tensors' data lies beside it
            raise Refused(f"its pickle is {self.sizes[pickles[0]] / 2 ** 20:.0f} MiB, more than any checkpoint's "
                          "structure")

    def load(self, placeholders=inert):
        """(the object of data.pkl, its tensors Stored, the names placeholders stood for in it): nothing is read of
        the tensors' data yet."""
        storages = {}

        def persistent_load(pid):
            torch_saves = (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                           and isinstance(pid[1], StorageType) and isinstance(pid[2], str) and type(pid[4]) is int
                           and pid[4] >= 0)
            if not torch_saves:
                raise Refused("it refers to data torch.save does not write (nothing was built)")
            _, kind, key, _, numel = pid
            record = f"{self.prefix}data/{key}"
            if self.sizes.get(record, -1) < numel * kind.dtype.itemsize:
                raise Refused(f"its storage {key} is missing or shorter than its {numel} elements")
            if key not in storages:
                storages[key] = Storage(self, key, kind.dtype, numel)
            return storages[key]
        with zipfile.ZipFile(self.path) as z, z.open(self.prefix + "data.pkl") as raw:
            f = io.BytesIO(raw.read())
        scan(f)
        reader = Reader(f, TORCH_BUILT, placeholders, encoding="utf-8")
        reader.persistent_load = persistent_load
        return reader.load(), reader.placeholders


def tensors(stored):
    """{key: tensor} of {key: Stored or tensor}: each Stored read from its zip to the CPU (a storage shared by several
    tensors read once)."""
    read, out = {}, {}
    archives = {v.storage.archive.path: v.storage.archive for v in stored.values() if isinstance(v, Stored)}
    for path, archive in archives.items():
        with zipfile.ZipFile(path) as z:
            for k, v in stored.items():
                if not isinstance(v, Stored) or v.storage.archive is not archive:
                    continue
                s = v.storage
                if (path, s.key) not in read:
                    data = bytearray(z.read(f"{archive.prefix}data/{s.key}"))[:s.numel * s.dtype.itemsize]
                    if len(data) < s.numel * s.dtype.itemsize:  # its zip's directory said more than it holds
                        raise Refused(f"its storage {s.key} holds {len(data)} bytes, not its {s.numel} elements")
                    read[path, s.key] = torch.frombuffer(data, dtype=s.dtype) if data else torch.empty(0, dtype=s.dtype)
                out[k] = read[path, s.key].as_strided(v.size, v.stride, v.offset)
    return {k: out.get(k, v) for k, v in stored.items()}
