"""What the steps of pretraining did, summed on the device without a host sync (Tally), and read back as the means of
a window of progress lines or of an epoch (window_means): sce.epoch's loop adds each step's StepResult (sce.step)."""
import torch

PROBE_TOP1 = "online_train_top1"  # the online probe's running top-1 (StepResult.probe_top1) in the stats and log.txt


class Tally:
    """What the steps did, summed on the device (no host sync), by name: per window of progress lines and per epoch,
    `steps` (the finite ones) and the sums over them of the `loss`, of the terms the method logs (in the order
    the step returns them, known from the first step: `terms`) and of the online probe's top-1 (PROBE_TOP1), stacked
    in one tensor so that one copy reads a window (read); the steps whose loss was finite (finite_losses);
    consecutive non-finite steps. `sums`: the epoch's before a resume within it (sce.epoch.Epoch.sums)."""

    def __init__(self, device, nonfinite, sums=None):
        self.names = self.terms = self.window = self.epoch = None  # the first step sets them
        if isinstance(sums, list):  # a checkpoint of before 2026-11-28: steps, loss, the terms, finite losses
            sums = {"list": sums[:-1], "finite_losses": sums[-1]}
        self.resumed = sums
        self.lacking, self.resumed_steps = [], 0.0  # names the resumed sums lack; their steps (resumed_sums)
        self.finite_losses = torch.full((), sums["finite_losses"] if sums else 0.0, device=device)  # any loss
        self.nonfinite = nonfinite.clone()

    def add(self, result):
        """One step's StepResult."""
        loss, finite, terms = result.loss, result.finite, result.terms or {}
        self.nonfinite = torch.where(finite, torch.zeros_like(self.nonfinite), self.nonfinite + 1)
        self.finite_losses += torch.isfinite(loss)
        named = {"steps": torch.ones_like(loss), "loss": loss.float(), **terms}
        if result.probe_top1 is not None:
            named[PROBE_TOP1] = result.probe_top1
        values = torch.where(finite, torch.stack(list(named.values())), 0.0)
        if self.names is None:  # the first step: steps, the loss, the terms in the order the step returns them
            self.names, self.terms, self.window = list(named), list(terms), torch.zeros_like(values)
            self.epoch = values.new_tensor(self.resumed_sums()) if self.resumed else torch.zeros_like(values)
        self.window += values
        self.epoch += values

    def resumed_sums(self):
        """The resumed epoch's sums in the order of `names`, 0 for a name it lacks (a run resumed with the online
        probe that stopped without it: read scales that name's sum to its mean over the steps since); an old
        checkpoint's list holds steps, loss and the method's terms."""
        resumed = self.resumed
        if "list" in resumed:
            resumed = dict(zip(self.names, resumed["list"]))
        self.lacking, self.resumed_steps = [n for n in self.names if n not in resumed], resumed.get("steps", 0.0)
        return [resumed.get(name, 0.0) for name in self.names]

    def read(self, sums):
        """{name: value} of `sums` (the window or the epoch): one copy to the host. In the epoch's, a name the
        resumed sums lacked counts this invocation's steps only: its sum x steps / steps since the resume."""
        values = dict(zip(self.names, sums.tolist()))
        if sums is self.epoch and self.lacking:
            since = values["steps"] - self.resumed_steps
            for name in self.lacking:
                values[name] = values[name] * values["steps"] / since if since else float("nan")
        return values

    def sums(self):
        """The epoch's sums so far by name, for a checkpoint within it (sce.epoch.Epoch.sums)."""
        return dict(self.read(self.epoch), finite_losses=self.finite_losses.item())


def window_means(sums, steps):
    """The loss and terms of `sums` (Tally.read) averaged over the window's finite steps (NaN when none was finite,
    never 0), and the number of its `steps` skipped as non-finite."""
    finite = sums.pop("steps")
    return dict({name: total / finite if finite else float("nan") for name, total in sums.items()},
                skipped_steps=steps - round(finite))
