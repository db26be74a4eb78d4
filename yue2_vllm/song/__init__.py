"""One song's parts, which `pipeline.YuE2Pipeline` (the single-song orchestrator) composes.

results (what each stage hands the next), models (the loaded weights and their placement), engine_life (the
vLLM engine's start, retry, fallback and close), admission (the device memory songs' buffers are admitted into),
stages (plan, semantic, synthesis, decode) and run_dir (a run directory's checkpoints, records and resume).
This room sits between the floor and the orchestrators: it may read engine/, model/ and quant/, never serve/,
cli/, the pipeline, the scheduler or bench.
"""
