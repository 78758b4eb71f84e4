"""vLLM integration: an EC connector that feeds vLLM's encoder cache from encoder_service, and a chat front end.

vLLM is an optional extra (`pip install -e '.[vllm]'` in a checkout of this repository): this package imports
without it; vLLM is imported only when the connector class is used (vLLM's factory does
`getattr(module, "EncoderServiceConnector")`).

  connector.py  EncoderServiceConnector (vLLM's ECConnectorBase, role ec_consumer): a thin adapter
  transfer.py   what it adapts, vLLM-free: fetch-ahead into host shared memory, the worker's device copy
  proxy.py      `encoder-service vllm-proxy`: OpenAI chat requests -> our encode -> vLLM with metadata-only
                image_embeds parts whose uuid is our id

On the vLLM prefill/decode instance:

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --ec-transfer-config "$(python -c 'import json; \
        from encoder_service.integrations.vllm import ec_transfer_config; \
        print(json.dumps(ec_transfer_config("http://encoder:8000", auth_token="...")))')"

docs/vllm.md has the whole deployment.
"""

from __future__ import annotations

CONNECTOR = "EncoderServiceConnector"
MODULE = "encoder_service.integrations.vllm"
PARAMS_KEY = "encoder_service"  # request.ec_transfer_params[PARAMS_KEY] = {"ids": [our id of each image, in order]}


def ec_transfer_config(url: str, **extra) -> dict:
    """vLLM's `--ec-transfer-config` for this connector: `url` of the encoder (http://... or grpc://...) plus
    `ec_connector_extra_config` options (transfer.py: ConnectorOptions), checked here."""
    from encoder_service.integrations.vllm.transfer import ConnectorOptions

    extra_config = {"url": url, **{k: v for k, v in extra.items() if v is not None}}
    ConnectorOptions.from_extra_config(extra_config)  # ValueError now rather than in vLLM's engine
    return {"ec_connector": CONNECTOR, "ec_role": "ec_consumer", "ec_connector_module_path": MODULE,
            "ec_connector_extra_config": extra_config}


def __getattr__(name: str):
    if name in (CONNECTOR, "EncoderServiceMetadata"):
        try:
            from encoder_service.integrations.vllm import connector
        except ImportError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "vllm":
                raise ImportError(f"{MODULE}.{name} needs vLLM: pip install -e '.[vllm]' in a checkout of "
                                  f"encoder_service ({exc})") from exc
            raise
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONNECTOR", "MODULE", "PARAMS_KEY", "ec_transfer_config", "EncoderServiceConnector"]
