"""kvtier: a learned KV-cache tiering sidecar for vLLM / LMCache / Mooncake.

The code lives in the top-level folders of the repository (``collectors/``, ``policies/``,
``controller/``, ``replay/``), which this package exposes as ``kvtier.collectors`` etc.
"""

__version__ = "0.1.0"
