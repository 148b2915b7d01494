"""The one table of GGML tensor types: what every other module knows about a type, it reads here.

A row gives ggml's id and name, the values and bytes of one block (ggml's ``type_traits``: a type's data is whole
blocks, so a tensor of n values takes n / block * nbytes bytes), and, for the types the CPU kernels read, the stem of
their C files (``cpu/c/generic/<stem>.c``) and the SIMD variants that have code of their own
(``cpu/c/x86/<stem>.c`` for avx512 and avx2, ``cpu/c/arm/<stem>.c`` for neon). The kernels fall back to the generic
C wherever a variant is missing. ``int8`` marks the types whose generic file also has the integer path's code
(``iq32`` and ``iscales``, see ``cpu/c/matmul_int.c``). Imports nothing heavy: the header parser sizes tensors from it.
"""

from __future__ import annotations

from dataclasses import dataclass

SIMD_DIRS = {"avx512": "x86", "avx2": "x86", "neon": "arm"}  # a SIMD variant -> the folder of its files


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block: int  # values per block
    nbytes: int  # bytes per block
    kernel: str | None = None  # C file stem, None: no CPU kernel (dequantized at load)
    simd: tuple[str, ...] = ()  # variants with code of their own (keys of SIMD_DIRS)
    int8: bool = False  # an integer path: x quantized to int8 blocks as ggml's Q8_K / Q8_0 (cpu/c/q8.h)
    int8_default: bool = False  # ... taken by default (PP_EXACT unset): where it measured faster (bench/NOTES.md)
    # the SIMD variants (keys of SIMD_DIRS) whose CPUs hold a product's rows interleaved in groups at load for the
    # integer path (`tensors.grouped`, `cpu.kernels.group_rows`): where the grouped kernel measured faster
    grouped: tuple[str, ...] = ()

    @property
    def kernel_block(self) -> int:
        """Values a kernel decodes per step: whole blocks, and whole groups of 32 (F16's block is one value)."""
        return max(self.block, 32)

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.nbytes


AVX512 = ("avx512",)
X86 = ("avx512", "avx2")
TYPES: dict[int, GGMLType] = {t.id: t for t in (
    GGMLType(0, "F32", 1, 4),
    GGMLType(1, "F16", 1, 2, "f16"),
    GGMLType(2, "Q4_0", 32, 18, "q4_0", X86, int8=True, int8_default=True, grouped=X86),
    GGMLType(3, "Q4_1", 32, 20, "q4_1", X86, int8=True, int8_default=True, grouped=X86),
    GGMLType(6, "Q5_0", 32, 22, "q5_0", X86, int8=True, int8_default=True, grouped=X86),
    GGMLType(7, "Q5_1", 32, 24, "q5_1", X86, int8=True, int8_default=True, grouped=X86),
    GGMLType(8, "Q8_0", 32, 34, "q8_0", ("avx2", "neon"), int8=True, int8_default=True),
    GGMLType(9, "Q8_1", 32, 36),
    GGMLType(10, "Q2_K", 256, 84, "q2_k", AVX512, int8=True, int8_default=True, grouped=AVX512),
    GGMLType(11, "Q3_K", 256, 110, "q3_k", AVX512, int8=True, int8_default=True, grouped=AVX512),
    GGMLType(12, "Q4_K", 256, 144, "q4_k", ("avx512", "avx2", "neon"), int8=True, int8_default=True,
             grouped=X86),
    GGMLType(13, "Q5_K", 256, 176, "q5_k", ("avx512", "avx2"), int8=True, int8_default=True),
    GGMLType(14, "Q6_K", 256, 210, "q6_k", ("avx512", "avx2"), int8=True, int8_default=True, grouped=AVX512),
    GGMLType(15, "Q8_K", 256, 292),
    GGMLType(16, "IQ2_XXS", 256, 66),
    GGMLType(17, "IQ2_XS", 256, 74),
    GGMLType(18, "IQ3_XXS", 256, 98),
    GGMLType(19, "IQ1_S", 256, 50),
    GGMLType(20, "IQ4_NL", 32, 18, "iq4_nl", X86, int8=True, int8_default=True, grouped=X86),
    GGMLType(21, "IQ3_S", 256, 110),
    GGMLType(22, "IQ2_S", 256, 82),
    GGMLType(23, "IQ4_XS", 256, 136, "iq4_xs", ("avx512", "avx2"), int8=True,
             int8_default=True, grouped=AVX512),
    GGMLType(24, "I8", 1, 1),
    GGMLType(25, "I16", 1, 2),
    GGMLType(26, "I32", 1, 4),
    GGMLType(27, "I64", 1, 8),
    GGMLType(28, "F64", 1, 8),
    GGMLType(29, "IQ1_M", 256, 56),
    GGMLType(30, "BF16", 1, 2),
    GGMLType(34, "TQ1_0", 256, 54),
    GGMLType(35, "TQ2_0", 256, 66),
    GGMLType(39, "MXFP4", 32, 17),
    GGMLType(40, "NVFP4", 64, 36),
    GGMLType(41, "Q1_0", 128, 18),
)}
F32, F16 = 0, 1


def type_name(ggml_type: int) -> str:
    """ggml's name of a tensor type id ("Q4_K"), or "type <id>" for one this table does not know."""
    t = TYPES.get(ggml_type)
    return t.name if t is not None else f"type {ggml_type}"


def has_kernel(ggml_type: int, k: int) -> bool:
    """Whether rows of ``k`` values of ``ggml_type`` have a CPU kernel (whole kernel blocks)."""
    t = TYPES.get(ggml_type)
    return t is not None and t.kernel is not None and k % t.kernel_block == 0


def has_int8(ggml_type: int) -> bool:
    """Whether ``ggml_type`` has the integer path (its products with x quantized to int8 blocks, `cpu.kernels`)."""
    t = TYPES.get(ggml_type)
    return t is not None and t.int8


def tinygrad_expands(ggml_type: int) -> bool:
    """Whether tinygrad's ``ggml_data_to_tensor`` expands this type (its knowledge, asked of it). tinygrad 0.13.0
    lacks Q2_K, Q3_K and IQ4_NL (which the C kernels read), IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M, TQ1_0 and TQ2_0: the load
    path dequantizes those with the `gguf` package instead."""
    from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT

    return ggml_type in _GGML_NATIVE or ggml_type in _GGML_QUANT
