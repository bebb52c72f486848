"""StepBuffer: every field lives at an aligned, non-overlapping offset of one host byte
buffer mirrored into one device buffer of the same layout; one sync = one copy."""
import pytest
import torch

from cache.step_buffer import STALE_JUNK, StepBuffer, StepExtent

T, S, MB = 24, 5, 7
PER_TOKEN = ["input_ids", "positions", "slot_mapping", "prompt_token_mask"]
PER_SEQ = ["mamba_src", "mamba_dst", "logits_indices", "seeds", "output_pos", "seq_lens", "top_k",
           "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


def make(device="cpu"):
    return StepBuffer(T, S, MB, 2 * S, torch.device(device))


def _layout(views):
    """name -> (byte offset in its storage, byte length, element size); one storage for all."""
    storages = {v.untyped_storage().data_ptr() for v in views.values()}
    assert len(storages) == 1, "fields live in more than one buffer"
    base = storages.pop()
    return {n: (v.data_ptr() - base, v.numel() * v.element_size(), v.element_size()) for n, v in views.items()}


@pytest.mark.parametrize("side", ["host", "device"])
def test_layout_aligned_and_non_overlapping(side):
    buf = make()
    views = getattr(buf, side)
    layout = _layout(views)
    spans = sorted((off, off + size, name) for name, (off, size, _) in layout.items())
    for name, (off, size, itemsize) in layout.items():
        assert off % itemsize == 0, f"{name} at offset {off} is not aligned to {itemsize}"
        assert 0 <= off and off + size <= buf.nbytes, name
        assert views[name].is_contiguous(), name
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        assert e0 <= s1, f"{n0} overlaps {n1}"
    assert sum(size for _, size, _ in layout.values()) == buf.nbytes  # packed, no padding
    assert views["input_ids"].untyped_storage().nbytes() == buf.nbytes


def test_field_shapes_match_between_host_and_device():
    buf = make()
    assert set(buf.host) == set(buf.device)
    for name in buf.host:
        assert buf.host[name].shape == buf.device[name].shape and buf.host[name].dtype == buf.device[name].dtype
    for name in PER_TOKEN:
        assert buf.host[name].shape == (T,), name
    for name in PER_SEQ:
        assert buf.host[name].shape == (S,), name
    assert buf.host["cu_seqlens_q"].shape == (S + 1,)
    assert buf.host["block_tables"].shape == (S, MB)
    assert buf.host["prompt_token_mask"].dtype == torch.bool
    assert buf.host["input_ids"].dtype == torch.int64 and buf.host["temperature"].dtype == torch.float32


def test_host_and_device_are_separate_storages():
    buf = make()
    assert buf.host["input_ids"].untyped_storage().data_ptr() != buf.device["input_ids"].untyped_storage().data_ptr()


def _fill_random(views, gen):
    for name, v in views.items():
        if v.dtype == torch.bool:
            v.copy_(torch.randint(0, 2, v.shape, generator=gen).bool())
        elif v.dtype.is_floating_point:
            v.copy_(torch.randn(v.shape, generator=gen))
        else:
            v.copy_(torch.randint(-(2**31), 2**31 - 1, v.shape, generator=gen).to(v.dtype))


def test_round_trip_every_field():
    buf = make()
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        host = buf.host  # the host buffer the next step is written into
        _fill_random(host, gen)
        expected = {n: v.clone() for n, v in host.items()}
        before = buf.num_syncs
        buf.sync(mask_rows=S)
        assert buf.num_syncs == before + 1
        for name, value in expected.items():
            assert torch.equal(buf.device[name].cpu(), value), (step, name)


@pytest.mark.parametrize("mask_rows", [0, 2])
def test_a_sync_copies_only_the_mask_rows_the_step_uses(mask_rows):
    """`grammar_masks` is the layout's last field, so one copy ends after the step's mask
    rows: every other field arrives whole, mask rows past them keep the device's bytes."""
    buf = StepBuffer(T, S, MB, 2 * S, torch.device("cpu"), mask_bytes=3)
    assert max(buf.host, key=lambda n: buf.host[n].data_ptr()) == "grammar_masks"
    _fill_random(buf.host, torch.Generator().manual_seed(3))
    expected = {n: v.clone() for n, v in buf.host.items()}
    buf.device["grammar_masks"].fill_(7)
    buf.sync(mask_rows)
    for name, value in expected.items():
        if name != "grammar_masks":
            assert torch.equal(buf.device[name], value), name
    masks = buf.device["grammar_masks"]
    assert torch.equal(masks[:mask_rows], expected["grammar_masks"][:mask_rows])
    assert bool((masks[mask_rows:] == 7).all())


def test_fields_do_not_clobber_each_other():
    """Writing one field's whole view leaves every other field's bytes unchanged."""
    buf = make()
    gen = torch.Generator().manual_seed(1)
    host = buf.host
    _fill_random(host, gen)
    for name, v in host.items():
        others = {n: o.clone() for n, o in host.items() if n != name}
        v.view(torch.uint8).fill_(0xAB) if v.dtype != torch.bool else v.fill_(True)
        for n, o in others.items():
            assert torch.equal(host[n], o), f"writing {name} changed {n}"


@pytest.mark.gpu
def test_cuda_host_buffer_is_pinned_and_mirrors():
    buf = make("cuda")
    assert buf.host["input_ids"].is_pinned()
    assert buf.device["input_ids"].is_cuda
    _fill_random(buf.host, torch.Generator().manual_seed(2))
    expected = {n: v.clone() for n, v in buf.host.items()}
    buf.sync(mask_rows=S)
    torch.cuda.synchronize()
    for name, value in expected.items():
        assert torch.equal(buf.device[name].cpu(), value), name


# Which leading rows of each field a step reads, restated from the layout table
# (cache/step_buffer.py): the rows `pack` must carry.
ROWS_READ = {
    **dict.fromkeys(["input_ids", "positions", "slot_mapping", "prompt_token_mask"], "tokens"),
    **dict.fromkeys(["mamba_src", "mamba_dst", "input_from_prev", "logits_indices", "seeds", "output_pos",
                     "history_rows", "prompt_lens", "history_lens", "num_drafts", "seq_lens", "block_tables", "top_k",
                     "dt_limit_hits", "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "grammar_rows"], "seqs"),
    "grammar_masks": "masks",
    **dict.fromkeys(["cu_seqlens_q", "prefill_cu_seqlens", "save_cu"], "seqs + 1"),
    "new_state_slots": "new_slots", "save_slots": "saves", "save_offsets": "saves", "verify_dst": "width x seqs",
}


def _rows(name: str, extent: StepExtent) -> tuple[slice, ...]:
    kind = ROWS_READ[name]
    if kind == "width x seqs":
        return slice(0, extent.width), slice(0, extent.seqs)
    return (slice(0, extent.seqs + 1 if kind == "seqs + 1" else getattr(extent, kind)),)


@pytest.mark.parametrize("extent", [StepExtent(tokens=3, seqs=3, width=1, new_slots=0, saves=0),
                                    StepExtent(tokens=T, seqs=S, width=3, new_slots=2 * S, saves=4, masks=S),
                                    StepExtent(tokens=9, seqs=2, width=2, new_slots=1, saves=1, masks=1)])
def test_pack_carries_every_row_a_step_reads_and_nothing_else(extent):
    """What tensor parallelism sends (`pack`) and a worker writes into its own buffer
    (`unpack`): each field's leading rows of the extent, equal to the sender's; every byte
    outside them keeps the receiver's own (stale) value."""
    sender = StepBuffer(T, S, MB, 2 * S, torch.device("cpu"), max_width=3, max_saves=4, mask_bytes=3)
    receiver = StepBuffer(T, S, MB, 2 * S, torch.device("cpu"), max_width=3, max_saves=4, mask_bytes=3)
    assert set(sender.host) == set(ROWS_READ)
    gen = torch.Generator().manual_seed(0)
    for name, view in sender.host.items():
        view.copy_(torch.randint(1, 100, view.shape, generator=gen).to(view.dtype))
        receiver.host[name].copy_(torch.randint(200, 300, view.shape, generator=gen).to(view.dtype)
                                  if view.dtype != torch.bool else torch.zeros_like(view))
    stale = {name: v.clone() for name, v in receiver.host.items()}
    packed = sender.pack(extent)
    receiver.unpack(extent, packed)
    for name, view in receiver.host.items():
        rows = _rows(name, extent)
        assert torch.equal(view[rows], sender.host[name][rows]), name
        outside = torch.ones_like(view, dtype=torch.bool)
        outside[rows] = False
        assert torch.equal(view[outside], stale[name][outside]), name
    assert len(packed) == sum(v[_rows(n, extent)].numel() * v.element_size() for n, v in sender.host.items())
    with pytest.raises(ValueError, match="step message"):
        receiver.unpack(extent, packed[:-1])
    # The tests' check: every byte outside the step's rows becomes junk, the rows arrive.
    receiver.unpack(extent, packed, scramble_stale=True)
    for name, view in receiver.host.items():
        rows = _rows(name, extent)
        assert torch.equal(view[rows], sender.host[name][rows]), name
        outside = torch.ones_like(view, dtype=torch.bool)
        outside[rows] = False
        junk = view.view(torch.uint8).view(*view.shape, view.element_size()) if view.dtype != torch.bool \
            else view.view(torch.uint8)
        assert bool((junk[outside] == STALE_JUNK).all()), name
