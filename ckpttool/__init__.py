"""ckpttool: plan-then-stream conversion and sharding of large model checkpoints.

As a library (ckpttool/api.py): `ckpttool.convert(src, dst, mp=8)`, `dequant`, `shard`, `merge`, `plan_report` and
`run_recipe`, each the command of that name; `Request` and `run` (ckpttool/runner.py) for anything else; every
failure a `CkptError`. They load on first use, so importing ckpttool (or any module of it) stays cheap.
"""

from ckpttool.version import __version__

__all__ = ["__version__", "convert", "dequant", "shard", "merge", "plan_report", "run_recipe", "Request", "RunReport",
           "run", "CkptError"]
# where each exported name lives; none may be the name of a subpackage (ckpttool.plan would shadow a `plan`)
_API = {"convert": "api", "dequant": "api", "shard": "api", "merge": "api", "plan_report": "api",
        "run_recipe": "api", "Request": "runner", "RunReport": "runner", "run": "runner", "CkptError": "errors"}


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    if _API[name] == "api":
        from ckpttool import api as module
    elif _API[name] == "runner":
        from ckpttool import runner as module
    else:
        from ckpttool import errors as module
    return getattr(module, name)
