"""A tensor as a GGUF file stores it, for the generators (`modelgen`, `gemma3gen`): its bytes in a GGML type, and
the file types (llama_ftype) a whole-file dtype names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 11,
              "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "TQ2_0": 37, "Q4_K_M": 15,
              "Q3_K_M": 12}  # llama_ftype (Q3_K, Q4_K and Q5_K: the _S files; MIXED has none)


def encode_tensor(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object | None]:
    """-> (array to store, raw GGML type or None for the float types)."""
    from gguf import GGMLQuantizationType, quants

    from pp_worker.testing import kquants

    if type_name in ("F32", "F16"):
        return w.astype(np.float32 if type_name == "F32" else np.float16), None
    qtype = GGMLQuantizationType[type_name]
    if type_name in kquants.QUANTIZERS:  # gguf cannot quantize the K, IQ4 and TQ types
        flat = kquants.quantize(w.reshape(-1, w.shape[-1]).astype(np.float32), type_name)  # rows; experts are 3-D
        return flat.reshape(*w.shape[:-1], -1), qtype
    # gguf.quants is documented bit-exact with ggml's reference quantizers (quantize_row_q8_0_ref...)
    return quants.quantize(w.astype(np.float32), qtype), qtype


def finish(writer: Any, tmp: Path, path: Path) -> Path:
    """Write a `gguf.GGUFWriter`'s file at ``tmp`` and move it to ``path`` (readers of a shared model folder never see
    half a file)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
