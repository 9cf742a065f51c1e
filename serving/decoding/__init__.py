"""Pure decoding math over tensors: warping, and one verification rule per module.

No models, caches or I/O here; the engine (serving/engine.py) owns those.
"""
