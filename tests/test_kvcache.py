"""KV cache dtypes: fp16 caches give the same tokens as a same-cast reference, logits within tolerance of float64,
and every kernel stores values of its buffer's dtype (what NVRTC requires; the CPU would convert silently)."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import numpy as np
import pytest
from samecast import SameCastReference
from tinygrad import Device, dtypes
from tinygrad.llm.model import TransformerBlock

from pp_worker.testing.chain import Chain
from pp_worker.testing.cudagraph import check_stores
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.engines.kvcache import default_kv_dtype
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

MAX_CONTEXT = 80  # unlike other modules' contexts: this module's kernels are rendered here, not found cached
LOGIT_ATOL_SAME_CAST = 2e-3
LOGIT_ATOL_FP64 = 3e-2
# sha256 of tinygrad 0.13.0's TransformerBlock._attention, which kvcache.CacheBlock copies with one change
TINYGRAD_ATTENTION_SHA256 = "5a0f266d0ec16a947fb3a06f554f1e8821d5249e18420aca6d4d9e3619886e60"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("kv") / "tiny.gguf", preset="tiny", seed=5)


def test_cache_block_copies_the_attention_of_this_tinygrad():
    source = inspect.getsource(TransformerBlock._attention)
    assert hashlib.sha256(source.encode()).hexdigest() == TINYGRAD_ATTENTION_SHA256, (
        "tinygrad's TransformerBlock._attention changed: copy it into kvcache.CacheBlock again (keeping the cast "
        "of the stored keys and values), then update this hash")


def test_default_dtype_per_device():
    assert default_kv_dtype("CPU") == "float16" and default_kv_dtype("CPU:LLVM") == "float16"  # bench/NOTES.md
    assert default_kv_dtype("CUDA") == default_kv_dtype("NV:1") == default_kv_dtype("NULL:CUDA:sm_90") == "float16"


def test_fp16_caches_are_exact_against_a_same_cast_reference(model, monkeypatch):
    renderer = type(Device["CPU"].renderer)
    render, half_stores = renderer.render, []

    def checked(self, uops):  # NVRTC's rule, applied where the CPU's compiler would convert silently
        check_stores(uops)
        half_stores.extend(u for u in uops if u.op.name == "STORE" and u.src[1].dtype.scalar() == dtypes.half)
        return render(self, uops)

    monkeypatch.setattr(renderer, "render", checked)
    chain = Chain(model, 2, MAX_CONTEXT, kv_dtype="float16")
    assert chain.engines[1].kv_pool.dtype == dtypes.half
    prompt = list(range(30, 67))  # 37 tokens: calls of 32, 4 and 1
    got, got_logits = chain.generate(0, prompt, 12)
    assert half_stores, "no kernel stored into a float16 cache here: the check above saw nothing"
    monkeypatch.undo()  # tinygrad's own blocks store uncast: the check would refuse the reference
    reference = SameCastReference(model, MAX_CONTEXT, kv_dtype=dtypes.half)
    want, want_logits = reference.generate(prompt, 12, chain.boundaries)
    assert got == want
    np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), rtol=0, atol=LOGIT_ATOL_SAME_CAST)
    ref64 = RefModel.from_gguf(model).logits(prompt + got[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(got_logits), ref64, rtol=0, atol=LOGIT_ATOL_FP64)


def test_fp16_pages_hold_half_the_bytes(model):
    wide, narrow = (TinygradEngine(str(model), 1, 2, max_context=MAX_CONTEXT, kv_dtype=d)
                    for d in ("float32", "float16"))
    blocks, kv_heads, head_dim, page = 2, 2, 16, 256  # stage 1 of 2 of the tiny preset; kvcache.PAGE
    assert wide.kv_pool.page_bytes == blocks * 2 * kv_heads * page * head_dim * 4
    assert narrow.kv_pool.page_bytes * 2 == wide.kv_pool.page_bytes
    assert narrow.describe()["kv_dtype"] == "float16"
    assert narrow.describe()["kv_session_bytes"] == narrow.kv_pool.page_bytes  # MAX_CONTEXT fits one page
