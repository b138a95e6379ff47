"""A vLLM KV connector: a stock vLLM decode instance pulls a prompt's KV from our stages.

``connector.WavePPConnector`` (imports vLLM; load it by ``kv_connector_module_path``) and the
vLLM-free pieces it uses (``params``: the ``kv_transfer_params`` it understands; ``cache``:
vLLM's CPU cache seen as a kv_transfer pool). Nothing here imports ``prefill_node``.
"""
