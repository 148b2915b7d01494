"""A CPU stage's weights in memory advised for transparent huge pages (`hostio._huge_pages`).

tinygrad maps its CPU buffers shared, and Linux gives shared memory 4 KiB pages only, so a weight streamed from DRAM
crossed a page every 4 KiB. These tests read the kernel's own account of the mapping (/proc/self/smaps: its
``VmFlags``, ``hg`` where MADV_HUGEPAGE was given), which holds whatever THP policy the machine has, and run a
real stage on such memory.
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes, nn

from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import generate
from pp_worker.worker import hostio

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE and smaps are Linux's")


def _mapping(address: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of this process's mapping holding ``address``, or None."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        if lo <= address < hi:
            flags = re.search(r"^VmFlags:(.*)$", entry, re.M)
            return lo, hi, set(flags.group(1).split()) if flags else set()
    return None


def _weights(chain: Chain) -> list[Tensor]:
    """Every buffer-backed tensor of every stage's blocks, head and embedding (packed weights' bytes included; not
    the fp16 views of bytes)."""
    objs = [o for e in chain.engines for o in (*e._w.blocks, e._w.output, e._w.token_embd) if o is not None]
    return [t for o in objs for t in nn.state.get_state_dict(o).values() if t.uop.base.realized is not None]


def _address(t: Tensor) -> int:
    return int(hostio.device_buffer(t)._buf.va_addr)


def test_a_weight_sized_tensor_sits_on_huge_page_boundaries_advised_for_them() -> None:
    n = 5 * hostio.HUGE_PAGE // 2  # two whole huge pages and half of one
    values = np.random.default_rng(0).standard_normal(n // 4).astype(np.float32)

    def fill(mv: memoryview) -> None:
        np.frombuffer(mv, np.float32)[:] = values

    t = hostio.filled((n // 4,), dtypes.float32, fill, weight=True)
    at = _address(t)
    assert at % hostio.HUGE_PAGE == 0
    head, tail = _mapping(at), _mapping(at + n - 1)
    assert head is not None and tail is not None
    assert "hg" in head[2] and head[1] - at == 2 * hostio.HUGE_PAGE  # the whole pages, advised
    assert "hg" not in tail[2] and tail[0] == at + 2 * hostio.HUGE_PAGE  # the half page: small pages
    assert np.array_equal(t.numpy(), values)
    assert (t * 2).sum().item() == pytest.approx(2 * float(values.astype(np.float64).sum()), rel=1e-4)
    del t
    gc.collect()
    assert _mapping(at) is None  # unmapped with its buffer


@pytest.mark.parametrize("size, weight", [(hostio.HUGE_MIN - 4, True), (4 * hostio.HUGE_MIN, False)])
def test_small_weights_and_other_tensors_stay_in_tinygrads_memory(size: int, weight: bool) -> None:
    t = hostio.filled((size // 4,), dtypes.float32, weight=weight)  # not a weight: a stage's inputs, written in place
    assert hostio.device_buffer(t).options is None and hostio.host_view(t) is not None and t.sum().item() == 0.0


@pytest.mark.parametrize("dtype", ["F16", "Q4_K"])  # the float path's kernels and the integer path's packed bytes
def test_a_stage_whose_weights_sit_in_huge_page_memory_computes_the_same_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    model = generate(tmp_path / f"kq-{dtype}.gguf", preset="kq", seed=4, dtype=dtype)
    prompt = [5, 9, 11, 3, 7, 2, 40, 41]
    want = Chain(model, 2, 64).generate(1, prompt, 4)
    monkeypatch.setattr(hostio, "HUGE_MIN", 16 << 10)  # this model's matrices (~64-400 KiB) take the path too
    chain = Chain(model, 2, 64)
    moved = [w for w in _weights(chain) if hostio.device_buffer(w).options is not None]
    assert moved and all(_address(w) % hostio.HUGE_PAGE == 0 for w in moved)
    got = chain.generate(1, prompt, 4)
    assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1], strict=True))
