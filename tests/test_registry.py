"""The method registry: every method has one entry, dispatch goes through it, unknown names fail early."""

from __future__ import annotations

import ast
import inspect
import textwrap
import tomllib
from pathlib import Path

import pytest

from experiment import registry
from experiment.config import ConfigError, RunConfig
from experiment.registry import METHODS, FactoryNotFound, MethodEntry, UnknownMethod, family_kind, load_factory, lookup
from server.app import build_strategy
from strategies.baselines import LocalTraining
from strategies.codistill import CoDistillation
from strategies.depthfl import DepthFL
from strategies.flexifed import FlexiFed
from strategies.heterofl import HeteroFL
from strategies.inclusivefl import InclusiveFL
from strategies.pfedknow import PFedKnow
from strategies.pfedknow_modes import MODES as PFEDKNOW_MODES
from strategies.pfedknow_modes import settings_from as pfedknow_settings
from tests.test_pfedknow_config import BASE as PFEDKNOW_BASE

ROOT = Path(__file__).resolve().parents[1]

#: The smallest valid run config of each method (test model, every tier its own variant).
SMALL: dict[str, object] = {"model": "tiny", "tier-memory-mb": "auto"}
PFEDKNOW: dict[str, object] = {k: v for k, v in PFEDKNOW_BASE.items() if k != "method"}
RUN_CONFIGS: dict[str, dict[str, object]] = {
    **{m: SMALL for m in ("inclusivefl", "all-large", "all-small", "exclusive", "local")},
    **{m: {**SMALL, "tier-widths": "0.25:0.5:1"} for m in ("heterofl", "fedrolex")},
    **{m: SMALL for m in ("flexifed-basic", "flexifed-clustered", "flexifed-max", "clustered-fl", "standalone")},
    **{
        m: {
            "model": "codist-cnn",
            "tiers": "small:large",
            "tier-proportions": "1:1",
            "tier-memory-mb": "auto",
            "distill-size": 64,
        }
        for m in ("codist-merged", "codist-periodic", "codist-fedavg")
    },
    **dict.fromkeys(PFEDKNOW_MODES, PFEDKNOW),
    "depthfl": SMALL,
}
EXPECTED_CLASS = {
    "inclusivefl": InclusiveFL,
    "all-large": InclusiveFL,
    "all-small": InclusiveFL,
    "exclusive": InclusiveFL,
    "local": LocalTraining,
    "heterofl": HeteroFL,
    "fedrolex": HeteroFL,
    **dict.fromkeys(("flexifed-basic", "flexifed-clustered", "flexifed-max", "clustered-fl", "standalone"), FlexiFed),
    **dict.fromkeys(("codist-merged", "codist-periodic", "codist-fedavg"), CoDistillation),
    **dict.fromkeys(PFEDKNOW_MODES, PFedKnow),
    "depthfl": DepthFL,
}


def test_every_method_of_the_pyproject_comment_is_registered_and_nothing_else() -> None:
    """The pyproject's ``method`` comment lists the registered methods (what a user reads first)."""
    text = (ROOT / "pyproject.toml").read_text()
    default = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]["method"]
    assert default in METHODS
    assert set(RUN_CONFIGS) == set(METHODS) == set(EXPECTED_CLASS)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_entry_builds_its_strategy_class(method: str) -> None:
    """Dispatch by the entry's factory: the class each method ran as before the registry."""
    cfg = RunConfig.model_validate({**RUN_CONFIGS[method], "method": method})
    strategy = build_strategy(cfg)
    assert type(strategy) is EXPECTED_CLASS[method]
    assert cfg.entry is METHODS[method]
    assert cfg.entry.median == strategy.supports_median  # the config refuses the median where the strategy would


def test_entry_facts_drive_the_strategy_options() -> None:
    beta0 = build_strategy(RunConfig.model_validate({**SMALL, "method": "exclusive", "beta": 0.7}))
    assert isinstance(beta0, InclusiveFL) and beta0.beta == 0.0  # baselines never distil momentum
    md = build_strategy(RunConfig.model_validate({**SMALL, "method": "inclusivefl", "beta": 0.7}))
    assert isinstance(md, InclusiveFL) and md.beta == 0.7
    rolling = build_strategy(RunConfig.model_validate({**RUN_CONFIGS["fedrolex"], "method": "fedrolex"}))
    static = build_strategy(RunConfig.model_validate({**RUN_CONFIGS["heterofl"], "method": "heterofl"}))
    assert isinstance(rolling, HeteroFL) and rolling.rolling and isinstance(static, HeteroFL) and not static.rolling
    assert RunConfig.model_validate({**SMALL, "method": "all-large"}).training_catalog.names() == ["strong"]
    assert RunConfig.model_validate({**SMALL, "method": "all-small"}).training_catalog.names() == ["weak"]


def test_unknown_method_fails_naming_the_key_the_choices_and_the_closest() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower({"method": "inclusivfl"})
    msg = str(err.value)
    assert msg.startswith("run config 'method': 'inclusivfl' is not a registered method (did you mean 'inclusivefl'?)")
    assert all(name in msg for name in METHODS)
    with pytest.raises(UnknownMethod, match=r"'method': 'fedsomething' is not a registered method; choices: "):
        lookup("fedsomething")


def test_a_factory_that_does_not_exist_or_builds_no_strategy_fails_naming_the_method() -> None:
    missing = MethodEntry("nowhere", "test", "strategies.heterofl:no_such_factory", frozenset({"transformer"}))
    expected = r"method 'nowhere': strategy factory 'strategies.heterofl:no_such_factory'"
    with pytest.raises(FactoryNotFound, match=expected):
        load_factory(missing)
    with pytest.raises(FactoryNotFound, match="not found"):
        load_factory(MethodEntry("x", "test", "no_such_module:f", frozenset({"transformer"})))


def test_views_and_families() -> None:
    assert registry.names(width_tiers=True) == ("heterofl", "fedrolex")
    assert set(registry.names(client="unlabeled-pruning")) == set(PFEDKNOW_MODES)
    assert registry.modes("codist") == {
        "codist-merged": "merged",
        "codist-periodic": "periodic",
        "codist-fedavg": "fedavg",
    }
    assert [family_kind(m) for m in ("minilm-l6", "tiny", "conv", "preresnet18", "vgg", "resnet", "codist-cnn")] == [
        "transformer",
        "transformer",
        "cnn",
        "cnn",
        "architectures",
        "architectures",
        "codist",
    ]


def _string_constants(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_no_method_name_is_branched_on_in_the_apps_or_the_factories() -> None:
    """Method names live in the registry: the apps and the factories read entries, not names."""
    for path in (ROOT / "server" / "app.py", *(ROOT / "client").glob("*.py")):
        named = _string_constants(path) & set(METHODS)
        assert not named, f"{path.relative_to(ROOT)} names methods {sorted(named)}"
    for entry in METHODS.values():
        factory = load_factory(entry)
        tree = ast.parse(textwrap.dedent(inspect.getsource(factory)))
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not named & set(METHODS), f"{entry.strategy} names methods {sorted(named & set(METHODS))}"


def test_every_factory_lives_in_a_strategy_module() -> None:
    """A method is its module in ``strategies/`` plus its registry entry (issue 20, item 1)."""
    for entry in METHODS.values():
        assert entry.strategy.startswith("strategies."), f"{entry.name}: factory {entry.strategy} outside strategies/"
        assert load_factory(entry).__module__ == entry.strategy.partition(":")[0]


def test_the_configuration_checks_branch_on_entry_facts_not_method_names() -> None:
    """``RunConfig``'s cross-key checks and the methods' own checks name no method (issue 20, item 1)."""
    tree = ast.parse((ROOT / "experiment" / "config.py").read_text())
    checks = [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("_consistent", "_family_mismatch")
    ]
    assert len(checks) == 2
    for fn in checks:
        named = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not named & set(METHODS), f"{fn.name} names methods {sorted(named & set(METHODS))}"
    named = _string_constants(ROOT / "experiment" / "method_checks.py") & set(METHODS)
    assert not named, f"experiment/method_checks.py names methods {sorted(named)}"
    checked = {name for name, e in METHODS.items() if e.check is not None}
    assert checked == {
        "codist-merged",
        "codist-periodic",
        "depthfl",
        *(n for n, e in METHODS.items() if e.client != "supervised"),
    }


def test_every_client_role_has_a_train_behaviour() -> None:
    """The ClientApp dispatches a train message on the entry's ``client`` fact: one behaviour per role."""
    from typing import get_args

    from client.app import TRAIN_BEHAVIOURS
    from experiment.registry import ClientRole

    assert set(TRAIN_BEHAVIOURS) == set(get_args(ClientRole))
    assert {e.client for e in METHODS.values()} <= set(TRAIN_BEHAVIOURS)


def test_semifl_threshold_comes_from_its_confidence_and_pfedknow_from_delta() -> None:
    """The one mode that filters pseudo-labels by max-softmax confidence takes ``1 - semifl-confidence``."""
    both = {**PFEDKNOW, "pfedknow-delta": 0.3, "semifl-confidence": 0.9}
    assert pfedknow_settings(RunConfig.model_validate({**both, "method": "pfedknow"})).delta == 0.3
    assert pfedknow_settings(RunConfig.model_validate({**both, "method": "pfedknow-as1"})).delta == 0.3
    assert pfedknow_settings(RunConfig.model_validate({**both, "method": "semifl"})).delta == pytest.approx(0.1)
