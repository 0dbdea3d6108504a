"""Seed 004's failure-aware placement: a policy network that scores GPUs, trained by
REINFORCE against the best of several random placements.

docs/placement.md, "Seed 004: failure-aware placement". The seed's state is (N GPUs
wanted, estimated run time, each GPU busy or faulty); its network gives each GPU a
score, busy and faulty GPUs are masked out, and the best-scored GPU is taken until N are
chosen. Its reward compares the batch's makespan with the best of several random
placements of the same batch.

Two choices of ours, each because the plain reading did not learn:

- The scorer is shared: one small network scores every GPU from that GPU's features
  (its known failures, how recent the last one is) and the job's (run time, share of
  the free GPUs it wants), with the same weights for every GPU. A network with one
  output per GPU position has to learn each GPU apart, from the few failures each one
  shows; a shared scorer learns "a GPU that failed before is a risk" once, for all.
- Training samples N GPUs without replacement (Plackett-Luce: softmax over the free
  GPUs, take one, renormalise over the rest), so that its log-probability has a
  gradient; placing takes the top N scores (the seed's rule). Every placement of one
  episode is compared on the same failure draw (failures belong to the GPUs), and the
  advantage is a sample's reward less the mean of the episode's samples.

Not in :mod:`placement.registry`: the registry's policies place pods on a
:class:`~placement.cluster.ClusterState` node by node; this one chooses GPUs from a pool
for :func:`placement.failures.simulate`. Pure: numpy, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from placement.cluster import Bools, Ints
from placement.failures import (
    FailureDraw,
    FailureModel,
    Floats,
    Job,
    Outcome,
    Pool,
    View,
    best_of_random,
    simulate,
)

FEATURES = 4  # per GPU: log1p(failures), recency, the job's run time, its share of free
HIDDEN = 8
RECENCY_DAYS = 90.0  # a failure this many days ago counts 1/e of one today
RUN_DAYS_SCALE = math.log1p(30.0)  # a 30-day job's run-time feature is 1


def features(view: View, job: Job) -> Floats:
    """Each GPU's features for ``job`` (rows: GPUs). The job's are the same on every row:
    they matter only through the network's mixing of them with the GPU's."""
    size = view.free.size
    out = np.empty((size, FEATURES))
    out[:, 0] = np.log1p(view.failures)
    out[:, 1] = np.exp(-view.days_since / RECENCY_DAYS)  # 0 for a GPU that never failed
    out[:, 2] = math.log1p(job.hours / 24.0) / RUN_DAYS_SCALE
    out[:, 3] = job.gpus / max(int(view.free.sum()), 1)
    return out


@dataclasses.dataclass
class Network:
    """The shared scorer: score(x) = w2 . tanh(W1 x + b1), the same for every GPU. (An
    output bias would add the same to every score: softmax and top-N ignore it.)"""

    w1: Floats  # (HIDDEN, FEATURES)
    b1: Floats  # (HIDDEN,)
    w2: Floats  # (HIDDEN,)

    @staticmethod
    def initial(rng: np.random.Generator, scale: float = 0.1) -> Network:
        return Network(
            rng.normal(0.0, scale, (HIDDEN, FEATURES)),
            np.zeros(HIDDEN),
            rng.normal(0.0, scale, HIDDEN),
        )

    def params(self) -> list[Floats]:
        return [self.w1, self.b1, self.w2]

    def scores(self, x: Floats) -> Floats:
        out: Floats = np.tanh(x @ self.w1.T + self.b1) @ self.w2
        return out

    def backward(self, x: Floats, dscores: Floats) -> list[Floats]:
        """The gradients of sum(dscores * scores(x)) with respect to w1, b1, w2."""
        h = np.tanh(x @ self.w1.T + self.b1)
        dz = np.outer(dscores, self.w2) * (1.0 - h * h)
        return [dz.T @ x, dz.sum(axis=0), h.T @ dscores]


def masked(scores: Floats, free: Bools) -> Floats:
    """The scores with busy and faulty GPUs at -inf: never chosen."""
    return np.where(free, scores, -np.inf)


def top_n(scores: Floats, free: Bools, n: int) -> Ints:
    """The seed's choice: the best-scored free GPU, then the next, until ``n`` (equal
    scores: the lower-numbered GPU first)."""
    if int(free.sum()) < n:
        raise ValueError(f"{n} GPUs wanted, {int(free.sum())} free")
    order = np.argsort(-masked(scores, free), kind="stable")
    return order[:n].astype(np.int64)


def sample_n(scores: Floats, free: Bools, n: int, rng: np.random.Generator) -> Ints:
    """``n`` free GPUs drawn without replacement from the softmax of their scores, in the
    order drawn (Plackett-Luce). The Gumbel top-k draw: adding independent Gumbel noise
    to the scores and taking the top ``n`` draws exactly that sequence."""
    noisy = masked(scores, free) + rng.gumbel(size=scores.size)
    return top_n(noisy, free, n)


def plackett_luce(scores: Floats, free: Bools, order: Ints) -> tuple[float, Floats]:
    """The log-probability of drawing ``order`` (in that order) from the free GPUs, and
    its gradient with respect to every GPU's score (0 at the masked ones).

    log p = sum_k (s[a_k] - log D_k), D_k the sum of exp(s) over the GPUs still free at
    draw k. A GPU's gradient is [chosen] - exp(s_g) * (the sum of 1/D_k over the draws
    at which it was still there). Each D_k is summed from positive terms (the GPUs never
    chosen plus those chosen at k or later), not taken off a total, so that it stays
    exact when the chosen GPUs hold nearly all the mass.
    """
    top = float(scores[free].max())
    e = np.where(free, np.exp(np.where(free, scores, top) - top), 0.0)
    chosen_e = e[order]
    never = np.ones(e.size, dtype=np.bool_)
    never[order] = False
    rest = float(e[never].sum())
    d = rest + np.cumsum(chosen_e[::-1])[::-1]  # D_k for k = 1..n
    logp = float((scores[order] - top).sum() - np.log(d).sum())
    inv = np.cumsum(1.0 / d)  # sum over k <= j of 1/D_k
    grad = -e * (inv[-1] if order.size else 0.0)
    grad[order] = 1.0 - chosen_e * inv
    return logp, grad


class Placer:
    """The trained network as a placement for :func:`placement.failures.simulate`: top-N
    scores (``sample`` False) or a Plackett-Luce draw that adds each decision's gradient
    of its log-probability to ``grads``."""

    def __init__(self, net: Network, sample: bool = False) -> None:
        self.net = net
        self.sample = sample
        self.grads = [np.zeros_like(p) for p in net.params()]

    def __call__(self, view: View, job: Job, rng: np.random.Generator) -> Ints:
        x = features(view, job)
        scores = self.net.scores(x)
        if not self.sample:
            return top_n(scores, view.free, job.gpus)
        order = sample_n(scores, view.free, job.gpus, rng)
        _, dscores = plackett_luce(scores, view.free, order)
        rows = view.free  # masked GPUs have no gradient: leave their rows out
        for total, g in zip(self.grads, self.net.backward(x[rows], dscores[rows]), strict=True):
            total += g
        return order


@dataclasses.dataclass(frozen=True)
class Training:
    """REINFORCE's settings (docs/placement.md gives why each)."""

    episodes: int = 150
    samples: int = 4  # policy draws per episode, compared on one failure draw
    randoms: int = 10  # the random placements whose best is the reward's reference
    restart_weight: float = 0.1  # the reward's restart term, next to the seed's makespan
    learning_rate: float = 0.03
    seed: int = 0


# An episode's instance: the pool, the batch and the failure draw, from a generator.
Instance = tuple[Pool, Sequence[Job], FailureDraw]
MakeInstance = Callable[[np.random.Generator], Instance]


def reward(outcome: Outcome, best: Outcome, restart_weight: float) -> float:
    """The seed's reward, (best random makespan - ours) / best random makespan, plus
    ``restart_weight`` times the same relative difference in restarts."""
    gain = (best.makespan_hours - outcome.makespan_hours) / best.makespan_hours
    fewer = (best.restarts - outcome.restarts) / max(best.restarts, 1)
    return gain + restart_weight * fewer


def train(
    model: FailureModel, make: MakeInstance, settings: Training
) -> tuple[Network, list[float]]:
    """Train a network on ``settings.episodes`` instances from ``make``; return it and
    each episode's mean reward. Deterministic for a seed."""
    rng = np.random.default_rng(settings.seed)
    net = Network.initial(rng)
    moments = [np.zeros_like(p) for p in net.params()]
    squares = [np.zeros_like(p) for p in net.params()]
    history: list[float] = []
    steps = 0
    for _ in range(settings.episodes):
        pool, jobs, draw = make(rng)
        best, _ = best_of_random(pool, jobs, draw, model, settings.randoms, rng)
        rewards: list[float] = []
        grads: list[list[Floats]] = []
        for _ in range(settings.samples):
            placer = Placer(net, sample=True)
            outcome = simulate(pool, jobs, draw, placer, model, rng)
            rewards.append(reward(outcome, best, settings.restart_weight))
            grads.append(placer.grads)
        history.append(float(np.mean(rewards)))
        adv = np.asarray(rewards) - np.mean(rewards)
        spread = float(adv.std())
        if spread < 1e-12:
            continue  # every draw did as well: nothing to learn from this episode
        adv /= spread
        steps += 1
        step = [sum(a * g[i] for a, g in zip(adv, grads, strict=True)) / len(adv) for i in range(3)]
        # Adam, ascending the reward.
        for p, m, v, g in zip(net.params(), moments, squares, step, strict=True):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p += (
                settings.learning_rate
                * (m / (1 - 0.9**steps))
                / (np.sqrt(v / (1 - 0.999**steps)) + 1e-8)
            )
    return net, history
