"""Dealing a held-out split to clients so that each client's test data follows its training labels.

:func:`label_matched_shares` is the pure arithmetic behind ``client-test-split = "held-out"``
(:func:`models.data.load_partition`): personalized-FL methods (pFedKnow, seed 002; SemiFL) judge
each client's own model on test data of the client's own label distribution, and those test
examples must come from the held-out split (the test split, or the validation carve), never from
the training split.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


class LabelShareError(ValueError):
    """The label counts or labels handed to :func:`label_matched_shares` are malformed."""


def label_matched_shares(train_label_counts: ArrayLike, held_out_labels: ArrayLike, seed: int) -> list[np.ndarray]:
    r"""Deal a held-out split's examples to ``K`` clients, each class in proportion to the clients' training data.

    With :math:`n_{k,c}` client ``k``'s training examples of class ``c``,
    :math:`N_c = \sum_k n_{k,c}` and :math:`m_c` the held-out examples of class ``c``, client
    ``k`` gets

    .. math:: q_{k,c} = \lfloor m_c\, n_{k,c} / N_c \rfloor + [k \in R_c]

    where :math:`R_c` are the :math:`m_c - \sum_k \lfloor m_c n_{k,c} / N_c \rfloor` clients
    with the largest remainders (ties to the lower ``k``), so every held-out example of a class
    some client trains on goes to exactly one client.  A class no client trains on
    (:math:`N_c = 0`) goes to none.  The examples of each class are dealt in client order from a
    permutation drawn by ``numpy.random.default_rng(seed)``, class by class in increasing order.
    Each client's test data then follows its own label distribution, up to the held-out split's
    class balance (class ``c`` is weighted by :math:`m_c / N_c`; equal for a stratified
    held-out split such as Fashion-MNIST's or the validation carve) (the personalized models
    are judged on the kind of data they were personalized to: pFedKnow's and SemiFL's local test
    sets, IID or Dirichlet), and no example is a training example.

    Parameters
    ----------
    train_label_counts : array_like
        ``(K, C)`` non-negative integers, :math:`n_{k,c}`.
    held_out_labels : array_like
        ``(M,)`` integer labels in ``0 .. C-1``.
    seed : int
        Seed of the per-class permutations (the run seed: the deal is a function of it).

    Returns
    -------
    list of numpy.ndarray
        Client ``k``'s held-out indices, sorted.

    Raises
    ------
    LabelShareError
        If the counts are not a non-negative integer ``(K, C)`` array, or the labels not a 1-D
        integer array in ``0 .. C-1``.

    """
    counts, labels = np.asarray(train_label_counts), np.asarray(held_out_labels)
    if counts.size and not np.issubdtype(counts.dtype, np.integer):
        raise LabelShareError(f"train label counts must be integers, got {counts.dtype}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise LabelShareError(f"held-out labels must be integers, got {labels.dtype}")
    counts, labels = counts.astype(np.int64), labels.astype(np.int64)
    if counts.ndim != 2 or (counts < 0).any():
        raise LabelShareError(
            f"train label counts must be a non-negative (clients, classes) array, got shape {counts.shape}"
        )
    if labels.ndim != 1:
        raise LabelShareError(f"held-out labels must be a 1-D array, got shape {labels.shape}")
    num_clients, num_classes = counts.shape
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise LabelShareError(f"held-out labels must lie in 0..{num_classes - 1}, got {labels.min()}..{labels.max()}")
    rng = np.random.default_rng(seed)
    shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(labels == c))
        total = int(counts[:, c].sum())
        if total == 0 or members.size == 0:
            continue
        exact = members.size * counts[:, c]
        quota = exact // total
        short = members.size - int(quota.sum())
        remainders = exact - quota * total
        quota[np.lexsort((np.arange(num_clients), -remainders))[:short]] += 1
        start = 0
        for k in range(num_clients):
            shares[k].append(members[start : start + quota[k]])
            start += int(quota[k])
    return [np.sort(np.concatenate(parts)) if parts else np.array([], dtype=np.int64) for parts in shares]
