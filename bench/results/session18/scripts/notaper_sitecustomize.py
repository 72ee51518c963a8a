try:
    import kvferry.engine.policy as _p
    _p.TAPER_CODING_SECONDS = 1e9
except Exception:
    pass
