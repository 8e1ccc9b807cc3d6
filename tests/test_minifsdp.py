"""MiniFSDP (chapter 08's NumPy sketch): padding instead of dropping remainders, reduce-scatter as a mean over
ranks, a sharded SGD step equal to the unsharded one, and a peak that counts the whole fridge."""
import numpy as np
import pytest

from fsdp_lab.theory.minifsdp import MiniFSDP, article_peak_estimate, dropped_by_floor_division, padded

SIZES = [4096, 4097, 11008, 5]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_gather_returns_every_element_whatever_the_remainder(n):
    rng = np.random.default_rng(n)
    layers = [rng.standard_normal(s) for s in SIZES]
    m = MiniFSDP.from_layers(n, layers)
    for i, layer in enumerate(layers):
        assert all(m.fridges[r][i].size == padded(layer.size, n) // n for r in range(n))
        np.testing.assert_array_equal(m.gather_layer(i), layer)
        full = m.gather_layer(i, keep_padding=True)
        assert full.size == padded(layer.size, n) and not full[layer.size:].any()


def test_floor_division_would_lose_the_remainder():
    assert dropped_by_floor_division(SIZES, 4) == [0, 1, 0, 1]
    assert padded(4097, 4) == 4100 and padded(5, 8) == 8 and padded(1, 1) == 1


def test_reduce_scatter_is_the_mean_over_ranks_cut_into_slices():
    n = 3
    m = MiniFSDP(n, [10])
    grads = [np.arange(10.0) * (r + 1) for r in range(n)]
    shards = m.reduce_scatter_grad(0, grads)
    assert [s.size for s in shards] == [4, 4, 4]
    np.testing.assert_allclose(np.concatenate(shards)[:10], np.mean(grads, axis=0))
    np.testing.assert_array_equal(np.concatenate(shards)[10:], 0.0)


def test_sharded_sgd_equals_unsharded_sgd():
    rng = np.random.default_rng(0)
    layer = rng.standard_normal(4097)
    grads = [rng.standard_normal(4097) for _ in range(4)]
    m = MiniFSDP.from_layers(4, [layer])
    m.sgd_step(0, m.reduce_scatter_grad(0, grads), lr=0.1)
    np.testing.assert_allclose(m.gather_layer(0), layer - 0.1 * np.mean(grads, axis=0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_peak_counts_the_whole_fridge_and_matches_the_simulation(n):
    sizes = [4096, 4096, 4096, 11008, 4096]
    m = MiniFSDP(n, sizes)
    fridge = sum(padded(s, n) for s in sizes) // n
    assert m.fridge_elements() == fridge
    assert m.peak_params() == fridge + max(padded(s, n) for s in sizes)
    stats = m.simulate_step()
    assert stats.peak_live == m.peak_params()
    assert (stats.gathers, stats.reduce_scatters) == (2 * len(sizes), len(sizes))
    assert stats.elements_sent == 3 * sum(padded(s, n) for s in sizes) * (n - 1) // n
    if n > 1:  # the article's estimate leaves out the other layers' slices
        assert article_peak_estimate(sizes, n) < m.peak_params()


def test_simulated_step_with_gradients_trains_every_rank_slice():
    m = MiniFSDP(2, [7, 3], seed=1)
    before = [m.gather_layer(i).copy() for i in range(2)]
    m.simulate_step(grad_fn=lambda idx, full, r: np.full(full.size, float(r + 1)), lr=0.5)
    for i in range(2):
        np.testing.assert_allclose(m.gather_layer(i), before[i] - 0.5 * 1.5)


def test_from_shards_adopts_real_shards_and_checks_their_size():
    shards = [[np.array([1.0, 2.0])], [np.array([3.0, 0.0])]]
    m = MiniFSDP.from_shards(shards, [3])
    np.testing.assert_array_equal(m.gather_layer(0), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"rank 1, layer 0: shard has 1 elements, expected 2"):
        MiniFSDP.from_shards([[np.zeros(2)], [np.zeros(1)]], [3])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        MiniFSDP(0, [4])
    with pytest.raises(ValueError, match="layer_sizes"):
        MiniFSDP(2, [4, 0])
    m = MiniFSDP(2, [4])
    with pytest.raises(ValueError, match="one gradient per rank: got 1, world_size is 2"):
        m.reduce_scatter_grad(0, [np.zeros(4)])
    with pytest.raises(ValueError, match="rank 1's gradient for layer 0 has 3 elements, the layer 4"):
        m.reduce_scatter_grad(0, [np.zeros(4), np.zeros(3)])
