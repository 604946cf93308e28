"""Co-distillation beyond the CNN pair: text pools (keyword batches) and domain-shifted pools."""

from __future__ import annotations

import pytest
import torch
from datasets import Array2D, Dataset, Features, Value

from experiment.config import ConfigError, RunConfig
from models.batches import model_logits
from models.data import read_guardian_headlines, text_inputs
from models.images import MEAN, STD, image_loader, mixed_domains, shift_images
from models.transformer import load_tokenizer, resolve_source
from server.app import CentralEvaluator, build_strategy
from strategies.codistill import CoDistillation, distillation_inputs
from strategies.distillation import distill, sample_batches

TEXT_POOLS: dict[str, object] = {
    "model": "tiny",
    "method": "codist-merged",
    "tiers": "small:large",
    "tier-layers": "1:2",
}
TEXT_POOLS |= {"tier-proportions": "1:1", "tier-memory-mb": "auto"}


def test_guardian_headlines_are_unlabeled_out_of_domain_text() -> None:
    heads = read_guardian_headlines()
    assert len(heads) > 4000 and len(set(heads)) == len(heads)
    assert all(isinstance(h, str) and h.strip() == h and h for h in heads)


def test_text_inputs_pad_right_and_batches_trim_to_the_longest_row() -> None:
    tok = load_tokenizer(resolve_source("tiny"))
    x = text_inputs(["a b c d e f g h", "short", "a b"], tok, max_length=6)
    assert set(x) == {"input_ids", "attention_mask"} and x["input_ids"].shape == (3, 6)
    assert x["attention_mask"].sum(1).tolist()[0] == 6  # truncated at max_length
    assert bool((x["input_ids"][x["attention_mask"] == 0] == (tok.pad_token_id or 0)).all())
    batches = list(sample_batches(x, steps=3, batch_size=1, seed=0))
    for b in batches:  # one row each: no padding column survives
        assert isinstance(b, dict)
        assert b["input_ids"].shape == b["attention_mask"].shape
        assert bool(b["attention_mask"].all())


def test_text_pools_distill_on_keyword_batches() -> None:
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({**TEXT_POOLS, "distill-size": 64, "distill-steps": 4})
    data = distillation_inputs(cfg)
    assert isinstance(data, dict) and data["input_ids"].shape[0] == 64
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CoDistillation)
    strategy.set_state(cfg.family().initial_states(cfg.catalog, seed=0))
    small, large = (strategy._model(p, strategy.state[p]) for p in ("small", "large"))
    batch = next(sample_batches(data, steps=1, batch_size=64, seed=1))
    with torch.no_grad():  # a confident teacher, so that there is something to learn
        large.get_parameter("classifier.weight").mul_(30.0)

    # KL(teacher || student) on the distillation text shrinks after distilling (lam = 0)
    def kl(student: torch.nn.Module) -> float:
        with torch.no_grad():
            p = torch.softmax(model_logits(large, batch), -1)
            return float(torch.sum(p * (p.log() - torch.log_softmax(model_logits(student, batch), -1))))

    before = kl(small)
    out = distill(small, large, [batch] * 40, steps=40, temperature=1.0, lam=0.0, lr=1e-2)
    small.load_state_dict(out.state)
    after = kl(small)
    assert after < 0.75 * before, (before, after)  # measured: 0.88 -> 0.53
    assert out.losses[-1] < out.losses[0]
    students = strategy.codistill(1, strategy.state, strategy.pools)
    group = strategy.report(1).group("large")
    assert group["distill-seconds"] > 0 and set(students) == {"small", "large"}


def test_distill_data_must_fit_the_data_kind() -> None:
    with pytest.raises(ConfigError, match=r"'distill-data'.*text"):
        RunConfig.from_flower({**TEXT_POOLS, "distill-data": "crops"})
    image: dict[str, object] = {
        "model": "codist-cnn",
        "method": "codist-merged",
        "tiers": "small:large",
        "tier-memory-mb": "auto",
    }
    image |= {"dataset": "embedded:fashion_mnist", "num-labels": 10, "tier-proportions": "1:1"}
    with pytest.raises(ConfigError, match=r"'distill-data'.*image"):
        RunConfig.from_flower({**image, "distill-data": "headlines"})
    with pytest.raises(ConfigError, match=r"'method'.*model sizes"):
        RunConfig.from_flower({"model": "conv", "method": "codist-merged"})
    assert RunConfig.from_flower(image).distill_data == "out-of-domain"


# --- domain-shifted pools ------------------------------------------------------------------------


def test_inverted_domain_is_the_pixel_complement() -> None:
    pixels = torch.arange(0, 256, dtype=torch.float32).reshape(1, 1, 16, 16)
    norm = (pixels / 255 - MEAN) / STD
    torch.testing.assert_close(shift_images(norm, "inverted"), ((255 - pixels) / 255 - MEAN) / STD)
    assert shift_images(norm, "plain") is norm
    mixed = mixed_domains(torch.ones(5, 1, 2, 2), ["plain", "inverted"])
    assert mixed[:, 0, 0, 0].tolist() == [1.0, -1.0, 1.0, -1.0, 1.0]
    with pytest.raises(ValueError, match="unknown image domain"):
        shift_images(norm, "rotated")


def test_image_loader_sees_its_domain() -> None:
    feats = Features({"image": Array2D((4, 4), "uint8"), "label": Value("int64")})
    ds = Dataset.from_dict({"image": [[[0] * 4] * 4, [[255] * 4] * 4], "label": [0, 1]}, features=feats)
    plain = next(iter(image_loader(ds, batch_size=2, shuffle=False)))["x"]
    inverted = next(iter(image_loader(ds, batch_size=2, shuffle=False, domain="inverted")))["x"]
    assert plain[0].max() == -1.0 and inverted[0].min() == 1.0 and torch.equal(plain, -inverted)


def test_tier_domains_are_validated() -> None:
    base: dict[str, object] = {
        "model": "codist-cnn",
        "method": "codist-merged",
        "tiers": "small:large",
        "tier-memory-mb": "auto",
    }
    base |= {"dataset": "embedded:fashion_mnist", "num-labels": 10, "tier-proportions": "1:1"}
    cfg = RunConfig.from_flower({**base, "tier-domains": "plain:inverted"})
    assert cfg.tier_domain("large") == "inverted" and cfg.domains == ["plain", "inverted"]
    assert RunConfig.from_flower(base).domains == ["plain"]
    with pytest.raises(ConfigError, match="'tier-domains' has 1 entries"):
        RunConfig.from_flower({**base, "tier-domains": "plain"})
    with pytest.raises(ConfigError, match=r"'tier-domains'.*not image domains"):
        RunConfig.from_flower({**base, "tier-domains": "plain:upside-down"})
    with pytest.raises(ConfigError, match=r"'tier-domains'.*image models only"):
        RunConfig.from_flower({**TEXT_POOLS, "tier-domains": "plain:inverted"})


def test_central_evaluation_reports_each_domain_and_their_mean() -> None:
    base: dict[str, object] = {
        "model": "codist-cnn",
        "method": "codist-fedavg",
        "tiers": "small:large",
        "tier-memory-mb": "auto",
    }
    base |= {"dataset": "embedded:fashion_mnist", "num-labels": 10, "tier-proportions": "1:1"}
    cfg = RunConfig.from_flower({**base, "tier-domains": "plain:inverted", "server-test-size": 200})
    evaluator = CentralEvaluator(cfg)
    states = cfg.family().initial_states(cfg.catalog, seed=0)
    out = evaluator({"small": [states["small"]]})["small"]
    assert set(out) == {"accuracy", "loss", "accuracy-plain", "accuracy-inverted", "loss-plain", "loss-inverted"}
    assert out["accuracy"] == pytest.approx((out["accuracy-plain"] + out["accuracy-inverted"]) / 2)
    assert out["loss-plain"] != out["loss-inverted"]  # the two domains really are different inputs
    data = distillation_inputs(cfg.model_copy(update={"distill_size": 10}))
    assert isinstance(data, torch.Tensor) and data.shape == (10, 1, 28, 28)
