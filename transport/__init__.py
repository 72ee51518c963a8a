"""kvferry's data plane: moves opaque frames between sidecars. Knows nothing of KV or codecs."""

__all__: list[str] = []
