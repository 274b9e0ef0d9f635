

def test_parts_fit_in_the_buses_messages():
    """A nats-server without the shipped config takes 1 MiB messages: a handoff's parts shrink to fit (a 720 KiB
    block goes one per message), and a block larger than a message is named once at start."""
    from services.engine.kv_transfer import HEADROOM, PART_BYTES, block_fits, chunks_per_part

    block = 720 << 10
    assert chunks_per_part(block, 64 << 20) == PART_BYTES // block == 11
    assert chunks_per_part(block, 1 << 20) == 1 and chunks_per_part(block, None) == 11
    assert chunks_per_part(2 << 20, 1 << 20) == 1  # (sent, refused by the bus, recomputed: said at start)
    assert block_fits(block, 1 << 20) == "" and block_fits(block, block + HEADROOM) == ""
    assert "max_payload: 64MB" in block_fits(2 << 20, 1 << 20)
