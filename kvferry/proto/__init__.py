"""The gRPC control plane's messages (``v1``: generated from ``proto/kvferry/v1`` and committed)
and their translation to and from the REST API's JSON shapes (``convert``). A leaf: it imports no
other part of kvferry, so the server (``kvferry.api``) and the client SDK share it without either
importing the other. The ``_pb2`` modules need protobuf, the ``_pb2_grpc`` ones grpcio (the grpc
extra); nothing here is imported by ``kvferry.client`` unless ``kvferry.client.grpc`` is."""
