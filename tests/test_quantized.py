"""Quantized files kept quantized (engines.weights, cpu_kernels) through whole chains of stage engines: every block
type on 2 and 3 stages gives the tokens of the dequantize-at-load path and stays within the float64 reference's
tolerance; so do Q4_K_M- and Q3_K_M-like mixes. The models: ``kq`` (dim 256, 6 blocks, every width a multiple of
256), as MIXED (all thirteen kept types cycling over the matrices: any two consecutive blocks hold every one, so every
stage of 2 or 3 holds every type), as Q4_K_M and as Q3_K_M."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import QUANT_TYPES, generate
from pp_worker.testing.npref import RefModel

MAX_CONTEXT = 64
N_TOKENS = 8
LOGIT_ATOL_FP64 = 3e-2  # as tests/test_tinygrad_engine.py: fp32 compute, fp16 stage boundaries vs float64
LOGIT_ATOL_FP16_WEIGHTS = 3e-2  # dequantized-at-load weights are rounded to fp16 once; kept ones are not


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quantized")
    return {dt: generate(d / f"kq-{dt}.gguf", "kq", seed=3, dtype=dt) for dt in ("MIXED", "Q4_K_M", "Q3_K_M", "TQ2_0")}


@pytest.fixture(scope="module")
def chains(models):
    built: dict[tuple[str, int, bool, str], Chain] = {}

    def get(dtype: str, num_stages: int, keep_quantized: bool = True, kernels: str = "c") -> Chain:
        key = (dtype, num_stages, keep_quantized, kernels)
        if key not in built:
            built[key] = Chain(models[dtype], num_stages, MAX_CONTEXT, prefill_chunk=8, keep_quantized=keep_quantized,
                               kernels=kernels)
        return built[key]

    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [rng.integers(3, 700, n).tolist() for n in (5, 19)]  # 19: calls of 8, 8, 2, 1


@pytest.mark.parametrize("num_stages", [2, 3])
def test_every_type_kept_packed_gives_the_tokens_of_dequantize_at_load(chains, prompts, num_stages):
    packed, loaded = chains("MIXED", num_stages), chains("MIXED", num_stages, keep_quantized=False)
    for stage in packed.engines:  # every stage holds every type, as the file's bytes
        held = stage.describe()
        assert set(held["weights"]) == {"F16", "F32", *QUANT_TYPES} and held["weights_converted"] == {}
    for stage in loaded.engines:
        held = stage.describe()
        assert set(held["weights"]) == {"F16", "F32"} and set(held["weights_converted"]) == set(QUANT_TYPES)
    for rid, prompt in enumerate(prompts):
        got, got_logits = packed.generate(rid, prompt, N_TOKENS)
        want, want_logits = loaded.generate(rid, prompt, N_TOKENS)
        assert got == want, f"prompt {rid}"
        np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), rtol=0, atol=LOGIT_ATOL_FP16_WEIGHTS)


@pytest.mark.parametrize("dtype, num_stages, keep", [("MIXED", 2, True), ("MIXED", 3, True), ("MIXED", 2, False),
                                                     ("Q4_K_M", 2, True), ("Q4_K_M", 3, True), ("Q3_K_M", 2, True)])
def test_quantized_chains_match_the_float64_reference(chains, models, prompts, dtype, num_stages, keep):
    matches_the_reference(chains(dtype, num_stages, keep), models[dtype], prompts[1], 100)


def matches_the_reference(c: Chain, model: Path, prompt: list[int], rid: int) -> None:
    """The chain's greedy tokens, and its logits within tolerance, against the float64 reference on the file."""
    ref = RefModel.from_gguf(model)
    tokens, logits = c.generate(rid, prompt, N_TOKENS)
    want = ref.logits(prompt + tokens[:-1])[len(prompt) - 1:]  # the positions the chain predicted from
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=LOGIT_ATOL_FP64)
    assert tokens == ref.greedy(prompt, N_TOKENS)
    c.release(rid)


@pytest.mark.parametrize("dtype, num_stages, types", [("Q4_K_M", 3, {"Q4_K", "Q6_K"}),
                                                      ("Q3_K_M", 2, {"Q3_K", "Q4_K", "Q5_K", "Q6_K"})])
def test_mixes_stages_hold_their_share_of_the_file(chains, models, dtype, num_stages, types):
    """Each stage holds its tensors' bytes of the file (norm gains F32, as there) and nothing expanded."""
    from pp_worker.worker.gguf.header import read_header

    header = read_header(models[dtype])
    c = chains(dtype, num_stages)
    for stage in c.engines:
        held = stage.describe()
        assert set(held["weights"]) <= {*types, "F16", "F32"} and held["weights_converted"] == {}
        infos = [header.tensors[n] for n in stage.loaded_tensors]
        assert held["weight_bytes"] == sum(i.nbytes for i in infos)
    assert sum(len(s.loaded_tensors) for s in c.engines) == len(header.tensors)  # each tensor on one stage


@pytest.mark.parametrize("dtype, kernels, converted, kept", [
    ("Q3_K_M", "tinygrad", "Q3_K", {"Q4_K", "Q5_K", "Q6_K", "F16", "F32"}),  # tinygrad's expressions: none for Q3_K
    ("TQ2_0", "c", "TQ2_0", {"F16", "F32"}),  # no C kernel, no tinygrad expression
])
def test_types_nothing_reads_packed_are_dequantized_at_load_and_named(chains, models, prompts, dtype, kernels,
                                                                      converted, kept):
    """Matrices of a type the stage's kernels cannot read packed (tinygrad's kernels, forced here as off the CPU:
    tinygrad 0.13.0 has no expression for Q3_K; TQ2_0: none anywhere) are dequantized to fp16 at load by the gguf
    package, every one counted in ``weights_converted``; the others stay packed, and the chain still gives the
    float64 reference's tokens."""
    from gguf import GGMLQuantizationType

    from pp_worker.worker.gguf.header import read_header

    c, count = chains(dtype, 2, kernels=kernels), 0
    for stage in c.engines:
        held = stage.describe()
        assert set(held["weights"]) <= kept and set(held["weights_converted"]) == {converted}
        count += held["weights_converted"][converted]
    type_id = GGMLQuantizationType[converted].value
    assert count == sum(i.ggml_type == type_id for i in read_header(models[dtype]).tensors.values())
    matches_the_reference(c, models[dtype], prompts[0], 101)


def test_sizing_a_kernels_type_needs_no_gguf_import(models):
    """A load reads every tensor's size from the header: for the C kernels' types tinygrad has no table for (Q3_K),
    the kernels' table answers, not the gguf package (importing it cost a Q3_K_M load 1.29x F16's time)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from pp_worker.worker.gguf.header import read_header; "
            f"h = read_header(Path({str(models['Q3_K_M'])!r})); "
            "assert all(t.nbytes for t in h.tensors.values()); print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("type_id, named", [(99, "type 99"), (15, "Q8_K")])
def test_a_type_nothing_reads_is_a_load_error_that_names_it(models, type_id, named):
    """An id no table knows (99), or one the gguf package sizes but cannot dequantize (Q8_K, ggml's type for
    activations): a one-line ModelLoadError naming the tensor and the type, not a crash."""
    import dataclasses

    from pp_worker.worker.gguf.header import ModelLoadError, read_header
    from pp_worker.worker.gguf.tensors import TensorSource

    header = read_header(models["Q3_K_M"])
    name = "blk.0.ffn_up.weight"
    header.tensors[name] = dataclasses.replace(header.tensors[name], ggml_type=type_id)
    with pytest.raises(ModelLoadError, match=rf"tensor {name} has GGML type {type_id} \({named}\), which this worker "
                                             r"cannot read$"):
        TensorSource(header, kernels="c").matrix(name, header.tensors[name].shape)
