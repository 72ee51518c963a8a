"""The gRPC front end (``server.ControlPlane``), served beside REST when ``grpc_port`` is set;
needs the grpc extra (grpcio, grpcio-health-checking, grpcio-reflection)."""
