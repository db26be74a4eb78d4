"""YuE2 in plain torch: the MoT (modeling, loader), the torch AR backend and its sampling arithmetic, the
NAR flow matching, the VAE, and the load-time int8/FP8 AR proxies. Imports nothing from `engine`, `quant`
or `serve`.
"""
