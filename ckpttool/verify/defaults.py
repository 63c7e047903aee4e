"""verify's defaults, apart from verify.py so the CLI can show them without importing torch."""

DTYPES = ("float32", "bfloat16")
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15}
DEFAULT_PROMPT = "hello world"
