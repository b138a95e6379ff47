"""Generated Python stubs of the wire contracts in proto/ (regenerate: scripts/gen_proto.py).

Import as ``from wavepp_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc``. The name is
``wavepp_proto`` rather than ``proto`` because a bare ``proto`` package belongs to proto-plus.
"""
