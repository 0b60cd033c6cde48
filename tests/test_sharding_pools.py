"""DevicePagePools: the per-device page pools behind data-parallel attention (host-side, no devices needed)."""
import pytest

from mla_jax.engine.pools import DevicePagePools


def test_sequences_stay_on_one_device_and_spread_over_devices():
    pools = DevicePagePools(num_pages=16, page_size=4, num_devices=4, max_seqs_per_device=2)
    assert pools.pages_per_device == 4 and pools.num_usable == 3 and pools.num_free == 12
    a = pools.allocate(2)
    b = pools.allocate(2)
    assert pools.device_of(a) != pools.device_of(b)          # the emptiest device takes the next sequence
    a += pools.allocate(1, near=a)
    assert pools.device_of(a) == pools.device_of(a[:1])
    # a's device is full now: growing a again is impossible even though other devices have room
    assert not pools.can_allocate(1, near=a) and pools.can_allocate(1)
    for d in range(4):                                       # every device's local page 0 stays scratch
        assert d * 4 not in a + b
    pools.free(a)
    assert pools.can_allocate(3, near=b[:1]) is False and pools.can_allocate(1, near=b)
    assert pools.num_free == 12 - 2


def test_decode_rows_per_device_limit_admission():
    pools = DevicePagePools(num_pages=8, page_size=4, num_devices=2, max_seqs_per_device=1)
    a = pools.allocate(1)
    b = pools.allocate(1)
    assert {pools.device_of(a), pools.device_of(b)} == {0, 1}
    assert not pools.can_allocate(1)                          # both devices' rows taken, though pages are free
    with pytest.raises(RuntimeError, match="free decode row"):
        pools.allocate(1)
    pools.free(b)
    assert pools.can_allocate(1)
    assert pools.shares_pool(a, a) and not pools.shares_pool(a, pools.allocate(1))


def test_bad_sizes_and_foreign_pages_raise():
    with pytest.raises(ValueError, match="not a multiple of 3"):
        DevicePagePools(num_pages=8, page_size=4, num_devices=3, max_seqs_per_device=1)
    pools = DevicePagePools(num_pages=8, page_size=4, num_devices=2, max_seqs_per_device=2)
    with pytest.raises(RuntimeError, match="exactly one device"):
        pools.device_of([1, 5])
    a = pools.allocate(1)
    pools.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pools.free(a)
