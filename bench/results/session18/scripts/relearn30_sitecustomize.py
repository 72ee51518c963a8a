try:
    import kvferry.engine.engine as _e
    _e.RELEARN_SECONDS = 30.0
except Exception:
    pass
