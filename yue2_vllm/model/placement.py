"""Where the torch MoT's AR expert lives, and the one owner that moves it.

On a discrete GPU whose AR phases run on the vLLM engine, the engine holds the AR weights on the card; our
copy of the AR expert (embeddings, lm_head, each layer's AR half: `modeling.ar_streamed_shapes`) stays in
pinned host memory, and the NAR's prefix prefill streams it to the device one layer at a time
(`modeling.staged`),
with the same bf16 weights and kernels, so the same numerics. Everything else lives on the device.

`ARPlacement` is the only code that moves these weights. A stage that reads them holds them (`hold`) with the
placement it needs: "any" (the prefill: resident or streamed, as they are), "device" (a torch-backend AR
song), "host" (`--offload-ar`'s ODE steps, a VAE decode short of room). A move happens only while nothing
holds the weights, so never under a running stage or a captured graph; when the last holder lets go they go
back home. Every move is counted and recorded (`moves`).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Iterator

import torch
from torch import nn

from .modeling import AR_EXPERT_MODULES, YuE2Config, ar_streamed_shapes

PLACES = ("any", "device", "host")


def weight_homes(config: YuE2Config, ar_on_device: bool) -> dict[str, str]:
    """`{tensor name: "host" | "device"}` for the AR-expert tensors: what `load_model` puts where."""
    return {name: "device" if ar_on_device else "host" for name in ar_streamed_shapes(config)}


def ar_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding `ar_streamed_shapes`: embeddings, lm_head and every layer's AR half."""
    return [model.model.embed_tokens, model.lm_head] + [getattr(layer, name) for layer in model.model.layers
                                                        for name in AR_EXPERT_MODULES]


class ARPlacement:
    """The owner of the AR expert's placement for one model (see the module docstring)."""

    def __init__(self, model: nn.Module, home: str):
        if home not in ("device", "host"):
            raise ValueError(f"home must be 'device' or 'host', got {home!r}")
        self._model, self.home = weakref.ref(model), home  # weak: the owner lives as long as its model
        self.device = model.device  # where the rest of the model lives
        self.where = home
        self.moves: list[dict] = []
        self._holders: dict[str, int] = {}
        self._cond = threading.Condition()
        self._host: dict[tuple[int, str, str], torch.Tensor] = {}  # pinned copies kept while on the device

    @property
    def holders(self) -> dict[str, int]:
        with self._cond:
            return dict(self._holders)

    def _fits(self, place: str) -> bool:
        return place == "any" or place == self.where or self.device.type == "cpu"

    @contextlib.contextmanager
    def hold(self, place: str, why: str) -> Iterator[str]:
        """Hold the AR expert where `place` says for a stage; yields where it is. Waits while other holders
        keep it elsewhere; moves it (counted) only when nobody holds it."""
        if place not in PLACES:
            raise ValueError(f"place must be one of {PLACES}, got {place!r}")
        with self._cond:
            while not self._fits(place) and self._holders:
                self._cond.wait()
            if not self._fits(place):
                self._move(place, why)
            self._holders[why] = self._holders.get(why, 0) + 1
            where = self.where
        try:
            yield where
        finally:
            with self._cond:
                self._holders[why] -= 1
                if not self._holders[why]:
                    del self._holders[why]
                if not self._holders and self.where != self.home:
                    self._move(self.home, f"{why} done")
                self._cond.notify_all()

    def _move(self, place: str, why: str) -> None:
        """Move every AR-expert tensor to `place` (the caller holds the lock and nobody holds the weights)."""
        start, moved = time.perf_counter(), 0
        for module in ar_modules(self._model()):
            for owner in module.modules():
                for kind in ("_parameters", "_buffers"):  # int8 AR linears keep their weights as buffers
                    for name, tensor in getattr(owner, kind).items():
                        if tensor is None:
                            continue
                        key = (id(owner), kind, name)
                        if place == "device":
                            if self.home == "host":  # the pinned copy stays for the way back
                                self._host[key] = tensor.data
                            moved_to = tensor.data.to(self.device, non_blocking=True)
                        else:  # back to the pinned copy when there is one, else a fresh host copy
                            kept = self._host.pop(key, None)
                            moved_to = kept if kept is not None else tensor.data.to("cpu")
                        getattr(owner, kind)[name] = (nn.Parameter(moved_to, requires_grad=False)
                                                      if kind == "_parameters" else moved_to)
                        moved += tensor.numel() * tensor.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.where = place
        self.moves.append({"to": place, "bytes": moved, "why": why, "seconds": time.perf_counter() - start})

    def describe(self) -> dict:
        return {"home": self.home, "where": self.where, "moves": len(self.moves),
                "moved_bytes": sum(move["bytes"] for move in self.moves), "holders": self.holders}


_OWNERS: "weakref.WeakKeyDictionary[nn.Module, ARPlacement]" = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()


def placement_of(model: nn.Module) -> ARPlacement:
    """The model's placement owner, one per model (made on first use: the AR expert's home is where it was
    loaded). Kept beside the model, not on it, so a copy of the model gets an owner of its own."""
    with _OWNERS_LOCK:
        owner = _OWNERS.get(model)
        if owner is None:
            on_device = model.model.layers[0].post_attention_layernorm.weight.device == model.device
            owner = _OWNERS[model] = ARPlacement(model, "device" if on_device else "host")
        return owner
