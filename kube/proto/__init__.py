"""The kubelet's gRPC protocols: ``*.proto`` written from the public API reference, the
``*_pb2*.py`` modules generated from them by ``make proto`` (grpcio-tools; a test checks
that the committed ones are what it makes)."""
