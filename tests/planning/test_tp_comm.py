"""The communication model of a tensor-parallel decode step (tandem.planning.tp_comm)."""

import pytest

from tandem.planning.tp_comm import GPUS, MODELS, ModelShape, decode_step_comm


def test_a_step_all_reduces_twice_per_layer_and_once_for_the_embedding():
    model = ModelShape("m", layers=10, hidden=1000, params=1e9)
    comm = decode_step_comm(model, GPUS["h100"], tp=4, batch=8)
    assert comm.all_reduces == 21
    assert comm.bytes_per_rank == pytest.approx(21 * 2 * 3 / 4 * 8 * 1000 * 2)  # ring: 2 (N-1)/N of the tensor
    link = GPUS["h100"]
    assert comm.comm_s == pytest.approx(21 * (link.all_reduce_latency_s + 2 * 3 / 4 * 8 * 1000 * 2 / link.link_bytes_s))
    assert comm.weights_s == pytest.approx(1e9 * 2 / 4 / link.hbm_bytes_s)


def test_one_rank_communicates_nothing_and_more_ranks_read_less_each():
    model, gpu = MODELS["llama-3-70b"], GPUS["h200"]
    whole = decode_step_comm(model, gpu, tp=1, batch=1)
    assert (whole.all_reduces, whole.bytes_per_rank, whole.comm_s) == (0, 0.0, 0.0)
    shares = [decode_step_comm(model, gpu, tp, 1) for tp in (2, 4, 8)]
    assert [s.weights_s for s in shares] == pytest.approx([whole.weights_s / tp for tp in (2, 4, 8)])
    # The share of a step spent communicating grows with TP: the reason to pick the smallest TP that fits.
    ratios = [s.comm_s / s.weights_s for s in shares]
    assert ratios == sorted(ratios)


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        decode_step_comm(MODELS["llama-3-8b"], GPUS["h100"], tp=0, batch=1)
