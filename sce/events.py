"""TensorBoard's writer for the scripts, whose failure to write (a full disk) ends its events, never the run."""
import threading


def summary_writer(output_dir):
    """A TensorBoard SummaryWriter on output_dir (Events), or None (with a line saying so) without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard is not installed: no TensorBoard scalars", flush=True)
        return None
    events = Events(None, output_dir)  # first: the writer's thread writes (and may fail) in its constructor
    try:
        events.writer = SummaryWriter(output_dir)
    except OSError as e:  # a full disk
        return events.failed(e)
    return events


class Events:
    """A SummaryWriter whose failure to write (a full disk) ends its events with one line, never the run: its writer
    thread's error, raised again by its next call, is caught here; that thread's own report of it (a traceback) is
    not printed (threading.excepthook, for TensorBoard's writer threads only)."""

    def __init__(self, writer, output_dir):
        self.writer, self.output_dir = writer, output_dir
        if not getattr(threading.excepthook, "quiet_tensorboard", False):
            threading.excepthook = _quiet_tensorboard(threading.excepthook)

    def __getattr__(self, name):  # add_scalar, add_image, flush, close
        def call(*args, **kwargs):
            try:
                return getattr(self.writer, name)(*args, **kwargs) if self.writer else None
            except OSError as e:
                return self.failed(e)
        return call

    def failed(self, error):
        print(f"=> TensorBoard could not write to {self.output_dir} ({error.strerror}): no more of its events in "
              "this run", flush=True)
        self.writer = None


def _quiet_tensorboard(hook):
    def quiet(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            hook(args)
    quiet.quiet_tensorboard = True
    return quiet
