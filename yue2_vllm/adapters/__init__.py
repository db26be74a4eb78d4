"""Adapters (LoRA and kin) users bring for either half of YuE2, made ready for both sides that run them.

`keys` reads one tensor name of any layout, `layouts` finds an adapter's files and config and reads it into
one normalized form (`weights`), `fused` splits ComfyUI's fused qkv / gate_up factors, `halves` tells AR from
NAR, `checks` refuses what does not fit the base model, `cache` converts once into a content-addressed
directory (the AR part as the PEFT directory vLLM loads, the rest as the torch side applies it), and
`registry` names the adapters a process serves. The torch side applies them through `model.lora`.
"""
