# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
"""Messages and service stubs of kvferry.v1."""
