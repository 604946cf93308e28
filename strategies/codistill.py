r"""Federated co-distillation between capacity pools: PeriodicCodist and MergedCodist.

Seed 003 ("Federated co-distillation ... heterogeneous devices"), Algorithms 1 and 2
(Appendix B), settings in Appendix C.  Clients form *pools* by capacity; pool ``i`` trains its
own model ``theta_i`` by FedAvg with a per-pool FedAdam server optimizer (``beta_1 = 0.9``,
``beta_2 = 0.999``, ``tau = 1e-5``, server learning rate decaying linearly to 0 over the
rounds).  No parameter is shared between pools: they exchange knowledge only by distillation on
the server's unlabeled data.

Distillation (Appendix C.4) of student ``i`` from the teacher ``j != i`` (both copies taken at
the same moment), on unlabeled inputs ``x`` with temperature ``T`` and student regularization
``lam``:

.. math::

    q &= (1 - \lambda)\,\mathrm{softmax}(z_j(x) / T) + \lambda\,\mathrm{softmax}(z_i^{0}(x) / T) \\
    \mathcal{L} &= \mathrm{KL}\big(q \,\|\, \mathrm{softmax}(z_i(x) / T)\big)

where ``z_i^0`` are the student's logits at the start of distillation (a frozen copy) and
``z_i`` its current logits; ``s`` Adam steps (default hyper-parameters, a fresh optimizer per
distillation, learning rate decaying linearly over the rounds) give ``theta_i^student``.  With
more than two pools the teacher distribution is the mean of the other pools' tempered
softmaxes (for two pools exactly the paper's).

* **PeriodicCodist** (Algorithm 1): FedAvg in every pool; after the FedAvg update of round
  ``t`` with ``t % p == 0``, every model distills ``s`` steps from copies of the others,
  is replaced by its student, and its FedAdam moments (and step count) are reset.
* **MergedCodist** (Algorithm 2): every round, from copies of the round-start models
  ``theta_i^t``, ``s`` steps give ``theta_i^student``; the distillation gradient is merged with
  the FedAvg pseudo-gradient and applied by FedAdam:
  ``Delta_i = alpha g_i + (1 - alpha) delta_i ||g_i|| / ||delta_i||`` (``alpha = 1``: FedAvg).
  ``merge_start = t_0 > 1`` runs rounds ``t < t_0`` with ``alpha = 1`` and no distillation (the
  paper's conclusions: "By setting alpha = 1, we can recover FedAvg and skip the
  codistillation cost for specific rounds"); a diagnosis of when distillation should start.
* **fedavg**: per-pool FedAvg/FedAdam only (the paper's baseline).

``moment_reset = r > 0`` (MergedCodist and FedAvg only; not in the paper) resets every pool's
FedAdam moments and step count after the update of every round ``t`` with ``t % r == 0``: the
reset Algorithm 1 makes after each periodic distillation, without the distillation.  A control
that separates Algorithm 1's optimizer reset from its knowledge transfer (issue 19, C7 / C8).

Sign convention
---------------
The paper (FedJAX) writes pseudo-gradients as descent directions,
``g_i = theta_i^t - mean_k theta_{i,k}`` and ``delta_i = theta_i^t - theta_i^student``, and
applies ``theta <- theta - eta Adam(Delta)``.  This project's
:func:`~strategies.fedadam.fedadam_step` takes *update* directions and applies
``theta <- theta + eta_t m / (sqrt(v) + tau)``.  Here, therefore,
``g_i = mean_k theta_{i,k} - theta_i^t`` and ``delta_i = theta_i^student - theta_i^t`` (both
negated).  :func:`merged_update` is odd in ``(g, delta)`` jointly and Adam's ``m / sqrt(v)`` is
odd in its input, so both conventions give the same new parameters.

The math is the pure functions below and the distillation loop with its target and loss in
:mod:`strategies.distillation`; :class:`CoDistillation` is the Flower glue.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack

import torch
from flwr.app import MessageType
from flwr.common import log
from torch import Tensor, nn

from experiment.lists import split_list
from experiment.method_settings import CodistGroup, ServerAdamGroup, ServerTrainingGroup
from models.batches import Batch
from models.catalog import VariantCatalog
from models.codist import unlabeled_image_crops, unlabeled_images
from models.data import load_splits, read_guardian_headlines, text_inputs
from models.images import mixed_domains
from models.transformer import load_tokenizer, resolve_source
from strategies.base import HeterogeneousStrategy
from strategies.distillation import DistillationConfigError, distill, sample_batches
from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step, group_states_from_dict, group_states_to_dict
from strategies.options import StrategyOptions
from strategies.round_sums import GroupMeans, GroupMeansResult

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry

Params = dict[str, Tensor]
Mode = Literal["periodic", "merged", "fedavg"]
Membership = Literal["instead", "also"]
MODES: tuple[str, ...] = ("periodic", "merged", "fedavg")
_MODE_OF: dict[str, Mode] = {"periodic": "periodic", "merged": "merged", "fedavg": "fedavg"}
MEMBERSHIPS: tuple[str, ...] = ("instead", "also")
_T = TypeVar("_T")

#: The paper's server optimizer (Appendix C.3): FedAdam with Adam's defaults but ``tau = 1e-5``.
#: ``eta`` was tuned per pool on ``(1e-4, 1e-1)``; ``1e-2`` is a starting point.
CODIST_FEDADAM = FedAdamConfig(eta=1e-2, beta_1=0.9, beta_2=0.999, tau=1e-5)


class CodistConfigError(DistillationConfigError):
    """Inconsistent co-distillation settings (raised before round 1)."""


def parse_mode(value: str) -> Mode:
    """``value`` as a co-distillation mode (``periodic``, ``merged``, ``fedavg``); else :class:`CodistConfigError`."""
    try:
        return _MODE_OF[value]
    except KeyError:
        raise CodistConfigError(f"mode must be one of {MODES}, got {value!r}") from None


# --- pure math --------------------------------------------------------------------------------


def linear_decay(lr0: float, server_round: int, total_rounds: int) -> float:
    """Learning rate of round ``t`` (1-based) decaying linearly to 0 over ``T`` rounds.

    ``lr_t = lr0 * max(0, 1 - (t - 1) / T)``: ``lr0`` in round 1, ``lr0 / T`` in round ``T``,
    0 afterwards -- ``optax.linear_schedule(lr0, 0, T)`` evaluated at step ``t - 1``, the
    schedule of the paper's FedJAX server and distillation optimizers (Appendix C.3-C.4).

    Raises
    ------
    CodistConfigError
        For ``t < 1`` or ``T < 1``.

    """
    if server_round < 1 or total_rounds < 1:
        raise CodistConfigError(f"need round >= 1 and total rounds >= 1, got {server_round} and {total_rounds}")
    return lr0 * max(0.0, 1.0 - (server_round - 1) / total_rounds)


def global_norm(tensors: Mapping[str, Tensor]) -> float:
    """L2 norm of all tensors together, ``sqrt(sum_k ||t_k||^2)`` (accumulated in float64)."""
    total = 0.0
    for t in tensors.values():
        total += float(torch.sum(t.detach().to(torch.float64) ** 2))
    return math.sqrt(total)


def norm_ratio(delta: Mapping[str, Tensor], g: Mapping[str, Tensor]) -> float:
    """``||delta||_2 / ||g||_2`` over ``g``'s keys, the factor eq. 2's rescaling divides ``delta`` by.

    Above 1 the merge shrinks the distillation gradient, below 1 it stretches it.  0 when
    ``||delta|| = 0``; ``inf`` when ``||g|| = 0 < ||delta||``.
    """
    d_norm = global_norm({k: delta[k] for k in g})
    if d_norm == 0.0:
        return 0.0
    g_norm = global_norm(g)
    return math.inf if g_norm == 0.0 else d_norm / g_norm


def merged_update(g: Mapping[str, Tensor], delta: Mapping[str, Tensor], alpha: float) -> Params:
    r"""MergedCodist's merged pseudo-gradient (Algorithm 2, line 8; eq. 2).

    ``Delta = alpha g + (1 - alpha) delta ||g||_2 / ||delta||_2``, the norms taken over all of
    ``g``'s tensors together (the whole model's update).  Keys are ``g``'s; ``delta`` must hold
    them (extra keys are ignored).  ``alpha = 1`` returns ``g`` bit for bit (FedAvg).

    Zero norms: when ``||delta|| = 0`` (the student did not move: ``s = 0``, learning rate 0,
    or it already matches its target) the distillation term is 0 and ``Delta = alpha g``; when
    ``||g|| = 0`` the rescaled distillation term is 0 as well.  Nothing is ever divided by 0.

    Raises
    ------
    CodistConfigError
        For ``alpha`` outside ``[0, 1]`` or ``delta`` lacking a key of ``g``.

    """
    if not 0.0 <= alpha <= 1.0:
        raise CodistConfigError(f"alpha must be in [0, 1], got {alpha}")
    missing = [k for k in g if k not in delta]
    if missing:
        raise CodistConfigError(f"distillation gradient lacks {missing[:3]}")
    g_norm = global_norm(g)
    d_norm = global_norm({k: delta[k] for k in g})
    scale = 0.0 if d_norm == 0.0 else (1.0 - alpha) * g_norm / d_norm
    return {k: alpha * t + scale * delta[k] for k, t in g.items()}


@dataclass(frozen=True)
class DistillConfig:
    """Distillation hyper-parameters of one student (Appendix C.4).

    Attributes
    ----------
    steps : int
        Adam steps ``s`` per distillation (paper: 200 for PeriodicCodist, 32 for MergedCodist).
    temperature : float
        ``T > 0`` of the teacher (and student) softmax (tuned on ``(0.1, 10)``).
    lam : float
        Student regularization toward its start-of-distillation predictions (tuned on
        ``(0.001, 0.5)``).
    lr : float
        Initial Adam learning rate (tuned on ``(1e-4, 1e-1)``).
    batch_size : int
        Unlabeled examples per step.
    decay : bool
        Decay ``lr`` linearly to 0 over the rounds (:func:`linear_decay`).

    """

    steps: int = 32
    temperature: float = 1.0
    lam: float = 0.1
    lr: float = 1e-3
    batch_size: int = 64
    decay: bool = True

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise CodistConfigError(f"steps must be >= 0, got {self.steps}")
        if not self.temperature > 0.0:
            raise CodistConfigError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.lam <= 1.0:
            raise CodistConfigError(f"lam must be in [0, 1], got {self.lam}")
        if self.lr < 0.0:
            raise CodistConfigError(f"lr must be >= 0, got {self.lr}")
        if self.batch_size < 1:
            raise CodistConfigError(f"batch_size must be >= 1, got {self.batch_size}")


# --- Flower glue ------------------------------------------------------------------------------


class CoDistillation(HeterogeneousStrategy[GroupMeansResult]):
    """PeriodicCodist / MergedCodist / per-pool FedAvg on Flower (seed 003, Algorithms 1-2).

    Pools are the catalog variants (smallest first).  Each pool's model lives in
    ``self.state[pool]``; its FedAdam state in ``self.adam[pool]``
    (:class:`~strategies.fedadam.FedAdamState`, reset after a periodic distillation).  One
    round, after the base class has validated replies and formed the example-weighted mean
    client weights ``w_i`` of every pool that had replies:

    * ``g_i = w_i - theta_i^t`` (update direction, see the module's sign convention);
    * ``merged``: students ``theta_i^student`` from copies of the round-start models,
      ``delta_i = theta_i^student - theta_i^t``, ``Delta_i`` = :func:`merged_update`;
      ``fedavg`` / ``periodic``: ``Delta_i = g_i``;
    * ``theta_i^{t+1}`` = :func:`~strategies.fedadam.fedadam_step` with ``eta`` =
      :func:`linear_decay` of the pool's ``eta`` (when ``server_lr_decay``);
    * ``periodic`` and ``t % period == 0``: distill every pool from copies of the others
      (all taken after this round's FedAdam updates), replace, reset every FedAdam state;
    * ``merged`` / ``fedavg`` with ``moment_reset = r > 0`` and ``t % r == 0``: reset every
      FedAdam state (no distillation).

    A pool without replies this round is not updated (no ``g_i`` to rescale by); it still
    teaches.  Per pool and round the report gets ``distill-seconds`` (server wall seconds of
    that student's distillation, 0 when none ran), ``distill-loss`` (KL at the last step),
    ``server-lr`` and ``distill-lr``.

    Parameters
    ----------
    catalog : VariantCatalog
        One variant per pool (e.g. :func:`models.codist.codist_catalog`).
    num_rounds : int
        Total rounds ``T`` of the linear decays.
    build_model : Callable[[str], nn.Module]
        Pool name -> a fresh model whose ``state_dict`` keys are the pool's layout names.
        Needed unless ``mode="fedavg"``.
    distill_data : Tensor, Mapping[str, Tensor] or Callable[[], Iterable[...]]
        Unlabeled inputs -- images ``(N, C, H, W)`` or a text model's padded keyword inputs
        (``input_ids``, ``attention_mask``: ``(N, L)``) -- sampled with :func:`sample_batches`
        (seeded by ``seed`` and the round; every student of a round sees the same batches), or a
        callable returning a fresh iterable of batches per student.  Needed unless
        ``mode="fedavg"``.
    mode : {"merged", "periodic", "fedavg"}
        MergedCodist, PeriodicCodist or the FedAvg baseline.
    alpha : float
        MergedCodist's merging factor (tuned on ``(0.05, 0.95)``; 1 = FedAvg).
    merge_start : int
        MergedCodist's first distilling round ``t_0`` (>= 1; 1 = every round, the paper's
        Algorithm 2): rounds before it apply the FedAvg update ``g`` alone (``alpha = 1``) and
        skip the distillation.  Reports ``merge-norm-ratio`` ``||delta|| / ||g||`` per pool in
        the rounds that merge.
    moment_reset : int
        ``r >= 0``: reset every pool's FedAdam state after every round ``t`` with ``t % r == 0``
        (0 = never).  MergedCodist and FedAvg only: PeriodicCodist already resets after each
        distillation (Algorithm 1), so a non-zero value with ``mode="periodic"`` is an error.
    period : int
        PeriodicCodist's ``p`` (paper: 200).
    adam : FedAdamConfig or Mapping[str, FedAdamConfig]
        Server optimizer, one for all pools or one per pool (the paper tunes ``eta`` per pool).
    distill : DistillConfig or Mapping[str, DistillConfig]
        Distillation settings, one for all students or one per student pool.
    server_lr_decay : bool
        Decay every pool's FedAdam ``eta`` linearly to 0 over ``num_rounds`` (:func:`linear_decay`,
        the paper's schedule); ``False`` keeps ``eta`` constant (run-config key
        ``codist-server-lr-decay``; a diagnosis, not in the paper).
    membership : {"instead", "also"}
        ``instead``: a node trains only the variant it chose (the largest that fits).
        ``also``: a node trains every pool up to and including its choice, one message per
        pool and round (the paper's nested pools ``P_H subset P``).
    device : str or torch.device
        Where distillation runs.
    seed : int
        Seed of node sampling and of distillation batches.
    **options
        :class:`~strategies.base.StrategyOptions`, passed to :class:`~strategies.base.HeterogeneousStrategy`.

    """

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        num_rounds: int,
        build_model: Callable[[str], nn.Module] | None = None,
        distill_data: Batch | Callable[[], Iterable[Batch]] | None = None,
        mode: Mode = "merged",
        alpha: float = 0.5,
        merge_start: int = 1,
        moment_reset: int = 0,
        period: int = 200,
        adam: FedAdamConfig | Mapping[str, FedAdamConfig] | None = None,
        distill: DistillConfig | Mapping[str, DistillConfig] | None = None,
        server_lr_decay: bool = True,
        membership: Membership = "instead",
        device: str | torch.device = "cpu",
        **options: Unpack[StrategyOptions],
    ) -> None:
        mode = parse_mode(mode)
        if membership not in MEMBERSHIPS:
            raise CodistConfigError(f"membership must be one of {MEMBERSHIPS}, got {membership!r}")
        if num_rounds < 1:
            raise CodistConfigError(f"num_rounds must be >= 1, got {num_rounds}")
        if period < 1:
            raise CodistConfigError(f"period must be >= 1, got {period}")
        if not 0.0 <= alpha <= 1.0:
            raise CodistConfigError(f"alpha must be in [0, 1], got {alpha}")
        if merge_start < 1 or (mode == "merged" and merge_start > num_rounds):
            raise CodistConfigError(
                f"merge_start (codist-merge-start) must be a round in 1..{num_rounds} (the run's rounds), "
                f"got {merge_start}; a run that never distills is mode 'fedavg'"
            )
        if moment_reset < 0 or (mode == "periodic" and moment_reset > 0):
            raise CodistConfigError(
                f"moment_reset (codist-moment-reset) must be >= 0 and is read by modes merged and fedavg only, "
                f"got {moment_reset} with mode {mode!r}; PeriodicCodist resets after each distillation "
                "(every codist-period rounds): set codist-moment-reset = 0"
            )
        if mode != "fedavg":
            if len(catalog) < 2:
                raise CodistConfigError(f"co-distillation ({mode}) needs at least two pools, got {catalog.names()}")
            if build_model is None or distill_data is None:
                raise CodistConfigError(f"mode {mode!r} needs build_model and distill_data")
        super().__init__(catalog=catalog, **options)
        seed = options.get("seed", 0)
        self.pools = catalog.names()
        self.num_rounds = num_rounds
        self.build_model = build_model
        self.distill_data = distill_data
        self.mode: Mode = mode
        self.alpha = alpha
        self.merge_start = merge_start
        self.moment_reset = moment_reset
        self.period = period
        self.adam_cfg = _per_pool(adam if adam is not None else CODIST_FEDADAM, self.pools, "adam")
        self.distill_cfg = _per_pool(distill if distill is not None else DistillConfig(), self.pools, "distill")
        self.server_lr_decay = server_lr_decay
        self.membership: Membership = membership
        self.device = torch.device(device)
        self.seed = seed
        self.adam = {p: FedAdamState() for p in self.pools}

    # ------------------------------------------------------------ membership
    def node_variants(self, node_id: int) -> list[str]:
        """Pools a node trains this round: its choice, or every pool up to it (``also``)."""
        chosen = self.profiles[node_id].variant
        if chosen is None:
            return []
        if self.membership == "instead":
            return [chosen]
        return self.pools[: self.pools.index(chosen) + 1]

    def message_variants(self, node_id: int, kind: str) -> list[str]:
        """Training: every pool of :meth:`node_variants` (one message each); evaluation: the node's choice."""
        if kind == MessageType.TRAIN:
            return self.node_variants(node_id)
        return super().message_variants(node_id, kind)

    # ------------------------------------------------------------------ math
    def server_adam_config(self, pool: str, server_round: int) -> FedAdamConfig:
        """The pool's FedAdam config with this round's (decayed) ``eta``."""
        cfg = self.adam_cfg[pool]
        if not self.server_lr_decay:
            return cfg
        return dataclasses.replace(cfg, eta=linear_decay(cfg.eta, server_round, self.num_rounds))

    def distill_lr(self, pool: str, server_round: int) -> float:
        """The student pool's Adam learning rate this round."""
        cfg = self.distill_cfg[pool]
        return linear_decay(cfg.lr, server_round, self.num_rounds) if cfg.decay else cfg.lr

    def distillation_batches(self, pool: str, server_round: int) -> Iterable[Batch]:
        """Unlabeled batches for student ``pool`` in ``server_round``."""
        data = self.distill_data
        if data is None:
            raise CodistConfigError("no distillation data was given")
        if isinstance(data, Tensor | Mapping):
            cfg = self.distill_cfg[pool]
            return sample_batches(
                data, steps=cfg.steps, batch_size=cfg.batch_size, seed=self.seed * 1_000_003 + server_round
            )
        return data()

    def _model(self, pool: str, params: Mapping[str, Tensor]) -> nn.Module:
        if self.build_model is None:
            raise CodistConfigError("no build_model was given")
        model = self.build_model(pool)
        model.load_state_dict(dict(params), strict=True)
        return model.to(self.device)

    def codistill(
        self, server_round: int, sources: Mapping[str, Mapping[str, Tensor]], students: Sequence[str]
    ) -> dict[str, Params]:
        """Distill each of ``students`` from the other pools' models, all built from ``sources``.

        Every model is a copy of ``sources`` taken before any student moves (Algorithms 1-2,
        "in parallel").  Reports ``distill-seconds``, ``distill-loss`` and ``distill-lr`` per
        student.
        """
        report = self.report(server_round)
        models = {p: self._model(p, sources[p]) for p in self.pools}
        out: dict[str, Params] = {}
        for pool in students:
            cfg = self.distill_cfg[pool]
            lr = self.distill_lr(pool, server_round)
            t0 = time.perf_counter()
            result = distill(
                models[pool],
                [m for p, m in models.items() if p != pool],
                self.distillation_batches(pool, server_round),
                steps=cfg.steps,
                temperature=cfg.temperature,
                lam=cfg.lam,
                lr=lr,
            )
            seconds = time.perf_counter() - t0
            out[pool] = {k: result.state[k].cpu() for k in sources[pool]}
            group = report.group(pool)
            group["distill-seconds"] = seconds
            group["distill-lr"] = lr
            if result.losses:
                group["distill-loss"] = result.losses[-1]
        return out

    def new_round_sums(self) -> GroupMeans:
        """Each pool's example-weighted mean client weights."""
        return GroupMeans()

    def apply_round(
        self, server_round: int, means: Mapping[str, Mapping[str, Tensor]], counts: Mapping[str, int]
    ) -> None:
        """One round of the configured mode (see the class docstring)."""
        report = self.report(server_round)
        for pool in self.pools:
            report.group(pool)["distill-seconds"] = 0.0
        start = {p: dict(self.state[p]) for p in self.pools}
        # the updates, in place: the means are this round's own tensors
        g = {p: {k: t.sub_(start[p][k]) for k, t in m.items()} for p, m in means.items() if counts.get(p, 0) > 0}
        if self.mode == "merged" and server_round >= self.merge_start:
            students = self.codistill(server_round, start, [p for p in self.pools if p in g])
            with torch.no_grad():
                deltas = {p: {k: students[p][k] - start[p][k] for k in gp} for p, gp in g.items()}
                update = {p: merged_update(gp, deltas[p], self.alpha) for p, gp in g.items()}
            for p, gp in g.items():
                report.group(p)["merge-norm-ratio"] = norm_ratio(deltas[p], gp)
        else:
            update = g
        new = dict(start)
        with torch.no_grad():
            for pool, delta in update.items():
                cfg = self.server_adam_config(pool, server_round)
                new[pool] = fedadam_step(start[pool], delta, self.adam[pool], cfg)
                report.group(pool)["server-lr"] = cfg.eta
        self.state = new
        if self.mode == "periodic" and server_round % self.period == 0:
            self.state = {**self.state, **self.codistill(server_round, self.state, self.pools)}
            self.reset_moments()
            log(INFO, "PeriodicCodist round %d: co-distilled %s, FedAdam moments reset", server_round, self.pools)
        elif self.moment_reset and server_round % self.moment_reset == 0:
            self.reset_moments()
            log(INFO, "CoDistillation (%s) round %d: FedAdam moments reset", self.mode, server_round)
        log(INFO, "CoDistillation (%s) round %d: clients per pool %s", self.mode, server_round, dict(counts))

    def reset_moments(self) -> None:
        """Forget every pool's FedAdam moments and step count (Algorithm 1's reset)."""
        for state in self.adam.values():
            state.reset()

    def method_state(self) -> dict[str, Any]:
        """Checkpointed method state: every pool's FedAdam moments and step count.

        Distillation keeps no state between rounds (fresh Adam per distillation, batches seeded
        by the round), so a resumed run continues exactly.
        """
        return {"adam": group_states_to_dict(self.adam)}

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state` (one FedAdam state per pool required)."""
        self.adam = group_states_from_dict(data.get("adam"), self.pools, "pools")

    def summary(self) -> None:
        """Log the mode and its settings, then the base summary."""
        log(
            INFO,
            "\t├──> co-distillation mode %s (alpha %.3g from round %d, period %d, reset every %d, %s), %d rounds",
            self.mode,
            self.alpha,
            self.merge_start,
            self.period,
            self.moment_reset,
            self.membership,
            self.num_rounds,
        )
        super().summary()


def _per_pool(value: _T | Mapping[str, _T], pools: Sequence[str], what: str) -> dict[str, _T]:
    """``{pool: value}`` from one value or a per-pool mapping covering every pool."""
    if isinstance(value, Mapping):
        missing = [p for p in pools if p not in value]
        if missing:
            raise CodistConfigError(f"{what} settings lack pools {missing}")
        return {p: value[p] for p in pools}
    return dict.fromkeys(pools, value)


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> CoDistillation:
    """Co-distillation in ``entry.mode`` (merged, periodic, per-pool FedAvg) from the run config.

    Registry factory (:class:`experiment.registry.MethodEntry` ``strategy``).
    """
    family = cfg.family()
    own, server = cfg.settings_of(CodistGroup), cfg.settings_of(ServerTrainingGroup)
    return CoDistillation(
        num_rounds=cfg.num_server_rounds,
        build_model=lambda pool: family.build(cfg.catalog.get(pool)),
        distill_data=distillation_inputs(cfg),
        mode=parse_mode(entry.mode),
        alpha=own.codist_alpha,
        merge_start=own.codist_merge_start,
        moment_reset=own.codist_moment_reset,
        period=own.codist_period,
        server_lr_decay=own.codist_server_lr_decay,
        adam=server_adam_per_pool(cfg),
        distill=DistillConfig(
            steps=server.distill_steps,
            temperature=server.distill_temperature,
            lam=own.distill_lambda,
            lr=server.distill_lr,
            batch_size=server.distill_batch_size,
        ),
        membership=own.codist_membership,
        device=cfg.torch_device(),
        **options,
    )


def server_adam_per_pool(cfg: RunConfig) -> dict[str, FedAdamConfig]:
    """One server optimizer per pool (tier): ``tier-server-lr``'s eta, else ``server-lr``'s."""
    base = FedAdamConfig.from_settings(cfg.settings_of(ServerAdamGroup))
    per_pool = cfg.settings_of(CodistGroup).tier_server_lr
    if not per_pool:
        return dict.fromkeys(cfg.tier_names, base)
    rates = [float(x) for x in split_list(per_pool, "tier-server-lr")]
    return {t: dataclasses.replace(base, eta=eta) for t, eta in zip(cfg.tier_names, rates, strict=True)}


def distillation_inputs(cfg: RunConfig) -> Batch:
    """The server's unlabeled distillation set (``distill-size`` examples).

    Images: photo crops (``crops``, out-of-domain) or training images without labels
    (``in-domain``).  Text: Guardian headlines (``headlines``, out-of-domain) or training
    texts without labels (``in-domain``), tokenized for the transformer pools.
    ``out-of-domain`` (the default) picks crops or headlines by the model's data kind.  With
    several input domains (``tier-domains``) the images are split into equal shares, one per
    domain (:func:`models.images.mixed_domains`), like the paper's mixed distillation data.
    """
    own = cfg.settings_of(CodistGroup)
    source = own.distill_data
    if source == "out-of-domain":
        source = "crops" if cfg.image_data else "headlines"
    if cfg.image_data:
        if source == "crops":
            x = unlabeled_image_crops(own.distill_size, cfg.image_size, cfg.image_channels, seed=cfg.seed)
        else:
            train, _ = load_splits(cfg.data_spec())
            x = unlabeled_images(train, own.distill_size, seed=cfg.seed)
        return mixed_domains(x, cfg.domains)
    if source == "headlines":
        texts = read_guardian_headlines()
    else:
        train, _ = load_splits(cfg.data_spec())
        texts = [str(t) for t in train["text"]]
    gen = torch.Generator().manual_seed(cfg.seed)
    keep = torch.randperm(len(texts), generator=gen)[: own.distill_size].tolist()
    tokenizer = load_tokenizer(resolve_source(cfg.model))
    return text_inputs([texts[i] for i in keep], tokenizer, max_length=cfg.max_seq_len)
