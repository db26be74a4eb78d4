"""yue2-vllm: serve the YuE2-3B song model (AR half on vLLM, NAR and VAE in torch)."""
__version__ = "0.1.0"
