"""Everything that runs in or talks to vLLM: the AR backend (client of one resident engine worker), the
worker process, the plugin (YuE2's sampler on both model runners, the architecture registration), the
phase-sliced Qwen3, the pair scheduler, the runner choice, and the in-engine sampling arithmetic.

Importing this package imports no vLLM: only the worker process (and vLLM, by FQCN) loads the modules
that need it.
"""
