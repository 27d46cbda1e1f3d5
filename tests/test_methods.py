"""A method is one record of sce.losses.METHODS plus its loss: a BYOL-style method (a predictor, a symmetric loss,
no queue) is added as one record and trains a step through main_pretrain.py's flags, its model's shape read from
the record; a method without a queue allocates none; the help's defaults come from the records."""
import dataclasses
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

import main_pretrain
from sce import cli, losses
from sce.builder import build_model
from sce.step import Training, train_step
from sce.optim import build_optimizer


def byol_loss(q, k, queue):
    """BYOL's regression of the online prediction onto the target: 2 - 2 cos(q, k); it reads no queue."""
    assert queue is None
    return (2 - 2 * (q * k).sum(dim=1)).mean()


BYOL = losses.Method("BYOL's regression", lambda args, lam=None: functools.partial(byol_loss), tau=1.0, tau_m=1.0,
                     views=losses.GlobalViews(target="strong", online="strong"), resume=(), queue=False,
                     symmetric=True, predictor=(24,),
                     projector=((24,), 12, "none"))


def test_a_methods_views_are_named_in_the_batchs_order_and_a_bare_pair_is_refused():
    """View 0 of a batch is the target's, view 1 the online's, as the record names them; a pair written
    positionally (in either order) cannot be taken."""
    from sce.data.views import view_specs
    with pytest.raises(TypeError):
        losses.GlobalViews("weak", "strong")
    for bare in (("strong", "weak"), ["weak", "strong"], {"target": "weak", "online": "strong"}):
        with pytest.raises(TypeError, match=r"Method.views: GlobalViews\(target=..., online=...\)"):
            dataclasses.replace(losses.METHODS["sce"], views=bare)
    assert losses.METHODS["sce"].views == losses.GlobalViews(online="strong", target="weak")
    for method in losses.METHODS:
        args = main_pretrain.parse_args(["--data", "d", "--method", method])
        views = losses.METHODS[method].views
        assert [s.aug for s in view_specs(args)] == [views.target, views.online]
    args = main_pretrain.parse_args(["--data", "d", "--target-aug", "strong-beta", "--online-aug", "weak"])
    assert [s.aug for s in view_specs(args)] == ["strong-beta", "weak"]


@pytest.fixture
def with_byol(monkeypatch):
    monkeypatch.setitem(losses.METHODS, "byol", BYOL)
    yield importlib.reload(main_pretrain)  # the parser's --method choices and help read the records
    monkeypatch.undo()
    importlib.reload(main_pretrain)


def test_a_byol_style_method_is_one_record_and_trains_a_step(with_byol):
    script = with_byol
    args = script.parse_args(["--data", "d", "--method", "byol", "--arch", "resnet18", "--small-input",
                              "--crop-size", "16", "--batch-size", "8"])
    assert (args.symmetric, args.pred_hidden_dims, args.queue_size) == (True, [24], 0)
    assert (args.proj_hidden_dims, args.proj_dim, args.proj_last_bn) == ([24], 12, "none")
    assert script.check_args(args) == 1
    torch.manual_seed(0)
    model = build_model(args, losses.criterion(args))
    assert model.queue is None and "queue" not in model.state_dict()  # nothing allocated
    assert isinstance(model.predictor[0], torch.nn.Linear) and model.pairs(2) == [(0, 1), (1, 0)]
    before = [p.clone() for p in model.online_parameters()]
    optimizer = build_optimizer("sgd", model, 0.1, 0.0)
    views = [torch.randn(8, 3, 16, 16) for _ in range(2)]
    result = train_step(Training(model, model, optimizer), views, 0.99)
    assert result.finite and result.terms is None and result.probe_top1 is None and 0 <= result.loss <= 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.online_parameters()))
    with pytest.raises(cli.UserError, match="--queue-size is a setting of a method with a queue"):
        script.check_args(script.parse_args(["--data", "d", "--method", "byol", "--queue-size", "64"]))
    help_text = script.parser.format_help()
    assert "byol 1.0" in help_text and "byol none" in help_text  # --tau's and --queue-size's from the record


def test_the_help_reads_each_record_and_the_model_takes_its_shape():
    help_text = " ".join(main_pretrain.parser.format_help().split())
    assert f"(default: the method's: {cli.per_method(lambda m: m.tau)})" in help_text
    sce = main_pretrain.parse_args(["--data", "d"])
    assert (sce.queue_size, sce.symmetric, sce.pred_hidden_dims) == (cli.QUEUE_SIZE, False, [])
    changed = dataclasses.replace(losses.METHODS["moco"], symmetric=True, predictor=(32,))
    queue_less = dataclasses.replace(changed, queue=False)
    for record in (changed, queue_less):
        losses.METHODS["moco"], saved = record, losses.METHODS["moco"]
        try:
            args = main_pretrain.parse_args(["--data", "d", "--method", "moco"])
        finally:
            losses.METHODS["moco"] = saved
        assert (args.symmetric, args.pred_hidden_dims, args.queue_size > 0) == (True, [32], record.queue)
    given = main_pretrain.parse_args(["--data", "d", "--no-symmetric", "--pred-hidden-dims"])
    assert given.symmetric is False and given.pred_hidden_dims == []  # a flag given wins over the record


def test_a_queue_is_allocated_only_for_a_method_with_one():
    kwargs = dict(arch="resnet18", small_input=True, proj_hidden_dims=(8,), proj_dim=4)
    with_queue = losses.METHODS["sce"]
    assert with_queue.queue and build_model_queue(kwargs, 64).shape == (64, 4)
    assert build_model_queue(kwargs, 0) is None


def build_model_queue(kwargs, size):
    from sce.builder import MomentumModel
    model = MomentumModel(lambda q, k, queue: F.mse_loss(q, k), queue_size=size, **kwargs)
    return model.queue


def test_the_online_probe_learns_from_labelled_images_only_and_reads_its_top1():
    """OnlineProbe.step: a cross-entropy step of its head alone (the features are given detached), images labelled
    -1 count for nothing, and it returns the top-1 (%) of the logits it stepped from; with no label at all it
    stays finite and a fresh head unchanged. Its head starts from its own seed: the run's random draws stay the same."""
    from sce.step import OnlineProbe
    torch.manual_seed(5)
    state = torch.get_rng_state()
    probe = OnlineProbe(8, 3, "cpu", lr=0.1)
    assert torch.equal(torch.get_rng_state(), state)
    features = torch.randn(6, 8)
    labels = torch.tensor([0, 1, 2, -1, -1, 1])
    logits = probe.head(features).detach()
    expected = 100 * ((logits.argmax(1) == labels) & (labels >= 0)).sum() / 4
    before = [p.clone() for p in probe.head.parameters()]
    assert probe.step(features, labels) == pytest.approx(expected.item())
    assert all(not torch.equal(a, b) for a, b in zip(before, probe.head.parameters()))
    fresh = OnlineProbe(8, 3, "cpu", lr=0.1)  # (Adam's momentum would carry on a probe that stepped before)
    before = [p.clone() for p in fresh.head.parameters()]
    assert fresh.step(features, torch.full((6,), -1)) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.head.parameters()))


def test_the_probes_gradient_over_ranks_is_the_whole_batchs_mean(monkeypatch):
    """Ranks holding different numbers of labelled images (STL-10's unlabelled ones): each rank's head steps with the
    gradient of the whole batch's labelled images, as one process holding them all; not the mean of the ranks' means.
    Two ranks simulated in one process: rank 1's sum recorded, then added to rank 0's by the all-reduce."""
    from sce import distributed as du
    from sce.step import OnlineProbe
    features, labels = torch.randn(6, 8), torch.tensor([0, -1, -1, 1, 2, 1])  # rank 0: 1 labelled; rank 1: 3
    whole = OnlineProbe(8, 3, "cpu")
    whole.step(features, labels)
    sent = []
    monkeypatch.setattr(du, "world_size", lambda: 2)
    monkeypatch.setattr(du, "all_reduce_sum", lambda x: sent.append(x.clone()) or x)
    OnlineProbe(8, 3, "cpu").step(features[3:], labels[3:])  # rank 1's share
    monkeypatch.setattr(du, "all_reduce_sum", lambda x: x + sent[0])
    rank0 = OnlineProbe(8, 3, "cpu")
    rank0.step(features[:3], labels[:3])
    for a, b in zip(rank0.head.parameters(), whole.head.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
        torch.testing.assert_close(a, b)


def test_the_probe_keeps_the_runs_random_numbers_and_its_own_settings_on_resume(monkeypatch):
    """Its head's draws touch no GPU generator (shuffle-BN's there) and put the CPU's back; a resumed probe keeps
    this run's lr; a mid-epoch checkpoint written without it (an old list, or a dict) resumes with it."""
    from sce.step import OnlineProbe, StepResult
    from sce.tally import Tally, window_means
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: pytest.fail("a GPU generator was seeded"))
    saved = OnlineProbe(8, 3, "cpu", lr=0.1)
    saved.step(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    probe = OnlineProbe(8, 3, "cpu", lr=0.02)
    probe.load_state_dict(saved.state_dict())
    assert probe.restored and probe.optimizer.param_groups[0]["lr"] == 0.02
    assert torch.equal(probe.head.weight, saved.head.weight)
    one = torch.ones(())
    for sums in ([2.0, 14.0, 6.0, 2.0], {"steps": 2.0, "loss": 14.0, "a": 6.0, "finite_losses": 2.0}):
        tally = Tally("cpu", torch.zeros(()), sums)
        tally.add(StepResult(7 * one, torch.ones((), dtype=torch.bool), {"a": 3 * one}, probe_top1=50 * one))
        tally.add(StepResult(7 * one, torch.ones((), dtype=torch.bool), {"a": 3 * one}, probe_top1=100 * one))
        epoch = tally.read(tally.epoch)
        assert epoch == {"steps": 4.0, "loss": 28.0, "a": 12.0, "online_train_top1": 300.0}
        assert window_means(epoch, 4)["online_train_top1"] == 75.0  # the mean of its own two steps, not 37.5


def test_a_resumed_run_keeps_the_sizes_it_started_with(tmp_path):
    """A run older than the settings' sources map (its args.json flat values only) resumed with --dataset cifar10
    keeps what it started with (an earlier version took 224 and no small stem for any dataset), not the row a fresh
    run takes; a flag given still wins."""
    (tmp_path / "checkpoint_last.pth").write_bytes(b"")
    (tmp_path / "args.json").write_text('{"crop_size": 224, "small_input": false, "lr": 0.5}')
    flags = ["--data", "d", "--dataset", "cifar10", "--output-dir", str(tmp_path)]
    args = main_pretrain.parse_args(flags)
    assert (args.crop_size, args.small_input, args.lr, args.recipe) == (224, False, 0.5, None)
    assert args.sources["crop_size"] == "run: its args.json" and "resuming" in args.notes[0]
    args = main_pretrain.parse_args(flags + ["--crop-size", "40"])
    assert (args.crop_size, args.small_input) == (40, False)
    with pytest.raises(cli.UserError, match="--online-probe-lr must be positive"):
        main_pretrain.check_args(main_pretrain.parse_args(["--data", "d", "--online-probe-lr", "0"]))
