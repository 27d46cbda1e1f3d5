"""Batches assembled on the device, for pretraining and evaluation alike: one code path for each way crops reach it.

    Preloaded   the images live on the device (sce.data.preloading); each epoch's order and each view's parameter
                rows are made on the host once and moved there in one copy, the next epoch's while this one trains:
                a step indexes them, with no host work and no sync
    pack        the decode route's loader batch, in a worker: each image's JPEG bytes (for the device to decode) or,
                for a file the device does not decode, the crops the worker cut; each view's parameter rows
    unpack      that batch on the device: the JPEGs decoded and cut there, placed beside the workers' crops; an image
                nothing reads goes to the caller's `unreadable` (pretraining replaces it, an evaluation raises)
"""
import concurrent.futures

import torch


class Preloaded:
    """Iterating yields an epoch's batches cut from `images` (uint8 (N, 3, H, W) on the device): for each
    `per_batch` indices of the order, make(index, tables) with the epoch's parameter tables indexed there.
    prepare(epoch) -> (the epoch's whole order, [a table (N, ...) per view]) on the host; set_epoch(epoch, skip)
    picks the epoch and the first `skip` indices of its order to leave out (a resumed epoch). ahead: the next
    epoch's are prepared while this one is iterated (an order or tables that change with the epoch)."""

    def __init__(self, images, per_batch, prepare, make, ahead=True):
        self.images, self.per_batch, self.prepare, self.make, self.ahead = images, per_batch, prepare, make, ahead
        self.epoch, self.skip, self.ready = 0, 0, {}
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epoch-tables")

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def _moved(self, epoch):
        order, tables = self.prepare(epoch)
        device = self.images.device
        pin = device.type == "cuda"
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if pin else (lambda t: t.to(device))
        return move(torch.as_tensor(order)), [move(t) for t in tables]

    def tables(self, epoch):
        """The epoch's order and tables on the device; the next epoch's start on the host meanwhile."""
        future = self.ready.pop(epoch, None)
        order, tables = future.result() if future else self._moved(epoch)
        self.ready = {epoch + 1: self.worker.submit(self._moved, epoch + 1)} if self.ahead else {}
        return order, tables

    def __iter__(self):
        order, tables = self.tables(self.epoch)
        for index in order[self.skip:].split(self.per_batch):
            yield self.make(index, [table[index] for table in tables])


def pack(payloads):
    """A decode-route batch from its samples' payloads, each (crops per view or None, rows per view, a plain JPEG's
    bytes or None): (the JPEGs' bytes end to end, their lengths, their places in the batch, per view the other
    images' crops (or None), their places, per view the rows of every image)."""
    encoded = [i for i, p in enumerate(payloads) if p[2] is not None]
    cropped = [i for i, p in enumerate(payloads) if p[2] is None]
    jpegs = [payloads[i][2] for i in encoded]
    views = range(len(payloads[0][1]))
    crops = [torch.stack([payloads[i][0][v] for i in cropped]) if cropped else None for v in views]
    rows = [torch.stack([p[1][v] for p in payloads]) for v in views]
    return (torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8), [len(d) for d in jpegs],
            torch.tensor(encoded, dtype=torch.long), crops, torch.tensor(cropped, dtype=torch.long), rows)


def unpack(packed, decoder, sizes, cut, unreadable):
    """A pack()ed batch on the decoder's device -> per view its crops (N, 3, size, size), float in [0, 255]:
    cut(image, view, j) cuts view `view` of decoded image j (uint8 (3, H, W) on the device) with its rows, which
    stay on the host (a window's bounds read without a device sync); unreadable(j) -> image j's crops per view, or
    raises."""
    jpegs, lengths, encoded, crops, cropped, rows = packed
    device = decoder.device
    images = decoder(list(jpegs.split(lengths))) if lengths else []
    out = [torch.empty((len(encoded) + len(cropped), 3, size, size), device=device) for size in sizes]
    places = cropped.to(device, non_blocking=True)  # once, not once a view
    for v, c in enumerate(crops):
        if c is not None:
            out[v][places] = c.to(device, non_blocking=True).float()
    for j, image in zip(encoded.tolist(), images):
        views = unreadable(j) if image is None else [cut(image, v, j) for v in range(len(sizes))]
        for v, x in enumerate(views):
            out[v][j] = x.to(device).float()
    return out
