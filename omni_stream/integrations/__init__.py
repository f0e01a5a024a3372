"""Integrations with systems outside omni_stream, each an optional extra.

``ray_serve``: replicas of an Engine on a Ray cluster behind one
EngineLike (``pip install "omni-stream[ray]"``; docs/scale-out.md).
Nothing here is imported by ``import omni_stream``.
"""
