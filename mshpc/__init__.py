"""mshpc: MegaScale-style LLM training on Slurm clusters.

`mshpc.submit(config, ...)` and `mshpc.submit_sweep(configs, ...)` submit training jobs (see
mshpc/launch/submit.py); they are imported on first use, so `import mshpc` stays light.
"""

from typing import Any

__all__ = ["submit", "submit_sweep"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mshpc.launch import submit

        return getattr(submit, name)
    raise AttributeError(f"module 'mshpc' has no attribute {name!r}")
