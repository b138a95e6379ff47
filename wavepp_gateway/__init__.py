"""WavePP gateway: the OpenAI-compatible front door over the prefill tier and a decode fleet."""
