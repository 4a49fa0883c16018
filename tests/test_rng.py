"""Randomness inside a step: per rank, per step, reproducible across restarts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pardist


def _masks(steps: int, start: int = 0) -> list[torch.Tensor]:
    pardist.seed_everything(0)  # as the README says: the same seed on every rank
    pardist.set_rng_count(start)
    masks = []

    @pardist.data_parallel
    def step(w, x):
        masks.append(F.dropout(torch.ones(64), 0.5) != 0)
        return pardist.pmean((x * w).sum(), "gpu")

    rank, world = pardist.rank(), pardist.world_size()
    for _ in range(steps):
        step(torch.ones(3), torch.ones(2 * world, 3).chunk(world)[rank])
    return masks


def _per_rank(tmp: str):
    masks = _masks(3)
    count = pardist.rng_count()
    outside = torch.rand(4)  # the step streams leave the global generator alone
    pardist.seed_everything(0)
    untouched = torch.rand(4)
    # a restart: the count saved with the checkpoint, loaded by a fresh run
    pardist.checkpoint.save(tmp, {"rng": torch.tensor(2)}, step=2)
    saved = int(pardist.checkpoint.load(tmp + "/2", {"rng": torch.tensor(0)})["rng"])
    resumed = _masks(1, start=saved)
    return masks, count, resumed, torch.equal(outside, untouched)


def test_masks_differ_per_rank_and_step_and_replay_after_a_restart(run, tmp_path):
    results = run(2, _per_rank, str(tmp_path))
    for masks, count, resumed, untouched in results:
        assert count == 3 and untouched
        assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
        assert torch.equal(resumed[0], masks[2])  # the same stream after a restart at step 2
    (a, *_), (b, *_) = results
    for s in range(3):
        assert not torch.equal(a[s], b[s]), f"step {s}: both ranks drew the same dropout mask"


def _twice():
    return _masks(2), _masks(2)


def test_the_same_seed_gives_the_same_masks(run):
    for first, second in run(2, _twice):
        assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_set_rng_count_checks_its_argument():
    import pytest

    with pytest.raises(TypeError, match="pardist.set_rng_count"):
        pardist.set_rng_count(-1)


@pytest.mark.parametrize("fast", [True, False])
def test_a_step_streams_generators_are_as_seeded_by_their_own_calls(monkeypatch, fast):
    # Each stream's states are made ahead, several steps at a time, on spare generators
    # (_rng._planned): inside it, torch's, NumPy's and Python's generators must be
    # exactly as torch.manual_seed / np.random.seed / random.seed of the derived value
    # leave them, across a plan's end, two indices in turn, a count set back and a new
    # seed; and the caller's states come back after each.
    import random

    import numpy as np

    from pardist.runtime import _numpy_rng, _python_rng, _rng

    if not fast:  # the libraries' own calls, where the copies are not known to be exact
        monkeypatch.setattr(_numpy_rng, "_fast", False)
        monkeypatch.setattr(_python_rng, "_checked", (random._inst, None))
    monkeypatch.setattr(_rng, "_plans", {})

    def states():
        return torch.get_rng_state(), np.random.get_state(), random.getstate()

    def same(a, b):
        return torch.equal(a[0], b[0]) and _numpy_states_equal(a[1], b[1]) and a[2] == b[2]

    caller = states()
    torch.manual_seed(3)
    order = [0] * 20 + [0, 3, 0, 3, 3] + ["count 5", 0, 0, "seed 7", 0, 3]
    try:
        for index in order:
            if index == "count 5":
                pardist.set_rng_count(5)
                continue
            if index == "seed 7":
                torch.manual_seed(7)
                continue
            value = _rng.derive(torch.initial_seed(), index, pardist.rng_count())
            np.random.seed(11)
            np.random.standard_normal()  # the caller's cached Gaussian, to be kept
            before = states()
            with _rng.stream(index):
                inside = states()
            assert same(states(), before)
            torch.manual_seed(value), np.random.seed(value % 2**32), random.seed(value)
            assert same(inside, states()), f"stream {index} at count {pardist.rng_count() - 1}"
            torch.set_rng_state(before[0])
    finally:
        torch.set_rng_state(caller[0]), np.random.set_state(caller[1]), random.setstate(caller[2])


def test_nested_streams_reseed_by_index():
    from pardist.runtime import _rng

    pardist.seed_everything(0)
    with _rng.stream(0):
        with _rng.stream(5):
            a = torch.rand(3)
        with _rng.stream(5):
            b = torch.rand(3)
        with _rng.stream(6):
            c = torch.rand(3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _compiled_masks():
    pardist.seed_everything(0)
    pardist.set_rng_count(0)

    @pardist.data_parallel(compile=True)
    def step(w, x):
        return pardist.all_gather(F.dropout(x * w, 0.5), "gpu") != 0

    x = torch.ones(4, 16).chunk(2)[pardist.rank()]
    masks = [step(torch.ones(16), x) for _ in range(3)]
    pardist.set_rng_count(1)
    return masks, step(torch.ones(16), x)


def test_a_compiled_step_draws_per_rank_and_step(run):
    (masks, replay), _ = run(2, _compiled_masks)
    assert not torch.equal(masks[0][:2], masks[0][2:])  # rank 0's rows and rank 1's
    assert not torch.equal(masks[0], masks[1]) and torch.equal(replay, masks[1])


def _seeded_twice():
    pardist.seed_everything(1)
    first = _draws(2)
    pardist.seed_everything(1)  # no set_rng_count: seeding alone restarts the streams
    return first, _draws(2)


def _draws(steps: int) -> list:
    """Per step: torch's dropout mask, NumPy's and Python's draws inside the step."""
    import random

    import numpy as np

    out = []

    @pardist.data_parallel
    def step(w, x):
        out.append((F.dropout(torch.ones(32), 0.5) != 0, np.random.rand(4), random.random()))
        return pardist.pmean((x * w).sum(), "gpu")

    rank, world = pardist.rank(), pardist.world_size()
    for _ in range(steps):
        step(torch.ones(3), torch.ones(2 * world, 3).chunk(world)[rank])
    return out


def _same(a, b) -> bool:
    import numpy as np

    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_seeding_again_replays_every_stream_of_a_step(run):
    for first, second in run(2, _seeded_twice):
        assert all(_same(x, y) for x, y in zip(first, second))
        assert not _same(first[0], first[1])  # a new draw each step


def _numpy_per_rank():
    import random

    import numpy as np

    pardist.seed_everything(0)
    draws = _draws(2)
    after = (np.random.rand(3), random.random())  # outside steps: as if no step had run
    pardist.seed_everything(0)
    return draws, after, (np.random.rand(3), random.random())


def test_numpy_and_random_are_per_rank_inside_a_step_and_untouched_outside(run):
    import numpy as np

    (a, after, plain), (b, *_) = run(2, _numpy_per_rank)
    assert np.array_equal(after[0], plain[0]) and after[1] == plain[1]
    for s in range(2):
        assert not np.array_equal(a[s][1], b[s][1]), f"step {s}: NumPy drew alike on both ranks"
        assert a[s][2] != b[s][2], f"step {s}: random drew alike on both ranks"


class SpecAugment(torch.nn.Module):
    """wav2vec2's time masking: spans chosen per row with NumPy, filled with a learned vector."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 6)
        self.mask = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):  # (rows, time, 6)
        import numpy as np

        rows, time, _ = x.shape
        hide = torch.zeros(rows, time, dtype=torch.bool)
        for r in range(rows):  # as transformers' _compute_mask_indices: np.random per row
            start = np.random.choice(time - 3, 2, replace=False)
            for s in start:
                hide[r, s : s + 3] = True
        return self.proj(torch.where(hide[..., None], self.mask, x)).pow(2).mean()


def _spec_augment(deterministic):
    pardist.seed_everything(0)
    apply, params, buffers = pardist.functional(SpecAugment())
    x = torch.randn(8, 12, 6, generator=torch.Generator().manual_seed(2))
    rank, world = pardist.rank(), pardist.world_size()

    @pardist.data_parallel(deterministic=deterministic)
    def step(p, x):
        return pardist.grad(lambda p, x: apply(p, buffers, x)[0])(p, x)

    return [step(params, x.chunk(world)[rank]) for _ in range(2)]


def test_numpy_masking_is_per_row_group_and_the_same_at_every_world_size(run):
    # The deterministic mode: each row group draws NumPy's numbers from its own stream,
    # so the masks (and the gradients) are the same bits at 1 and 2 ranks.
    one = run(1, _spec_augment, 4)[0]
    for got in run(2, _spec_augment, 4):
        for g1, g2 in zip(one, got):
            assert all(torch.equal(g1[k], g2[k]) for k in g1)
    # The default mode: the ranks mask differently (were they alike, rank 1's half of the
    # batch would be masked as rank 0's): the gradients differ from one process's.
    two = run(2, _spec_augment, None)[0]
    assert not all(torch.equal(one[0][k], two[0][k]) for k in one[0])


def _numpy_states_equal(a, b) -> bool:
    import numpy as np

    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


@pytest.mark.parametrize("cached_gauss", [False, True])
@pytest.mark.parametrize("how", ["fast", "numpy"])
def test_numpy_state_comes_back_exactly(monkeypatch, how, cached_gauss):
    # A step gives NumPy's global generator back as get_state had it, the cached second
    # Gaussian (has_gauss, gauss) included, whether saved by one memmove or by NumPy.
    import numpy as np

    from pardist.runtime import _numpy_rng

    monkeypatch.setattr(_numpy_rng, "_fast", how == "fast")
    np.random.seed(7)
    if cached_gauss:
        np.random.standard_normal()  # draws two, keeps one
    before = np.random.get_state()
    assert before[3] == int(cached_gauss)
    saved = _numpy_rng.save()
    assert saved[0] == how
    np.random.seed(1)
    np.random.rand(5), np.random.standard_normal(3)  # the step's own draws
    _numpy_rng.restore(saved)
    assert _numpy_states_equal(np.random.get_state(), before)
    want = np.random.standard_normal(4)
    np.random.set_state(before)
    assert np.array_equal(np.random.standard_normal(4), want)


def test_the_fast_numpy_path_is_taken_where_it_is_exact():
    from pardist.runtime import _numpy_rng

    assert _numpy_rng._works()  # numpy 2.x's MT19937 here; else NumPy's own calls


@pytest.mark.parametrize("cached_gauss", [False, True])
@pytest.mark.parametrize("how", ["fast", "python"])
def test_python_random_state_comes_back_exactly(monkeypatch, how, cached_gauss):
    # A step gives Python's global generator back as getstate had it, the cached second
    # Gaussian (gauss_next) included, whether saved by one memmove or by getstate.
    import random

    from pardist.runtime import _python_rng

    region = _python_rng._region(random._inst) if how == "fast" else None
    monkeypatch.setattr(_python_rng, "_checked", (random._inst, region))
    random.seed(7)
    if cached_gauss:
        random.gauss(0.0, 1.0)  # draws two, keeps one
    before = random.getstate()
    assert (before[2] is not None) == cached_gauss
    saved = _python_rng.save()
    assert saved[0] == how
    random.seed(1)
    random.random(), random.gauss(0.0, 1.0), random.getrandbits(300)  # the step's own draws
    _python_rng.restore(saved)
    assert random.getstate() == before
    want = [random.gauss(0.0, 1.0) for _ in range(3)] + [random.random()]
    random.setstate(before)
    assert [random.gauss(0.0, 1.0) for _ in range(3)] + [random.random()] == want


def test_the_fast_python_random_path_is_taken_where_it_is_exact():
    import random

    from pardist.runtime import _python_rng

    assert _python_rng._works(random._inst)  # CPython's RandomObject; else getstate / setstate
    _python_rng.save()
    assert _python_rng._checked[0] is random._inst and _python_rng._checked[1] is not None
