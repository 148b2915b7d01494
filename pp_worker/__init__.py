"""pp_worker: one stage of a pipeline-parallel LLM, served as JSON lines over stdin/stdout.

Importing the package prints nothing and imports no tinygrad (stub mode starts fast).
"""

from pathlib import Path

__version__ = "0.1.0"
DEFAULT_MODEL = Path(__file__).resolve().parent / "data" / "zen.gguf"  # the embedded demo model
