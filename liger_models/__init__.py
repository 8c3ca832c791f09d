"""liger-models: natively fused Llama-family modeling files.

The public API (``AutoLigerForCausalLM``, ``Liger<Family>ForCausalLM``) is exported here as the families land.
"""

__version__ = "0.1.0"
