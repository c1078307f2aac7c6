"""Weight-only quantization at load: int8 per output channel, int4 in groups, round to nearest
or activation-aware (AWQ) scales and clipping calibrated on text that ships with Python.

``formats`` defines the numerics, ``linear`` the layers that run them, ``awq`` the calibration
and ``apply`` the transformation of a loaded model.
"""
