r"""FedAdam server optimizer as a pure function with one explicit state per group.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), in the exact form of
Flower's ``flwr.serverapp.strategy.FedAdam`` so that one homogeneous group reproduces
Flower's strategy to float precision:

.. math::

    m_t &= \beta_1 m_{t-1} + (1 - \beta_1) \Delta_t \\
    v_t &= \beta_2 v_{t-1} + (1 - \beta_2) \Delta_t^2 \\
    \eta_t &= \eta \sqrt{1 - \beta_2^{t+1}} / (1 - \beta_1^{t+1}) \\
    w_{t+1} &= w_t + \eta_t m_t / (\sqrt{v_t} + \tau)

where ``Delta_t`` is the (weighted) mean client update.  ``t`` is the group's own
step count (1 on its first update), which equals Flower's ``server_round`` when the
group trains every round.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from experiment.method_settings import ServerAdamGroup


@dataclass(frozen=True)
class FedAdamConfig:
    """FedAdam hyper-parameters (Flower's names)."""

    eta: float = 1e-3
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-6

    @classmethod
    def from_settings(cls, adam: ServerAdamGroup) -> FedAdamConfig:
        """The run config's ``server-lr``, ``server-beta1``, ``server-beta2``, ``server-tau``."""
        return cls(eta=adam.server_lr, beta_1=adam.server_beta1, beta_2=adam.server_beta2, tau=adam.server_tau)


@dataclass
class FedAdamState:
    """First/second moments per parameter and the number of steps taken."""

    m: dict[str, Tensor] = field(default_factory=dict)
    v: dict[str, Tensor] = field(default_factory=dict)
    step: int = 0

    def reset(self) -> None:
        """Forget moments and step count."""
        self.m.clear()
        self.v.clear()
        self.step = 0

    def to_dict(self) -> dict[str, object]:
        """``{"m": {name: Tensor}, "v": {name: Tensor}, "step": int}`` (for checkpoints)."""
        return {"m": dict(self.m), "v": dict(self.v), "step": self.step}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> FedAdamState:
        """Inverse of :meth:`to_dict`; raise ``ValueError`` on a malformed entry."""
        m, v, step = data.get("m"), data.get("v"), data.get("step")
        if not isinstance(m, dict) or not isinstance(v, dict) or not isinstance(step, int) or step < 0:
            raise ValueError("FedAdam state needs tensor dicts 'm', 'v' and a step count >= 0")
        if set(m) != set(v) or not all(isinstance(t, Tensor) for t in (*m.values(), *v.values())):
            raise ValueError("FedAdam moments 'm' and 'v' must be tensors with the same names")
        return cls(m=dict(m), v=dict(v), step=step)


def group_states_to_dict(states: Mapping[str, FedAdamState]) -> dict[str, dict[str, object]]:
    """One FedAdam state per group (tier, pool) as checkpoint data: ``{group: state.to_dict()}``."""
    return {group: st.to_dict() for group, st in states.items()}


def group_states_from_dict(data: object, groups: Collection[str], what: str) -> dict[str, FedAdamState]:
    """Inverse of :func:`group_states_to_dict` for exactly ``groups``; ``ValueError`` names the ``what`` that differ."""
    if not isinstance(data, dict) or set(data) != set(groups):
        found = sorted(data) if isinstance(data, dict) else []
        raise ValueError(f"checkpoint's FedAdam states are for {what} {found}, not {sorted(groups)}")
    return {group: FedAdamState.from_dict(st) for group, st in data.items()}


def fedadam_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: FedAdamState,
    cfg: FedAdamConfig,
) -> dict[str, Tensor]:
    """Apply one FedAdam step; return new parameters (``state`` is updated in place).

    Only keys present in ``delta`` move; other parameters are returned unchanged
    (frozen tensors that clients never upload).
    """
    state.step += 1
    t = state.step
    eta_t = cfg.eta * math.sqrt(1.0 - cfg.beta_2 ** (t + 1)) / (1.0 - cfg.beta_1 ** (t + 1))
    out = dict(params)
    for name, d in delta.items():
        # Seven element-wise passes per parameter, each into a fresh or an in-place result
        # (the plain expressions take twelve): the fused ``add_(alpha=)``, ``addcmul_`` and
        # ``addcdiv`` compute the same sums with one rounding less, so the result equals the
        # plain formula (and Flower's NumPy strategy) to float precision, not bit for bit.
        # The previous moments and ``params`` are only read (a checkpoint may still hold them).
        m, v = state.m.get(name), state.v.get(name)
        m = torch.mul(d, 1 - cfg.beta_1) if m is None else torch.mul(m, cfg.beta_1).add_(d, alpha=1 - cfg.beta_1)
        if v is None:
            v = torch.mul(d, d).mul_(1 - cfg.beta_2)
        else:
            v = torch.mul(v, cfg.beta_2).addcmul_(d, d, value=1 - cfg.beta_2)
        state.m[name] = m
        state.v[name] = v
        # w + eta_t m / (sqrt(v) + tau)
        out[name] = torch.addcdiv(params[name], m, torch.sqrt(v).add_(cfg.tau), value=eta_t)
    return out
