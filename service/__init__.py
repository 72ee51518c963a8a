"""kvferry's sidecar: the command line and (later) the daemon that drives codec and transport."""

__all__: list[str] = []
