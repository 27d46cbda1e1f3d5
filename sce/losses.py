"""The objectives of SCE and its baselines, as pure functions on l2-normalised tensors.

Shapes: q (N, D) online outputs, k (N, D) target outputs (no gradient), queue (M, D).
The candidates of query i are its positive k_i followed by the M queue entries, so the
batch sums of the paper's equations run over [k_i, queue] here, as in the authors' code and in
MoCo (other in-batch keys are not candidates).
Equation numbers refer to the SCE paper (WACV 2023).
METHODS holds each method main_pretrain.py trains, one record each (Method).
"""
import dataclasses
import functools

import torch
import torch.nn.functional as F


def _similarities(q, k, queue):
    """(N, 1) positive and (N, M) negative cosine similarities of the queries."""
    pos = torch.einsum("nd,nd->n", q, k).unsqueeze(1)
    neg = torch.einsum("nd,md->nm", q, queue)
    return pos, neg


def sce_loss(q, k, queue, lambda_=0.5, tau=0.1, tau_m=0.07, mask_positive=False):
    """L_SCE, eq. 9: cross-entropy between the target w2 (eq. 7) and the online p1 (eq. 8).

    The target relations s2 (eq. 3) come from k against the queue. The published code gives
    the positive a constant 0 logit (it keeps a small weight); mask_positive=True gives it
    weight exactly 0, as eq. 3 writes it.
    """
    pos, neg = _similarities(q, k, queue)
    log_p1 = F.log_softmax(torch.cat([pos, neg], dim=1) / tau, dim=1)  # eq. 8
    with torch.no_grad():
        sim2_neg = torch.einsum("nd,md->nm", k, queue) / tau_m
        sim2_pos = torch.full_like(sim2_neg[:, :1], float("-inf") if mask_positive else 0.0)
        s2 = F.softmax(torch.cat([sim2_pos, sim2_neg], dim=1), dim=1)  # eq. 3
        w2 = (1 - lambda_) * s2  # eq. 7
        w2[:, 0] += lambda_
    return -(w2 * log_p1).sum(dim=1).mean()  # eq. 9


def infonce_loss(q, k, queue, tau=0.2):
    """L_InfoNCE, eq. 1 (MoCo v2): the positive against the queue."""
    pos, neg = _similarities(q, k, queue)
    logits = torch.cat([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


def ressl_loss(q, k, queue, tau=0.1, tau_m=0.04):
    """L_ReSSL, eq. 4: relations of k (eq. 3) predicted from q (eq. 2); the positive is
    excluded from both distributions."""
    neg = torch.einsum("nd,md->nm", q, queue)
    log_s1 = F.log_softmax(neg / tau, dim=1)  # eq. 2
    with torch.no_grad():
        s2 = F.softmax(torch.einsum("nd,md->nm", k, queue) / tau_m, dim=1)  # eq. 3
    return -(s2 * log_s1).sum(dim=1).mean()  # eq. 4


def ceil_loss(q, k, queue, tau=0.1):
    """L_Ceil of Proposition 1: -log of the online mass p1 puts on the negatives."""
    pos, neg = _similarities(q, k, queue)
    return (torch.logsumexp(torch.cat([pos, neg], dim=1) / tau, dim=1)
            - torch.logsumexp(neg / tau, dim=1)).mean()


def combined_loss(q, k, queue, lambda_=0.5, mu=0.5, eta=0.5, tau=0.1, tau_m=0.07):
    """Eq. 10 with free coefficients (Table 3). With mu = eta = 1 - lambda it equals
    sce_loss(..., mask_positive=True) exactly (Proposition 1)."""
    loss = lambda_ * infonce_loss(q, k, queue, tau)
    if mu:
        loss = loss + mu * ressl_loss(q, k, queue, tau, tau_m)
    if eta:
        loss = loss + eta * ceil_loss(q, k, queue, tau)
    return loss


@torch.no_grad()
def loss_terms(q, k, queue, tau=0.1, tau_m=0.07):
    """The three terms of eq. 10, for logging every step: the same values as infonce_loss,
    ressl_loss and ceil_loss, from two similarity matrices instead of their four."""
    pos, neg = _similarities(q, k, queue)
    log_all = torch.logsumexp(torch.cat([pos, neg], dim=1) / tau, dim=1)
    log_neg = torch.logsumexp(neg / tau, dim=1)
    s2 = F.softmax(torch.einsum("nd,md->nm", k, queue) / tau_m, dim=1)  # eq. 3
    return {"infonce": (log_all - pos[:, 0] / tau).mean(),  # eq. 1
            "ressl": -(s2 * (neg / tau - log_neg[:, None])).sum(dim=1).mean(),  # eq. 4
            "ceil": (log_all - log_neg).mean()}


def sce_criterion(args, lam=None):
    """SCE's loss with the run's settings: eq. 9 (lam: its Lambda, by default --lambda), or eq. 10 with
    --loss-coeffs' free coefficients."""
    if args.loss_coeffs:
        lam_, mu, eta = args.loss_coeffs
        return functools.partial(combined_loss, lambda_=lam_, mu=mu, eta=eta, tau=args.tau, tau_m=args.tau_m)
    return functools.partial(sce_loss, lambda_=args.lambda_ if lam is None else lam.value, tau=args.tau,
                             tau_m=args.tau_m, mask_positive=args.mask_positive)


def eq10_terms(args):
    """The three terms of eq. 10 at the run's temperatures, logged every step (loss_terms)."""
    return functools.partial(loss_terms, tau=args.tau, tau_m=args.tau_m)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlobalViews:
    """A method's two global views, each a row of Table 2 (sce.data.views.AUGMENTATIONS), named in the batch's order
    (sce.data.views.view_specs): view 0 the target, view 1 the online. Keywords only: a pair written positionally,
    in either order, is refused."""
    target: str  # --target-aug's default
    online: str  # --online-aug's default

    def in_batch_order(self):
        return [self.target, self.online]


@dataclasses.dataclass(frozen=True)
class Method:
    """A method whole: main_pretrain.py's --method NAME. Adding one is its loss function above and its record in
    METHODS (and, for benchmarks/reproduction/reproduce.sh, its row of the paper's table in reproduce_tools.py's
    PAPER). Its loss is f(q, k, queue) (queue None for a method without one); the model's shape is the record's
    defaults of main_pretrain.py's flags, which a flag given on the command line overrides."""
    about: str  # what it optimises, for --help
    criterion: object  # (args, lam=None) -> functools.partial of its loss function with the run's settings
    tau: float  # --tau's default
    tau_m: float  # --tau-m's default
    views: GlobalViews  # --target-aug's and --online-aug's defaults (rows of Table 2)
    resume: tuple  # the settings (args keys) its loss and terms read: a resumed run keeps them
    flags: tuple = ()  # (flag, argparse keywords) of the flags only it reads, added to main_pretrain.py's parser
    terms: object = None  # (args) -> f(q, k, queue) -> {name: value}, logged beside the loss; None: the loss only
    queue: bool = True  # a queue of past keys (--queue-size's default 65536); False: none is allocated
    symmetric: bool = False  # --symmetric's default: both global views serve as targets
    predictor: tuple = ()  # --pred-hidden-dims' default: the predictor's hidden widths; (): no predictor
    projector: tuple = ((2048, 2048), 256, "affine")  # --proj-hidden-dims, --proj-dim and --proj-last-bn's defaults

    def __post_init__(self):
        if not isinstance(self.views, GlobalViews):  # a bare pair would be read in some order, silently
            raise TypeError(f"Method.views: GlobalViews(target=..., online=...), not {self.views!r}")


SCE_FLAGS = (
    ("--lambda", dict(dest="lambda_", type=float, default=0.5, metavar="LAMBDA",
                      help="weight of the one-hot target, eq. 7")),
    ("--lambda-schedule", dict(default="constant", choices=["constant", "linear", "cosine"],
                               help="lambda after its warmup: constant, or linear / cosine from --lambda to "
                                    "--lambda-end at the last step (a varying lambda is the paper's future work; "
                                    "the authors' later code has it)")),
    ("--lambda-end", dict(type=float, metavar="LAMBDA", help="lambda at the last step (default: --lambda)")),
    ("--lambda-warmup-steps", dict(type=int, default=0, metavar="STEPS",
                                   help="steps of a linear rise of lambda from --lambda-warmup-start to --lambda")),
    ("--lambda-warmup-start", dict(type=float, metavar="LAMBDA",
                                   help="lambda at step 0 of its warmup (default: --lambda)")),
    ("--mask-positive", dict(action="store_true", help="eq. 3 strictly: the positive gets target weight 0 "
                                                       "(default: the published constant 0 logit)")),
    ("--loss-coeffs", dict(type=float, nargs=3, metavar=("LAMBDA", "MU", "ETA"),
                           help="optimise eq. 10 with free coefficients (Table 3) instead of eq. 9")),
)

# a flag given on the command line wins over a method's defaults
METHODS = {
    "sce": Method("eq. 9 (or eq. 10 with --loss-coeffs)", sce_criterion, tau=0.1, tau_m=0.07,
                  views=GlobalViews(target="weak", online="strong"),
                  resume=("tau", "tau_m", "mask_positive", "loss_coeffs", "lambda_", "lambda_schedule", "lambda_end",
                          "lambda_warmup_steps", "lambda_warmup_start"), flags=SCE_FLAGS, terms=eq10_terms),
    # MoCo v2: InfoNCE on two strong views; its tau_m is only that of the logged terms
    "moco": Method("MoCo v2's InfoNCE, eq. 1", lambda args, lam=None: functools.partial(infonce_loss, tau=args.tau),
                   tau=0.2, tau_m=0.07, views=GlobalViews(target="strong", online="strong"),
                   resume=("tau", "tau_m"), terms=eq10_terms),
    # ReSSL's best ImageNet temperatures
    "ressl": Method("ReSSL's relational term, eq. 4",
                    lambda args, lam=None: functools.partial(ressl_loss, tau=args.tau, tau_m=args.tau_m),
                    tau=0.1, tau_m=0.04, views=GlobalViews(target="weak", online="strong"), resume=("tau", "tau_m"),
                    terms=eq10_terms),
}


def criterion(args, lam=None):
    """The loss main_pretrain.py's settings ask for: --method's, with the temperatures and its own flags; lam: its
    Lambda (a device tensor when it follows a schedule), by default --lambda."""
    return METHODS[args.method].criterion(args, lam)


def logged_terms(args):
    """f(q, k, queue) -> {name: value}: the terms --method logs beside its loss, at the run's settings; or None."""
    method = METHODS[args.method]
    return method.terms(args) if method.terms else None


def loss_name(args):
    """The loss function the run optimises (sce, infonce, ressl, combined), as args.json records it."""
    return METHODS[args.method].criterion(args).func.__name__.removesuffix("_loss")


def lambda_scheduled(args):
    """Whether lambda moves during training (--lambda-schedule, --lambda-warmup-steps)."""
    return args.lambda_schedule != "constant" or args.lambda_warmup_steps > 0


class Lambda:
    """Lambda of eq. 7 as the criterion reads it: --lambda, or, when it moves (--lambda-schedule,
    --lambda-warmup-steps; sce.step.Schedules.lambda_at), a device tensor set in place at each step (a CUDA graph
    of the step reads it there)."""

    def __init__(self, args, device=torch.device("cpu")):
        self.value = torch.tensor(args.lambda_, device=device) if lambda_scheduled(args) else args.lambda_

    def set(self, lam):
        if torch.is_tensor(self.value):
            self.value.fill_(lam)
