"""``strategies.base``: composite and payload records, and the cache of serialized tensors."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array

from strategies.inclusivefl import InclusiveFL
from strategies.records import ArrayCache, compose, decompose, to_record
from tests.toy import constant_state, reply, sent, toy_catalog, trained


def test_cache_reuses_the_array_of_an_unchanged_tensor() -> None:
    cache = ArrayCache()
    t = torch.tensor([1.0, -0.0, 3.0])
    a = cache.array(t)
    assert cache.array(t) is a
    assert a.data == Array(t.numpy()).data


def test_cache_reserializes_after_an_in_place_write_and_for_another_tensor() -> None:
    cache = ArrayCache()
    t = torch.tensor([1.0, 2.0])
    a = cache.array(t)
    t.add_(1.0)
    b = cache.array(t)
    assert b is not a
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
    assert cache.array(torch.tensor([2.0, 3.0])) is not b  # equal values, another object


def test_cache_never_holds_inference_tensors() -> None:
    cache = ArrayCache()
    with torch.inference_mode():
        t = torch.ones(2)
    assert cache.array(t) is not cache.array(t)
    assert len(cache) == 0


def test_retain_drops_every_other_entry() -> None:
    cache = ArrayCache()
    keep, drop = torch.zeros(1), torch.ones(1)
    a = cache.array(keep)
    cache.array(drop)
    cache.retain([keep])
    assert len(cache) == 1
    assert cache.array(keep) is a


def test_cached_records_equal_uncached_ones() -> None:
    state = {"v": {"a": torch.arange(4.0), "b": torch.tensor([-0.0, 5.0])}}
    cache = ArrayCache()
    compose(state, cache)
    cached, plain = compose(state, cache), compose(state)
    assert list(cached.keys()) == list(plain.keys())
    assert all(cached[k].data == plain[k].data for k in plain)
    assert to_record(state["v"], cache)["a"] is cached["v/a"]
    torch.testing.assert_close(decompose(cached)["v"]["a"], state["v"]["a"], rtol=0, atol=0)


def test_rounds_reserialize_only_what_changed() -> None:
    """Frozen tensors and tiers without replies keep their Array; trained tensors get a new one."""
    cat = toy_catalog({"weak": 1, "strong": 2})
    s = InclusiveFL(catalog=cat, beta=0.0)
    before = s.set_state(constant_state(cat, 1.0))
    s.aggregate_train(1, [reply(sent(s, 1, "strong"), trained(s.state["strong"], 0.5))])
    after = s._record
    assert after is not None and after is not before
    assert after["weak/classifier.weight"] is before["weak/classifier.weight"]  # weak tier had no reply
    assert after["strong/classifier.weight"] is not before["strong/classifier.weight"]
    for key in after:  # the record is what serializing the new state gives
        assert after[key].data == Array(s.state[key.split("/")[0]][key.split("/", 1)[1]].numpy()).data


def test_the_same_seed_samples_the_same_partitions_whatever_ids_the_nodes_got() -> None:
    """Simulation gives nodes new random ids each run; sampling by node key pairs the runs of a seed."""
    import random

    from strategies.profiles import NodeProfile

    def sampled_partitions(ids: list[int]) -> list[str]:
        s = InclusiveFL(catalog=toy_catalog({"weak": 1, "strong": 2}), seed=7)
        for pid, node in enumerate(ids):
            s.profiles[node] = NodeProfile(node, "weak", 100.0, 10, True, "weak", "", key=f"partition-{pid}")
        return sorted(s.profiles[n].key for n in s._sample(sorted(ids), 0.2, 1))

    first = sampled_partitions(random.Random(1).sample(range(10**6), 30))
    assert len(first) == 6
    assert sampled_partitions(random.Random(2).sample(range(10**6), 30)) == first
    # natural order of keys: partition-2 before partition-10; nodes without a key first, by id
    order = [NodeProfile(9, "t", 1.0, 1, True, "v", "", key=k).sampling_order for k in ("partition-2", "partition-10")]
    assert order[0] < order[1]
    assert NodeProfile(9, "t", 1.0, 1, True, "v", "").sampling_order < order[0]
