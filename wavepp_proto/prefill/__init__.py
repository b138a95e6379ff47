"""Package ``wavepp.prefill`` of the wire contracts."""
