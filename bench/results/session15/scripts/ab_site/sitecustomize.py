import os
if os.environ.get("KVF_NO_OVERLAP"):
    from kvferry.engine import pipeline as _P
    _P.OVERLAP_BYTES = 1 << 62
