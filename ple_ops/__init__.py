"""ple_ops: per-layer-embedding offload ops (host-flag wait, host-to-device pull, release).

Not built yet: see issue 3. The package exists so that the distribution's layout is fixed.
"""

__all__: list[str] = []
