"""Huge-page memory for the packed weights: the buffer's alignment, contents and lifetime, what the kernel says about
its mapping (/proc/self/smaps), the engine's and the floor probe's use of it, and the same logits either way."""

from __future__ import annotations

import copy
import gc
import re
from pathlib import Path

import pytest
import torch

from medusa_runtime import kernels
from medusa_runtime.decoding.decode import encode_prompt
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.kernels import hugepages
from medusa_runtime.kernels.packing import pack_all, pack_rows4
from medusa_runtime.measure.bandwidth import FloorProbe
from medusa_runtime.model import LoadedModel

SMAPS = Path("/proc/self/smaps")


@pytest.fixture(autouse=True)
def _huge_pages_on(monkeypatch):
    monkeypatch.delenv(hugepages.ENV_SWITCH, raising=False)  # these tests are about the default


def vma_field(address: int, field: str) -> int:
    """A numeric field (e.g. THPeligible) of the mapping of this process that holds ``address``."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"no {field} for {address:#x}")


def huge_expected() -> bool:
    return hugepages.thp_mode() in ("always", "madvise")


def test_huge_buffer_is_zeroed_aligned_and_outlives_its_mapping_object():
    buf = hugepages.huge_buffer(5 * hugepages.HUGE_PAGE + 123)
    assert buf.numel() == 5 * hugepages.HUGE_PAGE + 123 and buf.dtype == torch.uint8
    assert buf.data_ptr() % hugepages.HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    view = buf[hugepages.HUGE_PAGE:hugepages.HUGE_PAGE + 4000].view(torch.int32)
    view.copy_(torch.arange(1000, dtype=torch.int32))
    gc.collect()  # the mmap object is referenced by the tensor alone
    garbage = [torch.full((1 << 18,), 9, dtype=torch.int32) for _ in range(32)]  # reuse whatever was freed
    assert torch.equal(buf[hugepages.HUGE_PAGE:hugepages.HUGE_PAGE + 4000].view(torch.int32), torch.arange(1000, dtype=torch.int32))
    del garbage
    with pytest.raises(ValueError, match="-1 bytes"):
        hugepages.huge_buffer(-1)


def test_the_kernel_may_back_the_buffer_with_huge_pages_and_not_plain_memory(monkeypatch):
    """THPeligible is the kernel's own word on a mapping: 1 for the advised buffer wherever the system's mode
    allows huge pages on request, 0 for the PyTorch memory MEDUSA_HUGE_PAGES=0 falls back to (in madvise mode).
    Without /proc/self/smaps (not Linux) there is no transparent huge page mode either."""
    if not SMAPS.exists():
        assert hugepages.thp_mode() is None
        return
    buf = hugepages.huge_buffer(8 * hugepages.HUGE_PAGE)
    buf.fill_(1)
    assert vma_field(buf.data_ptr(), "THPeligible") == int(huge_expected())
    monkeypatch.setenv(hugepages.ENV_SWITCH, "0")
    plain = hugepages.huge_buffer(8 * hugepages.HUGE_PAGE)
    plain.fill_(1)
    if hugepages.thp_mode() == "madvise":
        assert vma_field(plain.data_ptr(), "THPeligible") == 0


def test_carve_places_views_at_aligned_offsets_and_refuses_an_overflow():
    sizes = [10, 4096, 1, 3000]
    need = hugepages.carved_bytes(sizes, torch.bfloat16)
    assert need == 4096 + 8192 + 4096 + 8192  # each rounded up to 4 KiB: 20 B, 8192 B, 2 B, 6000 B
    buf = hugepages.huge_buffer(need)
    views = hugepages.carve(buf, sizes, torch.bfloat16)
    assert [v.numel() for v in views] == sizes and all(v.dtype == torch.bfloat16 for v in views)
    assert [v.data_ptr() - buf.data_ptr() for v in views] == [0, 4096, 12288, 16384]
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert [float(v[0]) for v in views] == [1.0, 2.0, 3.0, 4.0] and float(views[1][-1]) == 2.0  # no overlap
    with pytest.raises(ValueError, match="do not fit"):
        hugepages.carve(buf, sizes + [1], torch.bfloat16)


def test_pack_all_equals_packing_each_weight_alone(default_bf16):
    """The weights packed side by side into the huge buffer hold the same bits as pack_rows4 of each alone."""
    engine = LeanEngine(default_bf16, use_kernels=False)
    ws = [engine.layers[0].qkv.weight, engine.layers[0].down.weight, engine.lm_head]
    lib = kernels.load()
    if lib is None:
        pytest.fail(f"the C library is needed here: {kernels.unavailable_reason()}")
    together = pack_all(lib, ws, amx=False)
    for w, p in zip(ws, together):
        assert torch.equal(p, pack_rows4(lib, w))
    assert together[0].data_ptr() % hugepages.HUGE_PAGE == 0


def test_engine_streams_weights_from_huge_pages_with_the_same_logits(default_bf16, monkeypatch):
    """The lean engine's packed weights (every layer's and the logits') lie in one advised buffer; an engine
    packed with MEDUSA_HUGE_PAGES=0 gives the same logits and hidden states bit for bit, plain step and tree."""
    huge = LeanEngine(default_bf16, use_kernels=True)
    monkeypatch.setenv(hugepages.ENV_SWITCH, "0")
    other = LoadedModel(copy.deepcopy(default_bf16.model), default_bf16.tokenizer, "copy", default_bf16.dtype,
                        default_bf16.device)
    plain = LeanEngine(other, use_kernels=True)
    first = huge._packed[0][0].data_ptr()
    assert first % hugepages.HUGE_PAGE == 0
    assert plain._packed[0][0].data_ptr() % hugepages.HUGE_PAGE != 0 or not huge_expected()
    if SMAPS.exists():
        assert vma_field(first, "THPeligible") == int(huge_expected())
        assert vma_field(huge._logits_kernel.packed.data_ptr(), "THPeligible") == int(huge_expected())
    prompt = torch.tensor(encode_prompt(default_bf16, "Name three colours.", chat=True))
    tree = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with torch.inference_mode():
        outs = []
        for e in (huge, plain):
            cache = e.new_cache(len(prompt) + 8)
            e.forward(prompt, 0, cache, last_only=True)
            step = e.forward(prompt[-1:], len(prompt), cache)
            rows = e.forward(torch.tensor([11, 22, 33, 44]), len(prompt) + 1, cache, tree=tree,
                             positions=torch.arange(len(prompt) + 1, len(prompt) + 5))
            outs.append((step, rows))
    for a, b in zip(*outs):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_floor_probe_copies_within_huge_page_memory():
    probe = FloorProbe(nbytes=4 * hugepages.HUGE_PAGE)
    assert probe.src.data_ptr() % hugepages.HUGE_PAGE == 0 and probe.dst.data_ptr() % hugepages.HUGE_PAGE == 0
    if SMAPS.exists():
        assert vma_field(probe.src.data_ptr(), "THPeligible") == int(huge_expected())
    assert torch.equal(probe.dst, probe.src) and int(probe.src[0]) == 1
    assert probe.gbs(2) > 0



def test_model_status_says_which_pages_the_weights_take(default_bf16, monkeypatch):
    from medusa_runtime.engines.lean import c_forward_status

    expected = "2 MiB pages" if huge_expected() else "4 KiB pages (transparent huge pages: "
    assert hugepages.describe().startswith(expected)
    if kernels.fast_path():
        assert f"packed weights in {hugepages.describe()}" in c_forward_status(default_bf16)
    monkeypatch.setenv(hugepages.ENV_SWITCH, "0")
    assert hugepages.describe() == "4 KiB pages (MEDUSA_HUGE_PAGES=0)"
