"""vLLM integration: :class:`~memkv.integrations.vllm.connector.MemkvConnector`.

Start vLLM with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MemkvConnector",
        "kv_connector_module_path": "memkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": "http://127.0.0.1:8080"}}'

Importing this package does not import vLLM; the connector module does.
"""
