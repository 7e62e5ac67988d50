"""EpochPlan: the one place that decides order, shards and epoch length."""
import numpy as np
import pytest

from fastdata.sampling import EpochPlan, distributed_info, seed_for


@pytest.mark.parametrize("n, b, world, drop_last, expected", [
    (1000, 64, 1, True, 15), (1000, 64, 1, False, 16), (1000, 64, 3, True, 5), (1000, 64, 3, False, 6),
    (64, 64, 1, True, 1), (63, 64, 1, True, 0), (63, 64, 1, False, 1),
])
def test_length(n, b, world, drop_last, expected):
    plan = EpochPlan(n, b, True, drop_last, 0, 0, world)
    assert len(plan) == expected
    assert len(plan.batches(0)) == expected


def test_a_bad_sample_count_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^num_samples must be an integer >= 0, got -1"):
        EpochPlan(-1, 10, True, False, 0)
    with pytest.raises(TypeError, match=r"^num_samples must be an integer >= 0, got 10.0"):
        EpochPlan(10.0, 10, True, False, 0)


def test_order_is_a_function_of_seed_and_epoch():
    a, b = EpochPlan(100, 10, True, False, 7), EpochPlan(100, 10, True, False, 7)
    np.testing.assert_array_equal(a.order(3), b.order(3))
    assert not np.array_equal(a.order(3), a.order(4))
    assert not np.array_equal(a.order(3), EpochPlan(100, 10, True, False, 8).order(3))
    np.testing.assert_array_equal(EpochPlan(100, 10, False, False, 7).order(5), np.arange(100))


def test_resume_start_skips_whole_batches():
    plan = EpochPlan(100, 10, True, True, 1)
    full = plan.batches(2)
    for k in (0, 3, 10):
        rest = plan.batches(2, k)
        assert len(rest) == 10 - k
        for x, y in zip(rest, full[k:]):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="outside"):
        plan.batches(0, 11)


def test_partial_last_step_is_split_evenly_over_ranks():
    # 70 samples, 3 ranks x 16: step 2 has 22 left → 8, 7, 7
    sizes = [[len(b) for b in EpochPlan(70, 16, False, False, 0, r, 3).batches(0)] for r in range(3)]
    assert sizes == [[16, 8], [16, 7], [16, 7]]


def test_batch_seeds_differ_per_batch_epoch_and_rank():
    p0, p1 = EpochPlan(100, 10, True, True, 1, 0, 2), EpochPlan(100, 10, True, True, 1, 1, 2)
    seeds = {p0.batch_seed(e, b) for e in range(3) for b in range(5)} | {p1.batch_seed(0, 0)}
    assert len(seeds) == 16


def test_distributed_info_reads_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed_info() == (2, 4)
    assert distributed_info(rank=0, world_size=1) == (0, 1)


def test_torchrun_variables_that_are_not_integers_are_named(monkeypatch):
    from fastdata.sampling import distributed_info

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed_info() == (1, 4)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="the WORLD_SIZE environment variable must be an integer >= 1, got 'four'"):
        distributed_info()


@pytest.mark.parametrize("name, bad, valid", [
    ("WORLD_SIZE", "0", ">= 1"), ("WORLD_SIZE", "abc", ">= 1"), ("RANK", "-1", ">= 0"),
    ("LOCAL_RANK", "-1", ">= 0"), ("NODE_RANK", "-1", ">= 0"), ("NODE_RANK", "x", ">= 0"),
    ("LOCAL_WORLD_SIZE", "0", ">= 1")])
def test_a_launcher_variable_out_of_its_range_is_named_with_the_range(no_launcher_env, name, bad, valid):
    """A negative rank or an empty world read as a rank: rank -1 of 4 would take a slice no rank owns."""
    env = no_launcher_env
    good = {"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for var, value in {**good, name: bad}.items():
        env.setenv(var, value)
    with pytest.raises(ValueError, match=f"^the {name} environment variable must be an integer {valid}, got '{bad}'"):
        distributed_info()


def test_an_empty_launcher_variable_is_unset(no_launcher_env):
    env = no_launcher_env
    for var, value in {"WORLD_SIZE": "4", "RANK": " ", "LOCAL_RANK": "1", "NODE_RANK": "",
                       "LOCAL_WORLD_SIZE": ""}.items():
        env.setenv(var, value)
    assert distributed_info() == (1, 4)       # no RANK: LOCAL_RANK on node 0
    env.setenv("WORLD_SIZE", "")
    env.setenv("LOCAL_RANK", "")
    assert distributed_info() == (0, 1)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 3])
def test_batches_from_an_aligned_offset_are_the_plans_own_batches(drop_last, world):
    for rank in range(world):
        plan = EpochPlan(101, 8, True, drop_last, seed=2, rank=rank, world_size=world)
        for start in range(len(plan) + 1):
            a, b = plan.batches(3, start), plan.batches_from(3, plan.offset_of(start))
            assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_batches_from_any_offset_re_split_the_rest_once_over_the_ranks():
    order = EpochPlan(101, 8, True, False, seed=2).order(3)
    for offset in (0, 5, 37, 100, 101):
        shards = [EpochPlan(101, 5, True, False, seed=2, rank=r, world_size=4).batches_from(3, offset)
                  for r in range(4)]
        assert len({len(s) for s in shards}) == 1
        got = np.concatenate([b for s in shards for b in s]) if offset < 101 else np.empty(0, np.int64)
        assert np.array_equal(np.sort(got), np.sort(order[offset:]))
    with pytest.raises(ValueError, match="sample offset 102 is outside"):
        EpochPlan(101, 5, True, False, seed=2).batches_from(0, 102)


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_rank_comes_from_lightnings_variables_without_rank(no_launcher_env):
    """Lightning's DDP launcher exports LOCAL_RANK, NODE_RANK and WORLD_SIZE, not RANK: a loader built
    before the process group exists took rank 0's shard on every process."""
    env = no_launcher_env
    env.setenv("WORLD_SIZE", "4")
    env.setenv("LOCAL_RANK", "1")
    env.setenv("NODE_RANK", "0")
    assert distributed_info() == (1, 4)
    env.setenv("NODE_RANK", "1")
    env.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed_info() == (3, 4)   # NODE_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK
    env.setenv("RANK", "2")
    assert distributed_info() == (2, 4)   # RANK, where it is set, wins


def test_an_unknown_rank_of_several_is_an_error_naming_the_missing_variable(no_launcher_env):
    env = no_launcher_env
    env.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=4 .* RANK \(or LOCAL_RANK with NODE_RANK\) is not set"):
        distributed_info()
    env.setenv("LOCAL_RANK", "1")
    env.setenv("NODE_RANK", "1")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE is not set"):
        distributed_info()
    assert distributed_info(rank=3, world_size=4) == (3, 4)  # explicit values need nothing
    env.setenv("WORLD_SIZE", "1")
    env.delenv("NODE_RANK")
    env.delenv("LOCAL_RANK")
    assert distributed_info() == (0, 1)


@pytest.mark.parametrize("n,batch,world", [(10, 3, 4), (9, 5, 2), (3, 2, 4), (17, 4, 3), (8, 4, 2)])
def test_even_plans_pad_the_last_step_and_lay_out_the_epochs_order(n, batch, world):
    plans = [EpochPlan(n, batch, True, False, 1, r, world, even=True) for r in range(world)]
    per_rank = [p.batches(0) for p in plans]
    assert len({len(b) for b in per_rank}) == 1
    steps = [np.concatenate([b[k] for b in per_rank]) for k in range(len(per_rank[0]))]
    assert len({len(b[-1]) for b in per_rank}) == 1
    remainder = plans[0].remainder() or len(steps[-1])
    np.testing.assert_array_equal(np.concatenate(steps[:-1] + [steps[-1][:remainder]]), plans[0].order(0))
    for r, plan in enumerate(plans):
        assert plan.rank_samples() == sum(map(len, per_rank[r]))
        uneven = EpochPlan(n, batch, True, False, 1, r, world)
        assert uneven.rank_samples() == sum(map(len, uneven.batches(0)))


# ---------------------------------------------------------------- generators seeded at once
def test_seed_sequence_words_are_numpys_for_every_row():
    """The array SeedSequence (sampling.seed_sequence_words) gives numpy's own words, bit for bit, for
    entropy of 1 to 9 words (fewer, as many as and more than the pool of 4) and the edge values."""
    from fastdata.sampling import seed_sequence_words

    rng = np.random.default_rng(0)
    for length in range(1, 10):
        rows = rng.integers(0, 2**32 - 1, size=(300, length), dtype=np.uint64)
        rows[:3] = [[0] * length, [2**32 - 2] * length, [1] * length]
        for n_words in (1, 4, 8):
            want = np.stack([np.random.SeedSequence([int(v) for v in r]).generate_state(n_words) for r in rows])
            assert np.array_equal(seed_sequence_words(rows, n_words), want), (length, n_words)
    words = np.array([[2**32 - 1, 5]], dtype=np.uint64)   # the words numpy makes of the int 5 * 2^32 + 2^32 - 1
    assert np.array_equal(seed_sequence_words(words, 4)[0], np.random.SeedSequence(6 * 2**32 - 1).generate_state(4))
    with pytest.raises(ValueError, match="array of 32-bit words, got shape \\(1, 1\\) with 4294967296"):
        seed_sequence_words(np.array([[2**32]], dtype=np.uint64), 4)


def test_batch_rngs_are_the_batch_rng_streams():
    """EpochPlan.batch_rngs(epoch, first, count) draws exactly what default_rng(batch_seed(...)) draws,
    for seeds and epochs that are negative, 0, 2^32 - 1 (two words of entropy in numpy) or huge, and
    seeds_for/generators_for agree with seed_for/default_rng where numpy takes its other paths."""
    from fastdata.sampling import generators_for, seeds_for

    for seed, epoch, rank in [(0, 0, 0), (7, 3, 1), (-5, 2**32 - 1, 0), (2**40 + 3, 12, 3)]:
        plan = EpochPlan(10_000, 8, True, False, seed, rank, 4)
        got = plan.batch_rngs(epoch, 5, 40)
        for b, g in enumerate(got, start=5):
            want = np.random.default_rng(plan.batch_seed(epoch, b))
            assert np.array_equal(g.integers(0, 5, size=(16, 2)), want.integers(0, 5, size=(16, 2)))
            assert np.array_equal(g.random(9), want.random(9))
    batches = np.array([0, 1, 2**32 - 1, -1, 2**31])
    assert seeds_for((3, 9, 0x5EED), batches, at=2).tolist() == [seed_for(3, 9, int(b), 0x5EED) for b in batches]
    seeds = np.array([0, 1, 2**32 - 2, 2**32 - 1, 2**32, 2**63 - 1], dtype=np.uint64)
    for g, s in zip(generators_for(seeds), seeds, strict=True):
        assert np.array_equal(g.random(5), np.random.default_rng(int(s)).random(5))


@pytest.mark.parametrize("even", [False, True])
def test_batches_from_hands_out_the_arrays_it_made_read_only(even):
    """The next epoch's batches are made ahead by a loader's thread and asked for again by iter(): the
    plan hands out the arrays it made (read-only: shared, a write raises instead of changing what every
    caller reads), a few (epoch, offset) at a time; a pickled plan leaves them behind and makes the same."""
    import pickle

    plan = EpochPlan(103, 10, True, False, 7, rank=1, world_size=2, even=even)
    first = plan.batches_from(3, 0)
    again = plan.batches_from(3, 0)
    assert again is not first and all(a is b for a, b in zip(first, again, strict=True))
    assert not any(ids.flags.writeable for ids in first)
    with pytest.raises(ValueError, match="read-only"):
        first[0][0] = 1
    resumed = plan.batches_from(3, 40)
    assert not any(a is b for a in resumed for b in first)
    for epoch in range(10):                      # bounded: older results are made again when asked for
        plan.batches_from(epoch, 0)
    assert len(plan._made) <= 4
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and copy._made == {}
    for a, b in zip(copy.batches_from(3, 0), first, strict=True):
        assert np.array_equal(a, b) and a.dtype == np.int64
    fresh = EpochPlan(103, 10, True, False, 7, rank=1, world_size=2, even=even)
    for a, b in zip(fresh._split(3, 40), resumed, strict=True):
        assert np.array_equal(a, b)
